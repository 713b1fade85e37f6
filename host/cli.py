"""zl-host: find the phones, push the programs, run the pipeline, show what happens."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

from rich.console import Console

console = Console(stderr=True, soft_wrap=True)
HELD_OUT = 0.2  # zl-host run's default share of the data kept out of training (the last micro-batches)


from .cli_error import CliError  # noqa: E402,F401  (one class, wherever a command raises it)


# ---------------------------------------------------------------- devices / emulate
def cmd_devices(a) -> int:
    from .devices import as_json, find_devices

    found, notes = find_devices(timeout=a.timeout, interfaces=a.mdns)
    if a.json:
        print(as_json(found))
        return 0
    if not found:
        print("no devices found. Looked at: " + "; ".join(notes))
        return 0
    for f in found:
        if f.source == "adb":  # the app's port is reached through adb forward during a run
            hint = "" if f.ready else ("  (accept the USB debugging prompt on the phone)" if f.state == "unauthorized"
                                       else "  (not usable until adb lists it as 'device')")
            print(f"{f.name:16} adb   {'usb, ' + f.state:22} {f.model or 'model unknown':22}{hint}")
            continue
        shown = f.name if f.instance in ("", f.name) else f"{f.name} [{f.instance}]"  # renamed after a conflict
        if f.status != "ok":  # a bad TXT record or another protocol: listed, never used
            print(f"{shown:16} {f.source:5} {f.endpoint or '-':22} {f.status}: {f.problem}")
            continue
        print(f"{shown:16} {f.source:5} {f.endpoint or f.serial or '-':22} proto {f.protocol or '?'}  "
              f"{f.runtime:16} {f.memory_bytes / 2**30:.1f} GiB")
    print("looked at: " + "; ".join(notes))
    return 0


def cmd_emulate(a) -> int:
    from .emulate import cpu_shares, start_phones
    from .devices import PHONES_HOME

    shares = cpu_shares(a.cpu_share, a.n)
    phones = start_phones(a.n, PHONES_HOME, prefix=a.prefix, cpu_shares=shares)
    for i, p in enumerate(phones):
        print(f"{p.name}: {p.endpoint} pid {p.proc.pid}, work dir {p.workdir}"
              + (f", CPU budget {shares[i]:g} of a core" if shares else ""))
    pids = " ".join(str(p.proc.pid) for p in phones)
    print(f"{a.n} emulated phone(s) running, advertised over mDNS on loopback. Stop them with: kill {pids}"
          " (or Ctrl-C here)")
    try:
        while all(p.alive() for p in phones):
            time.sleep(1.0)
    except KeyboardInterrupt:
        pass
    finally:
        for p in phones:
            p.stop()
    return 0


# ---------------------------------------------------------------- data
def prepare_data(export_dir: Path, manifest: dict, data: str | None, training: bool = True):
    from transformers import AutoTokenizer

    from zl_common.data import DataError, check_loss_positions, check_rejected, load_examples, tokenized_microbatches

    tok_dir = export_dir / "tokenizer"
    if not tok_dir.is_dir():
        raise CliError(f"{export_dir} has no tokenizer/ folder: export from a model directory with tokenizer files")
    tok = AutoTokenizer.from_pretrained(tok_dir)
    if data is None and manifest["model"]["source"] != "tiny":
        raise CliError("--data FILE is required for this model (the built-in synthetic set matches only --model tiny)")
    try:
        examples = load_examples(data)
        warning = check_rejected(examples)  # most rows bad: refused; some: said, then trained on the rest
        if warning:
            console.print(f"zl-host: warning: {warning}", markup=False)
        e = manifest["export"]
        mbs = tokenized_microbatches(examples, tok, e["seq_len"], e["micro_batch"])
        if training:  # a program never cuts a micro-batch's loss (eval reads the HF model's full logits)
            check_loss_positions(mbs, e["readout_rows"], e["micro_batch"])
    except DataError as err:
        raise CliError(str(err)) from None
    if not mbs:
        raise CliError(f"{data or 'the synthetic set'} gave no usable rows after tokenisation: check the file's format")
    return mbs


# ---------------------------------------------------------------- run
def parse_failures(specs: list[str]) -> list[dict]:
    from zl_mobile.assign_rules import FAILURE_DETECTS, FAILURE_MODES
    from zl_mobile.stage import FAILURE_POINTS, SLOW_POINT

    out = []
    for spec in specs or []:
        try:
            d = dict(part.split("=", 1) for part in spec.split(","))
            point = d.get("point", "after-phase1")
            if point == SLOW_POINT:  # not a failure: a slower phone (every phase 1 takes `seconds` more)
                f = {"stage": int(d["stage"]), "point": point, "seconds": float(d["seconds"])}
                if "window" in d:
                    f["window"] = int(d["window"])
            else:
                f = {"stage": int(d["stage"]), "window": int(d["window"]), "point": point,
                     **{k: d[k] for k in ("mode", "detect") if k in d}}
        except (KeyError, ValueError):
            raise CliError(f"--inject-failure {spec!r}: expected stage=K,window=W[,point=...][,mode=process|app]"
                           f"[,detect=connection|heartbeat] (or stage=K,point={SLOW_POINT},seconds=S[,window=W])") from None
        if f["point"] not in (*FAILURE_POINTS, SLOW_POINT):
            raise CliError(f"--inject-failure point {f['point']!r}: use one of {', '.join((*FAILURE_POINTS, SLOW_POINT))}")
        for key, allowed in (("mode", FAILURE_MODES), ("detect", FAILURE_DETECTS)):
            if f.get(key, allowed[0]) not in allowed:
                raise CliError(f"--inject-failure {key} {f[key]!r}: use one of {', '.join(allowed)}")
        if f.get("detect", "connection") != "connection" and f.get("mode") != "app":
            raise CliError(f"--inject-failure {spec!r}: detect=heartbeat needs mode=app (a killed process always "
                           "drops its connection)")
        out.append(f)
    return out


def emulated_count(spec: str) -> int:
    """N of --devices emulated:N: a whole number of phones, at least 1."""
    text = spec.split(":", 1)[1].strip()
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise CliError(f"--devices {spec!r}: N in emulated:N must be a whole number of phones (at least 1), "
                       "e.g. --devices emulated:3")
    return int(text)


def _load_resume(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "run.json").read_text())
    except FileNotFoundError:
        raise CliError(f"cannot resume: {run_dir} has no run.json (not a zl-host run dir); give the --out of an earlier run") from None
    except (OSError, json.JSONDecodeError) as e:
        raise CliError(f"cannot resume: {run_dir / 'run.json'} is unreadable ({e}); start a new run instead") from None


def cmd_run(a) -> int:
    from exporter.errors import ExportError
    from exporter.manifest import ManifestError, load_manifest

    from .adapter import base_model_path, write_peft_adapter
    from .coordinator import Coordinator, RunError
    from .plan import PlanError, RunSettings
    from .report import write_report

    if a.resume:
        run_dir = Path(a.resume)
        saved = _load_resume(run_dir)
        program, data, devices_spec = Path(saved["program"]), saved["data"], saved["devices"]
        held_out_fraction = saved.get("held_out", HELD_OUT)
        settings = RunSettings(**saved["settings"])
        run_id = saved["run_id"]
    else:
        if not a.program:
            raise CliError("--program DIR is required (the output of zl-export)")
        program, data, devices_spec = Path(a.program), a.data, a.devices
        held_out_fraction = a.held_out
        if devices_spec.startswith("emulated:"):
            emulated_count(devices_spec)  # before anything is loaded
        run_dir = Path(a.out or f"runs/{time.strftime('%Y%m%d-%H%M%S')}")
        run_id = f"run-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        settings = None
    try:
        manifest = load_manifest(program)
    except ManifestError as e:
        raise CliError(str(e)) from None
    mbs = prepare_data(program, manifest, data)
    from .evaluate import split_held_out
    train, held_out = split_held_out(mbs, held_out_fraction)
    if settings is None:
        windows = a.steps
        if a.micro_batches:
            windows = max(1, a.micro_batches // a.window)
        elif a.epochs:
            windows = max(1, round(a.epochs * len(train) / a.window))
        settings = RunSettings(windows=windows, window_size=a.window, lr=a.lr, alpha=a.alpha,
                               inflight_depth=a.inflight, heartbeat_timeout=a.heartbeat_timeout,
                               inject_failure=parse_failures(a.inject_failure), recovery=a.recovery,
                               replay_horizon=a.replay_horizon)
    k = len(manifest["chunks"])
    plan = None
    plan_path = saved.get("plan") if a.resume else getattr(a, "plan", None)  # a resumed run keeps its stage order
    if plan_path:
        from .plan_cli import check_plan_export, read_plan
        plan = check_plan_export(read_plan(Path(plan_path)), manifest, plan_path, program)
        if devices_spec == "auto":
            devices_spec = ",".join(plan["devices"])
    try:
        settings.checked_horizon(k)  # before any phone starts
        settings.checked_alpha(k)
    except PlanError as e:
        raise CliError(str(e)) from None
    run_dir.mkdir(parents=True, exist_ok=True)

    phones = []
    links = None
    network = None
    from .emulate import EmulatedLinks

    # a resumed run keeps its links (and takes over the namespaces its phones are in)
    emulated_links = EmulatedLinks(**saved.get("link") or {}) if a.resume else EmulatedLinks(a.link_mbit, a.link_delay_ms)
    if devices_spec.startswith("emulated:"):
        from .emulate import EmulatedPhone, cpu_shares, start_phones
        from .netns import NetnsError

        n = emulated_count(devices_spec)
        if n < k:
            raise CliError(f"{n} emulated phone(s) for {k} chunks: use --devices emulated:{k}")
        shares = None if a.resume else cpu_shares(a.cpu_share, n)  # a resumed run's phones keep their arguments
        try:
            network, phone_args, how = emulated_links.open(n)
        except NetnsError as e:
            raise CliError(f"cannot make the phones' network: {e}; run without --link-mbit") from None
        try:
            if a.resume and saved.get("phones"):
                phones = [EmulatedPhone(p["name"], Path(p["workdir"]), p["token"], p["args"], p["port"],
                                        net=network.phones[i] if network else None).adopt_or_start(p.get("pid"))
                          for i, p in enumerate(saved["phones"])]
            else:
                console.print(f"starting {n} emulated phones ({how})", markup=False)
                per_phone = None
                if getattr(a, "mem_limit", None):  # the phones' CPU budget or core, and their memory limit
                    from .plan_cli import check_mem_limits, emulated_phone_args, parse_list
                    limits = parse_list(a.mem_limit, n, "memory limit", "--mem-limit")
                    check_mem_limits(limits)
                    per_phone = emulated_phone_args(n, limits, shares)
                phones = start_phones(n, run_dir / "phones", extra_args=phone_args, network=network,
                                      per_phone_args=per_phone, cpu_shares=shares)
        except BaseException:
            if network is not None:
                network.close()
            raise
        handles = [p.handle() for p in phones]
    elif a.cpu_share is not None:
        raise CliError("--cpu-share budgets emulated phones only: use --devices emulated:N")
    elif emulated_links.mbit or emulated_links.delay_ms:
        raise CliError("--link-mbit / --link-delay-ms shape emulated phones' links only: use --devices emulated:N")
    else:
        from .adb_wiring import AdbLinks
        from .devices import DeviceLookupError, load_tokens, resolve

        adb_events: list = []  # the live view does not exist yet when the control ports are forwarded
        links = AdbLinks(data_port=a.adb_data_port, staging_dir=a.adb_staging,
                         on_event=lambda kind, data: adb_events[-1](kind, data) if adb_events else None)
        try:
            handles = resolve(devices_spec, k, load_tokens(a.tokens), a.wait, a.mdns, links=links)
        except DeviceLookupError as e:
            links.close()
            raise CliError(str(e)) from None
    from rich.live import Live

    from .live import LiveView

    view = LiveView(k, settings.micro_batches, manifest["export"]["micro_batch"])
    if links is not None:
        adb_events.append(view.on_event)
    on_event, watch = view.on_event, None
    if plan is not None:
        from .plan_cli import drift_watch, order_by_plan
        watch = drift_watch(plan, a.drift_margin, settings.window_size, run_dir,
                            lambda line: console.print(line, markup=False))

        def on_event(kind, data):
            view.on_event(kind, data)
            watch.on_event(kind, data)
    co = None
    try:
        if plan is not None:
            handles = order_by_plan(handles, plan)  # the plan's phones in its stage order
        co = Coordinator(program, handles, train, settings, run_dir, run_id=run_id, on_event=on_event,
                         link_tokens=saved.get("link_tokens") if a.resume else None, links=links,
                         keep_order=plan is not None)
        record = {"program": str(program.absolute()), "data": data, "held_out": held_out_fraction,
                  "devices": devices_spec, "run_id": run_id,
                  "settings": settings.to_json(), "link_tokens": co.link_tokens, "link": asdict(emulated_links),
                  **({"plan": str(Path(plan_path).absolute())} if plan is not None else {}),
                  "phones": [{"name": p.name, "workdir": str(p.workdir), "token": p.token, "args": p.extra_args,
                              "port": p.port, "pid": p.pid} for p in phones]}
        tmp = run_dir / "run.json.tmp"
        tmp.write_text(json.dumps(record, indent=2))
        tmp.chmod(0o600)  # holds pairing tokens
        tmp.replace(run_dir / "run.json")
        try:
            with Live(view, console=console, refresh_per_second=4, transient=False):
                result = co.run()
        finally:
            if not console.is_terminal:  # rich leaves the last table line open when not on a terminal
                console.line()
    except (PlanError, RunError) as e:
        raise CliError(str(e)) from None
    finally:
        for p in phones:
            p.stop()
        if network is not None:
            network.close()
        if links is not None:  # remove the adb forwards and reverses this run made
            if co is not None:
                co.stop_sampling()
            for problem in links.close():
                console.print(f"zl-host: warning: {problem}", markup=False)
    try:
        base = base_model_path(program, manifest)
    except ExportError:  # --model smollm2, its wheel not on this host: the path the export recorded
        base = manifest["model"].get("path")
    adapter_dir = write_peft_adapter(result["lora"], manifest, run_dir / "adapter", base)
    rows = settings.micro_batches * manifest["export"]["micro_batch"]
    summary = {"run_id": run_id, "program": str(program), "data": data or "synthetic", "windows": settings.windows,
               "window_size": settings.window_size, "micro_batches": settings.micro_batches, "lr": settings.lr,
               "seconds": result["seconds"], "samples_per_s": rows / result["seconds"],
               "recoveries": len(result["recoveries"]), "link_bytes": result["link_bytes"], "errors": result["errors"]}
    if watch is not None:
        summary["plan"] = {"file": str(Path(plan_path).absolute()), "chunks": plan["chunks"], "devices": plan["devices"],
                           "predicted_s": [s["time_s"] for s in plan["stages"]], "drift_reports": watch.reports}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    report = write_report(run_dir, summary)
    console.print(f"adapter: {adapter_dir}  report: {report}  metrics: {run_dir / 'metrics.jsonl'}")
    return 0


# ---------------------------------------------------------------- eval
def cmd_eval(a) -> int:
    from exporter.errors import ModelDirError
    from exporter.manifest import ManifestError, load_manifest

    from .adapter import base_model_path
    from .evaluate import evaluate, split_held_out

    program = Path(a.program)
    try:
        manifest = load_manifest(program, check_files=False)
    except ManifestError as e:
        raise CliError(str(e)) from None
    adapter = Path(a.adapter)
    if not (adapter / "adapter_config.json").is_file():
        raise CliError(f"{adapter} has no adapter_config.json: pass the adapter/ folder of a zl-host run")
    try:
        base = base_model_path(program, manifest)
    except ModelDirError as e:
        raise CliError(str(e)) from None
    if base is None or not Path(base).exists():
        raise CliError(f"the base model {base} recorded in {program}/manifest.json is not on this machine")
    os.environ["HF_HUB_OFFLINE"] = "1"  # everything is local: a missing file is an error, not a download
    from .adapter_check import AdapterError, base_weights_present, check_adapter
    try:
        base_weights_present(Path(base))
        check_adapter(adapter, Path(base), manifest.get("lora"))
    except AdapterError as e:
        raise CliError(str(e)) from None
    _, held_out = split_held_out(prepare_data(program, manifest, a.data, training=False))
    base_weights = manifest["export"].get("base_weights", "fp32")  # exports before int8 have none
    before = evaluate(base, None, held_out, base_weights)
    after = evaluate(base, adapter, held_out, base_weights)
    print(f"held-out answer tokens: {after['tokens']} (base weights {base_weights}, as trained)")
    print(f"base model:    NLL {before['nll']:.4f}  accuracy {before['accuracy']:.3f}")
    print(f"with adapter:  NLL {after['nll']:.4f}  accuracy {after['accuracy']:.3f}")
    if a.show:
        from rich.table import Table
        from transformers import AutoTokenizer

        from .answers import side_by_side

        tok = AutoTokenizer.from_pretrained(program / "tokenizer")
        table = Table(title=f"{a.show} held-out prompts: the base model's answer and the adapter's (greedy)")
        for col in ("prompt", "expected", "base model", "with adapter"):
            table.add_column(col, overflow="fold")
        for r in side_by_side(base, adapter, held_out, tok, a.show, base_weights):
            table.add_row(r["prompt"], r["expected"], r["base"], r["adapter"])
        Console(soft_wrap=False).print(table)
    return 0


# ---------------------------------------------------------------- main
def _positive(text: str) -> float:
    v = float(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return v


def _fraction(text: str) -> float:
    v = float(text)
    if not 0 <= v < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {text}")
    return v


def _alphas(text: str) -> float | list:
    """'0.5' -> 0.5; '0.5,0.75,1' -> [0.5, 0.75, 1.0]; each in [0, 1]."""
    try:
        vals = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number or one per stage (0.5,0.75,1), got {text}") from None
    bad = [v for v in vals if not 0 <= v <= 1]
    if bad:
        raise argparse.ArgumentTypeError(f"{bad[0]:g} is outside [0, 1]: the local loss is alpha*CE + (1-alpha)*KL")
    return vals[0] if len(vals) == 1 else vals


def _non_negative(text: str) -> float:
    v = float(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return v


def build_parser():
    p = argparse.ArgumentParser(prog="zl-host", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("devices", help="list reachable phones (mDNS and adb)")
    d.add_argument("--json", action="store_true")
    d.add_argument("--timeout", type=float, default=2.0)
    d.add_argument("--mdns", default="loopback", help="interfaces to browse: loopback, all, or an IPv4 address")
    d.set_defaults(func=cmd_devices)
    e = sub.add_parser("emulate", help="start N emulated phones (zl-phone processes)")
    e.add_argument("n", type=int)
    e.add_argument("--prefix", default="emu")
    e.add_argument("--cpu-share", default=None, metavar="F|F1,F2,...",
                   help="hold each phone to this share of one CPU core (one value, or one per phone), in a cgroup of "
                        "its own (needs root and the cgroup cpu controller)")
    e.set_defaults(func=cmd_emulate)
    r = sub.add_parser("run", help="train: ZeroLock over the phones")
    r.add_argument("--program", help="zl-export output dir")
    r.add_argument("--data", default=None, help="AG News CSV, JSONL, or wordnet[:validation|test] (WordNet noun glosses by category); omit for the tiny model's synthetic set")
    r.add_argument("--devices", default="auto", help="auto | emulated:N | NAME,NAME,...")
    r.add_argument("--steps", type=int, default=8, help="optimizer steps (update windows)")
    r.add_argument("--epochs", type=float, default=None, help="instead of --steps: passes over the training data")
    r.add_argument("--micro-batches", type=int, default=None, help="instead of --steps: total micro-batches")
    r.add_argument("--window", type=int, default=4, help="micro-batches per update window")
    r.add_argument("--held-out", type=_fraction, default=HELD_OUT,
                   help="fraction of the micro-batches kept out of training, the last ones (default %(default)s; "
                        "0: train on all, for data split beforehand)")
    r.add_argument("--inflight", type=int, default=2, help="hidden states in flight between neighbours")
    r.add_argument("--replay-horizon", type=int, default=None,
                   help="most hidden states a stage holds for its downstream's replay; when full it waits for the "
                        "downstream to commit (default 2 x window + in-flight depth; at least one window)")
    r.add_argument("--lr", type=float, default=2e-3)
    r.add_argument("--alpha", type=_alphas, default=None,
                   help="override the export's task/consistency blend: one value, or one per stage (0.5,0.75,1: more "
                        "task weight deeper down, which measured best on SmolLM2; docs/BENCHMARKS.md, Quality)")
    r.add_argument("--out", default=None, help="run dir (default runs/TIMESTAMP)")
    r.add_argument("--resume", default=None, help="continue the run in RUN_DIR")
    r.add_argument("--tokens", default=None, help="JSON file NAME -> pairing token")
    r.add_argument("--wait", type=float, default=30.0, help="seconds to wait for enough devices")
    r.add_argument("--mdns", default="loopback", help="interfaces to browse: loopback, all, or an IPv4 address")
    r.add_argument("--adb-data-port", type=int, default=47475,
                   help="port an adb phone's stage listens on for its upstream link (forwarded by the host; "
                        "0: the phone picks one and reports it)")
    r.add_argument("--adb-staging", default="/data/local/tmp/zerolock",
                   help="phone dir adb pushes into before run-as copies into the app's files")
    r.add_argument("--link-mbit", type=_positive, default=None,
                   help="with --devices emulated:N: each phone's link rate per direction (its own network "
                        "namespace where the machine allows it, else the transport's rate limiter)")
    r.add_argument("--link-delay-ms", type=_non_negative, default=0.0,
                   help="with --devices emulated:N: one-way latency of each phone's link")
    r.add_argument("--cpu-share", default=None, metavar="F|F1,F2,...",
                   help="with --devices emulated:N: hold each phone to this share of one CPU core (one value, or one "
                        "per phone), in a cgroup of its own (needs root and the cgroup cpu controller)")
    r.add_argument("--heartbeat-timeout", type=float, default=5.0)
    r.add_argument("--recovery", choices=["local", "global-rollback"], default="local",
                   help="local replay (ZeroLock) or the global rollback a BP pipeline needs (baseline)")
    r.add_argument("--inject-failure", action="append", help="stage=K,window=W[,point=after-phase1|before-commit|mid-checkpoint]"
                        "[,mode=process|app][,detect=connection|heartbeat]: kill the phone process, or fail the stage "
                        "inside the running phone (which then drops the session or goes silent); or "
                        "stage=K,point=slow-phase1,seconds=S: a slower phone (tests, benchmarks)")
    r.set_defaults(func=cmd_run)
    r.add_argument("--plan", default=None, help="a zl-host plan file: its chunks (the export must match) on its "
                                                "phones, and a report when the stage times drift from it")
    r.add_argument("--drift-margin", type=_positive, default=0.15,
                   help="with --plan: report when the slowest stage is this far off the plan (0.15: 15%%)")
    r.add_argument("--mem-limit", default=None, help="with --devices emulated:N: each phone's memory limit "
                                                     "(zl-phone --mem-limit), one for all or A,B,...")
    from .plan_cli import add_parsers
    add_parsers(sub)
    v = sub.add_parser("eval", help="held-out accuracy and NLL with the trained adapter")
    v.add_argument("--program", required=True)
    v.add_argument("--adapter", required=True)
    v.add_argument("--data", default=None)
    v.add_argument("--show", type=int, default=0, metavar="N",
                   help="also print N held-out prompts with the base model's and the adapter's answers")
    v.set_defaults(func=cmd_eval)
    return p


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    from zl_common.quiet import quiet_libraries

    quiet_libraries()  # torchao's, torch's and transformers' messages that are not the user's concern
    # SIGTERM (kill, a service manager, a CI timeout) ends a run as Ctrl-C does: phones stopped, adb
    # forwards and reverses removed, the resume hint printed; Python's default would skip all of it
    import signal
    import threading

    on_main = threading.current_thread() is threading.main_thread()
    previous = {}
    if on_main:
        # SIGINT too: a shell starts a script's background job with SIGINT ignored, and Python
        # keeps an inherited SIG_IGN, so Ctrl-C / kill -INT would do nothing
        previous = {s: signal.signal(s, h) for s, h in ((signal.SIGTERM, _interrupt),
                                                         (signal.SIGINT, signal.default_int_handler))}
    try:
        return a.func(a)
    except CliError as e:
        console.print(f"zl-host: error: {e}", style="red", markup=False)
        return 2
    except KeyboardInterrupt:
        console.print("zl-host: interrupted; continue with zl-host run --resume RUN_DIR", markup=False)
        return 130
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


if __name__ == "__main__":
    sys.exit(main())

"""zl-host: find the phones, push the programs, run the pipeline, show what happens."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from rich.console import Console

console = Console(stderr=True, soft_wrap=True)


from .cli_error import CliError  # noqa: E402,F401  (one class, wherever a command raises it)
from .run_config import HELD_OUT  # noqa: E402


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
    from .devices import PHONES_HOME
    from .emulate import cpu_shares, start_phones
    from .kotlin_phone import advertise, parse_runtimes

    shares = cpu_shares(a.cpu_share, a.n)
    phones = start_phones(a.n, PHONES_HOME, prefix=a.prefix, cpu_shares=shares,
                          runtimes=parse_runtimes(a.runtime, a.n))
    ads = advertise(phones)  # the Kotlin phones' mDNS records, held here while they run
    for i, p in enumerate(phones):
        print(f"{p.name}: {p.endpoint} pid {p.proc.pid}, {p.runtime} runtime, work dir {p.workdir}"
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
        for ad in ads:
            ad.close()
        for p in phones:
            p.stop()
    return 0


# ---------------------------------------------------------------- run
def cmd_run(a) -> int:
    from .run_config import RunConfig
    from .run_job import run

    run(RunConfig.from_args(a))
    return 0


# ---------------------------------------------------------------- eval
def cmd_eval(a) -> int:
    from .eval_command import run_eval

    adapter = Path(a.adapter)
    result = run_eval(Path(a.program), adapter, a.data, console, generate=a.generate, show=a.show,
                      seed=a.seed if a.sample else None, max_new_tokens=a.max_new_tokens)
    from .tensorboard_log import eval_run_dir, write_eval
    if (run_dir := eval_run_dir(adapter)) is not None:  # next to the run's training curves in TensorBoard
        write_eval(run_dir, result["base"], result["adapter"], _trained_micro_batches(run_dir))
    return 0


def _trained_micro_batches(run_dir: Path) -> int:
    """The TensorBoard step of a run's eval: the micro-batches it trained (summary.json), else 0."""
    import json

    try:
        return int(json.loads((run_dir / "summary.json").read_text()).get("micro_batches", 0))
    except (OSError, ValueError, TypeError):
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


def _per_stage(text: str, example: str, ok, refusal: str) -> float | list:
    """'x' -> x; 'x0,x1,...' -> one per stage; each value must pass `ok`, else `refusal` (with {v})."""
    try:
        vals = [float(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number or one per stage ({example}), got {text}") from None
    bad = [v for v in vals if not ok(v)]
    if bad:
        raise argparse.ArgumentTypeError(refusal.format(v=f"{bad[0]:g}"))
    return vals[0] if len(vals) == 1 else vals


def _alphas(text: str) -> float | list:
    """'0.5' -> 0.5; '0.5,0.75,1' -> [0.5, 0.75, 1.0]; each in [0, 1]."""
    return _per_stage(text, "0.5,0.75,1", lambda v: 0 <= v <= 1,
                      "{v} is outside [0, 1]: the local loss is alpha*CE + (1-alpha)*KL")


def _lrs(text: str) -> float | list:
    """'2e-3' -> 0.002; '0,0,3e-3' -> one per stage; each in [0, 100], as the phones' STAGE_ASSIGN rule
    (0: a forward-only stage); some stage must train."""
    lrs = _per_stage(text, "0,0,3e-3", lambda v: 0 <= v <= 100,
                     "{v} is not a learning rate: give values from 0 (a forward-only stage) to 100")
    if not any(lrs if isinstance(lrs, list) else [lrs]):
        raise argparse.ArgumentTypeError(f"{text}: every stage would be forward-only; give some stage an LR above 0")
    return lrs


def _non_negative(text: str) -> float:
    v = float(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return v


def add_generation_args(v) -> None:
    """eval's (and finetune's) options for the generated answers."""
    v.add_argument("--show", type=int, default=3, metavar="N",
                   help="print N held-out prompts with the base model's and the adapter's answers (default %(default)s)")
    v.add_argument("--generate", type=int, default=32, metavar="N",
                   help="generate answers to N held-out questions and score them by exact match and token F1 "
                        "(default %(default)s; 0: none)")
    v.add_argument("--sample", action="store_true", help="sample the answers (T=0.7, top-p 0.95) instead of greedy")
    v.add_argument("--seed", type=int, default=0, help="with --sample: the seed of the draws")
    v.add_argument("--max-new-tokens", type=int, default=None,
                   help="longest answer generated (default: the longest reference + 4 tokens)")


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
    e.add_argument("--runtime", default=None, metavar="python|kotlin|R1,R2,...",
                   help="what the phones run: python (zl-phone, default) or kotlin (the app's core on the JVM, "
                        "on ExecuTorch's C++ runtime); one for all or one per phone")
    e.add_argument("--cpu-share", default=None, metavar="F|F1,F2,...",
                   help="hold each phone to this share of one CPU core (one value, or one per phone), in a cgroup of "
                        "its own (needs root and the cgroup cpu controller)")
    e.set_defaults(func=cmd_emulate)
    r = sub.add_parser("run", help="train: ZeroLock over the phones")
    r.add_argument("--program", help="zl-export output dir")
    r.add_argument("--data", default=None,
                   help="AG News CSV, JSONL, or wordnet[:validation|test] (WordNet noun glosses by category); "
                        "omit for the tiny model's synthetic set")
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
    r.add_argument("--lr", type=_lrs, default=2e-3,
                   help="AdamW's learning rate: one value, or one per stage (3e-4,3e-4,3e-3: the early stages slower; "
                        "0,0,3e-3: stages 0 and 1 forward-only, phase 1 only, their LoRA left at the init)")
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
    r.add_argument("--runtime", default=None, metavar="python|kotlin|R1,R2,...",
                   help="with --devices emulated:N: what the phones run, python (zl-phone, default) or kotlin (the "
                        "app's core on the JVM, on ExecuTorch's C++ runtime); one for all or one per phone")
    r.add_argument("--mem-limit", default=None, help="with --devices emulated:N: each phone's memory limit "
                                                     "(zl-phone --mem-limit), one for all or A,B,...")
    from .plan_cli import add_parsers
    add_parsers(sub)
    from .export_run import add_parser as add_export_parser
    add_export_parser(sub)
    from .finetune import add_parser as add_finetune_parser
    add_finetune_parser(sub, add_generation_args, _lrs, _fraction, _alphas)
    v = sub.add_parser("eval", help="held-out NLL, accuracy, and generated answers' exact match and F1 with the trained adapter")
    v.add_argument("--program", required=True)
    v.add_argument("--adapter", required=True)
    v.add_argument("--data", default=None)
    add_generation_args(v)
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

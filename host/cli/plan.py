"""zl-host profile and zl-host plan: measure each phone, then split the model so none waits.

The commands only gather and show: host/planning/profile.py measures, host/planning/split_planner.py decides."""
from __future__ import annotations

import json
import os
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ..run.config import add_run_options

out_console = Console(soft_wrap=True)
if not out_console.is_terminal:  # a pipe or a log: wide enough that the tables keep one line a row
    out_console = Console(soft_wrap=True, width=160)
MiB = 2**20


def _cli_error():
    from .error import CliError
    return CliError


# ---------------------------------------------------------------- shared bits
def parse_list(text: str | None, n: int, what: str, flag: str) -> list[str | None]:
    """'A,B,C' -> one value per phone (a single value is given to every phone)."""
    if not text:
        return [None] * n
    items = [t.strip() for t in text.split(",")]
    if len(items) == 1:
        return items * n
    if len(items) != n or not all(items):
        raise _cli_error()(f"{flag} {text!r}: give one {what} for every one of the {n} phones, comma-separated "
                           f"(or one for all)")
    return items


def emulated_phone_args(n: int, mem_limits: list[str | None], cpu_shares: list[float] | None = None) -> "callable":
    """zl-phone arguments for phone i, as host.phones.emulate.start_phones gives them (its CPU budget, else
    its own core where there are two or more), plus its --mem-limit."""
    from ..phones.emulate import budget_args

    cores = sorted(os.sched_getaffinity(0))

    def args(i: int) -> list[str]:
        if cpu_shares:
            out = budget_args(cpu_shares[i])
        else:
            out = ["--cpus", str(cores[i % len(cores)]), "--threads", "1"] if len(cores) > 1 else []
        if mem_limits[i]:
            out += ["--mem-limit", mem_limits[i]]
        return out
    return args


def check_mem_limits(limits: list[str | None], flag: str = "--mem-limit") -> list[int | None]:
    """The limits in bytes (None where not given); a bad size is a one-line CliError naming `flag`."""
    from zl_mobile.memlimit import parse_size

    out = []
    for v in limits:
        try:
            out.append(None if v is None else parse_size(v))
        except ValueError as e:
            raise _cli_error()(f"{flag}: {e}") from None
    return out


def export_settings(a) -> tuple[str, dict]:
    """(model, export settings) from --program (an export's manifest) or the explicit flags."""
    if getattr(a, "program", None):
        from exporter.manifest import ManifestError, load_manifest
        try:
            m = load_manifest(Path(a.program), check_files=False)
        except ManifestError as e:
            raise _cli_error()(str(e)) from None
        src = m["model"]
        model = "tiny" if src["source"] == "tiny" else src["path"]
        if model is None:
            raise _cli_error()(f"{a.program} was exported from an in-memory model: pass --model DIR instead")
        return model, dict(m["export"])
    return a.model, {"seq_len": a.seq_len, "micro_batch": a.micro_batch, "loss_positions": a.loss_positions,
                     "backend": a.backend, "base_weights": a.base_weights}


# ---------------------------------------------------------------- profile
def cmd_profile(a) -> int:
    from ..planning.profile import ProfileError, export_calibration, profile_devices, save_profile
    from ..run.coordinator import RunError

    CliError = _cli_error()
    model, export = export_settings(a)
    out = Path(a.out)
    phones, links, handles = [], None, []
    console = Console(stderr=True, soft_wrap=True)
    say = lambda msg: console.print(msg, markup=False)  # noqa: E731
    try:
        try:
            cal = export_calibration(model, export, Path(a.calibration or out / "calibration"), progress=say)
        except Exception as e:
            from exporter.errors import ExportError
            if isinstance(e, ExportError):
                raise CliError(f"cannot export the calibration programs: {e}") from None
            raise
        if a.devices.startswith("emulated:"):
            from ..phones.emulate import start_phones
            try:
                n = int(a.devices.split(":", 1)[1])
            except ValueError:
                raise CliError(f"--devices {a.devices!r}: expected emulated:N with N a number") from None
            limits = parse_list(a.mem_limit, n, "memory limit", "--mem-limit")
            check_mem_limits(limits)
            from ..phones.emulate import cpu_shares
            shares = cpu_shares(a.cpu_share, n)
            say(f"starting {n} emulated phones")
            phones = start_phones(n, out / "phones", extra_args=["--mdns", "none"],
                                  per_phone_args=emulated_phone_args(n, limits, shares))
            handles = [p.handle() for p in phones]
        else:
            if a.mem_limit or a.cpu_share:
                raise CliError("--mem-limit / --cpu-share set emulated phones' limits: use --devices emulated:N (a "
                               "real phone reports its own budget)")
            handles, links = _real_devices(a)
        profiles = profile_devices(handles, cal, out / "runs", reps=a.reps, links=links, progress=say)
        for prof in profiles:
            say(f"{prof['device']}: profile saved to {save_profile(prof, out)}")
    except (ProfileError, RunError) as e:
        raise CliError(str(e)) from None
    finally:
        for p in phones:
            p.stop()
        if links is not None:
            for problem in links.close():
                console.print(f"zl-host: warning: {problem}", markup=False)
    out_console.print(profile_table(profiles))
    return 0


def _real_devices(a):
    from ..devices.adb_wiring import AdbLinks
    from ..devices.discovery import DeviceLookupError, find_devices, load_tokens, resolve

    CliError = _cli_error()
    links = AdbLinks(data_port=47475, staging_dir="/data/local/tmp/zerolock")
    try:
        tokens = load_tokens(a.tokens)
        spec = a.devices
        if spec == "auto":
            found, notes = find_devices(timeout=min(a.wait, 3.0), interfaces=a.mdns)
            names = [f.name for f in found if f.ready and f.name in tokens]
            if not names:
                raise CliError(f"no phone with a known pairing token found ({'; '.join(notes)}): start phones "
                               "(zl-host emulate N) or pass --tokens, or name them with --devices A,B")
            spec = ",".join(names)
        handles = resolve(spec, len(spec.split(",")), tokens, a.wait, a.mdns, links=links)
    except DeviceLookupError as e:
        links.close()
        raise CliError(str(e)) from None
    except BaseException:
        links.close()
        raise
    return handles, links


def profile_table(profiles: list[dict]) -> Table:
    t = Table(title="phone profiles (per micro-batch)")
    for col in ("device", "budget", "runtime", "per layer", "fixed", "readout+loss", "step/window",
                "weights/layer", "act/layer", "peak 1 layer", "push rate"):
        t.add_column(col, justify="right" if col != "device" else "left")
    for p in profiles:
        f = p["fit"]
        t.add_row(p["device"], _mib(p.get("budget_bytes")), _mib(f["runtime_bytes"]),
                  _ms(f["phase1_layer_s"] + f["phase2_layer_s"]), _ms(f["phase1_fixed_s"] + f["phase2_fixed_s"]),
                  _ms(f["phase2_fixed_s"]), _ms(f["step_fixed_s"] + f["step_layer_s"]),
                  _mib(f["layer_bytes"], 2), _mib(f["act_layer_bytes"], 2), _mib(f["peak_1_layer_bytes"]),
                  f"{p['link_mbit']:.0f} Mbit/s" if p.get("link_mbit") else "-")
    return t


# ---------------------------------------------------------------- plan
def plan_devices(spec: str, folder: Path) -> list[str] | None:
    if spec == "auto":
        return None
    if spec.startswith("emulated:"):
        try:
            return [f"emu{i}" for i in range(int(spec.split(":", 1)[1]))]
        except ValueError:
            raise _cli_error()(f"--devices {spec!r}: expected emulated:N with N a number") from None
    return [n.strip() for n in spec.split(",") if n.strip()]


def make_plan(model: str, export: dict, profiles: list[dict], window_size: int, schedule: str = "zerolock",
              link_mbit: float | None = None, scales: dict | None = None, budgets: dict | None = None):
    """(plan, even split's prediction, phone models) for these profiles; `budgets` (device -> bytes,
    zl-host plan --mem-limits) overrides the memory budgets the profiles recorded."""
    from ..planning.profile import check_matches, frame_bytes, model_layers, phone_model
    from ..planning.split_planner import evaluate_split, even_chunks, plan_split

    check_matches(profiles, export)
    L = model_layers(model)
    models = [phone_model(p, window_size, link_mbit, budget_bytes=(budgets or {}).get(p["device"]),
                          scale=(scales or {}).get(p["device"], 1.0)) for p in profiles]
    fb = frame_bytes(profiles[0])
    plan = plan_split(L, models, fb, schedule=schedule, window_size=window_size)
    even = evaluate_split(even_chunks(L, len(models)), models, fb, schedule, window_size)
    return plan, even, models


def cmd_plan(a) -> int:
    from ..planning.profile import ProfileError, load_profiles
    from ..planning.split_planner import InfeasibleError

    CliError = _cli_error()
    model, export = export_settings(a)
    folder = Path(a.profiles)
    budgets = None
    try:
        profiles = load_profiles(folder, plan_devices(a.devices, folder))
        if a.mem_limits:  # in the profiles' order: --devices, else the profile files' (sorted) names
            limits = check_mem_limits(parse_list(a.mem_limits, len(profiles), "memory budget", "--mem-limits"),
                                      "--mem-limits")
            budgets = {p["device"]: b for p, b in zip(profiles, limits)}
        plan, even, _ = make_plan(model, export, profiles, a.window, a.schedule, a.link_mbit, budgets=budgets)
    except (ProfileError, ValueError) as e:
        raise CliError(str(e)) from None
    except InfeasibleError as e:
        given = f" (budgets from --mem-limits {a.mem_limits})" if budgets else ""
        raise CliError(f"{e}{given}") from None
    record = {"format": "zerolock-plan", "model": model, "export": export, "window_size": a.window,
              "schedule": a.schedule, "profiles": str(folder.absolute()), **plan.to_json(),
              **({"mem_limits": budgets} if budgets else {}),
              "even": {"chunks": even.chunks, "devices": even.devices, "bottleneck_s": even.bottleneck_s}}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2))
    out_console.print(plan_table(plan, "planned split" + (" (budgets from --mem-limits)" if budgets else "")))
    out_console.print(f"bottleneck: stage {plan.bottleneck_stage} ({plan.stages[plan.bottleneck_stage].phone}) "
                      f"{_ms(plan.bottleneck_s)} per micro-batch; ideal (layers cut anywhere) {_ms(plan.ideal_s)} "
                      f"({plan.bottleneck_s / plan.ideal_s:.2f}x); even split {even.chunks} on "
                      f"{','.join(even.devices)}: {_ms(even.bottleneck_s)} "
                      f"({even.bottleneck_s / plan.bottleneck_s:.2f}x slower)", markup=False)
    out_console.print(f"chunks {plan.chunks} on {','.join(plan.devices)}; wrote {out}: "
                      f"zl-export --chunks {out} ... then zl-host run --plan {out} ...", markup=False)
    return 0


def plan_table(plan, title: str) -> Table:
    t = Table(title=title)
    for col in ("stage", "device", "layers", "predicted", "compute", "link", "memory", "budget", ""):
        t.add_column(col, justify="left" if col in ("device", "") else "right")
    b = plan.bottleneck_stage
    for k, s in enumerate(plan.stages):
        t.add_row(str(k), s.phone, f"{s.first}-{s.last} ({s.layers})", _ms(s.time_s), _ms(s.compute_s), _ms(s.link_s),
                  _mib(s.memory_bytes), _mib(s.budget_bytes), "bottleneck" if k == b else "")
    return t


def read_plan(path: Path) -> dict:
    CliError = _cli_error()
    try:
        d = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise CliError(f"no plan file {path}: write one with zl-host plan --out {path}") from None
    except (OSError, json.JSONDecodeError) as e:
        raise CliError(f"{path} is not a readable plan ({e}): write it again with zl-host plan") from None
    if d.get("format") != "zerolock-plan":
        raise CliError(f"{path} is not a zl-host plan file: write one with zl-host plan --out {path}")
    return d


def _ms(s) -> str:
    return "-" if s is None else f"{s * 1e3:.1f} ms"


def _mib(n, digits: int = 0) -> str:
    return "-" if n is None else f"{n / MiB:.{digits}f} MiB"


def add_parsers(sub) -> None:
    """zl-host profile and zl-host plan (called from host/cli/zl_host.py's build_parser)."""
    from exporter.config import BASE_WEIGHTS

    def export_flags(p):
        p.add_argument("--program", default=None, help="take the model and export settings from this zl-export output")
        p.add_argument("--model", default="tiny", help="local Hugging Face Llama directory, or 'tiny'")
        p.add_argument("--seq-len", type=int, default=128)
        p.add_argument("--micro-batch", type=int, default=1)
        p.add_argument("--loss-positions", type=int, default=None)
        p.add_argument("--backend", choices=["xnnpack", "portable"], default="xnnpack")
        p.add_argument("--base-weights", choices=BASE_WEIGHTS, default="fp32")

    p = sub.add_parser("profile", help="measure each phone: per-layer phase times, readout, memory, budget")
    p.add_argument("--devices", required=True, help="auto | emulated:N | NAME,NAME,... (adb serials too)")
    export_flags(p)
    p.add_argument("--out", default="profiles", help="folder for the profiles (one JSON per device)")
    p.add_argument("--calibration", default=None, help="folder for the calibration programs (default OUT/calibration)")
    p.add_argument("--reps", type=int, default=8, help="measured micro-batches per calibration stage (after one warm-up)")
    p.add_argument("--mem-limit", default=None, help="with emulated:N: each phone's memory limit, one for all or A,B,...")
    p.add_argument("--cpu-share", default=None, help="with emulated:N: each phone's share of one core, one for all or "
                                                     "F1,F2,... (zl-phone --cpu-share)")
    add_run_options(p, ["tokens", "wait", "mdns"])  # as zl-host run's (host/run/config.py)
    p.set_defaults(func=cmd_profile)

    q = sub.add_parser("plan", help="split the model over the profiled phones so the slowest stage is fastest")
    q.add_argument("--devices", default="auto", help="auto (every profile) | emulated:N | NAME,NAME,...")
    q.add_argument("--profiles", default="profiles", help="folder zl-host profile wrote")
    export_flags(q)
    add_run_options(q, ["window"], help={"window": "micro-batches per update window (the step is shared out)"})
    q.add_argument("--schedule", choices=["zerolock", "gpipe", "1f1b", "pipedream"], default="zerolock",
                   help="what the stages hold (held activations)")
    q.add_argument("--link-mbit", type=float, default=None, help="link rate to plan with instead of the measured one")
    q.add_argument("--mem-limits", default=None, help="each phone's memory budget to plan with instead of its profile's "
                                                      "(e.g. 1.25GiB, 900M): one for all, or A,B,... in --devices order")
    q.add_argument("--out", default="plan.json", help="the plan: zl-export --chunks PLAN, zl-host run --plan PLAN")
    q.set_defaults(func=cmd_plan)


# ---------------------------------------------------------------- zl-host run --plan
def check_plan_export(plan: dict, manifest: dict, plan_path, program) -> dict:
    """The export must be the plan's split, at the settings the phones were profiled at."""
    CliError = _cli_error()
    have = ",".join(f"{c['layers'][0]}-{c['layers'][1]}" for c in manifest["chunks"])
    if have != plan["chunks"]:
        raise CliError(f"{program} holds chunks {have}, the plan {plan_path} wants {plan['chunks']}: export with "
                       f"zl-export --chunks {plan_path} ...")
    for key in ("seq_len", "micro_batch", "backend"):
        want = (plan.get("export") or {}).get(key)
        if want is not None and manifest["export"].get(key) != want:
            raise CliError(f"{program} was exported with {key} {manifest['export'].get(key)}, the plan's profiles "
                           f"at {want}: export again with --{key.replace('_', '-')} {want}, or profile and plan again")
    return plan


def order_by_plan(handles: list, plan: dict) -> list:
    """The handles in the plan's stage order (every planned phone must be there)."""
    by_name = {h.name: h for h in handles}
    missing = [n for n in plan["devices"] if n not in by_name]
    if missing:
        raise _cli_error()(f"the plan puts stages on {', '.join(missing)}, not among this run's phones "
                           f"({', '.join(by_name) or 'none'}): pass --devices with the plan's phones or plan again")
    return [by_name[n] for n in plan["devices"]]


def drift_watch(plan: dict, margin: float, window_size: int, run_dir: Path, say):
    """A DriftWatch for the run, re-planning from the plan's profiles; reports go to the console
    and RUN_DIR/drift.jsonl."""
    from ..planning.profile import ProfileError, load_profiles
    from ..run.drift import DriftWatch, describe

    try:
        profiles = load_profiles(Path(plan["profiles"]), plan["devices"])
    except ProfileError:
        profiles = None  # the drift is still reported, without what a re-plan would gain

    def replan(scales):
        return make_plan(plan["model"], plan["export"], profiles, window_size, plan.get("schedule", "zerolock"),
                         scales=scales, budgets=plan.get("mem_limits"))[0]

    def report(rec):
        with open(Path(run_dir) / "drift.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")
        say(describe(rec))

    return DriftWatch(plan, replan if profiles else None, margin, report)

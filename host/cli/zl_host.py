"""zl-host: find the phones, push the programs, run the pipeline, show what happens."""
from __future__ import annotations

import argparse
import time
from pathlib import Path

from rich.console import Console

console = Console(stderr=True, soft_wrap=True)


from ..run.config import add_run_options  # noqa: E402
from .error import CliError  # noqa: E402,F401  (one class, wherever a command raises it)


# ---------------------------------------------------------------- devices / emulate
def cmd_devices(a) -> int:
    from ..devices.discovery import as_json, find_devices

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
    from ..devices.discovery import PHONES_HOME
    from ..phones.emulate import cpu_shares, start_phones
    from ..phones.kotlin_phone import advertise, parse_runtimes

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
    from ..run.config import RunConfig
    from ..run.job import run

    run(RunConfig.from_args(a))
    return 0


# ---------------------------------------------------------------- eval
def cmd_eval(a) -> int:
    from .eval import run_eval

    adapter = Path(a.adapter)
    result = run_eval(Path(a.program), adapter, a.data, console, generate=a.generate, show=a.show,
                      seed=a.seed if a.sample else None, max_new_tokens=a.max_new_tokens)
    from ..run.tensorboard_log import eval_run_dir, write_eval
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
    add_run_options(r)  # host/run/config.py: each option's one definition
    r.set_defaults(func=cmd_run)
    from .plan import add_parsers
    add_parsers(sub)
    from .export import add_parser as add_export_parser
    add_export_parser(sub)
    from .finetune import add_parser as add_finetune_parser
    add_finetune_parser(sub, add_generation_args)
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


"""Small helpers shared by the benchmark scripts: process memory, machine description, timing."""
from __future__ import annotations

import datetime
import os
import platform
import resource
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as `python bench/x.py` from anywhere
    sys.path.insert(0, str(REPO))

MiB = 1 << 20


def _interrupt(signum, frame):
    raise KeyboardInterrupt


# SIGTERM (kill, a timeout) unwinds a benchmark like Ctrl-C, so its `finally` blocks stop the
# emulated phones it started (they run in sessions of their own and would outlive it) and
# remove their cgroups and namespaces.
import signal  # noqa: E402
import threading  # noqa: E402

if threading.current_thread() is threading.main_thread():
    signal.signal(signal.SIGTERM, _interrupt)

from zl_common.quiet import quiet_libraries  # noqa: E402

quiet_libraries()  # a benchmark's terminal shows its figures, not torchao's or transformers' noise


def proc_status() -> dict:
    """VmRSS / VmHWM (peak RSS) of this process in bytes, from /proc/self/status."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def pss_bytes() -> int | None:
    """Proportional set size of this process now (None if the kernel does not say)."""
    from zl_mobile.telemetry import read_pss_bytes

    return read_pss_bytes()


def maxrss_bytes() -> int:
    """Peak RSS of this process over its life (getrusage; kilobytes on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def memory_snapshot() -> dict:
    s = proc_status()
    return {"rss": s.get("VmRSS"), "hwm": s.get("VmHWM"), "rss_anon": s.get("RssAnon"),
            "rss_file": s.get("RssFile"), "pss": pss_bytes(), "ru_maxrss": maxrss_bytes()}


def machine() -> dict:
    model = platform.processor() or "unknown"
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except (OSError, subprocess.CalledProcessError):
        pass
    mem = None
    try:
        with open("/proc/meminfo") as f:
            mem = int(f.readline().split()[1]) * 1024
    except OSError:
        pass
    return {"cpu": model, "cores": os.cpu_count(), "mem_total": mem, "kernel": platform.release(),
            "python": platform.python_version()}


def now_iso() -> str:
    return datetime.datetime.now().astimezone().isoformat(timespec="seconds")


def median(xs) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def gib(n) -> str:
    return "-" if n is None else f"{n / (1 << 30):.2f} GiB"


def mib(n) -> str:
    return "-" if n is None else f"{n / MiB:,.0f} MiB"


def replace_md_section(path: Path, heading: str, body: str, title: str, keep_from: str | None = None) -> None:
    """Write `heading` + body into a markdown file, replacing that section (up to the next '## ')
    and leaving the other sections as they are. If `keep_from` (a sub-heading) is present in the
    old section, the old text from it to the section's end is kept after the new body."""
    path = Path(path)
    text = path.read_text() if path.exists() else f"# {title}\n"
    lines = text.splitlines(keepends=True)
    start = next((i for i, ln in enumerate(lines) if ln.rstrip() == heading), None)
    kept = ""
    if start is None:
        before, after = text.rstrip("\n") + "\n\n", ""
    else:
        end = next((j for j in range(start + 1, len(lines)) if lines[j].startswith("## ")), len(lines))
        old = "".join(lines[start:end])
        if keep_from and keep_from in old:
            kept = old[old.index(keep_from):].rstrip("\n") + "\n"
        before, after = "".join(lines[:start]), "".join(lines[end:])
    section = heading + "\n\n" + body.rstrip("\n") + "\n" + ("\n" + kept if kept else "")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(before + section + ("\n" + after if after else ""))


def bench_micro_batches(export_dir: Path, n: int, micro_batch: int, seq_len: int):
    """n micro-batches of the synthetic data set, tokenised with the export's tokenizer."""
    from transformers import AutoTokenizer

    from zl_common.data import load_examples, tokenized_microbatches

    tok = AutoTokenizer.from_pretrained(Path(export_dir) / "tokenizer")
    return tokenized_microbatches(load_examples(None)[: n * micro_batch], tok, seq_len, micro_batch)


def run_on_phones(export_dir: Path, root: Path, settings, mbs, n_phones: int, *, prefix: str, extra_args=None,
                  per_phone_args=None, coordinator_cls=None, on_event=None, max_seconds: float = 240.0,
                  network=None, cpu_shares=None):
    """host.phones.emulate.run_on_emulated_phones with the benchmarks' defaults: run id "bench", a hung run
    ended with RunError after `max_seconds`. Returns (result, metrics records)."""
    import dataclasses

    from host.phones.emulate import run_on_emulated_phones

    return run_on_emulated_phones(export_dir, root, dataclasses.replace(settings, max_seconds=max_seconds), mbs,
                                  n_phones, prefix=f"{prefix}{os.getpid()}-", run_id="bench", extra_args=extra_args,
                                  per_phone_args=per_phone_args, network=network, cpu_shares=cpu_shares,
                                  coordinator_cls=coordinator_cls, on_event=on_event)


def run_sampled(cmd: list[str], interval_s: float, env: dict | None = None) -> tuple[int, str, list[tuple[float, int]]]:
    """Run a measuring process, sampling its PSS (/proc/PID/smaps_rollup) from this one until it
    exits: a thread inside it would see nothing while ExecuTorch's binding holds the interpreter.
    Returns (exit code, the tail of its stderr, [(time, PSS bytes)])."""
    import tempfile
    import time

    from zl_mobile.telemetry import read_pss_bytes

    samples = []
    with tempfile.TemporaryFile(mode="w+") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err, text=True)
        while proc.poll() is None:
            pss = read_pss_bytes(proc.pid)
            if pss is not None:
                samples.append((time.time(), pss))
            time.sleep(interval_s)
        err.seek(0)
        return proc.returncode, err.read()[-4000:], samples


def cpu_shares(text: str, stages: int) -> list[float] | None:
    """--cpu-share: None (unbudgeted, pinned) or one share of a core per stage. ValueError (one line)."""
    from zl_mobile.cpu_budget import CpuBudgetError, parse_shares, unavailable

    if text == "none" or (text == "auto" and stages < 3):
        return None
    try:
        shares = [round(1.8 / stages, 3)] * stages if text == "auto" else parse_shares(text, stages)
    except CpuBudgetError as e:
        raise ValueError(str(e)) from None
    why = unavailable()
    if why is not None:
        raise ValueError(f"--cpu-share {text}: {why} (--cpu-share none runs {stages} stages on pinned, shared cores)")
    cores = len(os.sched_getaffinity(0))
    if sum(shares) > cores:
        raise ValueError(f"--cpu-share {text}: the shares add up to {sum(shares):g} cores, more than the {cores} here; "
                         f"give at most {cores - 0.2:g} in all, so the host and the links keep some")
    return shares

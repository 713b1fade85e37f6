"""What a device reports about itself: memory (PSS), temperature, and where time went."""
from __future__ import annotations

import glob
import time
from pathlib import Path


def read_pss_bytes(pid: str | int = "self") -> int | None:
    """PSS from /proc/<pid>/smaps_rollup (Linux and Android); None where unavailable."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class PssSampler:
    """PSS for every micro-batch's telemetry without paying a read for each: reading
    smaps_rollup walks the process's page tables (3-4 ms on an emulated phone, more with a large
    weights file mapped), a third of a small model's micro-batch. A fresh reading is taken when
    the last one is older than `interval_s` or than 20x what the last read cost (so reading stays
    under ~5% of the time); otherwise the last reading is reported again."""

    def __init__(self, interval_s: float = 0.25, pid: str | int = "self"):
        self.interval_s = interval_s
        self.pid = pid
        self._value: int | None = None
        self._at = float("-inf")
        self._cost = 0.0

    def read(self) -> int | None:
        now = time.monotonic()
        if self._value is None or now - self._at >= max(self.interval_s, 20 * self._cost):
            self._value = read_pss_bytes(self.pid)
            self._at = time.monotonic()
            self._cost = self._at - now
        return self._value


def read_pss_by_backing(pid: str | int = "self") -> dict | None:
    """PSS split by what backs it (/proc/<pid>/smaps): the chunk's weights files (.ptd), its
    program (.pte), other files (shared libraries: the runtime, torch, ...) and anonymous memory
    (heap: arenas, buffers, tensors, interpreter objects). None where unavailable."""
    parts = {"weights": 0, "program": 0, "libraries": 0, "anonymous": 0}
    kind = "anonymous"
    try:
        lines = Path(f"/proc/{pid}/smaps").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        head = line.split(None, 5)
        if head and not head[0].endswith(":"):  # a mapping's header: range perms offset dev inode [path]
            path = head[5].removesuffix(" (deleted)").rstrip() if len(head) > 5 else ""
            kind = ("weights" if path.endswith(".ptd") else "program" if path.endswith(".pte")
                    else "libraries" if path.startswith("/") else "anonymous")
        elif head and head[0] == "Pss:":
            parts[kind] += int(head[1]) * 1024
    return parts


_runtime_pss: int | None = None


def runtime_pss_bytes() -> int | None:
    """This process's PSS before its first program was loaded: what the runtime itself costs
    (on an emulated phone the Python interpreter, torch and ExecuTorch), which no schedule
    changes. Read once, at the first call; the stage calls it before loading its program."""
    global _runtime_pss
    if _runtime_pss is None:
        _runtime_pss = read_pss_bytes()
    return _runtime_pss


def read_temperature_c() -> float | None:
    """The hottest thermal zone (or a battery supply's temp), if the hardware exposes one.
    None means unavailable: a temperature is never invented."""
    best = None
    for path in glob.glob("/sys/class/thermal/thermal_zone*/temp") + glob.glob("/sys/class/power_supply/*/temp"):
        try:
            raw = int(Path(path).read_text().strip())
        except (OSError, ValueError):
            continue
        # thermal zones report millidegrees, power supplies tenths of a degree
        c = raw / 1000.0 if "thermal_zone" in path else raw / 10.0
        if -40.0 < c < 150.0:
            best = c if best is None else max(best, c)
    return best


def total_memory_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def take_peak_rss_bytes() -> int | None:
    """Peak RSS (VmHWM) since the previous call, then reset the mark (Linux >= 4.0, Android).

    The kernel tracks this peak exactly, including inside ExecuTorch calls, where a Python
    sampling thread cannot run (the runtime's Python binding holds the GIL while it computes).
    None where unavailable."""
    peak = None
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                peak = int(line.split()[1]) * 1024
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
    except (OSError, ValueError, IndexError):
        pass
    return peak


class ActivityClock:
    """Splits wall time into active (computing) and waiting, for the active/wait timeline. Waiting
    is for input ("wait") or for the downstream to commit ("wait_downstream": backpressure)."""

    def __init__(self):
        self.active_s = 0.0
        self.wait_s = 0.0
        self.wait_downstream_s = 0.0  # part of wait_s: held back by backpressure, not waiting for input
        self.spans: list[tuple[str, float, float]] = []  # (kind, start, end) in time.time()

    def span(self, kind: str):
        clock = self

        class _Span:
            def __enter__(self):
                self.t0 = time.time()
                return self

            def __exit__(self, *exc):
                t1 = time.time()
                if kind in ("wait", "wait_downstream"):
                    clock.wait_s += t1 - self.t0
                    if kind == "wait_downstream":
                        clock.wait_downstream_s += t1 - self.t0
                else:
                    clock.active_s += t1 - self.t0
                clock.spans.append((kind, self.t0, t1))
                return False

        return _Span()

    def drain_spans(self) -> list:
        spans, self.spans = self.spans, []
        return spans

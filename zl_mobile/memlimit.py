"""An emulated phone's memory limit (zl-phone --mem-limit) and the budget a device reports.

A phone has less memory to give than it has: Android kills an app that takes too much. An
emulated phone with --mem-limit behaves the same way: a watchdog reads its memory a few times a
second and ends the process (exit 137, as a kill would) with one line saying why when it passes
the limit. Memory is PSS, what Android counts an app's memory in (charged_bytes): not RSS, which
counts a weights file's page once per mapping, and ExecuTorch maps a chunk's .ptd once per method
(TinyLlama shape: RSS 2.6 GiB of a 1.46 GiB .ptd, PSS 1.36 GiB). The limit is the budget the
phone reports in HELLO (`memory_budget_bytes`); without one the budget is what the kernel says is
available (MemAvailable), as Android's app reports its available memory."""
from __future__ import annotations

import logging
import os
import re
import sys
import threading
import time
from pathlib import Path

log = logging.getLogger("zl_mobile.memlimit")
KILLED_EXIT_CODE = 137
_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}


def parse_size(text: str) -> int:
    """'600M', '1.5G', '800000k' or plain bytes -> bytes. ValueError (one line) otherwise."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgG]?)(i?[bB])?\s*", text or "")
    if not m:
        raise ValueError(f"memory size {text!r} is not a number with an optional unit: give e.g. 600M or 1.5G")
    n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise ValueError(f"memory size {text!r} must be more than 0 bytes")
    return n


def rss_bytes() -> int:
    """Resident memory now, or the kernel's peak mark (VmHWM) if higher: the mark also catches a
    peak inside a runtime call, where this thread cannot run (the stage resets the mark after
    each micro-batch, zl_mobile.telemetry.take_peak_rss_bytes)."""
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return max(rss, int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    return rss


def charged_bytes() -> int:
    """What the limit charges this process: its PSS now, plus whatever the kernel's peak mark saw
    above the resident set now (rss_bytes' mark: a peak inside a runtime call, where this thread
    cannot run, is the arenas' anonymous memory, which PSS counts whole). rss_bytes where PSS
    cannot be read."""
    from .telemetry import read_pss_bytes

    pss = read_pss_bytes()
    if pss is None:
        return rss_bytes()
    with open("/proc/self/statm") as f:
        rss_now = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return pss + max(0, rss_bytes() - rss_now)


def available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo; None where unreadable."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class MemoryLimit:
    """The watchdog: start() it once; it ends the process when its memory (charged_bytes) passes `limit_bytes`."""

    def __init__(self, limit_bytes: int, name: str = "phone", period_s: float = 0.05):
        self.limit_bytes = limit_bytes
        self.name = name
        self.period_s = period_s
        self.peak = 0

    def start(self) -> "MemoryLimit":
        threading.Thread(target=self._watch, name="mem-limit", daemon=True).start()
        return self

    def _watch(self) -> None:
        while True:
            t0 = time.monotonic()
            used = charged_bytes()
            self.peak = max(self.peak, used)
            if used > self.limit_bytes:
                msg = (f"zl-phone {self.name}: killed: memory (PSS) {used / 2**20:.1f} MiB passed --mem-limit "
                       f"{self.limit_bytes / 2**20:.1f} MiB (as a phone's low-memory killer would); give the stage "
                       "fewer layers (zl-host plan) or the phone a larger limit")
                log.error(msg)
                print(msg, file=sys.stderr, flush=True)
                os._exit(KILLED_EXIT_CODE)
            # reading PSS walks the page tables (ms with a large weights file mapped): at most ~5% of a core
            time.sleep(max(self.period_s, 20 * (time.monotonic() - t0)))


def budget_bytes(limit: MemoryLimit | None) -> int | None:
    """What this device can give: its limit, else what is available."""
    return limit.limit_bytes if limit is not None else available_bytes()

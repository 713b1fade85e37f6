"""zl_mobile/memlimit.py's charge: PSS, so a weights file a process maps twice (ExecuTorch maps a
chunk's .ptd once per method) counts once, where the resident set counts it twice."""
from __future__ import annotations

import mmap
import os

from zl_mobile.memlimit import charged_bytes
from zl_mobile.telemetry import take_peak_rss_bytes

MiB = 1 << 20


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_file_mapped_twice_is_charged_once(tmp_path):
    size = 64 * MiB
    path = tmp_path / "chunk_0.ptd"
    path.write_bytes(os.urandom(size))
    take_peak_rss_bytes()  # the file's write buffers are gone: the peak mark starts from now
    rss0, charged0 = _rss_now(), charged_bytes()
    with open(path, "rb") as f:
        maps = [mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) for _ in range(2)]
    try:
        page = mmap.PAGESIZE
        touched = sum(m[i] for m in maps for i in range(0, size, page))  # every page of both mappings
        assert touched >= 0
        rss_grew, charged_grew = _rss_now() - rss0, charged_bytes() - charged0
        assert rss_grew > 1.8 * size  # the resident set counts each mapping's pages
        assert 0.8 * size < charged_grew < 1.3 * size, (rss_grew / MiB, charged_grew / MiB)
    finally:
        for m in maps:
            m.close()


def test_a_peak_the_watchdog_did_not_see_is_charged():
    """Anonymous memory freed before a reading (a runtime call's arenas) still shows in the peak mark."""
    take_peak_rss_bytes()
    charged0 = charged_bytes()
    block = bytearray(96 * MiB)
    block[::mmap.PAGESIZE] = b"x" * len(block[::mmap.PAGESIZE])  # touch every page
    del block
    assert charged_bytes() - charged0 > 80 * MiB
    take_peak_rss_bytes()
    assert charged_bytes() - charged0 < 16 * MiB

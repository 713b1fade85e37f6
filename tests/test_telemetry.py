"""The phone's own readings: PSS sampled so that telemetry does not cost a micro-batch's time."""
import time

import numpy as np

from zl_mobile.telemetry import PssSampler, read_pss_bytes


def test_pss_sampler_rereads_only_after_its_interval():
    s = PssSampler(interval_s=0.3)
    first = s.read()
    assert first is not None and first > 1 << 20
    grown = np.ones(64 << 20, np.uint8)  # 64 MiB touched: PSS rises by that much
    assert s.read() == first, "read again inside the interval"
    time.sleep(max(0.35, 21 * s._cost))  # a costly read (a large process) waits 20x its cost
    after = s.read()
    assert after >= first + (60 << 20) and abs(after - read_pss_bytes()) < 8 << 20
    del grown


def test_pss_sampler_waits_longer_when_a_read_is_costly():
    s = PssSampler(interval_s=0.0)
    s.read()
    s._cost = 0.02  # as if the last read took 20 ms: the next comes no sooner than 0.4 s later
    assert s.read() == s._value and time.monotonic() - s._at < 0.4
    s._at -= 0.5
    before = s._at
    s.read()
    assert s._at > before + 0.4

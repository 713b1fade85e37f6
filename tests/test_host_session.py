"""The host's session with a phone (host.run.client.open_session) against a real zl-phone: the phone
serves one host at a time, and a host that reconnects right after closing its own session waits
for the phone to free the slot instead of failing (what a loaded phone made zl-host profile do)."""
from __future__ import annotations

import os
import queue
import threading
import time

import pytest

from host.phones.emulate import start_phones
from host.run.client import DeviceError, open_session


@pytest.fixture(scope="module")
def phone(tmp_path_factory):
    (p,) = start_phones(1, tmp_path_factory.mktemp("session"), prefix=f"hs{os.getpid()}-")
    yield p
    p.stop()


def test_a_second_host_waits_for_the_first_to_leave(phone):
    first = open_session(phone.name, phone.endpoint, phone.token, queue.Queue(), timeout=10)
    closer = threading.Timer(1.5, first.close)  # the first host leaves while the second knocks
    closer.start()
    t0 = time.time()
    second = open_session(phone.name, phone.endpoint, phone.token, queue.Queue(), timeout=15)
    waited = time.time() - t0
    second.close()
    closer.join()
    assert waited >= 1.0  # it was refused BUSY until the first session closed, then got in


def test_a_phone_kept_busy_is_an_error_naming_busy(phone):
    first = open_session(phone.name, phone.endpoint, phone.token, queue.Queue(), timeout=10)
    try:
        t0 = time.time()
        with pytest.raises(DeviceError) as e:
            open_session(phone.name, phone.endpoint, phone.token, queue.Queue(), timeout=1.0)
        assert time.time() - t0 >= 1.0 and "BUSY" in str(e.value) and "already serves a host session" in str(e.value)
    finally:
        first.close()

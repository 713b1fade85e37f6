"""`--devices auto` with phones found but not usable (issue 55): the error names each of them, why
(no pairing token, busy, wrong protocol, not enough memory) and what to do, over real mDNS and a real
phone's session; and a Kotlin phone keeps its token where auto reads it, as zl-phone does."""
from __future__ import annotations

import os
import queue
import secrets

import pytest

from host.phones.emulate import start_phones
from host.run.client import DeviceClient
from zl_mobile.mdns import Advertisement, txt_record
from zl_mobile.protocol import new_token

TAG = f"dp{os.getpid()}{secrets.token_hex(2)}"  # other tests' phones may advertise on loopback too


def test_auto_names_each_phone_it_cannot_use_and_why(tmp_path):
    from host.devices.discovery import DeviceLookupError, resolve

    (busy,) = start_phones(1, tmp_path / "phones", prefix=f"{TAG}-busy")  # a real zl-phone, on mDNS
    ads = [Advertisement(f"{TAG}-notoken", 40061, txt_record(f"{TAG}-notoken", 2, "fake/x", 2**30)),
           Advertisement(f"{TAG}-old", 40062, txt_record(f"{TAG}-old", 1, "fake/x", 2**30)),
           Advertisement(f"{TAG}-small", 40063, txt_record(f"{TAG}-small", 2, "fake/x", 2**20))]
    tokens = {f"{TAG}-small": new_token(), f"{TAG}-old": new_token(), busy.name: busy.token}
    other_host = DeviceClient(busy.name, busy.endpoint, busy.token, queue.Queue())  # holds the phone's one session
    try:
        with pytest.raises(DeviceLookupError) as e:
            resolve("auto", 3, tokens, wait_s=8, interfaces="127.0.0.1", min_bytes=2**28)
    finally:
        other_host.close()
        for ad in ads:
            ad.close()
        busy.stop()
    msg = str(e.value)
    lines = msg.splitlines()
    assert lines[0].startswith("found 0 usable device(s) of 3 needed within 8 s"), msg
    assert "seen:" not in msg and lines[-1] == "start more phones (zl-host emulate N) or fix the above, then run again"
    why = {ln.strip().split(" at ")[0]: ln for ln in lines[1:-1] if TAG in ln}
    assert set(why) == {f"{TAG}-notoken", f"{TAG}-old", f"{TAG}-small", busy.name}, msg
    assert "127.0.0.1:40061: no pairing token" in why[f"{TAG}-notoken"] and "--tokens FILE" in why[f"{TAG}-notoken"]
    assert "wrong protocol (proto 1 is not this host's protocol version 2)" in why[f"{TAG}-old"]
    assert "not enough memory (advertises 1 MiB; the smallest chunk needs 256 MiB)" in why[f"{TAG}-small"]
    assert f"{busy.endpoint}: busy, serving another host's session" in why[busy.name]


def test_kotlin_phone_keeps_its_token_where_auto_reads_it(tmp_path, monkeypatch):
    import host.devices.discovery as devices

    (phone,) = start_phones(1, tmp_path, prefix=f"{TAG}-kt", runtimes=["kotlin"])
    try:
        path = phone.workdir / "pairing_token"
        assert path.read_text() == phone.token and path.stat().st_mode & 0o777 == 0o600
        monkeypatch.setattr(devices, "PHONES_HOME", tmp_path)  # where `zl-host emulate` puts its phones
        assert devices.load_tokens(None)[phone.name] == phone.token
    finally:
        phone.stop()

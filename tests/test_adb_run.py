"""Phones on USB in a run: adb forward for control, adb push checked by sha256, adb reverse between
stages, dumpsys sampling, and cleanup; through the real adb server and adbutils.

No Android device here: each "USB phone" is an EMULATED adbd (tests/emulated_adbd.py, attached with
``adb connect``) in front of a real zl-phone process. What is real: the adb server (Debian's adb),
adbutils, every forward/reverse/push/shell the host makes, the phone process, the training. What is
emulated: the device end of the ADB transport, ``run-as`` and ``dumpsys`` (which print captured
samples from tests/data/dumpsys).
"""
from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import socket
import struct
import subprocess
import threading
import time
from pathlib import Path

import pytest

from host.devices import adb
from host.devices.adb_wiring import (
    APP_PACKAGE,
    APP_PORT,
    HOST,
    AdbLinks,
    AdbPushUnavailable,
    Peer,
    Route,
    WiringError,
    peer_of,
    plan_route,
)
from host.run.coordinator import DeviceHandle

from .emulated_adbd import EmulatedAdbd, usb_phone_sandbox

DUMPSYS = Path(__file__).parent / "data" / "dumpsys"
MEMINFO, BATTERY = DUMPSYS / "meminfo_pixel2_android11.txt", DUMPSYS / "battery_samsung_s24.txt"  # captured on phones


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("zl-host: error:")]
    assert len(lines) == 1, err
    return lines[0]


# ------------------------------------------------------------------ wiring decisions (pure)

def test_peer_kinds():
    assert peer_of(DeviceHandle("R58M", "127.0.0.1:40001", "t", serial="R58M")) == Peer("R58M", "adb", serial="R58M")
    assert peer_of(DeviceHandle("emu0", "127.0.0.1:5000", "t")).kind == "local"
    assert peer_of(DeviceHandle("emu0", "[::1]:5000", "t")).kind == "local"
    assert peer_of(DeviceHandle("pixel", "192.168.1.20:47474", "t")) == Peer("pixel", "lan", ip="192.168.1.20")


@pytest.mark.parametrize("up, down, route", [
    ("host", "adb", Route(forward=True, reverse=False)),     # the feed: host port forwarded to the phone
    ("local", "adb", Route(forward=True, reverse=False)),    # a process on this host: same
    ("adb", "adb", Route(forward=True, reverse=True)),       # phone -> reverse -> host -> forward -> phone
    ("adb", "local", Route(forward=False, reverse=True)),    # phone -> reverse -> the emulated phone's port
    ("host", "local", Route(forward=False, reverse=False, direct_ip="127.0.0.1")),
    ("adb", "lan", Route(forward=False, reverse=False, direct_ip="10.0.0.9")),  # over the phone's own Wi-Fi
    ("lan", "lan", Route(forward=False, reverse=False, direct_ip="10.0.0.9")),
])
def test_plan_route(up, down, route):
    peers = {"host": HOST, "adb": Peer("a", "adb", serial="S1"), "local": Peer("l", "local", ip="127.0.0.1"),
             "lan": Peer("n", "lan", ip="10.0.0.9")}
    assert plan_route(peers[up], peers[down]) == route


def test_plan_route_refuses_what_cannot_connect():
    with pytest.raises(WiringError, match="pixel .on the network. cannot reach R58M, which is only on USB: connect"):
        plan_route(Peer("pixel", "lan", ip="10.0.0.9"), Peer("R58M", "adb", serial="R58M"))
    with pytest.raises(WiringError, match="--bind 0.0.0.0"):
        plan_route(Peer("pixel", "lan", ip="10.0.0.9"), Peer("emu0", "local", ip="127.0.0.1"))


def test_sha256sum_output():
    digest = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
    assert adb.parse_sha256sum(f"{digest}  files/programs/chunk_0.pte\n") == digest
    assert adb.parse_sha256sum("absent\n") is None
    assert adb.parse_sha256sum("sha256sum: files/x: Permission denied\n") is None
    assert adb.parse_sha256sum(digest.upper() + "  x\n") is None  # toybox prints lowercase; nothing else is trusted


# ------------------------------------------------------------------ the real adb server

@pytest.fixture(scope="module")
def adb_server():
    """A private adb server on a free port (never the user's 5037), killed afterwards; every
    host.devices.adb call in this module talks to it through ANDROID_ADB_SERVER_PORT."""
    exe = shutil.which("adb")
    if exe is None:
        pytest.fail("adb is not on PATH: apt-get install adb (Debian's package; CI installs it)")
    port = _free_port()
    subprocess.run([exe, "-P", str(port), "start-server"], capture_output=True, timeout=30, check=True)
    old = os.environ.get("ANDROID_ADB_SERVER_PORT")
    os.environ["ANDROID_ADB_SERVER_PORT"] = str(port)
    yield port
    if old is None:
        os.environ.pop("ANDROID_ADB_SERVER_PORT", None)
    else:
        os.environ["ANDROID_ADB_SERVER_PORT"] = old
    subprocess.run([exe, "-P", str(port), "kill-server"], capture_output=True, timeout=30)


def attach(adbd: EmulatedAdbd, port: int) -> str:
    """``adb connect`` the emulated device and wait until the server lists it as ready."""
    import adbutils

    client = adbutils.AdbClient(port=port)
    assert "connected to" in client.connect(adbd.serial, timeout=10)
    deadline = time.time() + 10
    while time.time() < deadline:
        if any(d.serial == adbd.serial and d.state == "device" for d in client.list()):
            return adbd.serial
        time.sleep(0.1)
    raise AssertionError(f"adb server did not list {adbd.serial} as a device")


class UsbPhone:
    """A zl-phone process (no mDNS: reachable only "over USB") behind an emulated adbd."""

    def __init__(self, root: Path, name: str, server_port: int, *, run_as: bool = True, staging: Path):
        from host.phones.emulated_phone import EmulatedPhone

        self.token = secrets.token_hex(32)
        self.phone = EmulatedPhone(name, root / name / "phone", self.token, ["--mdns", "none"]).start()
        self.sandbox = usb_phone_sandbox(root / name / "device", self.phone.workdir / "files", APP_PACKAGE,
                                         run_as=run_as, meminfo=MEMINFO, battery=BATTERY)
        self.adbd = EmulatedAdbd(self.sandbox, ports={APP_PORT: self.phone.port}, fs_root=staging.parent)
        self.serial = attach(self.adbd, server_port)

    def stop(self) -> None:
        import adbutils

        adbutils.AdbClient(port=int(os.environ["ANDROID_ADB_SERVER_PORT"])).disconnect(self.serial)
        self.adbd.close()
        self.phone.stop()


def test_adb_commands_fail_with_one_clear_line(adb_server):
    for call in (lambda: adb.forward("nope:1", 0, APP_PORT), lambda: adb.reverse("nope:1", 0, 4000),
                 lambda: adb.shell_rc("nope:1", "true")):
        with pytest.raises(adb.AdbCommandError) as e:
            call()
        msg = str(e.value)
        assert "\n" not in msg and "on nope:1 failed" in msg and "check 'adb devices' lists nope:1" in msg


def test_forward_reverse_push_on_an_emulated_usb_device(adb_server, tmp_path):
    """The wrappers in host/devices/adb.py against the real adb server: forward, reverse (tcp:0 reports
    the port), push, shell exit codes, cleanup of exactly what was made."""
    adbd = EmulatedAdbd(tmp_path / "dev")
    try:
        serial = attach(adbd, adb_server)
        assert [p for p in adb.list_adb_devices() if p.serial == serial][0].model == "ZeroLock Emulated"
        echo = socket.create_server(("127.0.0.1", 0))
        target = echo.getsockname()[1]

        def round_trip(port: int, payload: bytes) -> bytes:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
                c.sendall(payload)
                s, _ = echo.accept()
                with s:
                    got = b""
                    while len(got) < len(payload):
                        got += s.recv(65536)
                    s.sendall(got[::-1])
                    back = b""
                    while len(back) < len(payload):
                        back += c.recv(65536)
            assert got == payload
            return back

        local = adb.forward(serial, 0, target)
        assert ("tcp:%d" % local, "tcp:%d" % target) in adb.forward_list(serial)
        assert round_trip(local, b"f" * 300_000 + b"end") == (b"f" * 300_000 + b"end")[::-1]
        phone_port = adb.reverse(serial, 0, target)
        assert phone_port > 0 and ("tcp:%d" % phone_port, "tcp:%d" % target) in adb.reverse_list(serial)
        assert round_trip(phone_port, b"r" * 70_000) == b"r" * 70_000
        adb.forward_remove(serial, local)
        adb.reverse_remove(serial, phone_port)
        assert adb.forward_list(serial) == [] and adb.reverse_list(serial) == []

        src = tmp_path / "w.bin"
        src.write_bytes(os.urandom(200_000))
        assert adb.push(serial, str(src), str(adbd.sandbox / "x" / "w.bin")) == 200_000
        rc, out = adb.shell_rc(serial, ["sha256sum", str(adbd.sandbox / "x" / "w.bin")])
        assert rc == 0 and adb.parse_sha256sum(out) == hashlib.sha256(src.read_bytes()).hexdigest()
        assert adb.shell_rc(serial, "exit 3")[0] == 3
        with pytest.raises(adb.AdbCommandError, match="push w.bin"):  # outside the device's storage
            adb.push(serial, str(src), "/elsewhere/w.bin")
    finally:
        adbd.close()


def test_a_failing_stream_does_not_take_the_device_off_adb(adb_server, tmp_path):
    """A forwarded connection whose far end resets while adbd is writing to it: the emulated adbd
    closes that stream only (adbd sends CLSE for it); the device stays attached on its first
    connection and keeps its forward. (The error once ended the whole connection: the adb server
    listed the device 'offline' until it reconnected, and a cleanup at that moment failed.)"""
    adbd = EmulatedAdbd(tmp_path / "dev")
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)   # fills at once: adbd blocks writing
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    try:
        serial = attach(adbd, adb_server)
        local = adb.forward(serial, 0, srv.getsockname()[1])
        c = socket.create_connection(("127.0.0.1", local), timeout=10)

        def send():
            try:
                c.sendall(b"x" * (32 << 20))
            except OSError:
                pass

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        far, _ = srv.accept()   # never reads; once everything between is full, reset it
        time.sleep(1.5)
        far.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        far.close()
        sender.join(10)
        c.close()
        time.sleep(0.5)
        assert adbd.connections == 1, adbd.errors
        assert [p.state for p in adb.list_adb_devices() if p.serial == serial] == ["device"]
        assert ("tcp:%d" % local, "tcp:%d" % srv.getsockname()[1]) in adb.forward_list(serial)
        adb.forward_remove(serial, local)
    finally:
        srv.close()
        adbd.close()


def test_cleanup_waits_for_a_phone_briefly_off_adb(adb_server, tmp_path):
    """At cleanup a phone is 'offline' for a moment (a USB glitch: the connection drops, the
    server reconnects, the device answers a second later). close() waits for it and asks again;
    the reverse went with the dropped connection (adbd drops them), so nothing is left and
    nothing is reported. A phone that does not come back is reported in one line per item."""
    import adbutils

    adbd = EmulatedAdbd(tmp_path / "dev")
    try:
        serial = attach(adbd, adb_server)
        links = AdbLinks(data_port=0, staging_dir=str(tmp_path / "staging"))
        target = _free_port()
        links.forward(serial, APP_PORT)
        phone = links.reverse(serial, target)
        assert ("tcp:%d" % phone, "tcp:%d" % target) in adb.reverse_list(serial)
        adbd.drop_connection(offline_for=2.0)
        deadline = time.time() + 10
        while time.time() < deadline and [p.state for p in adb.list_adb_devices() if p.serial == serial] == ["device"]:
            time.sleep(0.02)
        assert [p.state for p in adb.list_adb_devices() if p.serial == serial] != ["device"]
        with pytest.raises(adb.AdbCommandError, match="offline|not found"):   # what close() meets first
            adb.reverse_list(serial)
        t0 = time.monotonic()
        assert links.close() == []
        assert time.monotonic() - t0 < 8
        assert adbd.connections >= 2 and adbd.reverses == {}
        assert adb.reverse_list(serial) == [] and adb.forward_list(serial) == []

        gone = AdbLinks(data_port=0, cleanup_wait=1.0)
        gone.reverse(serial, target)
        gone.forward(serial, APP_PORT)
        adbd.drop_connection(offline_for=30)   # does not come back within the wait
        time.sleep(0.5)
        t0 = time.monotonic()
        problems = gone.close()
        assert 0.8 < time.monotonic() - t0 < 5
        assert len(problems) == 1 and "\n" not in problems[0], problems   # the forward went with the connection
        assert "reverse --remove" in problems[0] and f"check 'adb devices' lists {serial}" in problems[0]
    finally:
        adbd.close()
        adbutils.AdbClient(port=adb_server).disconnect(adbd.serial)


def test_push_falls_back_when_the_app_is_not_debuggable(adb_server, tmp_path):
    files = tmp_path / "phone_files"
    files.mkdir()
    sandbox = usb_phone_sandbox(tmp_path / "dev", files, APP_PACKAGE, run_as=False)
    adbd = EmulatedAdbd(sandbox, fs_root=tmp_path)
    try:
        serial = attach(adbd, adb_server)
        links = AdbLinks(staging_dir=str(tmp_path / "staging"))
        src = tmp_path / "chunk_0.pte"
        src.write_bytes(b"program")
        with pytest.raises(AdbPushUnavailable, match="run-as.*needs a debuggable app") as e:
            links.push(serial, src, hashlib.sha256(b"program").hexdigest())
        assert "\n" not in str(e.value)
        n = len(adbd.shell_log)
        with pytest.raises(AdbPushUnavailable):  # remembered: no second attempt on this phone
            links.push(serial, src, hashlib.sha256(b"program").hexdigest())
        assert len(adbd.shell_log) == n and adbd.pushed == [] and not any(files.iterdir())
    finally:
        adbd.close()


def test_nothing_serving_behind_the_forward_is_one_clear_line(adb_server, small_export, tmp_path, capsys):
    """A phone on USB without the app serving: adb forward accepts the connection, then closes it."""
    from host.cli.zl_host import main

    adbd = EmulatedAdbd(tmp_path / "dev", ports={APP_PORT: _free_port()})  # nothing listens there
    serial = attach(adbd, adb_server)
    others = [UsbPhone(tmp_path, f"ok{i}", adb_server, staging=tmp_path / "staging") for i in range(2)]
    try:
        tokens = tmp_path / "tokens.json"
        tokens.write_text(json.dumps({serial: "ab" * 32, **{p.serial: p.token for p in others}}))
        rc = main(["run", "--program", str(small_export[0]), "--data", str(_data_file(tmp_path)),
                   "--devices", ",".join([serial] + [p.serial for p in others]),
                   "--tokens", str(tokens), "--wait", "5", "--out", str(tmp_path / "r"), "--adb-data-port", "0",
                   "--adb-staging", str(tmp_path / "staging")])
        assert rc == 2
        line = _error_line(capsys)
        assert f"{serial} (adb {serial}): nothing answered on the app's port through adb forward" in line
        assert "open ZeroLock on the phone and tap Start serving" in line
        for s in [serial] + [p.serial for p in others]:
            assert adb.forward_list(s) == []  # the control forwards of the failed run are gone
    finally:
        adbd.close()
        for p in others:
            p.stop()


def test_named_adb_phone_without_token(adb_server, small_export, tmp_path, capsys):
    from host.cli.zl_host import main

    adbd = EmulatedAdbd(tmp_path / "dev")
    serial = attach(adbd, adb_server)
    try:
        rc = main(["run", "--program", str(small_export[0]), "--data", str(_data_file(tmp_path)), "--devices", serial,
                   "--wait", "3",
                   "--out", str(tmp_path / "r")])
        assert rc == 2
        assert f"no pairing token for {serial}: pass --tokens FILE" in _error_line(capsys)
    finally:
        adbd.close()


# ------------------------------------------------------------------ whole runs

def _data_file(root: Path) -> Path:
    from zl_common.data import synthetic_examples

    path = root / "train.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in synthetic_examples(24, seed=5)))
    return path


def test_run_over_usb_pushes_once_forwards_reverses_and_cleans_up(adb_server, small_export, tmp_path, capsys):
    """zl-host devices lists three USB phones; zl-host run trains over them twice: the first run
    pushes every file with adb push, the second finds the same sha256 on the phones and pushes
    nothing; control goes through adb forward, hidden states phone to phone through adb reverse +
    forward; PSS and temperature come from dumpsys; every forward and reverse is gone afterwards."""
    from host.cli.zl_host import main

    out = small_export[0]
    manifest = json.loads((out / "manifest.json").read_text())
    staging = tmp_path / "staging"
    phones = [UsbPhone(tmp_path, f"usb{i}", adb_server, staging=staging) for i in range(3)]
    try:
        serials = [p.serial for p in phones]
        capsys.readouterr()
        assert main(["devices", "--timeout", "0.5", "--mdns", "127.0.0.1"]) == 0
        listing = capsys.readouterr().out
        for s in serials:
            assert any(line.startswith(s) and "usb, device" in line and "ZeroLock Emulated" in line
                       for line in listing.splitlines()), listing
        tokens = tmp_path / "tokens.json"
        tokens.write_text(json.dumps({p.serial: p.token for p in phones}))
        data = _data_file(tmp_path)
        args = ["run", "--program", str(out), "--data", str(data), "--devices", ",".join(serials), "--tokens",
                str(tokens), "--steps", "2", "--window", "2", "--lr", "2e-2", "--wait", "10",
                "--adb-data-port", "0", "--adb-staging", str(staging)]
        assert main([*args, "--out", str(tmp_path / "r1")]) == 0

        for p in phones:
            assert f"tcp:{APP_PORT}" in p.adbd.services            # control over adb forward
            names = {Path(x).name for x in p.adbd.pushed}           # manifest, program, weights, lora init
            assert len(p.adbd.pushed) >= 4 and "manifest.json" in names
            assert names <= {"manifest.json"} | {e["path"] for e in manifest["files"]}
            held = {f.name for f in (p.phone.workdir / "files").iterdir()}
            assert "manifest.json" in held
            for entry in manifest["files"]:
                if entry["path"] in held:   # what adb pushed is what the export holds
                    assert hashlib.sha256((p.phone.workdir / "files" / entry["path"]).read_bytes()).hexdigest() \
                        == entry["sha256"]
            assert adb.forward_list(p.serial) == [] and adb.reverse_list(p.serial) == []
        reverses = [s for p in phones for s in p.adbd.services if s.startswith("reverse:forward:tcp:0;")]
        assert len(reverses) == 2   # stage 0 -> 1 and 1 -> 2: each upstream phone reaches its neighbour
        assert list(staging.iterdir()) == []                        # staged copies removed

        recs = [json.loads(line) for line in (tmp_path / "r1" / "metrics.jsonl").read_text().splitlines()]
        assert {r["device"] for r in recs if r.get("kind") == "micro_batch"} == set(serials)
        sampled = [r for r in recs if r.get("kind") == "adb_dumpsys"]
        assert {r["device"] for r in sampled} == set(serials)
        assert all(r["pss_bytes"] == adb.parse_meminfo_pss_kib(MEMINFO.read_text()) * 1024 and
                   r["temperature_c"] == adb.parse_battery_temp_c(BATTERY.read_text()) for r in sampled)

        for p in phones:
            p.adbd.pushed.clear()
        assert main([*args, "--out", str(tmp_path / "r2")]) == 0
        for p in phones:
            assert p.adbd.pushed == []                              # same sha256 on the phone: nothing sent
            assert any("sha256sum" in c for c in p.adbd.shell_log)
            assert adb.forward_list(p.serial) == [] and adb.reverse_list(p.serial) == []
        assert (tmp_path / "r2" / "adapter" / "adapter_model.safetensors").is_file()
    finally:
        for p in phones:
            p.stop()


def test_mixed_usb_and_local_phones_with_protocol_fallback(adb_server, small_export, tmp_path):
    """Stage order USB -> local -> USB covers host->adb, adb->local (reverse only) and local->adb
    (forward only); the last phone's app is not debuggable, so its files go by FILE_* instead."""
    from host.phones.emulated_phone import EmulatedPhone
    from host.run.coordinator import Coordinator
    from host.run.settings import RunSettings
    from tests.conftest import small_micro_batches

    out = small_export[0]
    staging = tmp_path / "staging"
    a = UsbPhone(tmp_path, "usbA", adb_server, staging=staging)
    c = UsbPhone(tmp_path, "usbC", adb_server, staging=staging, run_as=False)
    b = EmulatedPhone("localB", tmp_path / "localB", secrets.token_hex(32), ["--mdns", "none"]).start()
    events = []
    links = AdbLinks(data_port=0, staging_dir=str(staging), on_event=lambda k, d: events.append((k, d)))
    try:
        chunks = json.loads((out / "manifest.json").read_text())["chunks"]
        sizes = {f["path"]: f["size"] for f in json.loads((out / "manifest.json").read_text())["files"]}
        need = sorted(range(3), key=lambda k: -(sizes[chunks[k]["weights"]] + chunks[k]["saved_activation_bytes"]))
        mem = {k: (3 - need.index(k)) << 30 for k in range(3)}  # so that stage k lands on the k-th device
        handles = [DeviceHandle(a.serial, links.control_endpoint(a.serial), a.token, mem[0], serial=a.serial),
                   DeviceHandle("localB", b.endpoint, b.token, mem[1]),
                   DeviceHandle(c.serial, links.control_endpoint(c.serial), c.token, mem[2], serial=c.serial)]
        settings = RunSettings(windows=2, window_size=2, lr=2e-2, max_seconds=240)
        co = Coordinator(out, handles, small_micro_batches(out), settings, tmp_path / "run", run_id="mixed",
                         on_event=lambda k, d: events.append((k, d)), links=links)
        assert [s.device.name for s in co.stages] == [a.serial, "localB", c.serial]
        result = co.run()
        assert result["lora"] and not result["errors"]
        links_made = [(d["up_kind"], d["down_kind"], d["forward"], d["reverse"]) for k, d in events if k == "link"]
        assert ("host", "adb", True, False) in links_made
        assert ("adb", "local", False, True) in links_made
        assert ("local", "adb", True, False) in links_made
        pushes = {(d["device"], d["via"]) for k, d in events if k == "push"}
        assert pushes == {(a.serial, "adb"), ("localB", "protocol"), (c.serial, "protocol")}
        fallback = [d for k, d in events if k == "adb_push_fallback"]
        assert [d["device"] for d in fallback] == [c.serial] and "run-as" in fallback[0]["why"]
        assert len(a.adbd.pushed) >= 4 and c.adbd.pushed == []
        assert (c.phone.workdir / "files" / chunks[2]["program"]).is_file()   # arrived by FILE_*
        assert links.close() == []
        for p in (a, c):
            assert adb.forward_list(p.serial) == [] and adb.reverse_list(p.serial) == []
    finally:
        links.close()
        b.stop()
        a.stop()
        c.stop()

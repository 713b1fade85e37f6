"""zl-phone as a process: mDNS advertisement on loopback, the printed pairing token, a bad
--token, and the --rate-mbit outgoing rate limit."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from zl_mobile.connection import Connection, connect
from zl_mobile.mdns import SERVICE_TYPE, _zeroconf, browse, parse_txt
from zl_mobile.protocol import PROTOCOL_VERSION, Message, MsgType, RateLimiter, host_handshake, new_token
from zl_mobile.telemetry import total_memory_bytes

PHONE = [sys.executable, "-m", "zl_mobile.phone"]
ENV = dict(os.environ, PYTHONUNBUFFERED="1")


@pytest.fixture(scope="module")
def advertised_phone(tmp_path_factory):
    """A zl-phone started without --token, advertising on loopback: (name, port, token, workdir)."""
    name = f"mdns{os.getpid()}"
    workdir = tmp_path_factory.mktemp("mdns") / name
    log_path = workdir.parent / "phone.log"
    proc = subprocess.Popen([*PHONE, "--name", name, "--workdir", str(workdir), "--threads", "1"],
                            stdout=subprocess.PIPE, stderr=open(log_path, "w"), text=True, env=ENV,
                            start_new_session=True)
    proc.log_path = log_path
    lines = []
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line.rstrip("\n"))
            if line.startswith("advertised"):
                break
        out = "\n".join(lines)
        assert lines and lines[-1].startswith("advertised"), f"zl-phone did not advertise:\n{out}\n{log_path.read_text()}"
        port = int(re.search(r"listening on 127\.0\.0\.1:(\d+),", out).group(1))
        token = re.search(r"^pairing token: (\S+)$", out, re.M).group(1)
        yield name, port, token, workdir, lines, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)  # a clean stop: the advertisement is withdrawn
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def test_phone_prints_its_pairing_token_and_keeps_it_private(advertised_phone):
    name, port, token, workdir, lines, _ = advertised_phone
    assert re.fullmatch(r"[0-9a-f]{64}", token)
    path = workdir / "pairing_token"
    assert path.read_text().strip() == token
    assert path.stat().st_mode & 0o077 == 0, oct(path.stat().st_mode)
    assert lines[-1] == f"advertised as {name}._zerolock._tcp.local. on loopback at 127.0.0.1"
    # the printed token is the one the phone authenticates with
    sock = connect(f"127.0.0.1:{port}")
    sock.settimeout(10)
    try:
        hello = host_handshake(sock, token)
        assert hello["name"] == name
    finally:
        sock.close()


def test_phone_is_found_over_mdns_on_loopback(advertised_phone):
    name, port, _, _, _, _ = advertised_phone
    found = browse(timeout=10, interfaces=["127.0.0.1"], until=lambda fs: any(f.name == name for f in fs))
    mine = [f for f in found if f.name == name]
    assert len(mine) == 1, found
    f = mine[0]
    assert (f.address, f.port, f.endpoint) == ("127.0.0.1", port, f"127.0.0.1:{port}")
    assert (f.proto, f.runtime, f.memory_bytes) == (PROTOCOL_VERSION, "zl_mobile/executorch", total_memory_bytes())
    # the TXT record itself carries name/proto/runtime/mem
    zc = _zeroconf(["127.0.0.1"])
    try:
        info = zc.get_service_info(SERVICE_TYPE, f"{name}.{SERVICE_TYPE}", timeout=3000)
        assert info is not None and info.port == port
        assert parse_txt(info.properties) == {"name": name, "proto": "2", "runtime": "zl_mobile/executorch",
                                              "mem": str(total_memory_bytes())}
    finally:
        zc.close()


def test_phone_stops_cleanly_on_sigint(advertised_phone):
    *_, proc = advertised_phone
    proc.send_signal(signal.SIGINT)
    try:
        assert proc.wait(timeout=15) == 0
    except subprocess.TimeoutExpired:
        proc.kill()
        pytest.fail(f"the phone did not stop within 15 s of SIGINT; its log:\n{proc.log_path.read_text()}")
    assert "Traceback" not in proc.log_path.read_text()


# ---- --token -----------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", ["nothex", "ab" * 31, "zz" * 32, "ab" * 33, ""],
                         ids=["not-hex", "too-short", "non-hex-digits", "too-long", "empty"])
def test_bad_token_exits_with_a_one_line_error(tmp_path, bad):
    workdir = tmp_path / "w"
    r = subprocess.run([*PHONE, "--name", "x", "--workdir", str(workdir), "--token", bad, "--mdns", "none"],
                       capture_output=True, text=True, timeout=60, env=ENV)
    assert r.returncode != 0
    err = r.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, r.stderr
    assert "token" in err and "64 hex digits" in err
    assert "listening" not in r.stdout
    assert not (workdir / "pairing_token").exists()  # nothing was written


def test_corrupt_stored_token_exits_with_a_one_line_error(tmp_path):
    workdir = tmp_path / "w"
    workdir.mkdir()
    (workdir / "pairing_token").write_text("garbage\n")
    r = subprocess.run([*PHONE, "--name", "x", "--workdir", str(workdir), "--mdns", "none"],
                       capture_output=True, text=True, timeout=60, env=ENV)
    assert r.returncode != 0
    err = r.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, r.stderr
    assert str(workdir / "pairing_token") in err and "delete it" in err


def test_token_is_kept_across_restarts(tmp_path):
    from zl_mobile.phone import load_or_create_token

    first = load_or_create_token(tmp_path, None)
    assert load_or_create_token(tmp_path, None) == first
    given = new_token()
    assert load_or_create_token(tmp_path, given) == given
    assert load_or_create_token(tmp_path, None) == given
    assert (tmp_path / "pairing_token").stat().st_mode & 0o077 == 0


# ---- --rate-mbit -------------------------------------------------------------------------------

MB = 1_000_000
RATE = 8e6 / 8  # 8 Mbit/s in bytes/s


def _send_timed(limiter, nbytes: int) -> tuple[float, Message]:
    """Send a STATE_PUT carrying nbytes over a loopback socket pair; (send time, message received)."""
    a, b = socket.socketpair()
    got = {}
    reader = threading.Thread(target=lambda: got.setdefault("msg", Connection(b).recv()))
    reader.start()
    data = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    t0 = time.monotonic()
    Connection(a, limiter=limiter).send(Message(MsgType.STATE_PUT, {"request_id": 1, "kind": "lora"}, {"w": data}))
    elapsed = time.monotonic() - t0
    reader.join(timeout=10)
    a.close()
    b.close()
    assert np.array_equal(got["msg"].tensors["w"], data)
    return elapsed, got["msg"]


def test_rate_limited_connection_sends_1_MB_at_8_Mbit_in_about_1_s():
    elapsed, _ = _send_timed(RateLimiter(RATE), MB)
    # 1 MB at 1 MB/s, less the initial burst (1/20 s worth)
    assert 0.85 <= elapsed <= 1.5, elapsed
    fast, _ = _send_timed(None, MB)
    assert fast < 0.5, fast


def test_rate_mbit_option_gives_the_device_its_limiter(tmp_path, monkeypatch):
    import zl_mobile.device as device_mod
    from zl_mobile import phone

    seen = {}
    monkeypatch.setattr(device_mod, "serve", lambda device, port, bind, ready: seen.setdefault("device", device))
    assert phone.main(["--name", "rl", "--workdir", str(tmp_path), "--token", new_token(), "--mdns", "none",
                       "--rate-mbit", "8"]) == 0
    limiter = seen["device"].limiter
    assert isinstance(limiter, RateLimiter) and limiter.rate == RATE
    seen.clear()
    handlers = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    assert phone.main(["--name", "rl", "--workdir", str(tmp_path), "--mdns", "none"]) == 0
    assert seen["device"].limiter is None
    # its caller's handlers come back (a forked export worker inherited the phone's SIGTERM once)
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == handlers


def test_link_delay_hands_frames_on_later_without_slowing_the_link():
    """--link-delay-ms: every frame a phone's links receive reaches it that much after it arrived:
    hidden states downstream; credits, replay requests and BP gradients upstream. Frames in flight
    are delayed together, not one after another (latency, not rate)."""
    from zl_mobile.link_rules import InboundQueue
    from zl_mobile.links import DelayLine, InboundLink, OutboundLink

    token, q, grads = new_token(), InboundQueue(), []
    inbound = InboundLink("in", token, q, inflight_depth=4, next_needed=lambda: 0, bind="127.0.0.1",
                          delay=DelayLine(0.3))
    out = OutboundLink("out", token, window_size=2, replay_horizon=8, delay=DelayLine(0.2),
                       on_gradient=lambda msg: grads.append(time.monotonic()))
    try:
        h = np.zeros((1024,), dtype=np.float32)
        for mb in range(4):
            out.publish(Message(MsgType.HIDDEN_STATE, {"micro_batch": mb, "window": 0}, {"h": h}))
        t0, t0_wall = time.monotonic(), time.time()
        out.set_address(f"127.0.0.1:{inbound.port}")
        seen = []
        for mb in range(4):
            assert q.take(mb, timeout=10) is not None
            seen.append(time.monotonic() - t0)
        # the upstream sees the replay request and credits 0.2 s late, the downstream the hidden states 0.3 s late
        assert out.sent_at[0] - t0_wall >= 0.2, out.sent_at
        assert seen[0] >= 0.5, seen
        assert seen[-1] < 0.5 + 0.25, seen   # one after another would take 4 x 0.3 s
        t1 = time.monotonic()
        inbound.send_gradient(0, h)
        deadline = time.monotonic() + 10
        while not grads and time.monotonic() < deadline:
            time.sleep(0.01)
        assert grads and grads[0] - t1 >= 0.2
    finally:
        out.close()
        inbound.close()


def test_both_ends_of_a_stage_link_buffer_frames_in_the_kernel():
    """Hidden states go downstream, BP gradients upstream, each sent from the stage's own thread:
    both ends of the link get a send buffer of a few frames, so a send returns while the bytes go
    out (a gradient send used to block its stage for the transfer on a slow link, as a hidden-state
    send did not)."""
    import socket

    from zl_mobile.connection import tune_link_socket
    from zl_mobile.link_rules import InboundQueue
    from zl_mobile.links import InboundLink, OutboundLink

    token, q = new_token(), InboundQueue()
    inbound = InboundLink("in", token, q, inflight_depth=4, next_needed=lambda: 0, bind="127.0.0.1")
    out = OutboundLink("out", token, window_size=2, replay_horizon=8)
    try:
        out.set_address(f"127.0.0.1:{inbound.port}")
        out.publish(Message(MsgType.HIDDEN_STATE, {"micro_batch": 0, "window": 0}, {"h": np.zeros(4, np.float32)}))
        assert q.take(0, timeout=10) is not None
        with socket.socket() as probe:  # what this kernel grants the link's request (capped by wmem_max)
            tuned = tune_link_socket(probe).getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        ends = {"downstream (gradients)": inbound._conn.sock, "upstream (hidden states)": out._conn.sock}
        for name, sock in ends.items():  # an untuned socket has the kernel's autotuned size instead
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == tuned, name
    finally:
        out.close()
        inbound.close()


def test_link_delay_option_gives_the_device_its_delay_line(tmp_path, monkeypatch, capsys):
    import zl_mobile.device as device_mod
    from zl_mobile import phone

    seen = {}
    monkeypatch.setattr(device_mod, "serve", lambda device, port, bind, ready: seen.setdefault("device", device))
    assert phone.main(["--name", "ld", "--workdir", str(tmp_path), "--token", new_token(), "--mdns", "none",
                       "--link-delay-ms", "40"]) == 0
    assert seen["device"].link_delay.delay_s == pytest.approx(0.04)
    with pytest.raises(SystemExit):
        phone.main(["--name", "ld", "--workdir", str(tmp_path), "--mdns", "none", "--link-delay-ms", "-5"])
    assert "--link-delay-ms must be >= 0, got -5" in capsys.readouterr().err


def test_rate_limited_hidden_state_link_is_shaped():
    """The limiter a phone gets from --rate-mbit shapes its outgoing hidden-state link."""
    from zl_mobile.link_rules import InboundQueue
    from zl_mobile.links import InboundLink, OutboundLink

    token = new_token()
    q = InboundQueue()
    inbound = InboundLink("in", token, q, inflight_depth=4, next_needed=lambda: 0, bind="127.0.0.1")
    out = OutboundLink("out", token, window_size=2, replay_horizon=8, limiter=RateLimiter(RATE))
    try:
        out.set_address(f"127.0.0.1:{inbound.port}")
        h = np.zeros((MB // 2 // 4,), dtype=np.float32)  # two hidden states of 0.5 MB each
        t0 = time.monotonic()
        for mb in range(2):
            out.publish(Message(MsgType.HIDDEN_STATE, {"micro_batch": mb, "window": 0}, {"h": h}))
        assert q.take(0, timeout=10) is not None and q.take(1, timeout=10) is not None
        elapsed = time.monotonic() - t0
        assert 0.85 <= elapsed <= 1.6, elapsed
        deadline = time.monotonic() + 5  # the sender counts a frame after send() returns, maybe after it arrived
        while out.bytes_sent < MB and time.monotonic() < deadline:
            time.sleep(0.01)
        assert out.bytes_sent >= MB
    finally:
        out.close()
        inbound.close()

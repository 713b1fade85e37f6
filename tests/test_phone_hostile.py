"""A hostile or careless host against one real zl-phone process (issue 21): an authenticated host
is still kept inside the phone's work dir and resource budget, abandoned transfers and sessions
leave nothing behind (descriptors, threads, RSS, part files), and idle, slow or too many
connections neither pile up nor end serve(). Real processes and loopback sockets throughout."""
from __future__ import annotations

import os
import queue
import resource
import secrets
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from host.phones.emulated_phone import EmulatedPhone
from host.run.client import DeviceClient
from tests.conftest import sealed_frame
from tests.test_phone_bad_input import TIMEOUT, Log, Session, _seq, _sha, assert_serves, auth_request, wait_free
from zl_mobile.protocol import PREAUTH_MAX_FRAME, ConnectionClosed, Message, MsgType, encode_message, new_token, recv_message

FAST = ["--mdns", "none", "--threads", "1", "--handshake-timeout", "1", "--io-timeout", "1"]


def serving_phone(tmp_path_factory, name: str):
    """A zl-phone for a module's hostile peers; afterwards it must still be alive, with no traceback
    in its log (whatever it was sent)."""
    p = EmulatedPhone(name, tmp_path_factory.mktemp(name) / "phone", new_token(), FAST).start()
    yield p
    try:
        assert p.alive(), f"the phone process died; see {p.log_path}"
        assert "Traceback" not in p.log_path.read_text(), p.log_path.read_text()
    finally:
        p.stop()


@pytest.fixture(scope="module")
def phone(tmp_path_factory):
    yield from serving_phone(tmp_path_factory, "hostile")


def proc_stats(pid: int) -> dict:
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return {"fds": len(os.listdir(f"/proc/{pid}/fd")), "threads": int(status["Threads"]),
            "rss_mib": int(status["VmRSS"].split()[0]) / 1024}


def settled_stats(pid: int, baseline: dict | None = None) -> dict:
    """Stats once the phone is idle: a closed session's heartbeat thread ends within its 0.5 s
    period. With a baseline: as soon as they are back to it; without: once they stop falling."""
    end = time.time() + TIMEOUT
    last = proc_stats(pid)
    while time.time() < end:
        time.sleep(0.6)
        st = proc_stats(pid)
        if baseline is not None:
            if st["threads"] <= baseline["threads"] and st["fds"] <= baseline["fds"]:
                return st
        elif st["threads"] >= last["threads"] and st["fds"] >= last["fds"]:
            return st
        last = st
    return proc_stats(pid)


# ---- STAGE_ASSIGN ------------------------------------------------------------------------------

def _assign(**over) -> dict:
    meta = {"request_id": next(_seq), "run_id": "hostile", "stage": 0, "num_stages": 1, "upstream": "host",
            "downstream": None, "program_sha256": "ab" * 32, "upstream_token": new_token()}
    for k, v in over.items():
        if k.startswith("config_"):
            meta.setdefault("config", {})[k[7:]] = v
        else:
            meta[k] = v
    return meta


@pytest.mark.parametrize("over,field", [
    ({"run_id": "../../escape_rel"}, "run_id"),
    ({"run_id": "/tmp/zl-escape-abs"}, "run_id"),
    ({"config_lr": "0.01"}, "config.lr"),
    ({"downstream": "127.0.0.1:99999", "downstream_token": new_token()}, "downstream"),
    ({"downstream": "garbage", "downstream_token": new_token()}, "downstream"),
    ({"config_keep_checkpoints": -1}, "config.keep_checkpoints"),
    ({"window_size": 0}, "window_size"),
    ({"window_size": 1 << 40}, "window_size"),
])
def test_a_bad_stage_assign_field_is_rejected_by_name_and_the_session_goes_on(phone, over, field):
    log = Log(phone)
    with Session(phone) as s:
        meta = _assign(**over)
        reply = s.request(Message(MsgType.STAGE_ASSIGN, meta))
        assert reply.type == MsgType.ERROR and reply["code"] == "REJECTED", reply
        assert reply["request_id"] == meta["request_id"]
        assert reply["message"].startswith(f"STAGE_ASSIGN {field}:"), reply["message"]
        s.heartbeat()
        # the same session is still usable: a well-formed assignment reaches the next check
        ok = _assign()
        reply = s.request(Message(MsgType.STAGE_ASSIGN, ok))
        assert reply["code"] == "REJECTED" and "no manifest.json" in reply["message"], reply
    log.wait_line("REJECTED:", f"STAGE_ASSIGN {field}:")
    # nothing was created for the refused run, inside the work dir or outside it
    assert not (phone.workdir / "stages").exists()
    assert not any(p.name.startswith("escape") for p in phone.workdir.parent.rglob("escape*"))
    assert not Path("/tmp/zl-escape-abs").exists()
    assert_serves(phone)  # never wedged BUSY


# ---- file transfers ----------------------------------------------------------------------------

def _begin(s: Session, name: str, size: int, sha: str = "00" * 32) -> int:
    tid = next(_seq)
    s.send(Message(MsgType.FILE_BEGIN, {"transfer_id": tid, "name": name, "kind": "other", "size": size,
                                        "sha256": sha}))
    return tid


def _chunk(s: Session, tid: int, offset: int, data: bytes) -> None:
    s.send(Message(MsgType.FILE_CHUNK, {"transfer_id": tid, "offset": offset},
                   {"data": np.frombuffer(data, dtype=np.uint8)}))


def _abandon_round(phone, sessions: int, per_session: int) -> None:
    piece = secrets.token_bytes(64 << 10)
    for i in range(sessions):
        s = Session(phone)
        for j in range(per_session):
            tid = _begin(s, f"w{j % 3}.bin", 1 << 20)  # names repeat: later BEGINs supersede earlier ones
            _chunk(s, tid, 0, piece)
        s.heartbeat()  # every frame above has been handled
        if i % 4 == 0:  # some sessions end inside a frame, as a host that crashed mid-send
            frame = encode_message(Message(MsgType.FILE_CHUNK, {"transfer_id": tid, "offset": len(piece)},
                                           {"data": np.frombuffer(piece, dtype=np.uint8)}))
            s.sock.sendall(sealed_frame(s.sock, frame)[:len(frame) // 2])
        s.close()
        wait_free(phone)


def test_abandoned_transfers_and_sessions_leave_nothing_behind(phone):
    _abandon_round(phone, 4, 10)  # warm-up: the allocator's first arenas are not a leak
    before = settled_stats(phone.pid)
    _abandon_round(phone, 40, 10)  # 400 transfers, 40 sessions
    after = settled_stats(phone.pid, before)
    print(f"phone before {before}, after 400 abandoned transfers in 40 sessions {after}")
    assert after["fds"] <= before["fds"], (before, after)
    assert after["threads"] <= before["threads"], (before, after)
    assert after["rss_mib"] <= before["rss_mib"] + 16, (before, after)
    assert list((phone.workdir / "incoming").iterdir()) == []
    assert not any(p.name.startswith("w") for p in (phone.workdir / "files").iterdir())


def test_open_transfers_are_capped_per_session(phone):
    with Session(phone) as s:
        tids = [_begin(s, f"cap{i}.bin", 10) for i in range(8)]
        extra = _begin(s, "cap8.bin", 10)
        reply = s.recv()
        assert reply.type == MsgType.FILE_RESULT and reply["transfer_id"] == extra and reply["ok"] is False
        assert "8 transfers are already open" in reply["message"]
        # finishing one frees a place
        s.request(Message(MsgType.FILE_END, {"transfer_id": tids[0]}))
        data = b"0123456789"
        assert s.push("cap8.bin", data)["ok"] is True


def test_two_uploads_to_one_name_cannot_both_succeed(phone):
    a, b = secrets.token_bytes(3000), secrets.token_bytes(3000)
    with Session(phone) as s:
        ta = _begin(s, "same.bin", len(a), _sha(a))
        tb = _begin(s, "same.bin", len(b), _sha(b))
        _chunk(s, ta, 0, a)  # chunks of the superseded transfer are dropped
        _chunk(s, tb, 0, b)
        ra = s.request(Message(MsgType.FILE_END, {"transfer_id": ta}))
        rb = s.request(Message(MsgType.FILE_END, {"transfer_id": tb}))
    assert ra.type == MsgType.FILE_RESULT and ra["ok"] is False and "superseded by transfer" in ra["message"], ra
    assert rb["ok"] is True and rb["sha256"] == _sha(b), rb
    assert (phone.workdir / "files" / "same.bin").read_bytes() == b


@pytest.mark.parametrize("name", ["n" * 251, "x" * 252, "y" * 253, "z" * 254, "q" * 255,
                                  "\u00e9" * 127 + "e"])  # the last: 255 bytes of UTF-8
def test_file_names_up_to_255_bytes_are_stored(phone, name):
    assert len(name.encode()) in range(251, 256)
    data = secrets.token_bytes(1000)
    with Session(phone) as s:
        reply = s.push(name, data)
        assert reply["ok"] is True, reply
    assert (phone.workdir / "files" / name).read_bytes() == data
    with Session(phone) as s:  # HELLO lists what the device stores, with its sha256
        assert s.hello["files"][name] == _sha(data)


# ---- idle, slow and too many connections -------------------------------------------------------

def _closed_with_timeout(sock: socket.socket) -> None:
    msg = recv_message(sock, max_frame=PREAUTH_MAX_FRAME)
    assert msg.type == MsgType.ERROR and msg["code"] == "TIMEOUT", msg
    with pytest.raises((ConnectionClosed, ConnectionResetError)):
        recv_message(sock, max_frame=PREAUTH_MAX_FRAME)
    sock.close()


def test_an_idle_connection_times_out(phone):
    sock = socket.create_connection(("127.0.0.1", phone.port), timeout=TIMEOUT)
    _closed_with_timeout(sock)
    assert_serves(phone)


def test_a_slowloris_handshake_times_out_however_steadily_it_trickles(phone):
    """One byte every 0.2 s: each read makes progress, yet the whole handshake has one deadline."""
    frame = encode_message(auth_request())
    sock = socket.create_connection(("127.0.0.1", phone.port), timeout=TIMEOUT)
    stop = threading.Event()

    def trickle():
        for byte in frame:
            if stop.wait(0.2):
                return
            try:
                sock.send(bytes([byte]))
            except OSError:
                return

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    try:
        _closed_with_timeout(sock)
    finally:
        stop.set()
        t.join()
    assert_serves(phone)


def test_a_session_stalled_inside_a_frame_is_dropped_with_timeout(phone):
    with Session(phone) as s:
        frame = encode_message(Message(MsgType.HEARTBEAT, {"seq": 1}))
        s.sock.sendall(frame[:10])
        msg = s.recv()
        assert msg.type == MsgType.ERROR and msg["code"] == "TIMEOUT" and "mid-frame" in msg["message"], msg
    assert_serves(phone)


class LimitedPhone:
    """A zl-phone under a low RLIMIT_NOFILE (set in the child only), started like EmulatedPhone."""

    def __init__(self, workdir: Path, nofile: int, args: list):
        self.name, self.token, self.workdir = "limited", new_token(), workdir
        workdir.mkdir(parents=True)
        self.log_path = workdir / "phone.log"

        def limit():
            resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        self.proc = subprocess.Popen(
            [sys.executable, "-m", "zl_mobile.phone", "--name", self.name, "--workdir", str(workdir),
             "--token", self.token, *args], stdout=subprocess.PIPE, stderr=open(self.log_path, "ab"),
            preexec_fn=limit, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        for line in iter(self.proc.stdout.readline, b""):
            if b"listening on" in line:
                self.port = int(line.decode().split("listening on ")[1].split(",")[0].rpartition(":")[2])
                break
        else:
            raise AssertionError(f"the phone did not start: {self.log_path.read_text()}")
        self.endpoint, self.pid = f"127.0.0.1:{self.port}", self.proc.pid
        threading.Thread(target=lambda: [None for _ in iter(self.proc.stdout.readline, b"")], daemon=True).start()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def _flood(port: int, n: int) -> list:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.settimeout(TIMEOUT)
        s.connect(("127.0.0.1", port))  # completes in the kernel's backlog even when accept() fails
        socks.append(s)
    return socks


def test_running_out_of_descriptors_does_not_end_serve(tmp_path):
    phone = LimitedPhone(tmp_path / "p", 64, [*FAST, "--max-connections", "500"])
    try:
        base = settled_stats(phone.pid)
        print(f"idle phone under RLIMIT_NOFILE 64: {base}")
        log = Log(phone)
        socks = _flood(phone.port, 64 - base["fds"] + 40)  # 40 more than the phone can hold open
        # EMFILE surfaces at accept() or, when accept won the race for the last descriptor, in a
        # connection's handshake (listing stored files): either way one connection is refused
        deadline = time.time() + TIMEOUT
        while "Too many open files" not in log.new() and time.time() < deadline:
            time.sleep(0.05)
        emfile = [ln for ln in log.new().splitlines() if "Too many open files" in ln]
        assert emfile and all("accept failed" in ln or "refused a connection" in ln for ln in emfile), log.new()
        assert sum("accept failed" in ln for ln in emfile) <= 1  # throttled: one line for a flood
        for s in socks:  # the phone times each one out as it gets to it
            s.close()
        assert phone.alive()
        assert_serves(phone)
        after = settled_stats(phone.pid, base)
        print(f"after the flood: {after}")
        assert after["fds"] <= base["fds"] and after["threads"] <= base["threads"]
        assert "Traceback" not in phone.log_path.read_text()
    finally:
        phone.stop()


def test_connections_beyond_the_cap_close_the_oldest_unauthenticated_one(tmp_path):
    """At the cap the oldest connection that has not authenticated gives way (issue 31): idle
    sockets reopened again and again cannot keep the real host out, and never more are open."""
    phone = LimitedPhone(tmp_path / "p", 1024, [*FAST, "--handshake-timeout", "30", "--max-connections", "4"])
    try:
        log = Log(phone)
        held = _flood(phone.port, 4)
        extra = _flood(phone.port, 4)
        log.wait_line("4 connections open already", "oldest unauthenticated", timeout=TIMEOUT)
        for s in held:  # the four oldest were closed by the phone without a word
            assert s.recv(1) == b""
        t0 = time.monotonic()
        # a host that authenticates finds room at once, the cap still full of idlers; counted while
        # its session is open (assert_serves would reconnect to check the slot is freed, and each
        # of those connections takes one more idler's place)
        client = DeviceClient(phone.name, phone.endpoint, phone.token, queue.Queue())
        try:
            assert client.hello.type == MsgType.HELLO and time.monotonic() - t0 < 5
            closed = 0  # the host's connection took one idler's place (the oldest the phone accepted:
            for s in extra:  # which of these four it took first is the scheduler's business), no more
                s.settimeout(0.2)
                try:
                    closed += s.recv(1) == b""
                except ConnectionResetError:
                    closed += 1
                except (socket.timeout, TimeoutError):
                    pass
            assert closed == 1
        finally:
            client.close()
        for s in extra:
            s.close()
    finally:
        phone.stop()

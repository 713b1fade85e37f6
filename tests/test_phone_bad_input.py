"""Bad input against one real zl-phone process, over real loopback sockets.

Each malformed or unauthorised input gets the ERROR code docs/PROTOCOL.md (2.2, 5, 6) names,
the phone logs a one-line reason in <workdir>/phone.log, and afterwards the phone still serves
a correct host session."""
from __future__ import annotations

import itertools
import json
import queue
import secrets
import socket
import struct
import time
import zlib

import numpy as np
import pytest

from host.phones.emulated_phone import EmulatedPhone
from host.run.client import DeviceClient
from zl_mobile.connection import Connection, connect
from zl_mobile.device import sha256_file
from zl_mobile.protocol import (
    PREAUTH_MAX_FRAME,
    ConnectionClosed,
    ErrorCode,
    HostHandshake,
    Message,
    MsgType,
    ProtocolError,
    encode_message,
    host_handshake,
    new_token,
    recv_message,
    send_message,
)
from zl_mobile.protocol.frames import SEALED_FLAG, encode_header
from zl_mobile.protocol.seal import TAG_BYTES, install, seal_of

TIMEOUT = 10.0
_seq = itertools.count(1000)


# ---- fixtures and helpers ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def phone(tmp_path_factory):
    p = EmulatedPhone("badin", tmp_path_factory.mktemp("phone") / "badin", new_token(),
                      ["--mdns", "none", "--threads", "1"]).start()
    yield p
    try:
        assert p.alive(), f"the phone process died; see {p.log_path}"
        text = p.log_path.read_text()
        assert "Traceback" not in text, f"the phone logged a traceback:\n{text}"
    finally:
        p.stop()


class Log:
    """The part of phone.log written since this object was made."""

    def __init__(self, phone):
        self.path = phone.log_path
        self.start = self.path.stat().st_size

    def new(self) -> str:
        with open(self.path, "rb") as f:
            f.seek(self.start)
            return f.read().decode(errors="replace")

    def wait_line(self, *needles: str, timeout: float = 5.0) -> str:
        """The one new log line that holds all needles (the log may be written just after the
        ERROR was sent)."""
        deadline = time.time() + timeout
        while True:
            lines = [ln for ln in self.new().splitlines() if all(n in ln for n in needles)]
            if lines or time.time() > deadline:
                break
            time.sleep(0.05)
        assert len(lines) == 1, f"expected one log line with {needles}, got {lines!r}; new log:\n{self.new()}"
        assert "Traceback" not in self.new()
        return lines[0]


def raw_socket(phone) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", phone.port), timeout=TIMEOUT)
    sock.settimeout(TIMEOUT)
    return sock


def expect_error_and_close(sock: socket.socket, code: ErrorCode, request_id=None) -> Message:
    """Read the ERROR the phone sends, then check that it closed the connection."""
    msg = recv_message(sock, max_frame=PREAUTH_MAX_FRAME)
    assert msg.type == MsgType.ERROR, msg
    assert msg["code"] == code.value, msg
    assert msg.get("request_id") == request_id
    assert msg["message"] and "\n" not in msg["message"]
    with pytest.raises((ConnectionClosed, ConnectionResetError)):
        recv_message(sock, max_frame=PREAUTH_MAX_FRAME)
    sock.close()
    return msg


def auth_request(**over) -> Message:
    meta = {"protocol_version": 2, "host_nonce": secrets.token_hex(32), "host_name": "test-host",
            "host_share": secrets.token_hex(32)}
    meta.update(over)
    return Message(MsgType.AUTH_REQUEST, meta)


def raw_frame(msg_type: int, meta: dict, *, version: int = 1, flags: int = 0) -> bytes:
    """A frame built by hand (no schema check, free header fields), with correct CRCs."""
    meta_b = json.dumps(meta).encode()
    body = struct.pack("<I", len(meta_b)) + meta_b + struct.pack("<H", 0)
    return encode_header(msg_type, len(body), version=version, flags=flags) + body + \
        struct.pack("<I", zlib.crc32(body))


def sealed(sock: socket.socket, frame: bytes) -> bytes:
    """A hand-built frame as this session's record layer sends it (PROTOCOL.md 6.1): after the
    handshake a plain frame is refused for its flags alone, before its body is looked at."""
    body = frame[16:-4]
    header = encode_header(frame[5], len(body) + TAG_BYTES, flags=SEALED_FLAG)
    ct = seal_of(sock).seal(header, body)
    return header + ct + struct.pack("<I", zlib.crc32(ct))


def handshake_when_free(endpoint: str, token: str, host_name: str):
    """(socket, HELLO) of an authenticated connection; BUSY is retried: the slot of a session or
    link closed just before is released asynchronously by the phone."""
    deadline = time.time() + TIMEOUT
    while True:
        sock = connect(endpoint, timeout=TIMEOUT)
        sock.settimeout(TIMEOUT)
        try:
            return sock, host_handshake(sock, token, host_name=host_name)
        except ProtocolError as e:
            sock.close()
            if e.code != ErrorCode.BUSY or time.time() > deadline:
                raise
            time.sleep(0.05)


class Session:
    """An authenticated host session over a raw Connection (the device's own heartbeats skipped)."""

    def __init__(self, phone, token: str | None = None):
        sock, self.hello = handshake_when_free(phone.endpoint, token or phone.token, "test-host")
        self.sock = sock
        self.conn = Connection(sock)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def send(self, msg: Message) -> None:
        self.conn.send(msg)

    def recv(self) -> Message:
        while True:
            msg = self.conn.recv()
            if msg.type == MsgType.HEARTBEAT and "time_ms" in msg.meta:
                continue  # the device's periodic heartbeat, not an answer
            return msg

    def request(self, msg: Message) -> Message:
        self.send(msg)
        return self.recv()

    def heartbeat(self) -> None:
        seq = next(_seq)
        reply = self.request(Message(MsgType.HEARTBEAT, {"seq": seq}))
        assert reply.type == MsgType.HEARTBEAT and reply["seq"] == seq, reply

    def push(self, name: str, data: bytes, kind: str = "other", sha256: str | None = None) -> Message:
        tid = next(_seq)
        self.send(Message(MsgType.FILE_BEGIN, {"transfer_id": tid, "name": name, "kind": kind, "size": len(data),
                                               "sha256": sha256 or _sha(data)}))
        for off in range(0, len(data), 1 << 20):
            self.send(Message(MsgType.FILE_CHUNK, {"transfer_id": tid, "offset": off},
                              {"data": np.frombuffer(data[off:off + (1 << 20)], dtype=np.uint8)}))
        reply = self.request(Message(MsgType.FILE_END, {"transfer_id": tid}))
        assert reply.type == MsgType.FILE_RESULT and reply["transfer_id"] == tid, reply
        return reply

    def close(self) -> None:
        self.conn.close()


def _sha(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()


def assert_serves(phone) -> None:
    """A correct host (DeviceClient) authenticates and gets HELLO; the session answers."""
    deadline = time.time() + TIMEOUT
    while True:
        try:
            client = DeviceClient(phone.name, phone.endpoint, phone.token, queue.Queue())
            break
        except Exception as e:  # noqa: BLE001 - only BUSY (slot not yet released) is retried
            if "BUSY" not in str(e) or time.time() > deadline:
                raise
            time.sleep(0.05)
    try:
        assert client.hello.type == MsgType.HELLO and client.hello["name"] == phone.name
        assert client.hello["protocol_version"] == 2
    finally:
        client.close()
    wait_free(phone)
    assert phone.alive()


def wait_free(phone) -> None:
    """Wait until no host session holds the phone's slot (released asynchronously when a session
    closes), so the next test starts from an idle phone."""
    deadline = time.time() + TIMEOUT
    while True:
        sock = raw_socket(phone)
        send_message(sock, auth_request())
        reply = recv_message(sock, max_frame=PREAUTH_MAX_FRAME)
        sock.close()
        if reply.type == MsgType.AUTH_CHALLENGE:
            return
        assert reply.type == MsgType.ERROR and reply["code"] == "BUSY", reply
        assert time.time() < deadline, "the phone kept its host session slot after the session closed"
        time.sleep(0.05)


# ---- before authentication: frame-level errors -------------------------------------------------

def _good_auth_frame() -> bytes:
    return encode_message(auth_request())


def _corrupt(frame: bytes, index: int) -> bytes:
    b = bytearray(frame)
    b[index] ^= 0x01
    return bytes(b)


HEADER_CASES = {
    # name: (bytes to send, expected code, words in the logged reason)
    "bad-magic": (lambda: b"GET / HTTP/1.1\r\n\r\n"[:16], ErrorCode.BAD_MAGIC, "not a ZeroLock"),
    "wrong-version": (lambda: encode_header(MsgType.AUTH_REQUEST, 100, version=2), ErrorCode.BAD_VERSION,
                      "protocol version 2 not supported"),
    "bad-header-checksum": (lambda: _corrupt(_good_auth_frame(), 12)[:16], ErrorCode.BAD_CHECKSUM,
                            "header CRC32 mismatch"),
    "nonzero-flags": (lambda: encode_header(MsgType.AUTH_REQUEST, 100, flags=1), ErrorCode.MALFORMED, "flags"),
    # body_len claims 1 MiB: refused from the header alone, before any body byte is sent
    "oversized": (lambda: encode_header(MsgType.AUTH_REQUEST, 1 << 20), ErrorCode.OVERSIZED,
                  "exceeds the 64.0 KiB limit"),
    "oversized-4GiB": (lambda: encode_header(MsgType.AUTH_REQUEST, 0xFFFFFFF0), ErrorCode.OVERSIZED,
                       "exceeds the 64.0 KiB limit"),
    "unknown-type": (lambda: encode_header(0x7F, 100), ErrorCode.UNKNOWN_TYPE, "0x7f"),
}


@pytest.mark.parametrize("case", list(HEADER_CASES))
def test_bad_frame_header_gets_error_from_the_header_alone(phone, case):
    data, code, reason = HEADER_CASES[case]
    log = Log(phone)
    sock = raw_socket(phone)
    sock.sendall(data())  # only the 16 header bytes: the phone must decide without the body
    msg = expect_error_and_close(sock, code)
    assert reason in msg["message"]
    line = log.wait_line("refused a connection", f"{code.value}:", reason)
    assert phone.name in line
    assert_serves(phone)


def test_bad_body_checksum(phone):
    log = Log(phone)
    sock = raw_socket(phone)
    sock.sendall(_corrupt(_good_auth_frame(), -1))
    expect_error_and_close(sock, ErrorCode.BAD_CHECKSUM)
    log.wait_line("refused a connection", "BAD_CHECKSUM:", "body CRC32 mismatch")
    assert_serves(phone)


@pytest.mark.parametrize("cut", ["in-header", "in-body"])
def test_truncated_frame_half_closed_gets_truncated(phone, cut):
    frame = _good_auth_frame()
    log = Log(phone)
    sock = raw_socket(phone)
    sock.sendall(frame[:8] if cut == "in-header" else frame[:len(frame) // 2])
    sock.shutdown(socket.SHUT_WR)  # end of stream mid-frame; we can still read the answer
    msg = expect_error_and_close(sock, ErrorCode.TRUNCATED)
    assert "stream ended inside a frame" in msg["message"]
    log.wait_line("refused a connection", "TRUNCATED:", "header" if cut == "in-header" else "AUTH_REQUEST body")
    assert_serves(phone)


def test_truncated_frame_then_close(phone):
    frame = _good_auth_frame()
    log = Log(phone)
    sock = raw_socket(phone)
    sock.sendall(frame[:len(frame) // 2])
    sock.close()
    log.wait_line("refused a connection", "TRUNCATED:")
    assert_serves(phone)


def test_preauth_frame_limit_is_exactly_64_KiB(phone):
    base = len(encode_message(auth_request(pad="")))
    fits = auth_request(pad="x" * (PREAUTH_MAX_FRAME - base))
    assert len(encode_message(fits)) == PREAUTH_MAX_FRAME
    sock = raw_socket(phone)
    send_message(sock, fits)  # a 64 KiB frame is accepted (the unknown key is ignored)
    assert recv_message(sock, max_frame=PREAUTH_MAX_FRAME).type == MsgType.AUTH_CHALLENGE
    sock.close()
    log = Log(phone)
    sock = raw_socket(phone)
    sock.sendall(encode_message(auth_request(pad="x" * (PREAUTH_MAX_FRAME - base + 1)))[:16])
    msg = expect_error_and_close(sock, ErrorCode.OVERSIZED)
    assert "64.0 KiB limit" in msg["message"]
    log.wait_line("refused a connection", "OVERSIZED:")
    assert_serves(phone)


# ---- before authentication: handshake errors ---------------------------------------------------

@pytest.mark.parametrize("version", [1, 3])  # 1: an unsealed host of the previous version
def test_auth_request_with_wrong_protocol_version(phone, version):
    log = Log(phone)
    sock = raw_socket(phone)
    send_message(sock, auth_request(protocol_version=version))
    msg = expect_error_and_close(sock, ErrorCode.BAD_VERSION)
    assert f"host speaks protocol version {version}" in msg["message"]
    log.wait_line("refused a connection", "BAD_VERSION:", f"host speaks protocol version {version}")
    assert_serves(phone)


@pytest.mark.parametrize("first", ["STAGE_ASSIGN", "HEARTBEAT", "AUTH_RESPONSE"])
def test_message_before_authentication(phone, first):
    msg = {
        "STAGE_ASSIGN": Message(MsgType.STAGE_ASSIGN, {"request_id": 1, "stage": 0, "num_stages": 3, "upstream": None,
                                                       "downstream": None, "program_sha256": "0" * 64}),
        "HEARTBEAT": Message(MsgType.HEARTBEAT, {"seq": 1}),
        "AUTH_RESPONSE": Message(MsgType.AUTH_RESPONSE, {"host_proof": "0" * 64}),
    }[first]
    log = Log(phone)
    sock = raw_socket(phone)
    send_message(sock, msg)
    err = expect_error_and_close(sock, ErrorCode.UNAUTHENTICATED)
    assert f"{first} before authentication" in err["message"]
    log.wait_line("refused a connection", "UNAUTHENTICATED:", f"{first} before authentication")
    assert_serves(phone)


def test_wrong_token(phone):
    log = Log(phone)
    sock = raw_socket(phone)
    hs = HostHandshake(new_token(), "impostor")
    send_message(sock, hs.start())
    challenge = recv_message(sock, max_frame=PREAUTH_MAX_FRAME)
    assert challenge.type == MsgType.AUTH_CHALLENGE and challenge["device_name"] == phone.name
    send_message(sock, hs.on_challenge(challenge))
    msg = expect_error_and_close(sock, ErrorCode.UNAUTHENTICATED)
    assert "host proof does not match" in msg["message"]
    log.wait_line("refused a connection", "UNAUTHENTICATED:", "host proof does not match")
    # the library's host side reports it with the device's code
    sock = raw_socket(phone)
    with pytest.raises(ProtocolError) as ei:
        host_handshake(sock, new_token())
    assert ei.value.code == ErrorCode.UNAUTHENTICATED
    sock.close()
    assert_serves(phone)


def test_replayed_host_nonce(phone):
    nonce = secrets.token_bytes(32)
    sock = raw_socket(phone)
    send_message(sock, HostHandshake(phone.token, rng=lambda n: nonce).start())
    assert recv_message(sock, max_frame=PREAUTH_MAX_FRAME).type == MsgType.AUTH_CHALLENGE
    sock.close()
    log = Log(phone)
    sock = raw_socket(phone)
    send_message(sock, HostHandshake(phone.token, rng=lambda n: nonce).start())
    msg = expect_error_and_close(sock, ErrorCode.UNAUTHENTICATED)
    assert "replayed" in msg["message"]
    log.wait_line("refused a connection", "UNAUTHENTICATED:", "replayed")
    assert_serves(phone)


# ---- one host at a time ------------------------------------------------------------------------

def test_second_host_gets_busy(phone):
    with Session(phone) as first:
        log = Log(phone)
        sock = raw_socket(phone)
        send_message(sock, auth_request())
        msg = expect_error_and_close(sock, ErrorCode.BUSY)
        assert "already serves a host session" in msg["message"]
        log.wait_line("refused a connection", "BUSY:")
        # the library's host side too, with the right token
        sock = raw_socket(phone)
        with pytest.raises(ProtocolError) as ei:
            host_handshake(sock, phone.token)
        assert ei.value.code == ErrorCode.BUSY
        sock.close()
        first.heartbeat()  # the first session is untouched
    assert_serves(phone)  # and its slot is released when it closes


def test_busy_at_auth_response_when_another_host_wins_the_race(phone):
    sock_a, sock_b = raw_socket(phone), raw_socket(phone)
    hs_a, hs_b = HostHandshake(phone.token), HostHandshake(phone.token)
    send_message(sock_a, hs_a.start())
    send_message(sock_b, hs_b.start())
    ch_a = recv_message(sock_a, max_frame=PREAUTH_MAX_FRAME)
    ch_b = recv_message(sock_b, max_frame=PREAUTH_MAX_FRAME)
    send_message(sock_a, hs_a.on_challenge(ch_a))
    hs_a.on_ok(recv_message(sock_a, max_frame=PREAUTH_MAX_FRAME))
    install(sock_a, hs_a.seal())  # the HELLO is sealed (PROTOCOL.md 6.1)
    assert recv_message(sock_a, max_frame=PREAUTH_MAX_FRAME).type == MsgType.HELLO
    send_message(sock_b, hs_b.on_challenge(ch_b))
    expect_error_and_close(sock_b, ErrorCode.BUSY)
    sock_a.close()
    assert_serves(phone)


# ---- after authentication ----------------------------------------------------------------------

def test_bad_frame_after_authentication_drops_only_that_session(phone):
    log = Log(phone)
    with Session(phone) as s:
        s.sock.sendall(_corrupt(sealed(s.sock, encode_message(Message(MsgType.HEARTBEAT, {"seq": 1}))), -1))
        msg = s.recv()
        assert msg.type == MsgType.ERROR and msg["code"] == "BAD_CHECKSUM" and "request_id" not in msg.meta
        with pytest.raises((ConnectionClosed, ConnectionResetError)):
            s.recv()
    log.wait_line("dropping the host session", "BAD_CHECKSUM:")
    with Session(phone) as s:  # oversized after auth: the host session's 64 MiB limit, from the header alone
        s.sock.sendall(encode_header(MsgType.STATE_PUT, 0xFFFFFFF0, flags=SEALED_FLAG))
        msg = s.recv()
        assert msg.type == MsgType.ERROR and msg["code"] == "OVERSIZED" and "64.0 MiB limit" in msg["message"]
    assert_serves(phone)


def test_file_with_wrong_sha256_is_rejected_and_discarded(phone):
    files = phone.workdir / "files"
    data = secrets.token_bytes(100_000)
    log = Log(phone)
    with Session(phone) as s:
        reply = s.push("bogus.pte", data, kind="program", sha256=_sha(b"something else"))
        assert reply["ok"] is False and reply["size"] == len(data) and reply["sha256"] == _sha(data)
        assert "bogus.pte" in reply["message"] and "discarded" in reply["message"]
        assert not (files / "bogus.pte").exists() and not (files / "bogus.pte.part").exists()
        log.wait_line("rejected file", "bogus.pte")
        # a size that does not match FILE_BEGIN is rejected too
        tid = next(_seq)
        s.send(Message(MsgType.FILE_BEGIN, {"transfer_id": tid, "name": "short.bin", "kind": "other",
                                            "size": len(data) + 1, "sha256": _sha(data)}))
        s.send(Message(MsgType.FILE_CHUNK, {"transfer_id": tid, "offset": 0},
                       {"data": np.frombuffer(data, dtype=np.uint8)}))
        reply = s.request(Message(MsgType.FILE_END, {"transfer_id": tid}))
        assert reply.type == MsgType.FILE_RESULT and reply["ok"] is False and reply["message"]
        assert not (files / "short.bin").exists() and not (files / "short.bin.part").exists()
        # a good file stored, then a bad push of the same name: the good one stays
        assert s.push("kept.bin", data)["ok"] is True
        assert s.push("kept.bin", data[::-1], sha256=_sha(data))["ok"] is False
        assert sha256_file(files / "kept.bin") == _sha(data)
        s.heartbeat()  # the session goes on
    assert_serves(phone)


def _assign_meta(manifest, k, **over):
    by_path = {f["path"]: f for f in manifest["files"]}
    chunk = manifest["chunks"][min(k, len(manifest["chunks"]) - 1)]
    meta = {"request_id": next(_seq), "run_id": "bad-input", "stage": k, "num_stages": len(manifest["chunks"]),
            "upstream": "host" if k == 0 else "127.0.0.1:1", "downstream": None,
            "program_sha256": by_path[chunk["program"]]["sha256"],
            "upstream_token": new_token(), "window_size": 2, "inflight_depth": 2, "replay_horizon": 4}
    meta.update(over)
    return {k_: v for k_, v in meta.items() if v is not DROP}


DROP = object()


def _rejected(s: Session, meta: dict, *words: str) -> str:
    reply = s.request(Message(MsgType.STAGE_ASSIGN, meta))
    assert reply.type == MsgType.ERROR, reply
    assert reply["code"] == "REJECTED" and reply["request_id"] == meta["request_id"], reply
    for w in words:
        assert w in reply["message"], reply["message"]
    s.heartbeat()  # an error about one request: the session goes on
    return reply["message"]


def test_stage_assign_that_does_not_fit_the_program(phone, small_export):
    out, manifest, _, _ = small_export
    chunk0, chunk1 = manifest["chunks"][0], manifest["chunks"][1]
    by_path = {f["path"]: f for f in manifest["files"]}
    log = Log(phone)
    with Session(phone) as s:
        # nothing pushed yet
        _rejected(s, _assign_meta(manifest, 0), "no manifest.json", "push the export's manifest")
        # a "manifest.json" that is not one: a failure on the device, reported for this request
        assert s.push("manifest.json", b"{not json", kind="manifest")["ok"] is True
        meta = _assign_meta(manifest, 0)
        reply = s.request(Message(MsgType.STAGE_ASSIGN, meta))
        assert reply.type == MsgType.ERROR and reply["code"] == "INTERNAL", reply
        assert reply["request_id"] == meta["request_id"] and "JSONDecodeError" in reply["message"]
        log.wait_line("ERROR", "INTERNAL:", "STAGE_ASSIGN failed on the device")
        s.heartbeat()
        # only the manifest: the chunk's files are missing
        manifest_bytes = (out / "manifest.json").read_bytes()
        assert s.push("manifest.json", manifest_bytes, kind="manifest")["ok"] is True
        _rejected(s, _assign_meta(manifest, 0), f"\"{chunk0['program']}\" is not on this device", "push it")
        # chunk 0's files pushed, chunk 1's not
        for key, kind in (("program", "program"), ("weights", "weights"), ("lora_init", "other")):
            data = (out / chunk0[key]).read_bytes()
            assert s.push(chunk0[key], data, kind=kind)["ok"] is True
        _rejected(s, _assign_meta(manifest, 1), f"\"{chunk1['program']}\" is not on this device")
        # wrong num_stages; a stage index past the export's chunks
        _rejected(s, _assign_meta(manifest, 0, num_stages=2), "stage 0 of 2 does not fit", "3 chunks")
        _rejected(s, _assign_meta(manifest, 3, num_stages=4), "stage 3 of 4 does not fit", "3 chunks")
        # upstream_token is optional in the schema (5.3), but a stage cannot accept its upstream without it
        _rejected(s, _assign_meta(manifest, 0, upstream_token=DROP), "upstream_token")
        # the program_sha256 of another chunk
        _rejected(s, _assign_meta(manifest, 0, program_sha256=by_path[chunk1["program"]]["sha256"]),
                  "program_sha256", f"chunk 0's program (\"{chunk0['program']}\")")
        log.wait_line("REJECTED:", "program_sha256")
        # a well-formed, fitting assignment is accepted after all that
        meta = _assign_meta(manifest, 0)
        ack = s.request(Message(MsgType.STAGE_ASSIGN, meta))
        assert ack.type == MsgType.ACK and ack["request_id"] == meta["request_id"] and ack["ok"] is True, ack
        assert ack["data_port"] > 0 and ack["committed_window"] == -1
        s.heartbeat()
        s.send(Message(MsgType.SHUTDOWN, {"reason": "test over"}))  # stops the stage, ends the session
        with pytest.raises((ConnectionClosed, ConnectionResetError)):
            s.recv()
    assert_serves(phone)


def test_stage_assign_with_stage_not_below_num_stages_is_malformed(phone):
    """stage >= num_stages breaks the message schema (5.3): a decoding error, fatal for the session."""
    log = Log(phone)
    with Session(phone) as s:
        s.sock.sendall(sealed(s.sock, raw_frame(MsgType.STAGE_ASSIGN, {
            "request_id": 7, "stage": 3, "num_stages": 3, "upstream": None, "downstream": None,
            "program_sha256": "0" * 64})))
        msg = s.recv()
        assert msg.type == MsgType.ERROR and msg["code"] == "MALFORMED" and "not below num_stages" in msg["message"]
        with pytest.raises((ConnectionClosed, ConnectionResetError)):
            s.recv()
    log.wait_line("dropping the host session", "MALFORMED:")
    assert_serves(phone)


def test_token_file_is_private(phone):
    path = phone.workdir / "pairing_token"
    assert path.read_text().strip() == phone.token
    assert path.stat().st_mode & 0o077 == 0, oct(path.stat().st_mode)


def test_a_full_disk_is_named_as_such_and_nothing_half_written_stays(tmp_path):
    """A write that fails on the device (ENOSPC: a real full disk cannot be made safely here, so
    the transfer's file handle fails its writes from the second chunk on) is reported by FILE_END
    as what it is, with the fix, not as the offset mismatch every later chunk would cause."""
    import errno

    from zl_mobile.device import Device

    class FullDisk:
        def __init__(self, fh):
            self.fh, self.writes = fh, 0

        def write(self, data):
            self.writes += 1
            if self.writes > 1:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.fh.write(data)

        def __getattr__(self, name):
            return getattr(self.fh, name)

    device = Device("full", tmp_path, new_token())
    data = secrets.token_bytes(3 << 20)
    tid = next(_seq)
    device.handle(Message(MsgType.FILE_BEGIN, {"transfer_id": tid, "name": "big.ptd", "kind": "weights",
                                               "size": len(data), "sha256": _sha(data)}))
    tr = device.receiver._open[tid]
    tr["fh"] = FullDisk(tr["fh"])
    for off in range(0, len(data), 1 << 20):
        device.handle(Message(MsgType.FILE_CHUNK, {"transfer_id": tid, "offset": off},
                              {"data": np.frombuffer(data[off:off + (1 << 20)], dtype=np.uint8)}))
    reply = device.handle(Message(MsgType.FILE_END, {"transfer_id": tid}))
    assert reply["ok"] is False
    msg = reply["message"]
    assert "big.ptd" in msg and "No space left on device" in msg and "after 1048576 bytes" in msg
    assert "make room" in msg and "push it again" in msg and "does not follow" not in msg
    files = tmp_path / "files"
    assert not (files / "big.ptd").exists() and not any((tmp_path / "incoming").iterdir())

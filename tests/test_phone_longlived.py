"""A phone that lives for days among careless peers (issue 31): what an authenticated host or a
stage-link peer can make it allocate, what a replaced stage leaves behind, and peers that lie or
stall. One real zl-phone process with the small export's last chunk, real loopback sockets."""
from __future__ import annotations

import json
import socket
import struct
import threading
import time
import zlib

import numpy as np
import pytest

from tests.conftest import sealed_frame
from tests.test_phone_bad_input import TIMEOUT, Session, _seq, _sha, assert_serves, handshake_when_free
from tests.test_phone_hostile import proc_stats, serving_phone, settled_stats
from zl_mobile.connection import Connection
from zl_mobile.protocol import ConnectionClosed, Message, MsgType, ProtocolError, encode_message, new_token
from zl_mobile.protocol.frames import SEALED_FLAG, encode_header


@pytest.fixture(scope="module")
def phone(tmp_path_factory):
    yield from serving_phone(tmp_path_factory, "longlived")


@pytest.fixture(scope="module")
def pushed(phone, small_export):
    """The manifest and the last chunk's files on the phone; returns (manifest, last stage index)."""
    out, manifest, _, _ = small_export
    k = len(manifest["chunks"]) - 1
    with Session(phone) as s:
        assert s.push("manifest.json", (out / "manifest.json").read_bytes(), kind="manifest")["ok"]
        for key in ("program", "weights", "lora_init"):
            name = manifest["chunks"][k][key]
            assert s.push(name, (out / name).read_bytes())["ok"]
    return manifest, k


def _assign_meta(manifest, k, **over) -> dict:
    by_path = {f["path"]: f for f in manifest["files"]}
    meta = {"request_id": next(_seq), "run_id": "longlived", "stage": k, "num_stages": len(manifest["chunks"]),
            "upstream": "127.0.0.1:1", "downstream": None,
            "program_sha256": by_path[manifest["chunks"][k]["program"]]["sha256"], "upstream_token": new_token(),
            "window_size": 2, "inflight_depth": 2, "replay_horizon": 4, "config": {"restart": True}}
    meta.update(over)
    return meta


def _assign(s: Session, meta: dict) -> Message:
    reply = s.request(Message(MsgType.STAGE_ASSIGN, meta))
    assert reply.type == MsgType.ACK and reply["request_id"] == meta["request_id"], reply
    return reply


def _shutdown(s: Session) -> None:
    """SHUTDOWN, then wait until the phone has closed the session (the stage is stopped by then)."""
    s.send(Message(MsgType.SHUTDOWN, {"reason": "test over"}))
    with pytest.raises((ConnectionClosed, ConnectionResetError)):
        while True:
            s.recv()


def _expect(recv, code: str, *words: str) -> Message:
    """The next message that is not a heartbeat or telemetry must be ERROR `code`."""
    while True:
        msg = recv()
        if msg.type not in (MsgType.HEARTBEAT, MsgType.TELEMETRY):
            break
    assert msg.type == MsgType.ERROR and msg["code"] == code, msg
    for w in words:
        assert w in msg["message"], msg["message"]
    return msg


# ---- what a declared length may cost -----------------------------------------------------------

def _rss_mib(pid: int) -> float:
    return proc_stats(pid)["rss_mib"]


def test_a_declared_body_is_not_allocated_before_its_bytes_arrive(phone):
    """A header declaring 60 MiB and then 100 bytes commits ~nothing; the stall is a TIMEOUT."""
    base = _rss_mib(phone.pid)
    with Session(phone) as s:
        s.sock.sendall(encode_header(MsgType.FILE_CHUNK, 60 << 20, flags=SEALED_FLAG) + b"\0" * 100)
        time.sleep(0.5)
        grown = _rss_mib(phone.pid) - base
        _expect(s.recv, "TIMEOUT", "stalled mid-frame", "100 of")  # FAST: --io-timeout 1
    assert grown < 16, f"RSS grew {grown:.0f} MiB for a 60 MiB declaration with 100 bytes sent"
    # the host session's frames are bounded by what it can need (64 MiB), from the header alone
    with Session(phone) as s:
        s.sock.sendall(encode_header(MsgType.FILE_CHUNK, 65 << 20, flags=SEALED_FLAG))
        _expect(s.recv, "OVERSIZED", "64.0 MiB limit")
    assert_serves(phone)


def test_large_bodies_once_freed_leave_rss_where_it_was(phone):
    """Whole bodies of 3-40 MiB (bad CRC: each session ends) are received and freed; glibc must
    hand them back (zl_mobile/heap.py) instead of keeping them on its heap for good."""
    base = _rss_mib(phone.pid)
    for n in [3, 9, 20, 40, 30, 9, 40, 20, 3, 30] * 2:
        with Session(phone) as s:
            s.sock.sendall(encode_header(MsgType.FILE_CHUNK, n << 20, flags=SEALED_FLAG) + b"\1" * ((n << 20) + 4))
            _expect(s.recv, "BAD_CHECKSUM")
    time.sleep(1.0)
    grown = _rss_mib(phone.pid) - base
    assert grown < 24, f"RSS stayed {grown:.0f} MiB up after 20 large bodies were freed"
    assert_serves(phone)


# ---- the data link -----------------------------------------------------------------------------

class Link:
    """An upstream's end of a stage link: handshake, then the downstream's REPLAY_REQUEST and
    initial CREDIT (if any)."""

    def __init__(self, port: int, token: str):
        self.sock, _ = handshake_when_free(f"127.0.0.1:{port}", token, "test-upstream")
        self.conn = Connection(self.sock)
        first = self.conn.recv()
        assert first.type == MsgType.REPLAY_REQUEST, first
        self.start = first["from_micro_batch"]
        self.credits = 0
        self.sock.settimeout(0.5)
        try:
            while True:
                m = self.conn.recv()
                if m.type == MsgType.CREDIT:
                    self.credits += m["credits"]
        except (socket.timeout, TimeoutError):
            pass
        self.sock.settimeout(TIMEOUT)

    def closed(self) -> bool:
        try:
            return self.conn.recv() is None
        except (ConnectionClosed, ConnectionResetError, ProtocolError):
            return True

    def close(self):
        self.conn.close()


def _hidden(manifest, k: int, mb: int, window: int | None = None, fill: float = 0.5) -> Message:
    spec = {t["name"]: t["shape"] for t in manifest["chunks"][k]["methods"]["phase1"]["inputs"]}
    first = manifest["chunks"][k]["first_input"]
    b, t = spec["position_ids"]
    labels = np.full((b, t), -100, dtype=np.int64)
    labels[:, :3] = 7  # within the readout rows of the small export (8)
    return Message(MsgType.HIDDEN_STATE, {"micro_batch": mb, "window": mb // 2 if window is None else window},
                   {"h": np.full(spec[first], fill, dtype=np.float32),
                    "attention_mask": np.ones((b, t), dtype=np.int64),
                    "position_ids": np.tile(np.arange(t, dtype=np.int64), (b, 1)), "labels": labels})


def test_the_data_link_keeps_to_its_credits_its_size_and_what_the_stage_can_use(phone, pushed):
    manifest, k = pushed
    base = _rss_mib(phone.pid)
    with Session(phone) as s:
        meta = _assign_meta(manifest, k, run_id="credits")
        port, token = _assign(s, meta)["data_port"], meta["upstream_token"]
        link = Link(port, token)
        assert (link.start, link.credits) == (0, 2)
        # a micro-batch the stage can never use: ERROR, and it is not kept
        link.conn.send(_hidden(manifest, k, 1_000_000))
        _expect(link.conn.recv, "UNEXPECTED", "micro-batch 1000000", "not kept")
        assert link.closed()
        link = Link(port, token)
        assert (link.start, link.credits) == (0, 2)  # nothing was queued: both credits are back
        # a window label that does not fit the micro-batch would fail the stage: refused at the link
        link.conn.send(_hidden(manifest, k, 1, window=5))
        _expect(link.conn.recv, "UNEXPECTED", "window 5")
        link = Link(port, token)
        # two frames for the two credits (micro-batches 1 and 2: the stage waits for 0), then a third
        for mb in (1, 2):
            link.conn.send(_hidden(manifest, k, mb))
        link.conn.send(_hidden(manifest, k, 3))
        _expect(link.conn.recv, "UNEXPECTED", "micro-batch 3", "no credit left")
        assert link.closed()
        # a frame far larger than this chunk's hidden state: OVERSIZED from its header alone
        link = Link(port, token)
        link.sock.sendall(encode_header(MsgType.HIDDEN_STATE, 200 << 20, flags=SEALED_FLAG))
        _expect(link.conn.recv, "OVERSIZED")
        # 40 bytes of a frame, then nothing: TIMEOUT after --io-timeout (1 s), the link slot frees
        link = Link(port, token)
        frame = encode_message(_hidden(manifest, k, 0))
        t0 = time.monotonic()
        link.sock.sendall(sealed_frame(link.sock, frame)[:40])
        _expect(link.conn.recv, "TIMEOUT", "stalled mid-frame")
        assert time.monotonic() - t0 < 5
        link = Link(port, token)  # the real upstream gets in
        link.close()
        _shutdown(s)
    assert _rss_mib(phone.pid) - base < 32


def test_a_diverging_run_is_reported_not_fatal(phone, pushed):
    """NaN hidden states give a NaN loss: TELEMETRY leaves it out and names it in `nonfinite`, and
    the stage goes on to commit the window."""
    manifest, k = pushed
    with Session(phone) as s:
        meta = _assign_meta(manifest, k, run_id="nan")
        link = Link(_assign(s, meta)["data_port"], meta["upstream_token"])
        for mb in (0, 1):
            link.conn.send(_hidden(manifest, k, mb, fill=float("nan")))
        seen = []
        deadline = time.time() + 60
        while time.time() < deadline:
            msg = s.recv()
            seen.append(msg)
            if msg.type == MsgType.CHECKPOINT_COMMITTED or msg.type == MsgType.ERROR:
                break
        assert msg.type == MsgType.CHECKPOINT_COMMITTED and msg["window"] == 0, seen[-3:]
        records = [m for m in seen if m.type == MsgType.TELEMETRY and m.get("kind") == "micro_batch"]
        assert len(records) == 2 and all("loss" in m["nonfinite"] and "loss" not in m.meta for m in records), records
        link.close()
        _shutdown(s)


# ---- a replaced stage --------------------------------------------------------------------------

def _refused(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        return False
    except ConnectionRefusedError:
        return True


def test_a_replaced_stage_leaves_no_thread_port_or_descriptor_behind(phone, pushed):
    manifest, k = pushed
    with Session(phone) as s:
        first = _assign(s, _assign_meta(manifest, k, run_id="replaced"))["data_port"]
        base = settled_stats(phone.pid)
        ports = []
        for i in range(12):
            ports.append(_assign(s, _assign_meta(manifest, k, run_id=f"replaced-{i % 3}"))["data_port"])
        after = settled_stats(phone.pid)
        print(f"after the first assignment: {base}; after 12 more: {after}")
        assert after["threads"] <= base["threads"] + 1 and after["fds"] <= base["fds"] + 2, (base, after)
        assert all(_refused(p) for p in [first, *ports[:-1]])  # replaced stages no longer listen
        _shutdown(s)
    assert _refused(ports[-1])


def _free_port() -> int:
    with socket.socket() as t:
        t.bind(("127.0.0.1", 0))
        return t.getsockname()[1]


def test_a_fixed_listen_port_is_bound_again_and_an_unbindable_one_refused_first(phone, pushed):
    manifest, k = pushed
    port = _free_port()
    with Session(phone) as s:
        for i in range(3):  # the host sends the same listen_port to a USB phone every time
            running = _assign_meta(manifest, k, run_id=f"fixed-{i}", listen_port=port)
            assert _assign(s, running)["data_port"] == port
        Link(port, running["upstream_token"]).close()
        holder = socket.socket()
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        taken = holder.getsockname()[1]
        try:
            meta = _assign_meta(manifest, k, run_id="never-created", listen_port=taken)
            reply = s.request(Message(MsgType.STAGE_ASSIGN, meta))
            assert reply.type == MsgType.ERROR and reply["code"] == "REJECTED", reply
            assert reply["message"].startswith("STAGE_ASSIGN listen_port:") and str(taken) in reply["message"]
        finally:
            holder.close()
        s.heartbeat()
        # refused before anything was stopped or created: the running stage still takes its link
        Link(port, running["upstream_token"]).close()
        assert not (phone.workdir / "stages" / "never-created").exists()
        _shutdown(s)


# ---- peers that lie or stall -------------------------------------------------------------------

class Downstream:
    """A downstream's end of a stage link, by hand: it accepts the OutboundLink under test."""

    def __init__(self, token: str):
        self.token = token
        self.srv = socket.socket()
        self.srv.bind(("127.0.0.1", 0))
        self.srv.listen(4)
        self.srv.settimeout(TIMEOUT)
        self.address = f"127.0.0.1:{self.srv.getsockname()[1]}"

    def accept(self) -> Connection:
        from zl_mobile.protocol import DeviceAuth, device_handshake

        sock, _ = self.srv.accept()
        sock.settimeout(TIMEOUT)
        hello = Message(MsgType.HELLO, {"name": "d", "protocol_version": 1, "runtime_version": "t",
                                        "memory_bytes": 0, "capabilities": ["link"]})
        device_handshake(sock, DeviceAuth(self.token, "d"), hello, timeout=TIMEOUT)  # one slot per connection
        return Connection(sock)


def _raw(msg_type: int, meta: dict) -> bytes:
    meta_b = json.dumps(meta).encode()
    body = struct.pack("<I", len(meta_b)) + meta_b + struct.pack("<H", 0)
    return encode_header(msg_type, len(body)) + body + struct.pack("<I", zlib.crc32(body))


def test_a_commit_beyond_what_was_sent_is_an_error_not_a_prune():
    from zl_mobile.links import OutboundLink

    token = new_token()
    down = Downstream(token)
    errors = []
    link = OutboundLink("up", token, window_size=2, replay_horizon=8, on_error=errors.append)
    try:
        for mb in range(4):
            link.publish(Message(MsgType.HIDDEN_STATE, {"micro_batch": mb, "window": mb // 2},
                                 {"h": np.zeros(2, dtype=np.float32)}))
        link.set_address(down.address)
        conn = down.accept()
        conn.send(Message(MsgType.REPLAY_REQUEST, {"from_micro_batch": 0, "to_micro_batch": 2**53}))
        conn.send(Message(MsgType.CREDIT, {"credits": 2}))
        assert [conn.recv()["micro_batch"] for _ in range(2)] == [0, 1]
        conn.send(Message(MsgType.CHECKPOINT_COMMITTED, {"window": 1000, "step": 1, "sha256": "ab" * 32}))
        _expect(conn.recv, "UNEXPECTED", "window 1000", "sent only those below 2", "nothing was pruned")
        assert link.buffered() == [0, 1, 2, 3]  # every hidden state still held for replay
        # the honest commit of window 0 (sent: 0 and 1) prunes exactly that window
        conn = down.accept()
        conn.send(Message(MsgType.REPLAY_REQUEST, {"from_micro_batch": 0, "to_micro_batch": 2**53}))
        conn.send(Message(MsgType.CREDIT, {"credits": 2}))
        assert [conn.recv()["micro_batch"] for _ in range(2)] == [0, 1]
        conn.send(Message(MsgType.CHECKPOINT_COMMITTED, {"window": 0, "step": 1, "sha256": "ab" * 32}))
        deadline = time.time() + TIMEOUT
        while link.buffered() != [2, 3] and time.time() < deadline:
            time.sleep(0.02)
        assert link.buffered() == [2, 3] and errors == []
        conn.close()
        # a bad frame from the downstream (CREDIT 0, from > to) gets an ERROR before the link drops
        for meta, t in (({"credits": 0}, MsgType.CREDIT),
                        ({"from_micro_batch": 5, "to_micro_batch": 1}, MsgType.REPLAY_REQUEST)):
            conn = down.accept()
            conn.sock.sendall(sealed_frame(conn.sock, _raw(t, meta)))
            _expect(conn.recv, "MALFORMED")
    finally:
        link.close()
        down.srv.close()


def test_files_a_manifest_names_stay_in_the_phones_storage(phone, small_export, pushed):
    """`../pairing_token` or an absolute path as the program, with its true sha256: refused
    without a word on whether the file exists or what it holds."""
    out, manifest, _, _ = small_export
    _, k = pushed
    token_file = phone.workdir / "pairing_token"
    assert token_file.exists()
    with Session(phone) as s:
        try:
            for name in ("../pairing_token", str(token_file), "../no-such-file", "/etc/hostname"):
                bad = json.loads(json.dumps(manifest))
                bad["chunks"][k]["program"] = name
                bad["files"].append({"path": name, "sha256": _sha(token_file.read_bytes()), "size": 64})
                assert s.push("manifest.json", json.dumps(bad).encode(), kind="manifest")["ok"]
                meta = _assign_meta(manifest, k, program_sha256=_sha(token_file.read_bytes()))
                reply = s.request(Message(MsgType.STAGE_ASSIGN, meta))
                assert reply.type == MsgType.ERROR and reply["code"] == "REJECTED", reply
                text = reply["message"]
                assert "not a plain file name" in text and "push the export's own manifest.json" in text, text
                assert "not on this device" not in text and "sha256" not in text, text
        finally:
            assert s.push("manifest.json", (out / "manifest.json").read_bytes(), kind="manifest")["ok"]


def test_state_put_and_a_host_error_get_what_the_spec_says(phone):
    with Session(phone) as s:
        rid = next(_seq)
        reply = s.request(Message(MsgType.STATE_PUT, {"request_id": rid, "kind": "lora"}))
        assert reply.type == MsgType.ACK and reply["ok"] is False and reply["request_id"] == rid, reply
        assert "does not load state" in reply["message"]
        s.heartbeat()
        s.send(Message(MsgType.ERROR, {"code": "INTERNAL", "message": "host gave up", "request_id": 5}))
        s.heartbeat()  # an error about one request: the session goes on
        s.send(Message(MsgType.ERROR, {"code": "INTERNAL", "message": "host gave up"}))
        with pytest.raises((ConnectionClosed, ConnectionResetError)):  # about the session: it ends (5.1)
            while True:
                s.recv()
    assert_serves(phone)


def test_a_transfer_times_out_from_its_last_chunk_while_heartbeats_flow(tmp_path):
    from zl_mobile.device import Device, Limits, serve

    token = new_token()
    device = Device("transfers", tmp_path / "w", token, limits=Limits(transfer_s=1.0))
    ready = threading.Event()
    port = []
    threading.Thread(target=serve, args=(device, 0, "127.0.0.1"),
                     kwargs={"ready": lambda p: (port.append(p), ready.set())}, daemon=True).start()
    assert ready.wait(TIMEOUT)

    class P:  # what Session needs of a phone
        endpoint = f"127.0.0.1:{port[0]}"

    data = b"x" * 2000
    with Session(P, token=token) as s:
        tid = next(_seq)
        s.send(Message(MsgType.FILE_BEGIN, {"transfer_id": tid, "name": "slow.bin", "kind": "other",
                                            "size": len(data), "sha256": _sha(data)}))
        s.send(Message(MsgType.FILE_CHUNK, {"transfer_id": tid, "offset": 0},
                       {"data": np.frombuffer(data[:1000], dtype=np.uint8)}))
        end = time.time() + 1.6
        while time.time() < end:  # the host is not silent: it heartbeats, but sends no chunk
            s.heartbeat()
            time.sleep(0.2)
        s.send(Message(MsgType.FILE_CHUNK, {"transfer_id": tid, "offset": 1000},
                       {"data": np.frombuffer(data[1000:], dtype=np.uint8)}))
        reply = s.request(Message(MsgType.FILE_END, {"transfer_id": tid}))
        assert reply.type == MsgType.FILE_RESULT and reply["ok"] is False, reply
        assert "no chunk for 1 s" in reply["message"], reply
    assert not (tmp_path / "w" / "files" / "slow.bin").exists()

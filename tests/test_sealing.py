"""Sealed sessions (PROTOCOL.md 6.1), as an attacker would test them: the shared vectors; an on-path
TCP proxy between a host and a real zl-phone that flips, drops, replays or reorders one frame after
the handshake; a peer of protocol version 1; a passive capture of a short training run on loopback."""
from __future__ import annotations

import hashlib
import json
import os
import socket
import struct
import threading
import time
import zlib
from pathlib import Path

import numpy as np
import pytest

from zl_mobile.protocol import (
    ConnectionClosed,
    ErrorCode,
    Message,
    MsgType,
    ProtocolError,
    decode_message,
    host_handshake,
    recv_message,
    send_message,
)
from zl_mobile.protocol import seal as S
from zl_mobile.protocol.frames import PREAUTH_MAX_FRAME

VEC = Path(__file__).resolve().parent / "vectors"
SEALING = json.loads((VEC / "sealing" / "vectors.json").read_text())


# ---- shared vectors (the Kotlin SealingVectorsTest runs the same file) ----------------------

def test_sealing_vectors_are_up_to_date():
    import importlib.util

    spec = importlib.util.spec_from_file_location("zl_sealing_generate", VEC / "sealing" / "generate.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert gen.render() == (VEC / "sealing" / "vectors.json").read_text(), "run tests/vectors/sealing/generate.py"


def test_keys_from_token_nonces_and_shares():
    v = SEALING
    hp, dp = S.private_from_bytes(bytes.fromhex(v["host_private"])), S.private_from_bytes(bytes.fromhex(v["device_private"]))
    assert S.public_share(hp).hex() == v["host_share"] and S.public_share(dp).hex() == v["device_share"]
    dh = S.shared_secret(hp, bytes.fromhex(v["device_share"]))
    assert dh.hex() == v["dh"] == S.shared_secret(dp, bytes.fromhex(v["host_share"])).hex()
    h2d, d2h = S.derive_keys(bytes.fromhex(v["token"]), bytes.fromhex(v["host_nonce"]), bytes.fromhex(v["device_nonce"]),
                             dh, bytes.fromhex(v["host_share"]), bytes.fromhex(v["device_share"]))
    assert (h2d.hex(), d2h.hex()) == (v["key_h2d"], v["key_d2h"]) and h2d != d2h
    # another token (same nonces and shares): other keys; so a man in the middle without it has none
    other = S.derive_keys(bytes(32), bytes.fromhex(v["host_nonce"]), bytes.fromhex(v["device_nonce"]), dh,
                          bytes.fromhex(v["host_share"]), bytes.fromhex(v["device_share"]))
    assert other[0] != h2d and other[1] != d2h
    assert S.nonce(7).hex() == v["nonce_of_counter_7"]


def _open_over_socket(key: str, counter: int, data: bytes) -> Message:
    """recv_message on a real socket pair with the record layer installed at `counter`."""
    a, b = socket.socketpair()
    try:
        S.install(b, S.Seal(bytes(32), bytes.fromhex(key), received=counter))
        a.sendall(data)
        a.shutdown(socket.SHUT_WR)
        return recv_message(b)
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("frame", SEALING["frames"], ids=lambda f: f["name"])
def test_sealed_frame_vectors(frame):
    key = SEALING["key_h2d"] if frame["direction"] == "h2d" else SEALING["key_d2h"]
    plain = (VEC / f"{frame['plain_vector']}.bin").read_bytes()
    sealed = bytes.fromhex(frame["sealed_hex"])
    want = decode_message(plain)
    got = _open_over_socket(key, frame["counter"], sealed)
    assert got.type == want.type and got.meta == want.meta
    assert set(got.tensors) == set(want.tensors)
    for k in want.tensors:
        assert np.asarray(got.tensors[k]).tobytes() == np.asarray(want.tensors[k]).tobytes()
    # the plain body does not appear in the sealed frame
    assert plain[16:-4] not in sealed and sealed[6] == 1 and len(sealed) == len(plain) + S.TAG_BYTES


@pytest.mark.parametrize("case", SEALING["tampered"], ids=lambda c: c["name"])
def test_tampered_frame_vectors(case):
    key = SEALING["key_h2d"] if case["direction"] == "h2d" else SEALING["key_d2h"]
    with pytest.raises(ProtocolError) as e:
        _open_over_socket(key, case["counter"], bytes.fromhex(case["sealed_hex"]))
    assert e.value.code == ErrorCode(case["error"]), case["why"]


# ---- an on-path proxy -----------------------------------------------------------------------

def _read_frame(sock: socket.socket) -> bytes | None:
    buf = b""
    while len(buf) < 16:
        chunk = sock.recv(16 - len(buf))
        if not chunk:
            return None
        buf += chunk
    need = struct.unpack_from("<I", buf, 8)[0] + 4
    rest = b""
    while len(rest) < need:
        chunk = sock.recv(need - len(rest))
        if not chunk:
            return None
        rest += chunk
    return buf + rest


def _fix_crcs(frame: bytearray) -> bytes:
    frame[12:16] = struct.pack("<I", zlib.crc32(bytes(frame[:12])))
    frame[-4:] = struct.pack("<I", zlib.crc32(bytes(frame[16:-4])))
    return bytes(frame)


class OnPathProxy:
    """Relays frames between a host (or an upstream stage) and a phone; in the host->phone direction
    of the first connection it applies `action` to frame number `at` (0 and 1 are AUTH_REQUEST and
    AUTH_RESPONSE: `at` >= 2 is sealed); later connections (a link reconnecting) pass untouched, or,
    with a list of actions, connection i gets the i-th and those after the list pass untouched.
    flip: one body byte flipped and both CRCs recomputed (what an attacker does); drop; replay
    (sent twice); reorder (frames at and at+1 swapped). It records what the phone sends back on each
    attacked connection (`from_phone`: the first's), and counts the connections."""

    def __init__(self, target: tuple[str, int], action: str | list[str] | None, at: "int | MsgType" = 2):
        self.actions = action if isinstance(action, list) else [action]
        self.target, self.at = target, at
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.from_phone_by_connection: list[list[bytes]] = [[] for _ in self.actions]
        self.from_phone = self.from_phone_by_connection[0]
        self.connections = 0
        self.threads: list[threading.Thread] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                host, _ = self.listener.accept()
                phone = socket.create_connection(self.target)
            except OSError:
                return
            i = self.connections
            self.connections += 1
            action = self.actions[i] if i < len(self.actions) else None
            for fn in (self._up, self._down):
                t = threading.Thread(target=fn, args=(host, phone, i, action), daemon=True)
                t.start()
                self.threads.append(t)

    def _up(self, host, phone, i, action):
        n, held = (0 if action else -1), None  # -1: nothing to do on this connection
        try:
            while (f := _read_frame(host)) is not None:
                out = [f]
                if isinstance(self.at, MsgType) and n >= 0 and f[5] == self.at:
                    self.at = n  # a message type: the first frame of that type is the one
                if n < 0:
                    pass
                elif n == self.at and action == "flip":
                    b = bytearray(f)
                    b[16 + 8] ^= 0x01
                    out = [_fix_crcs(b)]
                elif n == self.at and action == "drop":
                    out = []
                elif n == self.at and action == "replay":
                    out = [f, f]
                elif n == self.at and action == "reorder":
                    held, out = f, []
                elif n == self.at + 1 and held is not None:
                    out = [f, held]
                for x in out:
                    phone.sendall(x)
                n += n >= 0
        except OSError:
            pass
        finally:
            try:
                phone.shutdown(socket.SHUT_WR)
            except OSError:
                pass

    def _down(self, host, phone, i, action):
        try:
            while (f := _read_frame(phone)) is not None:
                if action:
                    self.from_phone_by_connection[i].append(f)
                host.sendall(f)
        except OSError:
            pass
        finally:
            try:
                host.shutdown(socket.SHUT_WR)
            except OSError:
                pass


@pytest.fixture(scope="module")
def phone(tmp_path_factory):
    from host.phones.emulate import start_phones

    (p,) = start_phones(1, tmp_path_factory.mktemp("seal"), prefix=f"seal{os.getpid()}-")
    yield p
    p.stop()


def _push_probe(sock: socket.socket, name: str, data: bytes) -> None:
    """FILE_BEGIN, FILE_CHUNK, FILE_END, sent as fast as they go (no waiting for an answer)."""
    sha = hashlib.sha256(data).hexdigest()
    send_message(sock, Message(MsgType.FILE_BEGIN, {"transfer_id": 1, "name": name, "kind": "weights",
                                                     "size": len(data), "sha256": sha}))
    send_message(sock, Message(MsgType.FILE_CHUNK, {"transfer_id": 1, "offset": 0},
                               {"data": np.frombuffer(data, dtype=np.uint8)}))
    send_message(sock, Message(MsgType.FILE_END, {"transfer_id": 1}))


def _shutdown(sock: socket.socket) -> None:
    """End a session and wait for the phone to close it: its slot is free again after that."""
    send_message(sock, Message(MsgType.SHUTDOWN, {}))
    try:
        while True:
            recv_message(sock)
    except (ConnectionClosed, OSError):
        pass


def _session_through(phone, action, name):
    proxy = OnPathProxy((phone.address, phone.port), action)
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
    got: list[Message] = []
    try:
        host_handshake(sock, phone.token, host_name="attacked")
        _push_probe(sock, name, os.urandom(3000))
        sock.settimeout(10)
        while True:
            try:
                got.append(recv_message(sock))
            except (ConnectionClosed, OSError):
                break
    finally:
        sock.close()
    return got, proxy


def test_untouched_session_through_the_proxy_applies_the_file(phone):
    """The control: the same proxy relaying faithfully, the file arrives (FILE_RESULT ok)."""
    proxy = OnPathProxy((phone.address, phone.port), None)
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
    try:
        host_handshake(sock, phone.token, host_name="control")
        _push_probe(sock, "probe_control.bin", os.urandom(3000))
        sock.settimeout(10)
        while (m := recv_message(sock)).type != MsgType.FILE_RESULT:
            pass
        assert m["ok"] is True
        _shutdown(sock)
    finally:
        sock.close()
    assert any(p.name == "probe_control.bin" for p in phone.workdir.rglob("*"))


@pytest.mark.parametrize("action", ["flip", "drop", "replay", "reorder"])
def test_on_path_tampering_ends_the_session_with_one_error_and_applies_nothing(phone, action):
    name = f"probe_{action}.bin"
    got, proxy = _session_through(phone, action, name)
    errors = [m for m in got if m.type == MsgType.ERROR]
    assert len(errors) == 1, [m.type.name for m in got]
    assert errors[0]["code"] == "UNAUTHENTICATED" and "failed to open" in errors[0]["message"]
    assert not any(m.type in (MsgType.FILE_RESULT, MsgType.ACK) for m in got), [m.type.name for m in got]
    # the ERROR is the last frame, and every frame the phone sent after its HELLO was sealed
    assert got[-1].type == MsgType.ERROR
    assert all(f[6] == 1 for f in proxy.from_phone[2:]) and proxy.from_phone[-1][5] == MsgType.ERROR
    time.sleep(0.3)
    assert not any(p.name.startswith(name) for p in phone.workdir.rglob("*"))
    # the phone recovers: the slot is free for the next (honest) host
    sock = socket.create_connection((phone.address, phone.port), timeout=10)
    try:
        assert host_handshake(sock, phone.token)["protocol_version"] == 2
        _shutdown(sock)
    finally:
        sock.close()


def test_phone_to_host_tampering_is_caught_by_the_host(phone):
    """The other direction: a HELLO altered in flight does not open on the host."""
    proxy_port = _flip_down_proxy((phone.address, phone.port))
    sock = socket.create_connection(("127.0.0.1", proxy_port), timeout=10)
    try:
        with pytest.raises(ProtocolError) as e:
            host_handshake(sock, phone.token)
        assert e.value.code == ErrorCode.UNAUTHENTICATED and "failed to open" in str(e.value)
    finally:
        sock.close()


def _flip_down_proxy(target) -> int:
    lst = socket.create_server(("127.0.0.1", 0))

    def run():
        host, _ = lst.accept()
        ph = socket.create_connection(target)
        threading.Thread(target=lambda: _pipe(host, ph), daemon=True).start()
        n = 0
        while (f := _read_frame(ph)) is not None:
            if n == 2:  # the HELLO, the first sealed frame from the phone
                b = bytearray(f)
                b[20] ^= 0x40
                f = _fix_crcs(b)
            host.sendall(f)
            n += 1
        host.close()

    threading.Thread(target=run, daemon=True).start()
    return lst.getsockname()[1]


def _pipe(a, b):
    try:
        while (d := a.recv(65536)):
            b.sendall(d)
    except OSError:
        pass


# ---- an old peer ------------------------------------------------------------------------------

def test_a_version_1_host_is_refused_with_one_line_naming_the_version(phone):
    sock = socket.create_connection((phone.address, phone.port), timeout=10)
    try:
        send_message(sock, Message(MsgType.AUTH_REQUEST, {"protocol_version": 1, "host_nonce": os.urandom(32).hex(),
                                                          "host_name": "old-host"}))
        reply = recv_message(sock, max_frame=PREAUTH_MAX_FRAME)  # plain: an old host can read it
        assert reply.type == MsgType.ERROR and reply["code"] == "BAD_VERSION"
        assert "protocol version 1" in reply["message"] and "2" in reply["message"] and "\n" not in reply["message"]
        with pytest.raises(ConnectionClosed):
            recv_message(sock)
    finally:
        sock.close()


def test_a_version_1_device_is_refused_by_the_host():
    """A device of version 1 answers a challenge without device_share: the host names the version."""
    from zl_mobile.protocol import HostHandshake

    hs = HostHandshake(bytes(32))
    hs.start()
    with pytest.raises(ProtocolError) as e:
        hs.on_challenge(Message(MsgType.AUTH_CHALLENGE, {"device_nonce": "ab" * 32, "device_name": "old"}))
    assert e.value.code == ErrorCode.BAD_VERSION and "protocol version 1" in str(e.value)


# ---- on the path between two stages ---------------------------------------------------------

ATTACKS = ["flip", "drop", "replay", "reorder"]


def test_frames_forged_between_two_stages_are_refused_and_the_run_ends_as_untouched(small_export, tmp_path, monkeypatch):
    """The attacker sits on the stage 0 -> stage 1 link (PROTOCOL.md 6.1: a stage link is sealed as
    a host session is, the upstream as host) and on each connection in turn flips a byte of, drops,
    replays, then reorders its second sealed frame: each time stage 1 answers with one ERROR and
    closes, acting on nothing in it; stage 0 reconnects (5.4.1) and replays from where stage 1 stands,
    so the run ends with the untouched run's LoRA, bit for bit."""
    from host.run.coordinator import Coordinator

    proxies: list[OnPathProxy] = []
    address = Coordinator._address

    def through_the_attacker(self, up, down):
        real = address(self, up, down)
        if up is None or up.k != 0:
            return real
        host, port = real.rsplit(":", 1)
        proxies.append(OnPathProxy((host, int(port)), ATTACKS, at=3))  # 2: the first sealed frame
        return f"127.0.0.1:{proxies[-1].port}"

    untouched, attacked = _untouched_then_attacked(
        small_export[0], tmp_path, 4, lambda: monkeypatch.setattr(Coordinator, "_address", through_the_attacker))
    [proxy] = proxies
    assert proxy.connections > len(ATTACKS)  # stage 0 came back after each attack ended a link
    for action, sent in zip(ATTACKS, proxy.from_phone_by_connection):
        # what stage 1 sent on the attacked connection: one ERROR, its last frame, sealed in its own direction
        assert sent[-1][5] == MsgType.ERROR and sent[-1][6] == 0x01, action
        assert [f[5] for f in sent].count(MsgType.ERROR) == 1, action
    _assert_ends_as_untouched(untouched, attacked)  # each window once: nothing of the forged frame


def test_a_stage_assign_forged_between_host_and_phone_is_refused_and_the_run_ends_as_untouched(
        small_export, tmp_path, monkeypatch):
    """The attacker sits on the host's session with stage 1 and flips a byte of its STAGE_ASSIGN (what
    would steer the phone): the phone answers one sealed ERROR and closes, having applied nothing; the
    host reconnects to the live phone as after a dropped session, assigns again, and the run ends with
    the untouched run's LoRA bit for bit, each window committed once."""
    from host.phones.emulated_phone import EmulatedPhone

    proxies: list[OnPathProxy] = []
    handle = EmulatedPhone.handle

    def through_the_attacker(self):
        h = handle(self)
        if self.name.endswith("-1"):
            host, port = h.endpoint.rsplit(":", 1)
            proxies.append(OnPathProxy((host, int(port)), "flip", at=MsgType.STAGE_ASSIGN))
            h.endpoint = f"127.0.0.1:{proxies[-1].port}"
        return h

    untouched, attacked = _untouched_then_attacked(
        small_export[0], tmp_path, 2, lambda: monkeypatch.setattr(EmulatedPhone, "handle", through_the_attacker))
    proxy = proxies[0]
    assert proxy.connections >= 2  # the host came back after the forged STAGE_ASSIGN ended the session
    sent = proxy.from_phone
    assert sent[-1][5] == MsgType.ERROR and sent[-1][6] == 0x01
    assert [f[5] for f in sent].count(MsgType.ERROR) == 1
    assert MsgType.ACK not in [f[5] for f in sent[2:]]  # nothing of the forged assignment was taken
    _assert_ends_as_untouched(untouched, attacked)


def _untouched_then_attacked(out, tmp_path, windows: int, place_attacker):
    """The small export's run twice, ((result, records) untouched, the same after `place_attacker()`)."""
    from host.run.settings import RunSettings
    from tests.conftest import run_pipeline, small_micro_batches

    mbs = small_micro_batches(out, n_examples=4)

    def settings():
        return RunSettings(windows=windows, window_size=2, lr=2e-2, inflight_depth=2)

    untouched = run_pipeline(out, tmp_path / "untouched", settings(), mbs)
    place_attacker()
    return untouched, run_pipeline(out, tmp_path / "attacked", settings(), mbs)


def _assert_ends_as_untouched(untouched, attacked) -> None:
    """The attacked run's LoRA is the untouched one's bit for bit, and each window was committed once."""
    import numpy as np

    (base, base_records), (result, records) = untouched, attacked
    assert all(np.array_equal(result["lora"][n], base["lora"][n]) for n in base["lora"])

    def commits(rs):
        return sorted((r["stage"], r["window"]) for r in rs if r["type"] == "CHECKPOINT_COMMITTED")

    assert commits(records) == commits(base_records)


# ---- a passive capture of a short run ---------------------------------------------------------

class LoopbackCapture:
    """Every TCP segment on `lo` (AF_PACKET, needs root), kept as (sport, dport, payload)."""

    def __init__(self):
        self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.ntohs(0x0003))
        # a deep buffer: under load the reader thread lags, and a dropped segment would hide a leak
        self.sock.setsockopt(socket.SOL_SOCKET, 33, 64 << 20)  # SO_RCVBUFFORCE (root)
        self.sock.bind(("lo", 0))
        self.sock.settimeout(0.2)
        self.segments: list[tuple[int, int, bytes]] = []
        self.stop = False
        self.t = threading.Thread(target=self._run, daemon=True)
        self.t.start()

    def _run(self):
        while not self.stop:
            try:
                pkt = self.sock.recv(1 << 17)
            except socket.timeout:
                continue
            if len(pkt) < 34 or pkt[12:14] != b"\x08\x00" or pkt[23] != 6:  # IPv4, TCP
                continue
            ihl = (pkt[14] & 0x0F) * 4
            tcp = 14 + ihl
            sport, dport = struct.unpack_from("!HH", pkt, tcp)
            doff = (pkt[tcp + 12] >> 4) * 4
            if len(pkt) > tcp + doff:
                self.segments.append((sport, dport, pkt[tcp + doff:]))

    def close(self) -> int:
        """Stop; the number of packets the kernel dropped for want of buffer (PACKET_STATISTICS)."""
        self.stop = True
        self.t.join()
        _, drops = struct.unpack("II", self.sock.getsockopt(263, 6, 8))  # SOL_PACKET, PACKET_STATISTICS
        self.sock.close()
        return drops


def _float_run(data: bytes, run: int = 24) -> bool:
    """A run of `run` aligned float32 values that look like activations (finite, 1e-4..1e3 in magnitude)."""
    for off in range(4):
        a = np.frombuffer(data[off:len(data) - (len(data) - off) % 4], dtype="<f4")
        m = np.isfinite(a) & (np.abs(a) > 1e-4) & (np.abs(a) < 1e3)
        best = cur = 0
        for v in m:
            cur = cur + 1 if v else 0
            best = max(best, cur)
            if best >= run:
                return True
    return False


def _captured_run(small_export, root: Path, unsealed: bool, monkeypatch):
    from host.run.coordinator import Coordinator
    from host.run.settings import RunSettings
    from tests.conftest import run_pipeline, small_micro_batches

    out, _, _, _ = small_export
    mbs = small_micro_batches(out, n_examples=2)
    settings = RunSettings(windows=1, window_size=1, lr=2e-2, inflight_depth=2)
    phones: list = []
    data_ports: set[int] = set()  # every stage data port the host hands out, as it hands it out
    address = Coordinator._address

    def recorded(self, up, down):
        real = address(self, up, down)
        data_ports.add(int(real.rsplit(":", 1)[1]))
        return real

    with monkeypatch.context() as m:
        m.setattr(Coordinator, "_address", recorded)
        if unsealed:  # the benchmark switch: phones inherit it, so both ends go unsealed
            m.setenv(S.BENCH_ENV, "1")
        cap = LoopbackCapture()
        try:
            run_pipeline(out, root, settings, mbs, phones_out=phones)
        finally:
            drops = cap.close()
    assert drops == 0, f"the capture lost {drops} packets"
    ports = data_ports | {p.port for p in phones}
    flows: dict[tuple[int, int], list[bytes]] = {}  # one byte stream per direction of each connection
    for s, d, p in cap.segments:
        if s in ports or d in ports:
            flows.setdefault((s, d), []).append(p)
    stream = b"\n--\n".join(b"".join(f) for f in flows.values())
    return mbs, stream, ports


def _program_needles(export_dir: Path) -> list[bytes]:
    """64 bytes from the middle of each chunk's program (.pte) and weights (.ptd)."""
    needles = []
    for f in sorted(export_dir.glob("chunk_[0-9].pt[ed]")):  # the ZeroLock programs this run pushes
        data = f.read_bytes()
        needles.append(data[len(data) // 2:len(data) // 2 + 64])
    return needles


def _token_needles(mbs) -> list[bytes]:
    """The first 8 token ids of every micro-batch's rows, as int64 and as int32."""
    needles = []
    for mb in mbs:
        for row in np.asarray(mb["input_ids"]):
            needles += [row[:8].astype("<i8").tobytes(), row[:8].astype("<i4").tobytes()]
    return needles


@pytest.mark.skipif(os.geteuid() != 0, reason="a loopback capture needs root (AF_PACKET)")
def test_passive_capture_of_a_run_shows_no_tokens_and_no_hidden_states(small_export, tmp_path, monkeypatch):
    mbs, sealed, ports = _captured_run(small_export, tmp_path / "sealed", unsealed=False, monkeypatch=monkeypatch)
    assert len(ports) == 6 and len(sealed) > 100_000  # 3 host ports and 3 stage data ports
    assert not any(n in sealed for n in _token_needles(mbs))
    assert not _float_run(sealed)
    programs = _program_needles(small_export[0])  # the host pushes every chunk's program and weights
    assert not any(n in sealed for n in programs)
    # the control, with the benchmark switch: the same capture does show them, so the test can see
    mbs, plain, _ = _captured_run(small_export, tmp_path / "plain", unsealed=True, monkeypatch=monkeypatch)
    assert any(n in plain for n in _token_needles(mbs))
    assert all(n in plain for n in programs)
    assert _float_run(plain)

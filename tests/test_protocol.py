"""Wire protocol (docs/PROTOCOL.md): vectors, round trips, handshake, socket helpers."""
from __future__ import annotations

import importlib.util
import json
import socket
import struct
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from zl_mobile.protocol import (
    DEFAULT_MAX_FRAME,
    HEADER_SIZE,
    PREAUTH_MAX_FRAME,
    ConnectionClosed,
    DeviceAuth,
    ErrorCode,
    FrameDecoder,
    HostHandshake,
    Message,
    MsgType,
    ProtocolError,
    RateLimiter,
    bf16_from_float32,
    bf16_to_float32,
    decode_message,
    device_handshake,
    device_proof,
    encode_message,
    error_reply,
    from_torch,
    host_handshake,
    host_proof,
    new_token,
    recv_message,
    send_message,
    to_torch,
)
from zl_mobile.protocol.frames import encode_header

VEC = Path(__file__).parent / "vectors"
_spec = importlib.util.spec_from_file_location("zl_vectors_generate", VEC / "generate.py")
gen = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gen)

VECTORS = sorted(p.stem for p in VEC.glob("*.bin"))
VALID = [n for n in VECTORS if json.loads((VEC / f"{n}.json").read_text())["valid"]]
INVALID = [n for n in VECTORS if n not in VALID]


def load(name):
    return (VEC / f"{name}.bin").read_bytes(), json.loads((VEC / f"{name}.json").read_text())


def strict_equal(a, b) -> bool:
    """JSON equality that also distinguishes int / float / bool."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(strict_equal(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(strict_equal(x, y) for x, y in zip(a, b))
    return a == b


# ---- vectors ---------------------------------------------------------------------------------

def test_vectors_are_reproducible():
    assert gen.stale(gen.build()) == [], "run: python tests/vectors/generate.py"
    assert gen.build() == gen.build()


def test_every_message_type_has_a_valid_vector():
    types = {json.loads((VEC / f"{n}.json").read_text())["type"] for n in VALID}
    assert types == {t.name for t in MsgType}


def test_there_are_invalid_vectors_for_every_decode_error():
    codes = {json.loads((VEC / f"{n}.json").read_text())["error"] for n in INVALID}
    assert codes == {"TRUNCATED", "OVERSIZED", "BAD_MAGIC", "BAD_VERSION", "BAD_CHECKSUM", "UNKNOWN_TYPE",
                     "MALFORMED"}


@pytest.mark.parametrize("name", VALID)
def test_valid_vector_decodes_to_its_json(name):
    data, want = load(name)
    msg = decode_message(data, max_frame=want["max_frame"])
    assert msg.type.name == want["type"] and int(msg.type) == want["type_code"]
    assert strict_equal(msg.meta, want["meta"])
    assert set(msg.tensors) == set(want["tensors"])
    for k, t in want["tensors"].items():
        assert strict_equal(gen.tensor_json(msg.tensors[k]), t), k
    assert encode_message(msg) == data  # Python re-encodes canonically, byte for byte
    # the same bytes through the stream decoder, one byte at a time
    dec = FrameDecoder(want["max_frame"])
    out = [m for i in range(len(data)) for m in dec.feed(data[i:i + 1])]
    assert out == [msg]
    dec.eof()


@pytest.mark.parametrize("name", INVALID)
def test_invalid_vector_raises_its_code(name):
    data, want = load(name)
    with pytest.raises(ProtocolError) as ei:
        decode_message(data, max_frame=want["max_frame"])
    assert ei.value.code.value == want["error"]
    assert "\n" not in str(ei.value) and len(ei.value.message) > 20


@pytest.mark.parametrize("name", [n for n in INVALID if n != "trailing_bytes"])
def test_invalid_vector_over_a_socket_raises_its_code(name):
    data, want = load(name)
    a, b = socket.socketpair()
    with a, b:
        a.sendall(data)
        a.shutdown(socket.SHUT_WR)
        if not data:
            with pytest.raises(ConnectionClosed):
                recv_message(b, max_frame=want["max_frame"])
            return
        with pytest.raises(ProtocolError) as ei:
            recv_message(b, max_frame=want["max_frame"])
        assert ei.value.code.value == want["error"]


def test_handshake_vector():
    hs = json.loads((VEC / "handshake.json").read_text())
    tok, nh, nd = (bytes.fromhex(hs[k]) for k in ("token", "host_nonce", "device_nonce"))
    assert bytes.fromhex(hs["host_input_hex"]) == b"ZLWP1 host\x00" + nh + nd
    assert len(bytes.fromhex(hs["host_input_hex"])) == 75
    assert len(bytes.fromhex(hs["device_input_hex"])) == 77
    assert host_proof(tok, nh, nd).hex() == hs["host_proof"]
    assert device_proof(tok, nh, nd).hex() == hs["device_proof"]
    assert hs["host_proof"] != hs["host_proof_with_wrong_token"]
    _, resp = load("auth_response")
    assert resp["meta"]["host_proof"] == hs["host_proof"]


# ---- encode/decode ---------------------------------------------------------------------------

@pytest.mark.parametrize("name,desc,msg", gen.valid_messages(), ids=lambda x: x if isinstance(x, str) else "")
def test_round_trip(name, desc, msg):
    assert decode_message(encode_message(msg)) == msg


def test_header_layout():
    frame = encode_message(Message(MsgType.HEARTBEAT, {"seq": 1}))
    assert frame[:4] == b"ZLWP" and frame[4] == 1 and frame[5] == 0x06 and frame[6:8] == b"\0\0"
    (body_len,) = struct.unpack_from("<I", frame, 8)
    assert len(frame) == HEADER_SIZE + body_len + 4


def test_tensor_data_is_8_aligned_and_zero_copy():
    msg = Message(MsgType.STATE_PUT, {"request_id": 1, "kind": "lora"},
                  {"a": np.arange(3, dtype=np.uint8), "b": np.arange(5, dtype=np.int64)})
    buf = bytearray(encode_message(msg))
    base = np.frombuffer(buf, np.uint8).ctypes.data
    got = decode_message(buf)
    for arr in got.tensors.values():
        assert (arr.ctypes.data - base) % 8 == 0
    got.tensors["b"][0] = 99  # views the buffer (bytearray: writable)
    assert np.frombuffer(buf, np.uint8).ctypes.data == base and got.tensors["b"][0] == 99


def test_torch_and_bfloat16():
    t = torch.randn(2, 3, dtype=torch.float32)
    tb = t.to(torch.bfloat16)
    msg = Message(MsgType.HIDDEN_STATE, {"micro_batch": 0, "window": 0},
                  {"h": tb, "labels": torch.tensor([[1, -100]]), "mask": torch.tensor([True, False]),
                   "f16": t.half()})
    got = decode_message(encode_message(msg))
    assert torch.equal(to_torch(got.tensors["h"]), tb)
    assert to_torch(got.tensors["h"]).dtype == torch.bfloat16
    assert torch.equal(to_torch(got.tensors["labels"]), torch.tensor([[1, -100]]))
    assert torch.equal(to_torch(got.tensors["mask"]), torch.tensor([True, False]))
    assert torch.equal(to_torch(got.tensors["f16"]), t.half())
    # numpy rounding matches torch's
    assert np.array_equal(bf16_from_float32(t.numpy()), from_torch(tb))
    assert np.array_equal(bf16_to_float32(from_torch(tb)), tb.float().numpy())


def test_non_contiguous_and_big_endian_inputs():
    a = np.arange(12, dtype=">f4").reshape(3, 4).T
    got = decode_message(encode_message(Message(MsgType.STATE_PUT, {"request_id": 0, "kind": "lora"}, {"a": a})))
    assert np.array_equal(got.tensors["a"], a) and got.tensors["a"].dtype == np.dtype("<f4")


@pytest.mark.parametrize("msg,fragment", [
    (Message(MsgType.STATE_PUT, {"request_id": 0, "kind": "lora"}, {"x": np.zeros(2)}), "float64"),
    (Message(MsgType.HEARTBEAT, {"seq": -1}), "seq"),
    (Message(MsgType.HEARTBEAT, {"seq": 1, "x": float("nan")}), "JSON"),
    (Message(MsgType.HIDDEN_STATE, {"micro_batch": 0, "window": 0}), "'h'"),
    (Message(MsgType.FILE_BEGIN, {"transfer_id": 0, "name": "a/b", "kind": "program", "size": 0,
                                  "sha256": "0" * 64}), "plain file name"),
    (Message(MsgType.STATE_GET, {"request_id": 0, "kind": "weights"}), "lora"),
    (Message(MsgType.CREDIT, {"credits": 0}), "credits"),
    (Message(MsgType.REPLAY_REQUEST, {"from_micro_batch": 5, "to_micro_batch": 4}), "from_micro_batch"),
])
def test_encoder_refuses_invalid_messages(msg, fragment):
    with pytest.raises(ProtocolError) as ei:
        encode_message(msg)
    assert ei.value.code == ErrorCode.MALFORMED and fragment in ei.value.message


def test_error_message_round_trip():
    err = ProtocolError(ErrorCode.BUSY, "device already\nserves a host")
    assert "\n" not in err.message
    got = decode_message(encode_message(error_reply(err, request_id=3)))
    assert got.meta == {"code": "BUSY", "message": "device already serves a host", "request_id": 3}
    assert ErrorCode.parse("NO_SUCH_CODE") == ErrorCode.INTERNAL


def test_oversized_is_rejected_from_the_header_alone():
    dec = FrameDecoder(max_frame=1024)
    with pytest.raises(ProtocolError) as ei:
        dec.feed(encode_header(MsgType.HIDDEN_STATE, 3 << 30))
    assert ei.value.code == ErrorCode.OVERSIZED and "3.0 GiB" in ei.value.message


# ---- handshake -------------------------------------------------------------------------------

TOKEN = new_token()
HELLO = Message(MsgType.HELLO, {"name": "emu-0", "protocol_version": 1, "runtime_version": "executorch 1.5.1",
                                "memory_bytes": 1 << 30, "capabilities": ["executorch"]})


def run_device(sock, auth, result):
    try:
        result["hs"] = device_handshake(sock, auth, HELLO)
    except Exception as e:  # noqa: BLE001 - reported to the test thread
        result["err"] = e


def connect(auth, token=TOKEN):
    """Run both handshake ends over a socketpair; returns (host result or exception, device result)."""
    a, b = socket.socketpair()
    a.settimeout(5)
    b.settimeout(5)
    res: dict = {}
    th = threading.Thread(target=run_device, args=(b, auth, res))
    th.start()
    try:
        host = host_handshake(a, token, "test-host")
    except ProtocolError as e:
        host = e
    th.join(5)
    return host, res, (a, b)


def test_handshake_success_and_one_session_at_a_time():
    auth = DeviceAuth(TOKEN, "emu-0")
    hello, dev, socks = connect(auth)
    assert hello == HELLO and dev["hs"].authenticated and dev["hs"].host_name == "test-host" and auth.busy
    # a second host is refused while the first session holds the slot
    err, dev2, socks2 = connect(auth)
    assert isinstance(err, ProtocolError) and err.code == ErrorCode.BUSY
    assert dev2["err"].code == ErrorCode.BUSY
    # session over -> a new host gets in
    dev["hs"].close()
    assert not auth.busy
    hello3, dev3, socks3 = connect(auth)
    assert hello3 == HELLO
    dev3["hs"].close()
    for s in (*socks, *socks2, *socks3):
        s.close()


def test_wrong_token_refused_both_ways():
    auth = DeviceAuth(TOKEN, "emu-0")
    err, dev, socks = connect(auth, token=new_token())
    assert err.code == ErrorCode.UNAUTHENTICATED and dev["err"].code == ErrorCode.UNAUTHENTICATED
    assert not auth.busy
    for s in socks:
        s.close()
    # an impostor device (other token) is detected by the host
    host = HostHandshake(TOKEN)
    impostor = DeviceAuth(new_token(), "evil").handshake()
    challenge = impostor.handle(host.start())
    with pytest.raises(ProtocolError) as ei:
        impostor.handle(host.on_challenge(challenge))
    assert ei.value.code == ErrorCode.UNAUTHENTICATED  # device side refuses the host proof too
    host2 = HostHandshake(TOKEN)
    host2.on_challenge(DeviceAuth(TOKEN, "d").handshake().handle(host2.start()))
    with pytest.raises(ProtocolError) as ei:
        host2.on_ok(Message(MsgType.AUTH_OK, {"device_proof": "ab" * 32}))
    assert ei.value.code == ErrorCode.UNAUTHENTICATED


def test_replayed_nonce_and_response_refused():
    auth = DeviceAuth(TOKEN, "emu-0")
    host = HostHandshake(TOKEN)
    request = host.start()
    hs1 = auth.handshake()
    response = host.on_challenge(hs1.handle(request))
    hs1.handle(response)
    hs1.close()
    # replay the recorded AUTH_REQUEST: the host nonce was already seen
    with pytest.raises(ProtocolError) as ei:
        auth.handshake().handle(request)
    assert ei.value.code == ErrorCode.UNAUTHENTICATED and "replayed" in ei.value.message
    # replay the recorded AUTH_RESPONSE after a fresh request: wrong for the new device nonce
    hs3 = auth.handshake()
    hs3.handle(HostHandshake(TOKEN).start())
    with pytest.raises(ProtocolError) as ei:
        hs3.handle(response)
    assert ei.value.code == ErrorCode.UNAUTHENTICATED and not auth.busy
    # and a handshake object cannot be driven twice
    with pytest.raises(ProtocolError):
        hs3.handle(response)


def test_device_refuses_other_messages_before_auth_and_bad_versions():
    auth = DeviceAuth(TOKEN, "emu-0")
    with pytest.raises(ProtocolError) as ei:
        auth.handshake().handle(Message(MsgType.STAGE_ASSIGN, {
            "request_id": 1, "stage": 0, "num_stages": 1, "upstream": None, "downstream": None,
            "program_sha256": "0" * 64}))
    assert ei.value.code == ErrorCode.UNAUTHENTICATED
    for old_or_new in (1, 3):  # 1: an unsealed host (protocol version 1) is refused, naming both versions
        with pytest.raises(ProtocolError) as ei:
            auth.handshake().handle(Message(MsgType.AUTH_REQUEST, {"protocol_version": old_or_new,
                                                                   "host_nonce": f"{old_or_new}" * 64,
                                                                   "host_name": "h"}))
        assert ei.value.code == ErrorCode.BAD_VERSION
        assert f"version {old_or_new}" in str(ei.value) and "speaks 2" in str(ei.value) and "\n" not in str(ei.value)
    hs = auth.handshake()
    hs.handle(HostHandshake(TOKEN).start())
    with pytest.raises(ProtocolError) as ei:
        hs.handle(Message(MsgType.HEARTBEAT, {"seq": 1}))
    assert ei.value.code == ErrorCode.UNAUTHENTICATED


def test_preauth_frame_limit_applies_over_sockets():
    auth = DeviceAuth(TOKEN, "emu-0")
    a, b = socket.socketpair()
    with a, b:
        res: dict = {}
        th = threading.Thread(target=run_device, args=(b, auth, res))
        th.start()
        a.sendall(encode_header(MsgType.AUTH_REQUEST, PREAUTH_MAX_FRAME))
        th.join(5)
        assert res["err"].code == ErrorCode.OVERSIZED
        reply = recv_message(a)
        assert reply.type == MsgType.ERROR and reply["code"] == "OVERSIZED"


# ---- sockets ---------------------------------------------------------------------------------

def test_socket_round_trip_big_tensor():
    h = np.random.default_rng(0).standard_normal((4, 128, 2048)).astype(np.float32)  # 4 MiB
    msg = Message(MsgType.HIDDEN_STATE, {"micro_batch": 1, "window": 0}, {"h": h})
    a, b = socket.socketpair()
    with a, b:
        th = threading.Thread(target=lambda: [send_message(a, msg), send_message(a, msg)])
        th.start()
        got = [recv_message(b), recv_message(b)]
        th.join()
        assert got == [msg, msg] and got[0].tensors["h"].flags.writeable
        a.close()
        with pytest.raises(ConnectionClosed):
            recv_message(b)


def test_socket_eof_mid_frame_is_truncated():
    frame = encode_message(Message(MsgType.HEARTBEAT, {"seq": 1}))
    for cut in (1, HEADER_SIZE - 1, HEADER_SIZE, len(frame) - 1):
        a, b = socket.socketpair()
        with a, b:
            a.sendall(frame[:cut])
            a.shutdown(socket.SHUT_WR)
            with pytest.raises(ProtocolError) as ei:
                recv_message(b)
            assert ei.value.code == ErrorCode.TRUNCATED


def test_socket_oversized_does_not_read_the_body():
    a, b = socket.socketpair()
    with a, b:
        good = encode_message(Message(MsgType.HEARTBEAT, {"seq": 7}))
        a.sendall(encode_header(MsgType.HIDDEN_STATE, 3 << 30) + good)
        with pytest.raises(ProtocolError) as ei:
            recv_message(b, max_frame=DEFAULT_MAX_FRAME)
        assert ei.value.code == ErrorCode.OVERSIZED
        assert recv_message(b).meta == {"seq": 7}  # exactly 16 bytes were consumed


def test_socket_timeouts():
    a, b = socket.socketpair()
    with a, b:
        b.settimeout(0.05)
        with pytest.raises(socket.timeout):
            recv_message(b)  # nothing sent: ordinary timeout, stream intact
        a.sendall(encode_message(Message(MsgType.HEARTBEAT, {"seq": 1}))[:20])
        with pytest.raises(ProtocolError) as ei:
            recv_message(b)
        assert ei.value.code == ErrorCode.TIMEOUT


def test_rate_limiter_token_bucket_with_fake_clock():
    now = [0.0]
    slept = []

    def sleep(s):
        slept.append(s)
        now[0] += s

    rl = RateLimiter(1000, burst=100, clock=lambda: now[0], sleep=sleep)
    rl.consume(100)  # the burst is free
    assert slept == []
    rl.consume(500)  # 500 bytes of debt at 1000 B/s
    assert slept == [pytest.approx(0.5)]
    now[0] += 1.0  # idle refills at most `burst`
    rl.consume(100)
    assert len(slept) == 1
    with pytest.raises(ValueError):
        RateLimiter(0)


def test_send_message_with_rate_limiter_shapes_real_sockets():
    msg = Message(MsgType.FILE_CHUNK, {"transfer_id": 0, "offset": 0},
                  {"data": np.zeros(300_000, dtype=np.uint8)})
    calls = []

    class Counting(RateLimiter):
        def consume(self, n):
            calls.append(n)
            super().consume(n)

    a, b = socket.socketpair()
    with a, b:
        got = {}
        th = threading.Thread(target=lambda: got.setdefault("m", recv_message(b)))
        th.start()
        t0 = time.monotonic()
        n = send_message(a, msg, limiter=Counting(2_000_000, burst=65536))
        dt = time.monotonic() - t0
        th.join()
    assert got["m"] == msg and sum(calls) == n and max(calls) <= 65536
    assert dt >= (n - 65536) / 2_000_000 * 0.9

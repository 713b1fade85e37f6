"""Hypothesis fuzzing of the decoder. Properties: any input either decodes or raises
ProtocolError (nothing else); memory use is bounded by max_frame, whatever the header or the
tensor records claim; encode/decode round-trips random messages; stream chunking is irrelevant.

Seeds: every test vector, plus tests/fuzz_corpus/<EXPECT>__<name>.bin (tricky frames, made by
tests/fuzz_corpus/make_corpus.py; EXPECT is `valid` or the error code)."""
from __future__ import annotations

import importlib.util
import struct
import tracemalloc
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from zl_mobile.protocol import (
    DEFAULT_MAX_FRAME,
    HEADER_SIZE,
    ConnectionClosed,
    FrameDecoder,
    Message,
    MsgType,
    ProtocolError,
    decode_message,
    encode_message,
    recv_message,
)
from zl_mobile.protocol.frames import encode_header

TESTS = Path(__file__).parent
CORPUS_DIR = TESTS / "fuzz_corpus"
_spec = importlib.util.spec_from_file_location("zl_fuzz_make_corpus", CORPUS_DIR / "make_corpus.py")
make_corpus = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_corpus)

CORPUS = sorted(CORPUS_DIR.glob("*.bin"))
SEEDS = [p.read_bytes() for p in sorted((TESTS / "vectors").glob("*.bin"))] + [p.read_bytes() for p in CORPUS]
VALID_SEEDS = []
for _s in SEEDS:
    try:
        decode_message(_s)
        VALID_SEEDS.append(_s)
    except ProtocolError:
        pass

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def decode_or_protocol_error(data: bytes, max_frame: int = DEFAULT_MAX_FRAME):
    try:
        return decode_message(data, max_frame=max_frame)
    except ProtocolError as e:
        assert e.code is not None and "\n" not in str(e)
        return e


def refit(frame: bytes) -> bytes:
    """Repair header and body CRCs of a (mutated) frame, so mutations reach the body parser."""
    if len(frame) < HEADER_SIZE:
        return frame
    b = bytearray(frame)
    b[12:16] = struct.pack("<I", zlib.crc32(bytes(b[:12])))
    (body_len,) = struct.unpack_from("<I", b, 8)
    if len(b) >= HEADER_SIZE + body_len + 4:
        end = HEADER_SIZE + body_len
        b[end:end + 4] = struct.pack("<I", zlib.crc32(bytes(b[HEADER_SIZE:end])))
    return bytes(b)


@st.composite
def mutated(draw, seeds=SEEDS + 2 * VALID_SEEDS):
    data = bytearray(draw(st.sampled_from(seeds)))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate", "u32"]))
        pos = draw(st.integers(0, max(len(data) - 1, 0)))
        if op == "flip" and data:
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and data:
            data[pos] = draw(st.sampled_from([0, 1, 2, 7, 8, 0x7F, 0x80, 0xFF]))
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete" and data:
            del data[pos:pos + draw(st.integers(1, 8))]
        elif op == "truncate":
            del data[pos:]
        elif op == "u32" and len(data) >= pos + 4:  # lengths and counts are the interesting fields
            data[pos:pos + 4] = struct.pack("<I", draw(st.sampled_from([0, 1, 0xFFFF, 0x7FFFFFFF, 0xFFFFFFFF,
                                                                          len(data), len(data) + 1])))
    if draw(st.booleans()):
        data = bytearray(refit(bytes(data)))
    return bytes(data)


# ---- corpus ----------------------------------------------------------------------------------

def test_corpus_is_up_to_date():
    files = make_corpus.build()
    assert {p.name for p in CORPUS} == set(files)
    assert all((CORPUS_DIR / n).read_bytes() == c for n, c in files.items())


@pytest.mark.parametrize("path", CORPUS, ids=lambda p: p.stem)
def test_corpus_frame_outcome(path):
    want = path.stem.split("__")[0]
    got = decode_or_protocol_error(path.read_bytes())
    assert (got.code.value if isinstance(got, ProtocolError) else "valid") == want


# ---- properties ------------------------------------------------------------------------------

@FUZZ
@given(st.binary(max_size=600))
@example(b"")
@example(b"ZLWP")
@example(encode_header(MsgType.HEARTBEAT, 0))
@example(encode_header(0xFF, 4) + b"\0" * 8)
def test_random_bytes_only_raise_protocol_error(data):
    decode_or_protocol_error(data)


@FUZZ
@given(st.sampled_from(list(MsgType)), st.binary(max_size=400))
def test_random_bodies_behind_a_valid_header(mtype, body):
    frame = encode_header(mtype, len(body)) + body + struct.pack("<I", zlib.crc32(body))
    decode_or_protocol_error(frame)


@FUZZ
@given(mutated())
def test_mutated_frames_only_raise_protocol_error(data):
    decode_or_protocol_error(data)


class BytesSocket:
    """Just enough of a blocking socket for recv_message."""

    def __init__(self, data: bytes):
        self._data = memoryview(data)
        self._pos = 0

    def recv_into(self, buf) -> int:
        n = min(len(buf), len(self._data) - self._pos, 4096)
        buf[:n] = self._data[self._pos:self._pos + n]
        self._pos += n
        return n


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated(), st.sampled_from([64, 1024, 64 << 10]))
@example(encode_header(MsgType.HIDDEN_STATE, 0xFFFFFFFF - 20), 64 << 10)
@example((CORPUS_DIR / "MALFORMED__nbytes_4GiB_claim.bin").read_bytes(), 64 << 10)
def test_memory_bounded_by_max_frame(data, max_frame):
    """Whatever a header or tensor record claims, decoding allocates O(max_frame), never more."""
    tracemalloc.start()
    try:
        sock = BytesSocket(data)
        try:
            while True:
                recv_message(sock, max_frame=max_frame)
        except (ProtocolError, ConnectionClosed):
            pass
        try:
            decode_message(data, max_frame=max_frame)
        except ProtocolError:
            pass
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 * max_frame + (256 << 10), f"peak {peak} bytes for max_frame {max_frame}"


# ---- random valid messages ---------------------------------------------------------------------

json_scalars = (st.none() | st.booleans() | st.integers(-(2 ** 63), 2 ** 63 - 1)
                | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20))
json_values = st.recursive(json_scalars, lambda kids: st.lists(kids, max_size=4)
                           | st.dictionaries(st.text(max_size=8), kids, max_size=4), max_leaves=20)
DTYPES = [np.float32, np.float16, np.int64, np.int32, np.uint8, np.bool_]


@st.composite
def arrays(draw):
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=4)))
    raw = draw(st.binary(min_size=int(np.prod(shape)) * np.dtype(dtype).itemsize,
                         max_size=int(np.prod(shape)) * np.dtype(dtype).itemsize))
    if dtype is np.bool_:
        return np.frombuffer(bytes(b & 1 for b in raw), np.uint8).view(np.bool_).reshape(shape)
    return np.frombuffer(raw, dtype).reshape(shape)


@FUZZ
@given(st.dictionaries(st.text(min_size=1, max_size=12), json_values, max_size=6),
       st.dictionaries(st.text(min_size=1, max_size=12).filter(lambda s: len(s.encode()) <= 1024), arrays(),
                       max_size=4),
       st.integers(0, 2 ** 63 - 1))
def test_random_messages_round_trip(extra, tensors, rid):
    msg = Message(MsgType.STATE_PUT, {**extra, "request_id": rid, "kind": "optimizer"}, tensors)
    try:
        frame = encode_message(msg)
    except ProtocolError:  # e.g. a lone surrogate drawn by st.text(): refused symmetrically
        return
    assert decode_message(frame) == msg
    assert decode_message(frame).meta == msg.meta


@FUZZ
@given(st.lists(st.sampled_from(VALID_SEEDS), min_size=1, max_size=4), st.data())
def test_stream_chunking_is_irrelevant(frames, data):
    stream = b"".join(frames)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=8)))
    dec = FrameDecoder()
    got, prev = [], 0
    for c in cuts + [len(stream)]:
        got += dec.feed(stream[prev:c])
        prev = c
    dec.eof()
    assert got == [decode_message(f) for f in frames]

"""Frame header, body layout and metadata JSON (PROTOCOL.md sections 2-3).

encode_parts(msg) -> buffers to write (tensor data not copied); encode_message(msg) -> bytes;
parse_header(16 bytes) -> FrameHeader (all header checks, incl. the size limit, before any body
is read); decode_body(...) / decode_message(buf) -> Message; FrameDecoder for byte streams.
"""
from __future__ import annotations

import json
import struct
import zlib
from typing import Any, NamedTuple

from .errors import ErrorCode, ProtocolError, human_bytes
from .messages import INT64_MAX, INT64_MIN, Message, MsgType, validate
from .quoting import quote
from .tensors import as_wire_array, decode_record, encode_record

MAGIC = b"ZLWP"
# the session protocol version (AUTH_REQUEST, HELLO, mDNS TXT): 2 = sealed sessions (section 6.1).
# The frame header's version byte stays FRAME_VERSION: the frame layout itself did not change; a
# sealed frame says so in its flags (SEALED_FLAG), which a version-1 peer rejects as MALFORMED.
PROTOCOL_VERSION = 2
FRAME_VERSION = 1
SEALED_FLAG = 0x0001
HEADER_SIZE = 16
TRAILER_SIZE = 4
OVERHEAD = HEADER_SIZE + TRAILER_SIZE
DEFAULT_MAX_FRAME = 256 << 20
PREAUTH_MAX_FRAME = 64 << 10
MAX_META_BYTES = 1 << 20
MAX_JSON_DEPTH = 32
MAX_TENSORS = 0xFFFF

_HEAD = struct.Struct("<4sBBHI")  # magic, version, type, flags, body_len (then header_crc u32)


class FrameHeader(NamedTuple):
    type: MsgType
    body_len: int

    @property
    def frame_size(self) -> int:
        return self.body_len + OVERHEAD


# ---- header ----------------------------------------------------------------------------------

def encode_header(msg_type: int, body_len: int, version: int = FRAME_VERSION, flags: int = 0) -> bytes:
    head = _HEAD.pack(MAGIC, version, msg_type, flags, body_len)
    return head + struct.pack("<I", zlib.crc32(head))


def parse_header(data: bytes | bytearray | memoryview, max_frame: int = DEFAULT_MAX_FRAME,
                 sealed: bool = False) -> FrameHeader:
    """Validate the first 16 bytes of a frame in the spec's order (2.2, steps 1-7). `sealed`: the
    connection's record layer is on (6.1), so flags MUST be SEALED_FLAG, else 0."""
    if len(data) < HEADER_SIZE:
        raise ProtocolError(ErrorCode.TRUNCATED,
                            f"stream ended after {len(data)} of the {HEADER_SIZE} header bytes; "
                            "the peer closed or crashed mid-frame")
    magic, version, mtype, flags, body_len = _HEAD.unpack_from(data, 0)
    if magic != MAGIC:
        raise ProtocolError(ErrorCode.BAD_MAGIC,
                            f"frame starts with {bytes(magic)!r}, not {MAGIC!r}; the peer is not a ZeroLock "
                            "endpoint or the stream lost sync (reconnect)")
    if version != FRAME_VERSION:
        raise ProtocolError(ErrorCode.BAD_VERSION,
                            f"protocol version {version} not supported (this side speaks {FRAME_VERSION} in frame headers); "
                            "upgrade the older of host and device so both speak the same version")
    (crc,) = struct.unpack_from("<I", data, 12)
    if zlib.crc32(bytes(data[:12])) != crc:
        raise ProtocolError(ErrorCode.BAD_CHECKSUM,
                            "frame header CRC32 mismatch; the link corrupted data or the stream lost sync (reconnect)")
    if flags != (SEALED_FLAG if sealed else 0):
        raise ProtocolError(ErrorCode.MALFORMED,
                            f"frame flags 0x{flags:04x} on a{' sealed' if sealed else 'n unsealed'} connection; "
                            f"expected 0x{SEALED_FLAG if sealed else 0:04x} (both sides must speak protocol "
                            f"version {PROTOCOL_VERSION})")
    size = body_len + OVERHEAD
    if size > max_frame:
        raise ProtocolError(ErrorCode.OVERSIZED,
                            f"frame of {human_bytes(size)} exceeds the {human_bytes(max_frame)} limit; "
                            "send smaller chunks or raise max_frame on the receiver")
    try:
        t = MsgType(mtype)
    except ValueError:
        raise ProtocolError(ErrorCode.UNKNOWN_TYPE,
                            f"message type 0x{mtype:02x} is not defined in protocol version {PROTOCOL_VERSION}; "
                            "the sender must only send types the receiver announced") from None
    return FrameHeader(t, body_len)


# ---- metadata JSON ---------------------------------------------------------------------------

def _no_dupes(pairs):
    obj = {}
    for k, v in pairs:
        if k in obj:
            raise ValueError(f"duplicate key {quote(k)}")
        obj[k] = v
    return obj


def _no_constant(name):
    raise ValueError(f"{name} is not JSON")


def _check_json_values(root: Any) -> None:
    """Depth <= 32, integers in int64, floats finite, strings valid Unicode (no lone surrogates)."""
    stack = [(root, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise ValueError(f"nesting deeper than {MAX_JSON_DEPTH}")
            items = v.items() if isinstance(v, dict) else ((None, x) for x in v)
            for k, x in items:
                if k is not None:
                    k.encode("utf-8")
                stack.append((x, depth + 1))
        elif type(v) is str:
            v.encode("utf-8")
        elif type(v) is int:
            if not INT64_MIN <= v <= INT64_MAX:
                raise ValueError(f"integer {v} does not fit in int64")
        elif type(v) is float:
            if v != v or v in (float("inf"), float("-inf")):
                raise ValueError("number out of double range")


def parse_meta(raw: bytes | memoryview) -> dict:
    try:
        text = bytes(raw).decode("utf-8")
        obj = json.loads(text, object_pairs_hook=_no_dupes, parse_constant=_no_constant)
        if type(obj) is not dict:
            raise ValueError(f"top level is {type(obj).__name__}, not an object")
        _check_json_values(obj)
    except (ValueError, RecursionError, UnicodeError) as e:  # JSONDecodeError is a ValueError
        raise ProtocolError(ErrorCode.MALFORMED,
                            f"metadata is not a valid JSON object ({str(e).splitlines()[0][:120]}); "
                            "fix the sender's JSON encoder") from None
    return obj


def dump_meta(meta: dict) -> bytes:
    try:
        _check_json_values(meta)
        return json.dumps(meta, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                          allow_nan=False).encode("utf-8")
    except (ValueError, TypeError, RecursionError, UnicodeError) as e:
        raise ProtocolError(ErrorCode.MALFORMED, f"metadata cannot be encoded as JSON: {e}") from None


# ---- body ------------------------------------------------------------------------------------

def encode_parts(msg: Message) -> list[bytes | memoryview]:
    """The frame as a list of buffers (header, body pieces, trailer); tensor data is not copied."""
    arrays = {}
    for name, value in msg.tensors.items():
        as_wire_array(value)  # type check early
        arrays[name] = value
    validate(msg.type, msg.meta, {k: as_wire_array(v)[1] for k, v in arrays.items()})
    if len(arrays) > MAX_TENSORS:
        raise ProtocolError(ErrorCode.MALFORMED, f"{len(arrays)} tensors; at most {MAX_TENSORS} per message")
    meta = dump_meta(msg.meta)
    if len(meta) > MAX_META_BYTES:
        raise ProtocolError(ErrorCode.MALFORMED,
                            f"metadata of {human_bytes(len(meta))} exceeds 1 MiB; carry bulk data as tensors")
    body: list[bytes | memoryview] = [struct.pack("<I", len(meta)), meta, struct.pack("<H", len(arrays))]
    off = 4 + len(meta) + 2
    for name, value in arrays.items():
        head, data, off = encode_record(name, value, off)
        body += [head, data]
    if off > 0xFFFFFFFF:
        raise ProtocolError(ErrorCode.OVERSIZED, f"message body of {human_bytes(off)} exceeds the 4 GiB format limit")
    crc = 0
    for part in body:
        crc = zlib.crc32(part, crc)
    return [encode_header(msg.type, off), *body, struct.pack("<I", crc)]


def encode_body(msg: Message) -> bytes:
    """The section 3 body alone, as one buffer: what a sealed frame encrypts."""
    return b"".join(encode_parts(msg)[1:-1])


def encode_message(msg: Message) -> bytes:
    return b"".join(encode_parts(msg))


def decode_body(msg_type: MsgType, body: bytes | bytearray | memoryview, body_crc: int) -> Message:
    """Steps 9-10 of the decoding order: body CRC, structure, tensors, schema. Tensors view `body`."""
    body = memoryview(body)
    if zlib.crc32(body) != body_crc:
        raise ProtocolError(ErrorCode.BAD_CHECKSUM,
                            f"{msg_type.name} body CRC32 mismatch; the link corrupted data (reconnect and resend)")
    return decode_plain_body(msg_type, body)


def decode_plain_body(msg_type: MsgType, body: bytes | bytearray | memoryview) -> Message:
    """Step 10 alone: a sealed frame's opened body (its CRC covered the sealed bytes)."""
    body = memoryview(body)
    n = len(body)
    if n < 4:
        raise ProtocolError(ErrorCode.MALFORMED, f"{msg_type.name} body of {n} bytes is too short for meta_len")
    (meta_len,) = struct.unpack_from("<I", body, 0)
    if not 0 < meta_len <= MAX_META_BYTES:
        raise ProtocolError(ErrorCode.MALFORMED,
                            f"{msg_type.name} meta_len {meta_len} outside 1..{MAX_META_BYTES}")
    if 4 + meta_len + 2 > n:
        raise ProtocolError(ErrorCode.MALFORMED,
                            f"{msg_type.name} meta_len {meta_len} runs past the body of {n} bytes")
    meta = parse_meta(body[4:4 + meta_len])
    pos = 4 + meta_len
    (count,) = struct.unpack_from("<H", body, pos)
    pos += 2
    tensors = {}
    for _ in range(count):
        name, arr, pos = decode_record(body, pos)
        if name in tensors:
            raise ProtocolError(ErrorCode.MALFORMED, f"{msg_type.name} has two tensors named {quote(name)}")
        tensors[name] = arr
    if pos != n:
        raise ProtocolError(ErrorCode.MALFORMED,
                            f"{msg_type.name} body has {n - pos} bytes after its last tensor record")
    validate(msg_type, meta, tensors)
    return Message(msg_type, meta, tensors)


def decode_frame(buf: bytes | bytearray | memoryview, max_frame: int = DEFAULT_MAX_FRAME) -> tuple[Message, int]:
    """Decode the frame at the start of `buf`. Returns (message, bytes consumed)."""
    view = memoryview(buf)
    head = parse_header(view[:HEADER_SIZE], max_frame)
    end = head.frame_size
    if len(view) < end:
        raise ProtocolError(ErrorCode.TRUNCATED,
                            f"{head.type.name} frame needs {end} bytes, only {len(view)} arrived; "
                            "the peer closed or crashed mid-frame")
    (crc,) = struct.unpack_from("<I", view, end - TRAILER_SIZE)
    return decode_body(head.type, view[HEADER_SIZE:end - TRAILER_SIZE], crc), end


def decode_message(buf: bytes | bytearray | memoryview, max_frame: int = DEFAULT_MAX_FRAME) -> Message:
    """Decode `buf` as exactly one frame (trailing bytes are MALFORMED)."""
    msg, used = decode_frame(buf, max_frame)
    if used != len(buf):
        raise ProtocolError(ErrorCode.MALFORMED,
                            f"{len(buf) - used} bytes follow the {msg.type.name} frame; expected exactly one frame")
    return msg


class FrameDecoder:
    """Incremental decoder for non-blocking/asyncio readers: feed() bytes, get whole messages.
    Rejects an oversized frame as soon as its header is in, before buffering its body."""

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME):
        self.max_frame = max_frame
        self._buf = bytearray()
        self._head: FrameHeader | None = None

    def feed(self, data: bytes) -> list[Message]:
        self._buf += data
        out = []
        while True:
            if self._head is None:
                if len(self._buf) < HEADER_SIZE:
                    return out
                self._head = parse_header(self._buf[:HEADER_SIZE], self.max_frame)
            end = self._head.frame_size
            if len(self._buf) < end:
                return out
            frame = bytes(self._buf[:end])
            del self._buf[:end]
            self._head = None
            out.append(decode_message(frame, self.max_frame))

    def eof(self) -> None:
        """Call at end of stream: TRUNCATED if a partial frame is buffered."""
        if self._buf:
            raise ProtocolError(ErrorCode.TRUNCATED,
                                f"stream ended with {len(self._buf)} bytes of an unfinished frame; "
                                "the peer closed or crashed mid-frame")

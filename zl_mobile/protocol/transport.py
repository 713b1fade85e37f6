"""Blocking-socket helpers: send_message / recv_message, and a token-bucket RateLimiter."""
from __future__ import annotations

import select
import socket
import struct
import threading
import time
import zlib
from typing import Callable, Protocol

from .errors import ConnectionClosed, ErrorCode, ProtocolError
from .frames import (
    DEFAULT_MAX_FRAME,
    HEADER_SIZE,
    SEALED_FLAG,
    TRAILER_SIZE,
    decode_body,
    decode_plain_body,
    encode_body,
    encode_header,
    encode_parts,
    parse_header,
)
from .messages import Message
from .seal import TAG_BYTES, seal_of

SEND_CHUNK = 64 << 10
# what a frame's body buffer starts at; it doubles as bytes arrive. 1 MiB: a hidden state of a
# small model fits at once, a large one takes a few doublings, and a header that declares much and
# sends nothing commits 1 MiB, not what it declared
FIRST_BODY_BUF = 1 << 20


class Limiter(Protocol):
    def consume(self, nbytes: int) -> None: ...


class RateLimiter:
    """Token bucket: consume(n) blocks until n bytes may go out at `bytes_per_s` on average,
    allowing bursts of up to `burst` bytes (default: 1/20 s worth, at least 16 KiB).
    Thread-safe; one limiter shared by several sockets shapes their sum."""

    def __init__(self, bytes_per_s: float, burst: int | None = None, *,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep):
        if bytes_per_s <= 0:
            raise ValueError(f"bytes_per_s must be > 0, got {bytes_per_s}")
        self.rate = float(bytes_per_s)
        self.burst = float(burst if burst is not None else max(16 << 10, bytes_per_s / 20))
        self._clock, self._sleep = clock, sleep
        self._tokens = self.burst
        self._last = clock()
        self._lock = threading.Lock()

    def consume(self, nbytes: int) -> None:
        with self._lock:
            now = self._clock()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
            self._last = now
            self._tokens -= nbytes  # may go negative: the debt is paid by sleeping
            wait = -self._tokens / self.rate if self._tokens < 0 else 0.0
        if wait > 0:
            self._sleep(wait)


def send_message(sock: socket.socket, msg: Message, *, limiter: Limiter | None = None) -> int:
    """Encode and send one message; returns the frame size. With a limiter, bytes go out in
    64 KiB pieces, each after limiter.consume(len(piece)). On a sealed connection (6.1) the
    frame goes out sealed."""
    seal = seal_of(sock)
    if seal is not None:
        body = encode_body(msg)
        header = encode_header(msg.type, len(body) + TAG_BYTES, flags=SEALED_FLAG)
        frame = bytearray(HEADER_SIZE + len(body) + TAG_BYTES + TRAILER_SIZE)
        frame[:HEADER_SIZE] = header
        with memoryview(frame) as view:
            sealed = view[HEADER_SIZE:-TRAILER_SIZE]
            seal.seal(header, body, out=sealed)  # encrypted straight into the frame
            struct.pack_into("<I", frame, len(frame) - TRAILER_SIZE, zlib.crc32(sealed))
            sealed.release()
        _send(sock, frame, limiter)
        return len(frame)
    total = 0
    pending: list = []
    pending_len = 0

    def flush():
        nonlocal pending, pending_len
        if pending:
            blob = b"".join(pending)
            _send(sock, blob, limiter)
            pending, pending_len = [], 0

    for part in encode_parts(msg):
        n = len(part) if isinstance(part, bytes) else part.nbytes
        total += n
        if n < SEND_CHUNK:  # coalesce small pieces into one write
            pending.append(part)
            pending_len += n
            if pending_len >= SEND_CHUNK:
                flush()
        else:
            flush()
            _send(sock, part, limiter)
    flush()
    return total


def _send(sock: socket.socket, data, limiter: Limiter | None) -> None:
    if limiter is None:
        sock.sendall(data)
        return
    view = memoryview(data).cast("B")
    for off in range(0, len(view), SEND_CHUNK):
        piece = view[off:off + SEND_CHUNK]
        limiter.consume(len(piece))
        sock.sendall(piece)


def _readable(sock: socket.socket, seconds: float) -> bool:
    if sock.fileno() < 0:  # closed by another thread (a link shutting down) while this one read
        raise ConnectionClosed("the connection was closed locally")
    p = select.poll()  # not select(): a phone may hold descriptors above FD_SETSIZE
    p.register(sock, select.POLLIN | select.POLLPRI)
    return bool(p.poll(seconds * 1000))


def _recv_exact(sock: socket.socket, buf: memoryview, what: str, first: bool, deadline: float | None = None,
                stall_s: float | None = None, done: int = 0, total: int | None = None) -> None:
    """Fill `buf`; `done` bytes of a `total`-byte part were read before it (for the messages)."""
    got = 0
    total = len(buf) if total is None else total
    while got < len(buf):
        if stall_s is not None and not _readable(sock, stall_s):  # reads only: sends keep their own pace
            if first and got == 0:
                raise socket.timeout(f"nothing received for {stall_s:g} s")
            raise ProtocolError(ErrorCode.TIMEOUT,
                                f"peer stalled mid-frame ({what}, {done + got} of {total} bytes, nothing for "
                                f"{stall_s:g} s); the connection is unusable, reconnect")
        if deadline is not None:  # one limit for the whole read: a byte now and then does not extend it
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("deadline passed") if first and got == 0 else ProtocolError(
                    ErrorCode.TIMEOUT, f"peer too slow ({what}, {done + got} of {total} bytes by the deadline); "
                                       "the connection is unusable, reconnect")
            sock.settimeout(left)
        try:
            n = sock.recv_into(buf[got:])
        except socket.timeout:
            if first and got == 0:
                raise  # nothing of a frame read yet: an ordinary timeout, the stream is intact
            raise ProtocolError(ErrorCode.TIMEOUT,
                                f"peer stalled mid-frame ({what}, {done + got} of {total} bytes); "
                                "the connection is unusable, reconnect") from None
        if n == 0:
            if first and got == 0:
                raise ConnectionClosed("peer closed the connection")
            raise ProtocolError(ErrorCode.TRUNCATED,
                                f"stream ended inside a frame ({what}: {done + got} of {total} bytes); "
                                "the peer closed or crashed mid-frame")
        got += n


def recv_message(sock: socket.socket, *, max_frame: int = DEFAULT_MAX_FRAME, deadline: float | None = None,
                 stall_s: float | None = None) -> Message:
    """Read exactly one frame: 16 header bytes, validate them (size limit included), then
    read the body into a buffer that grows as its bytes arrive. Raises ConnectionClosed on EOF between frames, ProtocolError
    otherwise (TRUNCATED on EOF mid-frame, TIMEOUT on a socket timeout mid-frame); a socket
    timeout before the first byte propagates as socket.timeout (TimeoutError). With `deadline`
    (time.monotonic()) the whole frame must arrive by then; the socket's timeout is changed. With
    `stall_s`, going that long without a byte is a timeout (socket.timeout between frames,
    TIMEOUT inside one), the socket's own timeout untouched."""
    seal = seal_of(sock)
    head_buf = bytearray(HEADER_SIZE)
    _recv_exact(sock, memoryview(head_buf), "header", first=True, deadline=deadline, stall_s=stall_s)
    head = parse_header(head_buf, max_frame, sealed=seal is not None)
    need = head.body_len + TRAILER_SIZE
    # the buffer grows with the bytes that arrive (doubling, from FIRST_BODY_BUF): a header that
    # declares 256 MiB and then sends nothing does not get 256 MiB zeroed before the first body byte
    rest = bytearray(min(need, FIRST_BODY_BUF))
    got = 0
    while True:
        with memoryview(rest) as view:
            _recv_exact(sock, view[got:], f"{head.type.name} body", first=False, deadline=deadline,
                        stall_s=stall_s, done=got, total=need)
        got = len(rest)
        if got == need:
            break
        rest.extend(bytes(min(need, 2 * got) - got))  # calloc'd pages: committed as they are filled
    (crc,) = struct.unpack_from("<I", rest, head.body_len)
    if seal is None:
        return decode_body(head.type, memoryview(rest)[:head.body_len], crc)
    sealed = memoryview(rest)[:head.body_len]
    if zlib.crc32(sealed) != crc:
        raise ProtocolError(ErrorCode.BAD_CHECKSUM,
                            f"{head.type.name} body CRC32 mismatch; the link corrupted data (reconnect and resend)")
    if head.body_len < TAG_BYTES:
        raise ProtocolError(ErrorCode.MALFORMED, f"sealed {head.type.name} body of {head.body_len} bytes is "
                                                 f"shorter than its {TAG_BYTES}-byte tag")
    # opened before anything in the body is parsed: a frame that fails here is never acted on
    return decode_plain_body(head.type, seal.open(bytes(head_buf), sealed, head.type.name))

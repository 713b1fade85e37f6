"""A socket plus a send lock: several threads (worker, heartbeat, reader) share one connection."""
from __future__ import annotations

import socket
import threading

from .protocol import DEFAULT_MAX_FRAME, Message, recv_message, send_message


class Connection:
    def __init__(self, sock: socket.socket, limiter=None, max_frame: int = DEFAULT_MAX_FRAME,
                 stall_s: float | None = None):
        self.sock = sock
        self.stall_s = stall_s  # recv: socket.timeout after this long with nothing, TIMEOUT mid-frame
        self.limiter = limiter
        self.max_frame = max_frame
        self._lock = threading.Lock()
        self.bytes_out = 0
        self.bytes_in = 0
        self.closed = False

    def send(self, msg: Message) -> int:
        with self._lock:
            n = send_message(self.sock, msg, limiter=self.limiter)
            self.bytes_out += n
            return n

    def try_send(self, msg: Message) -> bool:
        """Send, or return False if the peer is gone (best-effort messages like telemetry)."""
        try:
            self.send(msg)
            return True
        except OSError:
            return False

    def recv(self) -> Message:
        msg = recv_message(self.sock, max_frame=self.max_frame, stall_s=self.stall_s)
        return msg

    def close(self) -> None:
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def tune_link_socket(sock: socket.socket) -> socket.socket:
    """Both ends of a stage link: no Nagle delay, and room for a few frames (hidden states
    downstream, BP gradients upstream) in the kernel, so a send returns while the bytes go out
    and the stage goes on computing, as a GPU pipeline's isend does."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8 << 20)
    return sock


def connect(address: str, timeout: float = 5.0) -> socket.socket:
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=timeout)
    sock.settimeout(None)
    return tune_link_socket(sock)

"""The host's session with one device: handshake, file push, stage assignment, state, events."""
from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from zl_mobile.connection import Connection, connect
from zl_mobile.protocol import ConnectionClosed, ErrorCode, Message, MsgType, ProtocolError, host_handshake

log = logging.getLogger("host.client")
CHUNK_BYTES = 1 << 20


class DeviceError(Exception):
    """A device refused a request or went away; `code` is the ErrorCode it answered with, if any."""

    def __init__(self, message: str, code=None):
        super().__init__(message)
        self.code = code


@dataclass
class Event:
    device: str
    msg: Message | None  # None: the connection was lost
    at: float


class DeviceClient:
    def __init__(self, name: str, endpoint: str, token: str, events: "queue.Queue[Event]", timeout: float = 10.0,
                 connect_timeout: float | None = None):
        """`timeout`: for each request's answer; `connect_timeout` (default `timeout`): for the connect
        and the handshake."""
        self.name = name
        self.endpoint = endpoint
        self.events = events
        self.timeout = timeout
        connect_timeout = connect_timeout or timeout
        sock = connect(endpoint, timeout=connect_timeout)
        sock.settimeout(connect_timeout)
        try:
            self.hello = host_handshake(sock, token, host_name="zl-host")
        except ProtocolError as e:
            sock.close()
            raise DeviceError(f"{name} at {endpoint} refused the handshake ({e.code.value}): {e.message}",
                              code=e.code) from None
        sock.settimeout(None)
        self.conn = Connection(sock)
        self.last_heard = time.time()
        self.quiet_until = 0.0  # a device inside a long computation said it may be silent until then
        self._ids = itertools.count(1)
        self._waiters: dict[int, "queue.Queue[Message]"] = {}
        self._lock = threading.Lock()
        self.alive = True
        threading.Thread(target=self._read, name=f"client-{name}", daemon=True).start()

    @property
    def address(self) -> str:
        return self.endpoint.rpartition(":")[0]

    def _read(self) -> None:
        try:
            while True:
                msg = self.conn.recv()
                self.last_heard = time.time()
                if msg.type == MsgType.HEARTBEAT and "busy_ms" in msg.meta:  # see PROTOCOL.md, HEARTBEAT
                    self.quiet_until = self.last_heard + msg["busy_ms"] / 1000.0
                rid = msg.get("request_id") if msg.type in (MsgType.ACK, MsgType.STATE_PUT, MsgType.ERROR) else None
                if msg.type == MsgType.FILE_RESULT:
                    rid = -msg["transfer_id"]
                with self._lock:
                    waiter = self._waiters.pop(rid, None) if rid is not None else None
                if waiter is not None:
                    waiter.put(msg)
                elif msg.type != MsgType.HEARTBEAT:
                    self.events.put(Event(self.name, msg, time.time()))
        except (OSError, ProtocolError, ConnectionClosed) as e:
            log.info("%s: connection lost (%s)", self.name, e)
        finally:
            self.alive = False
            with self._lock:
                for w in self._waiters.values():
                    w.put(None)
                self._waiters.clear()
            self.events.put(Event(self.name, None, time.time()))

    def _request(self, msg: Message, rid: int, timeout: float | None = None) -> Message:
        w: "queue.Queue[Message]" = queue.Queue()
        with self._lock:
            self._waiters[rid] = w
        self.conn.send(msg)
        try:
            reply = w.get(timeout=timeout or self.timeout)
        except queue.Empty:
            raise DeviceError(f"{self.name} did not answer {msg.type.name} within {timeout or self.timeout:.0f} s") from None
        if reply is None:
            raise DeviceError(f"{self.name} disconnected while answering {msg.type.name}")
        if reply.type == MsgType.ERROR:
            raise DeviceError(f"{self.name} refused {msg.type.name} ({reply['code']}): {reply['message']}")
        return reply

    def has_file(self, name: str, sha256: str) -> bool:
        return (self.hello.get("files") or {}).get(name) == sha256

    def push_file(self, path: Path, kind: str, sha256: str, progress=None) -> bool:
        """Send a file unless the device already holds the same sha256; returns True if sent."""
        path = Path(path)
        if self.has_file(path.name, sha256):
            return False
        tid = next(self._ids)
        size = path.stat().st_size
        self.conn.send(Message(MsgType.FILE_BEGIN, {"transfer_id": tid, "name": path.name, "kind": kind,
                                                    "size": size, "sha256": sha256}))
        with open(path, "rb") as f:
            offset = 0
            while True:
                block = f.read(CHUNK_BYTES)
                if not block:
                    break
                self.conn.send(Message(MsgType.FILE_CHUNK, {"transfer_id": tid, "offset": offset},
                                       {"data": np.frombuffer(block, dtype=np.uint8)}))
                offset += len(block)
                if progress:
                    progress(len(block))
        reply = self._request(Message(MsgType.FILE_END, {"transfer_id": tid}), -tid, timeout=120)
        if not reply["ok"]:
            raise DeviceError(f"{self.name} rejected {path.name}: {reply.get('message', 'sha256 mismatch')}")
        return True

    def assign(self, meta: dict) -> Message:
        rid = next(self._ids)
        return self._request(Message(MsgType.STAGE_ASSIGN, {**meta, "request_id": rid}), rid, timeout=120)

    def get_state(self, kind: str = "lora") -> Message:
        rid = next(self._ids)
        return self._request(Message(MsgType.STATE_GET, {"request_id": rid, "kind": kind}), rid, timeout=60)

    def shutdown(self, reason: str = "run finished") -> None:
        self.conn.try_send(Message(MsgType.SHUTDOWN, {"reason": reason}))
        self.close()

    def close(self) -> None:
        self.conn.close()


def open_session(name: str, endpoint: str, token: str, events: "queue.Queue[Event]", timeout: float = 10.0,
                 **kwargs) -> DeviceClient:
    """A session with a phone, BUSY retried for `timeout` seconds: a host that has just closed a
    session with this phone (profile's passes, a restart) may reach it before the phone has seen
    that close and freed its one session slot, which a loaded phone takes a while to do. A phone
    still BUSY after that serves another host, and the error says so."""
    deadline = time.time() + timeout
    while True:
        try:
            return DeviceClient(name, endpoint, token, events, connect_timeout=timeout, **kwargs)
        except DeviceError as e:
            if e.code != ErrorCode.BUSY or time.time() >= deadline:
                raise
            time.sleep(0.2)


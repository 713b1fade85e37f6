"""Stage-to-stage hidden-state links over TCP (PROTOCOL.md 5.4.1): the sockets, threads and
handshakes around the link rules, which live apart in zl_mobile/link_rules.py (OutboundLinkState,
InboundCredits, InboundQueue, as the Kotlin core's LinkRules.kt; its TCP twin is device/TcpLinks.kt).

OutboundLink (upstream side, the TCP client): keeps every hidden state it produced in a replay
buffer until the downstream stage has committed the window that used it, and sends them in
micro-batch order as the downstream grants credits. It never drops one the downstream has not
committed: when the buffer holds `replay_horizon` entries the producer waits (wait_for_room)
before its next forward, so a fast upstream is held back instead of forgetting (backpressure).
With a ReplayStore the buffer is also on disk, so a restarted stage still serves what it had sent.
On (re)connection the downstream first says which micro-batch it needs next (REPLAY_REQUEST),
so a restarted stage gets exactly its gap again and nothing is sent twice to a live one.

InboundLink (downstream side, the TCP server): accepts one upstream at a time, announces its
resume point and its last committed window, grants credits, and hands HIDDEN_STATE frames to
the stage's inbound queue.

The host feeding stage 0 is an OutboundLink too, with a `source` that rebuilds any input from
the data set, so it holds nothing and can serve any replay."""
from __future__ import annotations

import collections
import errno
import logging
import socket
import threading
import time

from .connection import Connection, connect, tune_link_socket
from .link_rules import (
    LINK_MAX_CONNECTIONS,
    NO_END,
    STALL_S,
    InboundCredits,
    InboundQueue,
    OutboundLinkState,
    initial_credit,
    unusable_message,
)
from .protocol import (
    DEFAULT_MAX_FRAME,
    PROTOCOL_VERSION,
    ConnectionClosed,
    DeviceAuth,
    ErrorCode,
    Message,
    MsgType,
    ProtocolError,
    device_handshake,
    error_reply,
    host_handshake,
)
from .protocol.quoting import quote

log = logging.getLogger("zl_mobile.links")
HANDSHAKE_TIMEOUT_S = 10.0  # PROTOCOL.md 6: a link that does not authenticate in time is closed


def bind_listener(bind: str, port: int) -> socket.socket:
    """The data port's listening socket. SO_REUSEADDR: a fixed port (USB phones) is bound again
    right after the stage that held it closed, its old connections still in TIME_WAIT."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((bind, port))
        sock.listen(4)
    except OSError:
        sock.close()
        raise
    return sock


class DelayLine:
    """Hands each arriving frame on `delay_s` after it arrived, in arrival order, without holding
    up the receiving thread: the one-way latency of an emulated phone's link (zl-phone
    --link-delay-ms), where the kernel has no netem to add it in the network. Frames keep
    arriving at the link's rate; each is only seen later, as over a long path."""

    def __init__(self, delay_s: float):
        if delay_s < 0:
            raise ValueError(f"link delay must be >= 0 s, got {delay_s}")
        self.delay_s = delay_s
        self._items: collections.deque = collections.deque()
        self._cond = threading.Condition()
        threading.Thread(target=self._run, name="link-delay", daemon=True).start()

    def __call__(self, deliver, msg) -> None:
        with self._cond:
            self._items.append((time.monotonic() + self.delay_s, deliver, msg))
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._items:
                    self._cond.wait()
                due, deliver, msg = self._items.popleft()
            time.sleep(max(0.0, due - time.monotonic()))
            try:
                deliver(msg)
            except Exception:  # a consumer's failure must not stop later deliveries
                log.exception("link delay: delivering a frame failed")


def _now(deliver, msg) -> None:
    deliver(msg)


class OutboundLink:
    """The upstream end of one link: an OutboundLinkState (the rules) driven by a link thread that
    connects, sends what the credits allow, and a reader that applies what the downstream says."""

    def __init__(self, name: str, token: str, *, window_size: int, replay_horizon: int,
                 limiter=None, on_error=None, on_committed=None, on_gradient=None, prune_on_commit=True,
                 delay: DelayLine | None = None, store=None, first_mb: int = 0, source=None,
                 source_total: int | None = None, max_frame: int = DEFAULT_MAX_FRAME, stall_s: float | None = STALL_S):
        self.name = name
        self.token = token
        # the host's feed: source(mb) rebuilds any input, so nothing is buffered and any replay is served
        self.state = OutboundLinkState(name, window_size=window_size, replay_horizon=replay_horizon,
                                       prune_on_commit=prune_on_commit, feed=source is not None, feed_total=source_total)
        self.window_size = window_size
        self.replay_horizon = replay_horizon
        self.limiter = limiter
        self.max_frame, self.stall_s = max_frame, stall_s  # what the downstream may send (GRADIENT at most)
        self.on_error = on_error or (lambda msg: log.error(msg))
        self.on_committed = on_committed or (lambda meta: None)
        self.on_gradient = on_gradient or (lambda msg: None)  # BP baselines: dL/dh_k from downstream
        self._deliver = delay or _now  # what downstream sends arrives after the link's latency, if emulated
        self.prune_on_commit = prune_on_commit
        self.source = source
        self.source_total = source_total
        self.store = store  # ReplayStore: the buffer's on-disk copy, which outlives this process
        self._address: str | None = None
        loaded = store.load(below=first_mb) if store is not None else []
        self.state.restore([(msg["micro_batch"], msg) for msg in loaded], first_mb)
        self.peak_buffered = self.state.held()
        self._cond = threading.Condition()
        self._send_lock = threading.Lock()
        self._stop = False
        self._conn: Connection | None = None
        self.bytes_sent = 0
        self.frames_sent = 0
        self.sent_at: dict[int, float] = {}
        self._thread = threading.Thread(target=self._run, name=f"out-{name}", daemon=True)
        self._thread.start()

    @property
    def downstream_committed(self) -> int:
        with self._cond:
            return self.state.downstream_committed

    # --- producer side
    def set_address(self, address: str | None) -> None:
        with self._cond:
            if address != self._address:
                self._address = address
                if self._conn is not None:
                    self._conn.close()
            self._cond.notify_all()

    def full(self) -> bool:
        with self._cond:
            return self.state.full()

    def wait_for_room(self, stop: threading.Event | None = None) -> float:
        """Backpressure: block until the buffer holds fewer than `replay_horizon` hidden states
        (the downstream commits a window, and its hidden states go). Returns the seconds waited."""
        t0 = time.monotonic()
        with self._cond:
            while self.state.full() and not self._stop and not (stop and stop.is_set()):
                self._cond.wait(timeout=0.5)
        return time.monotonic() - t0

    def publish(self, msg: Message) -> None:
        """Hold `msg` for sending and replay. Never drops anything: the producer keeps within the
        horizon by calling wait_for_room first."""
        with self._cond:
            self.state.publish(msg["micro_batch"], msg)
            self.peak_buffered = max(self.peak_buffered, self.state.held())
            self._cond.notify_all()

    def persist(self, mb: int) -> None:
        """Write a published hidden state to the on-disk copy (after it was handed to the socket,
        so early forwarding does not wait for the disk)."""
        if self.store is None:
            return
        with self._cond:
            msg = self.state.get(mb)
        if msg is not None:
            self.store.put(msg)

    def sync(self) -> None:
        """Before the stage commits a checkpoint: its window's hidden states are durable first."""
        if self.store is not None:
            self.store.sync()

    def held(self) -> int:
        with self._cond:
            return self.state.held()

    def buffered(self) -> list[int]:
        with self._cond:
            return self.state.buffered()

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
            if self._conn is not None:
                self._conn.close()

    # --- link thread
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stop and self._address is None:
                    self._cond.wait()
                if self._stop:
                    return
                address = self._address
            try:
                sock = connect(address, timeout=2.0)
                host_handshake(sock, self.token, host_name=self.name)
            except (OSError, ProtocolError) as e:
                log.debug("%s: connecting to %s failed (%s); retrying", self.name, address, e)
                time.sleep(0.2)
                continue
            conn = Connection(sock, limiter=self.limiter, max_frame=self.max_frame, stall_s=self.stall_s)
            with self._cond:
                self._conn = conn
                self.state.connected()
            reader = threading.Thread(target=self._read, args=(conn,), name=f"out-read-{self.name}", daemon=True)
            reader.start()
            try:
                self._send_loop(conn)
            except (OSError, ProtocolError, ConnectionClosed) as e:
                log.info("%s: link to %s dropped (%s)", self.name, address, e)
            finally:
                conn.close()
                with self._cond:
                    if self._conn is conn:
                        self._conn = None
                        self.state.disconnected()
                reader.join(timeout=1.0)

    def _send_one(self, conn: Connection) -> bool:
        """Send the next hidden state if a credit allows; one sender at a time keeps the order."""
        with self._send_lock:
            with self._cond:
                if conn.closed or self._conn is not conn:
                    return False
                taken = self.state.take_next()
                if taken is None:
                    return False
                mb, msg = taken
            if msg is None:  # the host's feed: built when it is sent, never held
                msg = self.source(mb)
            n = conn.send(msg)
            with self._cond:
                self.bytes_sent += n
                self.frames_sent += 1
                self.sent_at[mb] = time.time()
            return True

    def pump(self) -> None:
        """Send what can go now, from the caller's thread. The stage calls this right after
        phase 1: ExecuTorch holds the GIL while a method runs, so a background sender would
        only get to run after phase 2; bytes handed to the kernel go out while phase 2 runs."""
        conn = self._conn
        if conn is None:
            return
        try:
            while self._send_one(conn):
                pass
        except OSError:
            conn.close()

    def _send_loop(self, conn: Connection) -> None:
        while True:
            with self._cond:
                while not (self._stop or conn.closed or self.state.sendable()):
                    self._cond.wait(timeout=0.5)
                if self._stop or conn.closed:
                    return
            self._send_one(conn)

    def _read(self, conn: Connection) -> None:
        try:
            while True:
                try:
                    msg = conn.recv()
                except socket.timeout:  # a quiet downstream between frames (stall_s): fine
                    continue
                # everything from downstream (credits, replay requests, commits, gradients) is seen
                # after the link's latency, if one is emulated, so the credit loop pays it too
                self._deliver(lambda m, c=conn: self._handle(c, m), msg)
        except ProtocolError as e:  # a bad frame (CREDIT 0, from > to, a stall): say so, then close
            log.warning("%s: downstream link error: %s", self.name, e)
            conn.try_send(error_reply(e))
        except (OSError, ConnectionClosed):
            pass
        conn.close()
        with self._cond:
            self._cond.notify_all()

    def _handle(self, conn: Connection, msg: Message) -> None:
        try:
            self._handle_one(conn, msg)
        except ProtocolError as e:  # a message that breaks the link rules: ERROR, then the link drops
            log.warning("%s: downstream link error: %s", self.name, e)
            conn.try_send(error_reply(e))
            conn.close()
            with self._cond:
                self._cond.notify_all()

    def _handle_one(self, conn: Connection, msg: Message) -> None:
        if msg.type == MsgType.GRADIENT:
            self.on_gradient(msg)
            return
        with self._cond:
            current = self._conn is conn  # a delayed credit or request of a dropped connection is void
            if msg.type == MsgType.CREDIT and current:
                self.state.on_credit(msg["credits"])
            elif msg.type == MsgType.REPLAY_REQUEST and current:
                error = self.state.on_replay_request(msg["from_micro_batch"])
                if error is not None:
                    self.on_error(error)
            elif msg.type == MsgType.CHECKPOINT_COMMITTED:
                # the downstream durably used everything up to this window: prune it
                w = msg["window"]
                refused = self.state.on_committed(w)
                if refused is not None:
                    if not current:  # a late word of a dropped connection: its successor re-announces
                        return
                    raise ProtocolError(ErrorCode.UNEXPECTED, refused)
                if self.state.prunes and self.store is not None:
                    self.store.drop_below(self.state.window_end(w))
                self.on_committed(msg.meta)
            elif msg.type == MsgType.ERROR:
                log.error("%s: downstream error %s: %s", self.name, quote(msg["code"]), quote(msg["message"]))
            self._cond.notify_all()


class InboundLink:
    """Listens for the upstream stage (or the host, for stage 0) on a data port."""

    def __init__(self, name: str, token: str, queue: InboundQueue, *, inflight_depth: int,
                 next_needed, port: int = 0, bind: str = "0.0.0.0", delay: DelayLine | None = None,
                 listener: socket.socket | None = None, max_frame: int = DEFAULT_MAX_FRAME,
                 stall_s: float | None = STALL_S, unusable=None, max_connections: int = LINK_MAX_CONNECTIONS):
        self.name = name
        # PROTOCOL.md 6: at most max_connections open at once; at the cap the oldest connection that
        # has not authenticated gives way (idle sockets cannot keep the upstream out)
        self._slots = threading.BoundedSemaphore(max_connections)
        self._unauthenticated: dict[int, socket.socket] = {}  # insertion order: oldest first
        self.max_frame, self.stall_s = max_frame, stall_s
        # unusable(msg) -> why a HIDDEN_STATE cannot be used by the stage (None: it can)
        self.unusable = unusable or (lambda msg: None)
        self._lock = threading.Lock()
        self._deliver = delay or _now  # hidden states arrive after the link's latency, if one is emulated
        self.queue = queue
        self.inflight_depth = inflight_depth
        self.next_needed = next_needed  # callable: the micro-batch this stage needs next
        self.auth = DeviceAuth(token, name)
        self._sock = listener if listener is not None else bind_listener(bind, port)
        self.port = self._sock.getsockname()[1]
        self._conn: Connection | None = None
        self._conn_credits: InboundCredits | None = None  # the current connection's
        self._stop = False
        self.bytes_received = 0
        self.received_at: dict[int, float] = {}
        # this stage's last CHECKPOINT_COMMITTED, re-announced on every new upstream connection: a
        # restarted upstream then drops what was committed while it was down instead of holding it
        self.last_commit: dict | None = None
        self._accept_thread = threading.Thread(target=self._accept, name=f"in-{name}", daemon=True)
        self._accept_thread.start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                sock, _ = self._sock.accept()
            except OSError as e:
                if self._stop or e.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    return
                time.sleep(0.05)  # out of descriptors: the link is still wanted, retry (its peer stays queued)
                continue
            if self._stop:
                sock.close()
                return
            if not self._slots.acquire(blocking=False) and not (self._evict_unauthenticated()
                                                                and self._slots.acquire(timeout=2.0)):
                sock.close()
                continue
            with self._lock:
                self._unauthenticated[id(sock)] = sock
            threading.Thread(target=self._serve_slot, args=(sock,), daemon=True).start()

    def _evict_unauthenticated(self) -> bool:
        with self._lock:
            if not self._unauthenticated:
                return False
            victim = self._unauthenticated.pop(next(iter(self._unauthenticated)))
        try:
            victim.shutdown(socket.SHUT_RDWR)  # wakes its handshake, which then fails and frees the slot
        except OSError:
            pass
        return True

    def _serve_slot(self, sock: socket.socket) -> None:
        try:
            self._serve(sock)
        finally:
            with self._lock:
                self._unauthenticated.pop(id(sock), None)
            self._slots.release()

    def _serve(self, sock: socket.socket) -> None:
        hello = Message(MsgType.HELLO, {"name": self.name, "protocol_version": PROTOCOL_VERSION, "runtime_version": "zl_mobile",
                                        "memory_bytes": 0, "capabilities": ["link"]})
        try:
            hs = device_handshake(sock, self.auth, hello, timeout=HANDSHAKE_TIMEOUT_S)
            sock.settimeout(None)
        except (OSError, ProtocolError, ConnectionClosed) as e:
            log.warning("%s: refused an upstream link: %s", self.name, e)
            sock.close()
            return
        with self._lock:
            self._unauthenticated.pop(id(sock), None)
        # BP gradients go back upstream on this socket; frames are bounded by what the chunk needs,
        # and a frame begun and then left for stall_s is a TIMEOUT (PROTOCOL.md 6)
        conn = Connection(tune_link_socket(sock), max_frame=self.max_frame, stall_s=self.stall_s)
        credits = InboundCredits(self.name)  # counted per connection: a new upstream starts with none
        with self._lock:
            self._conn, self._conn_credits = conn, credits
        try:
            conn.send(Message(MsgType.REPLAY_REQUEST, {"from_micro_batch": self.next_needed(), "to_micro_batch": NO_END}))
            if self.last_commit is not None:
                conn.send(Message(MsgType.CHECKPOINT_COMMITTED, dict(self.last_commit)))
            free = initial_credit(self.inflight_depth, len(self.queue))
            if free is not None:
                with self._lock:
                    credits.grant(free)
                conn.send(Message(MsgType.CREDIT, {"credits": free}))
            while not self._stop:
                try:
                    msg = conn.recv()
                except socket.timeout:  # an upstream waiting for credits is quiet between frames
                    continue
                if msg.type != MsgType.HIDDEN_STATE:
                    raise ProtocolError(ErrorCode.UNEXPECTED, f"{msg.type.name} on a hidden-state link; only "
                                                              "HIDDEN_STATE is sent downstream")
                mb = msg["micro_batch"]
                with self._lock:  # the frame is checked before it is kept: a bad one is never queued
                    refused = credits.spend(mb)
                if refused is not None:
                    raise ProtocolError(ErrorCode.UNEXPECTED, refused)
                why = self.unusable(msg)
                if why is not None:
                    raise ProtocolError(ErrorCode.UNEXPECTED, unusable_message(mb, self.name, why))
                self.bytes_received += sum(getattr(t, "nbytes", 0) for t in msg.tensors.values())
                self.received_at[msg["micro_batch"]] = time.time()
                self._deliver(self.queue.put, msg)
        except ProtocolError as e:
            log.warning("%s: upstream link error: %s", self.name, e)
            conn.try_send(error_reply(e))
        except (OSError, ConnectionClosed):
            pass
        finally:
            hs.close()
            conn.close()
            with self._lock:
                if self._conn is conn:
                    self._conn, self._conn_credits = None, None

    def grant(self, n: int = 1) -> None:
        """Return credits upstream as inbound entries are consumed."""
        with self._lock:
            conn, credits = self._conn, self._conn_credits
            if conn is None:
                return
            credits.grant(n)  # counted before it is sent: the frame it allows may come back at once
        conn.try_send(Message(MsgType.CREDIT, {"credits": n}))

    def send_gradient(self, mb: int, grad) -> int:
        """BP baselines: dL/dh_{k-1} goes back upstream over the same link."""
        conn = self._conn
        if conn is None:
            return 0
        try:
            return conn.send(Message(MsgType.GRADIENT, {"micro_batch": mb}, {"grad_h": grad}))
        except OSError:
            return 0

    def committed(self, window: int, step: int, sha: str) -> None:
        self.last_commit = {"window": window, "step": step, "sha256": sha}
        conn = self._conn
        if conn is not None:
            conn.try_send(Message(MsgType.CHECKPOINT_COMMITTED, dict(self.last_commit)))

    def close(self) -> None:
        """Stop listening and drop the link. shutdown() first: close() alone does not wake a thread
        blocked in accept(), which would keep the port listening (and the stage alive) for good."""
        self._stop = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        if self._conn is not None:
            self._conn.close()
        if threading.current_thread() is not self._accept_thread:
            self._accept_thread.join(timeout=2.0)

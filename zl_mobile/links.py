"""Stage-to-stage hidden-state links.

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
NO_END = 2**53  # "to the end" in REPLAY_REQUEST
HANDSHAKE_TIMEOUT_S = 10.0  # PROTOCOL.md 6: a link that does not authenticate in time is closed
STALL_S = 10.0  # PROTOCOL.md 6: a frame begun with no byte for this long is a stall (TIMEOUT)
LINK_MAX_CONNECTIONS = 64  # PROTOCOL.md 6: a data port's open connections, as the host port's default


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


def link_frame_limit(data_elements: int) -> int:
    """The largest frame a stage link needs: HIDDEN_STATE (or GRADIENT) carries the chunk's data
    tensors, `data_elements` elements of at most 8 bytes, twice over for the extra tensors that
    travel with them (labels), plus a full metadata part and the records' headers. A peer that
    declares more is OVERSIZED before anything is allocated (PROTOCOL.md 2.1)."""
    return min(DEFAULT_MAX_FRAME, 2 * 8 * data_elements + (1 << 20) + (64 << 10))


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


def commit_beyond_sent_message(window: int, end: int, usable_below: int, name: str) -> str:
    """Word for word in the Kotlin core (LinkRules.commitBeyondSentMessage)."""
    return (f"CHECKPOINT_COMMITTED window {window} covers micro-batches up to {end - 1}, but {name} has sent "
            f"only those below {usable_below} on this link: a downstream cannot commit what it never received; "
            "nothing was pruned (fix the downstream's commit bookkeeping)")


def hidden_state_without_credit_message(mb: int, name: str) -> str:
    """Word for word in the Kotlin core (LinkRules.noCreditMessage)."""
    return (f"HIDDEN_STATE for micro-batch {mb} on {name} with no credit left: an upstream sends one frame per "
            "credit granted (PROTOCOL.md 5.4.1); it was not kept")


def unusable_reason(mb: int, window: int, next_mb: int, *, inflight_depth: int, window_size: int,
                    total: int | None) -> str | None:
    """Why a stage whose next micro-batch is `next_mb` can never use HIDDEN_STATE `mb` labelled
    `window` (None: it can); the link refuses it before it is kept (PROTOCOL.md 5.4.1). Word for
    word in the Kotlin core (LinkRules.unusable)."""
    if mb < next_mb:
        return f"this stage is past it (it needs {next_mb} next)"
    if mb >= next_mb + 2 * inflight_depth:
        return f"beyond what the {inflight_depth} credits allow from micro-batch {next_mb}, the next this stage needs"
    if total is not None and mb >= total:
        return f"the run has {total} micro-batches"
    if window != mb // window_size:
        return f"labelled window {window}, but window size {window_size} puts it in window {mb // window_size}"
    return None


def replay_unavailable_message(start: int, end: int, name: str, held_from: int) -> str:
    """Word for word in the Kotlin core (LinkRules.replayUnavailableMessage): the host shows it."""
    return (f"replay unavailable: micro-batches {start}-{end} needed downstream of {name} are no longer held "
            f"(it holds {held_from} onward); the downstream asked below what it had reported committed, "
            "so its checkpoint or the upstream's replay files were lost: restore that stage's work dir "
            "or start a new run")


class OutboundLink:
    def __init__(self, name: str, token: str, *, window_size: int, replay_horizon: int,
                 limiter=None, on_error=None, on_committed=None, on_gradient=None, prune_on_commit=True,
                 delay: DelayLine | None = None, store=None, first_mb: int = 0, source=None,
                 source_total: int | None = None, max_frame: int = DEFAULT_MAX_FRAME, stall_s: float | None = STALL_S):
        if replay_horizon < 1:
            raise ValueError(f"replay horizon must be >= 1, got {replay_horizon}")
        self.name = name
        self.token = token
        self.window_size = window_size
        self.replay_horizon = replay_horizon  # the most hidden states held: the producer waits beyond it
        self.limiter = limiter
        self.max_frame, self.stall_s = max_frame, stall_s  # what the downstream may send (GRADIENT at most)
        self.on_error = on_error or (lambda msg: log.error(msg))
        self.on_committed = on_committed or (lambda meta: None)
        self.on_gradient = on_gradient or (lambda msg: None)  # BP baselines: dL/dh_k from downstream
        self._deliver = delay or _now  # what downstream sends arrives after the link's latency, if emulated
        self.prune_on_commit = prune_on_commit
        # the host's feed: source(mb) rebuilds any input, so nothing is buffered and any replay is served
        self.source = source
        self.source_total = source_total
        self.store = store  # ReplayStore: the buffer's on-disk copy, which outlives this process
        self._address: str | None = None
        self._buffer: collections.OrderedDict[int, Message] = collections.OrderedDict()
        # every micro-batch < this is not held (committed downstream, or before a restart's reload)
        self._pruned_below = first_mb
        if store is not None:
            for msg in store.load(below=first_mb):
                self._buffer[msg["micro_batch"]] = msg
            if self._buffer:
                self._pruned_below = next(iter(self._buffer))
        self.peak_buffered = len(self._buffer)
        self._next = None           # next micro-batch the downstream wants (None: not connected)
        # what the downstream can have used, on this connection: below its REPLAY_REQUEST's start
        # (committed or queued before), or sent on it. A CHECKPOINT_COMMITTED past this is a lie
        self._usable_below = None
        self._credits = 0
        self._cond = threading.Condition()
        self._send_lock = threading.Lock()
        self._stop = False
        self._conn: Connection | None = None
        self.bytes_sent = 0
        self.frames_sent = 0
        self.downstream_committed = -1
        self.sent_at: dict[int, float] = {}
        self._thread = threading.Thread(target=self._run, name=f"out-{name}", daemon=True)
        self._thread.start()

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
            return len(self._buffer) >= self.replay_horizon

    def wait_for_room(self, stop: threading.Event | None = None) -> float:
        """Backpressure: block until the buffer holds fewer than `replay_horizon` hidden states
        (the downstream commits a window, and its hidden states go). Returns the seconds waited."""
        t0 = time.monotonic()
        with self._cond:
            while len(self._buffer) >= self.replay_horizon and not self._stop and not (stop and stop.is_set()):
                self._cond.wait(timeout=0.5)
        return time.monotonic() - t0

    def publish(self, msg: Message) -> None:
        """Hold `msg` for sending and replay. Never drops anything: the producer keeps within the
        horizon by calling wait_for_room first."""
        mb = msg["micro_batch"]
        with self._cond:
            self._buffer[mb] = msg
            self.peak_buffered = max(self.peak_buffered, len(self._buffer))
            self._cond.notify_all()

    def persist(self, mb: int) -> None:
        """Write a published hidden state to the on-disk copy (after it was handed to the socket,
        so early forwarding does not wait for the disk)."""
        if self.store is None:
            return
        with self._cond:
            msg = self._buffer.get(mb)
        if msg is not None:
            self.store.put(msg)

    def sync(self) -> None:
        """Before the stage commits a checkpoint: its window's hidden states are durable first."""
        if self.store is not None:
            self.store.sync()

    def held(self) -> int:
        with self._cond:
            return len(self._buffer)

    def buffered(self) -> list[int]:
        with self._cond:
            return list(self._buffer)

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
                self._conn, self._next, self._credits, self._usable_below = conn, None, 0, None
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
                        self._conn, self._next = None, None
                reader.join(timeout=1.0)

    def _has(self, mb: int) -> bool:
        if self.source is not None:
            return mb < (self.source_total if self.source_total is not None else NO_END)
        return mb in self._buffer

    def _sendable(self) -> bool:
        return self._next is not None and self._credits > 0 and self._has(self._next)

    def _send_one(self, conn: Connection) -> bool:
        """Send the next hidden state if a credit allows; one sender at a time keeps the order."""
        with self._send_lock:
            with self._cond:
                if conn.closed or self._conn is not conn or not self._sendable():
                    return False
                mb = self._next
                msg = self._buffer.get(mb)
                self._credits -= 1
                self._next = mb + 1
                self._usable_below = max(self._usable_below or 0, mb + 1)
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
                while not (self._stop or conn.closed or self._sendable()):
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
                self._credits += msg["credits"]
            elif msg.type == MsgType.REPLAY_REQUEST and current:
                start = msg["from_micro_batch"]
                if start < self._pruned_below and self.source is None:  # never silently skipped, never a wait
                    held = next(iter(self._buffer), self._pruned_below)
                    self.on_error(replay_unavailable_message(start, self._pruned_below - 1, self.name, held))
                    start = self._pruned_below
                self._next = start
                self._usable_below = max(self._usable_below or 0, start)
            elif msg.type == MsgType.CHECKPOINT_COMMITTED:
                # the downstream durably used everything up to this window: prune it
                w = msg["window"]
                end = (w + 1) * self.window_size
                if self.source is None and end > (self._usable_below or 0):
                    if not current:  # a late word of a dropped connection: its successor re-announces
                        return
                    raise ProtocolError(ErrorCode.UNEXPECTED, commit_beyond_sent_message(
                        w, end, self._usable_below or 0, self.name))
                self.downstream_committed = max(self.downstream_committed, w)
                if self.prune_on_commit and self.source is None:
                    for mb in [k for k in self._buffer if k < end]:
                        del self._buffer[mb]
                    if self.store is not None:
                        self.store.drop_below(end)
                    # a later request below this is an error, never a silent wait
                    self._pruned_below = max(self._pruned_below, end)
                self.on_committed(msg.meta)
            elif msg.type == MsgType.ERROR:
                log.error("%s: downstream error %s: %s", self.name, quote(msg["code"]), quote(msg["message"]))
            self._cond.notify_all()


class InboundQueue:
    """Hidden states received from upstream, by micro-batch id, bounded by the credits granted."""

    def __init__(self, drop_older: bool = True):
        self._items: dict[int, Message] = {}
        self._cond = threading.Condition()
        self._stop = False
        # hidden states are taken in order, so older ones left behind are stale duplicates;
        # gradients (GPipe) are taken in reverse order and must all stay
        self.drop_older = drop_older

    def put(self, msg: Message) -> None:
        with self._cond:
            self._items[msg["micro_batch"]] = msg
            self._cond.notify_all()

    def take(self, mb: int, timeout: float | None = None) -> Message | None:
        """Wait for micro-batch `mb`; earlier ids still queued are discarded (already done)."""
        deadline = None if timeout is None else time.time() + timeout
        with self._cond:
            while mb not in self._items and not self._stop:
                left = None if deadline is None else deadline - time.time()
                if left is not None and left <= 0:
                    return None
                self._cond.wait(timeout=left if left is not None else 0.5)
            if self._stop and mb not in self._items:
                return None
            if self.drop_older:
                for k in [k for k in self._items if k < mb]:
                    del self._items[k]
            return self._items.pop(mb)

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)

    def ids(self) -> list[int]:
        """The micro-batches queued, in order."""
        with self._cond:
            return sorted(self._items)

    def next_after(self, mb: int) -> int:
        """The first micro-batch not yet here, counting from `mb` (the resume point)."""
        with self._cond:
            while mb in self._items:
                mb += 1
            return mb

    def stop(self) -> None:
        with self._cond:
            self._stop = True
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
        self._conn = conn
        try:
            conn.send(Message(MsgType.REPLAY_REQUEST, {"from_micro_batch": self.next_needed(), "to_micro_batch": NO_END}))
            if self.last_commit is not None:
                conn.send(Message(MsgType.CHECKPOINT_COMMITTED, dict(self.last_commit)))
            free = self.inflight_depth - len(self.queue)
            if free > 0:
                with self._lock:
                    conn.credits += free
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
                    if conn.credits <= 0:
                        raise ProtocolError(ErrorCode.UNEXPECTED, hidden_state_without_credit_message(mb, self.name))
                    conn.credits -= 1
                why = self.unusable(msg)
                if why is not None:
                    raise ProtocolError(ErrorCode.UNEXPECTED, f"HIDDEN_STATE for micro-batch {mb} on {self.name}: "
                                                              f"{why}; it was not kept")
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
            if self._conn is conn:
                self._conn = None

    def grant(self, n: int = 1) -> None:
        """Return credits upstream as inbound entries are consumed."""
        with self._lock:
            conn = self._conn
            if conn is None:
                return
            conn.credits += n  # counted before it is sent: the frame it allows may come back at once
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

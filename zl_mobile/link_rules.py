"""The stage-link rules of docs/PROTOCOL.md 5.4.1 as plain state: no sockets, no link threads.

The Python twin of the Kotlin core's LinkRules.kt, with its names:

- OutboundLinkState: the upstream side of a stage-to-stage link (and of the host's feed into
  stage 0): the replay buffer of hidden states, the downstream's resume point, the credits, the
  commits that prune the buffer and the horizon that holds the producer back (backpressure).
- InboundCredits: the downstream side's count of the HIDDEN_STATE frames one upstream connection
  may still send; a frame beyond them is refused, never kept.
- InboundQueue: the hidden states received, by micro-batch id; next_after gives the resume point
  a downstream announces in REPLAY_REQUEST, initial_credit its first CREDIT.
- unusable_reason: why a stage can never use a hidden state (refused before it is kept).

zl_mobile/links.py drives these over TCP. tests/vectors/link_rules/link_rules.json holds the
scenarios both languages run on these classes (tests/test_link_rules_vectors.py, LinkRulesTest.kt).
"""
from __future__ import annotations

import threading
import time

from .protocol.frames import DEFAULT_MAX_FRAME

NO_END = 2**53  # "to the end" in REPLAY_REQUEST: the largest integer every JSON reader keeps exact
STALL_S = 10.0  # PROTOCOL.md 6: a frame begun with no byte for this long is a stall (TIMEOUT)
LINK_MAX_CONNECTIONS = 64  # PROTOCOL.md 6: a data port's open connections, as the host port's default


def link_frame_limit(data_elements: int) -> int:
    """The largest frame a stage link needs: HIDDEN_STATE (or GRADIENT) carries the chunk's data
    tensors, `data_elements` elements of at most 8 bytes, twice over for the extra tensors that
    travel with them (labels), plus a full metadata part and the records' headers. A peer that
    declares more is OVERSIZED before anything is allocated (PROTOCOL.md 2.1)."""
    return min(DEFAULT_MAX_FRAME, 2 * 8 * data_elements + (1 << 20) + (64 << 10))


def commit_beyond_sent_message(window: int, end: int, usable_below: int, name: str) -> str:
    """Word for word in the Kotlin core (LinkRules.commitBeyondSentMessage)."""
    return (f"CHECKPOINT_COMMITTED window {window} covers micro-batches up to {end - 1}, but {name} has sent "
            f"only those below {usable_below} on this link: a downstream cannot commit what it never received; "
            "nothing was pruned (fix the downstream's commit bookkeeping)")


def hidden_state_without_credit_message(mb: int, name: str) -> str:
    """Word for word in the Kotlin core (LinkRules.noCreditMessage)."""
    return (f"HIDDEN_STATE for micro-batch {mb} on {name} with no credit left: an upstream sends one frame per "
            "credit granted (PROTOCOL.md 5.4.1); it was not kept")


def unusable_message(mb: int, name: str, why: str) -> str:
    """The refusal of a HIDDEN_STATE the stage cannot use (`why`: unusable_reason); word for word
    in the Kotlin core (LinkRules.unusableMessage)."""
    return f"HIDDEN_STATE for micro-batch {mb} on {name}: {why}; it was not kept"


def replay_unavailable_message(start: int, end: int, name: str, held_from: int) -> str:
    """Word for word in the Kotlin core (LinkRules.replayUnavailableMessage): the host shows it."""
    return (f"replay unavailable: micro-batches {start}-{end} needed downstream of {name} are no longer held "
            f"(it holds {held_from} onward); the downstream asked below what it had reported committed, "
            "so its checkpoint or the upstream's replay files were lost: restore that stage's work dir "
            "or start a new run")


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


def initial_credit(inflight_depth: int, queued: int) -> int | None:
    """The CREDIT a downstream grants right after its REPLAY_REQUEST: inflight_depth - queued, none if <= 0."""
    free = inflight_depth - queued
    return free if free > 0 else None


class OutboundLinkState:
    """Upstream side of one link. Not thread-safe by itself: its owner serializes calls.

    - publish: every hidden state produced goes into the replay buffer; nothing leaves it before
      the downstream commits it. When `full` (it holds `replay_horizon`) the producer waits.
    - connected: a new connection starts with no resume point and no credits.
    - on_replay_request: the downstream says which micro-batch it needs next; sending resumes
      there. Asking below what was pruned returns the replay-unavailable error (never a silent
      skip) and sending resumes at the first micro-batch not pruned.
    - on_credit: adds to the allowance; every frame taken (take_next) spends one.
    - on_committed: the downstream durably used windows <= w: their hidden states go (when
      `prunes`), and a later request below them is the error above. A commit past what the
      downstream can have received on this connection is refused (the text returned) and
      prunes nothing.

    The host's feed (`feed`) holds nothing: it rebuilds any input below `feed_total` (None: no
    end) when it is sent, so it serves any replay and is never pruned nor refuses a commit.
    """

    def __init__(self, name: str, *, window_size: int, replay_horizon: int, prune_on_commit: bool = True,
                 feed: bool = False, feed_total: int | None = None):
        if replay_horizon < 1:
            raise ValueError(f"replay horizon must be >= 1, got {replay_horizon}")
        if window_size < 1:
            raise ValueError(f"window size must be >= 1, got {window_size}")
        self.name = name
        self.window_size = window_size
        self.replay_horizon = replay_horizon  # the most hidden states held: the producer waits beyond it
        self.prune_on_commit = prune_on_commit
        self.feed, self.feed_total = feed, feed_total
        # insertion order is micro-batch order: the producer publishes in order
        self._buffer: dict[int, object] = {}
        self.pruned_below = 0  # every micro-batch below this is not held (committed, or before a restart's reload)
        self.next: int | None = None  # the next micro-batch the downstream wants (None: not connected yet)
        self.credits = 0
        self.downstream_committed = -1
        # what the downstream can have used, on this connection: below its REPLAY_REQUEST's start
        # (committed or queued before), or sent on it. A CHECKPOINT_COMMITTED past this is a lie
        self.usable_below: int | None = None

    @property
    def prunes(self) -> bool:
        """Whether a commit drops hidden states (the host's feed keeps its inputs for global rollback)."""
        return self.prune_on_commit and not self.feed

    def window_end(self, window: int) -> int:
        """The first micro-batch after `window`."""
        return (window + 1) * self.window_size

    # --- the producer's side
    def publish(self, mb: int, entry) -> None:
        self._buffer[mb] = entry

    def restore(self, entries: list[tuple[int, object]], first_mb: int) -> None:
        """A restarted stage's buffer from its on-disk copy (an unbroken run of micro-batches below
        `first_mb`, its resume point); nothing older is held, so a request below them is the
        replay-unavailable error, not a wait."""
        for mb, entry in entries:
            self._buffer[mb] = entry
        self.pruned_below = next(iter(self._buffer), first_mb)

    def full(self) -> bool:
        return len(self._buffer) >= self.replay_horizon

    def held(self) -> int:
        return len(self._buffer)

    def buffered(self) -> list[int]:
        return list(self._buffer)

    def get(self, mb: int):
        return self._buffer.get(mb)

    def __contains__(self, mb: int) -> bool:
        return mb in self._buffer

    # --- what the downstream says
    def connected(self) -> None:
        self.next, self.credits, self.usable_below = None, 0, None

    def disconnected(self) -> None:
        self.next = None

    def on_replay_request(self, start: int) -> str | None:
        """REPLAY_REQUEST from `start`: the replay-unavailable error text, or None."""
        error = None
        if start < self.pruned_below and not self.feed:  # never silently skipped, never a wait
            held = next(iter(self._buffer), self.pruned_below)
            error = replay_unavailable_message(start, self.pruned_below - 1, self.name, held)
            start = self.pruned_below
        self.next = start
        self.usable_below = max(self.usable_below or 0, start)
        return error

    def on_credit(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"credits must be >= 1, got {n}")
        self.credits += n

    def on_committed(self, window: int) -> str | None:
        """CHECKPOINT_COMMITTED `window`: prunes, or returns the refusal (nothing applied) when the
        window ends past what the downstream can have received on this connection."""
        end = self.window_end(window)
        if not self.feed and end > (self.usable_below or 0):
            return commit_beyond_sent_message(window, end, self.usable_below or 0, self.name)
        self.downstream_committed = max(self.downstream_committed, window)
        if self.prunes:
            for mb in [k for k in self._buffer if k < end]:
                del self._buffer[mb]
            self.pruned_below = max(self.pruned_below, end)  # a later request below this is an error
        return None

    # --- sending
    def _has(self, mb: int) -> bool:
        if self.feed:
            return mb < (self.feed_total if self.feed_total is not None else NO_END)
        return mb in self._buffer

    def sendable(self) -> bool:
        return self.next is not None and self.credits > 0 and self._has(self.next)

    def take_next(self) -> tuple[int, object] | None:
        """The next frame to send, (micro-batch, entry: None for the feed, which builds it), spending
        one credit; None if the rules allow none now."""
        if not self.sendable():
            return None
        mb = self.next
        self.credits -= 1
        self.next = mb + 1
        self.usable_below = max(self.usable_below or 0, mb + 1)
        return mb, self._buffer.get(mb)


class InboundCredits:
    """The HIDDEN_STATE frames one upstream connection may still send (PROTOCOL.md 5.4.1: the
    downstream enforces its credits). Not thread-safe by itself: its owner serializes calls."""

    def __init__(self, name: str):
        self.name = name
        self.credits = 0

    def grant(self, n: int) -> None:
        """Counted before the CREDIT goes out: the frame it allows may come back at once."""
        self.credits += n

    def spend(self, mb: int) -> str | None:
        """HIDDEN_STATE `mb` arrived: spends a credit, or returns the refusal (it is not kept)."""
        if self.credits <= 0:
            return hidden_state_without_credit_message(mb, self.name)
        self.credits -= 1
        return None


class InboundQueue:
    """Hidden states received from upstream, by micro-batch id, bounded by the credits granted."""

    def __init__(self, drop_older: bool = True):
        self._items: dict[int, object] = {}
        self._cond = threading.Condition()
        self._stop = False
        # hidden states are taken in order, so older ones left behind are stale duplicates;
        # gradients (GPipe) are taken in reverse order and must all stay
        self.drop_older = drop_older

    def put(self, msg) -> None:
        with self._cond:
            self._items[msg["micro_batch"]] = msg
            self._cond.notify_all()

    def take(self, mb: int, timeout: float | None = None):
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

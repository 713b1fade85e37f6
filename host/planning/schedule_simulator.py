"""What a pipeline's timeline would be, from its schedule and measured phase durations.

Replays the very action streams the stages run (zl_mobile/schedules.py) as a discrete-event
simulation: each stage runs its actions in order on one core; F(i) waits for h_{k-1}(i) (stage 0's
inputs are there from the start), B(i) below the last stage waits for dL/dh_k(i); a hidden state
goes downstream when its forward ends and the downstream has a credit for it (inflight_depth,
returned when the downstream takes it), a gradient goes upstream when its backward ends. Each
phone has one upload and one download channel at the link's rate (frames queue on them in the
order they are ready), and every frame arrives the link's one-way delay after it is through.

Used by bench/schedule_model.py to check the model against measured 2-stage runs and to say what
three and four stages would do on this machine's phase times; a prediction, never a measurement."""
from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass, field

from zl_mobile.schedules import schedule


@dataclass(frozen=True)
class StageTimes:
    """One stage's durations in seconds: phase 1 (F), phase 2 (ZeroLock's L or BP's B, with the
    per-micro-batch bookkeeping after it), and the window's STEP (AdamW + checkpoint)."""
    forward: float
    phase2: float
    step: float = 0.0


@dataclass(frozen=True)
class LinkModel:
    """Per phone and direction: rate (None: unshaped), one-way delay, and the bytes of one hidden
    state (a BP gradient has the same shape)."""
    rate_mbit: float | None = None
    delay_s: float = 0.0
    frame_bytes: int = 0

    def transfer_s(self) -> float:
        return 0.0 if not self.rate_mbit else self.frame_bytes * 8 / (self.rate_mbit * 1e6)


@dataclass
class Timeline:
    """Each stage's (op, micro-batch, start, end) and the end of every window (the last phase 2
    of its micro-batches on any stage, as bench/pipeline.py measures it)."""
    spans: list[list[tuple[str, int, float, float]]]
    window_end: dict[int, float] = field(default_factory=dict)

    def throughput(self, samples_per_micro_batch: int, window_size: int) -> float:
        """Samples per second over the windows after the first (steady state)."""
        last = max(self.window_end)
        return last * window_size * samples_per_micro_batch / (self.window_end[last] - self.window_end[0])

    def active_fraction(self, stage: int) -> float:
        """Compute time over the stage's span from its first action to its last."""
        s = self.spans[stage]
        busy = sum(e - b for _, _, b, e in s)
        return busy / (s[-1][3] - s[0][2])


class _Channel:
    """One direction of a phone's link: the intervals it is busy sending. Frames are booked as the
    simulation reaches them, which is not always in time order, so a frame takes the first gap
    from its ready time on that fits it."""

    def __init__(self):
        self.busy: list[tuple[float, float]] = []  # sorted, disjoint

    def earliest(self, t: float, dur: float) -> float:
        for b, e in self.busy:
            if e <= t:
                continue
            if b >= t + dur:
                break
            t = e
        return t

    def book(self, t: float, dur: float) -> None:
        bisect.insort(self.busy, (t, t + dur))


def _until_step(actions, last_window: int) -> list:
    """The actions up to the last window's STEP (the flush schedules never end on their own)."""
    out = []
    for a in actions:
        out.append(a)
        if a.op == "STEP" and a.mb == last_window:
            break
    return out


def simulate(method: str, times: list[StageTimes], window_size: int, windows: int,
             link: LinkModel = LinkModel(), inflight_depth: int = 4) -> Timeline:
    """The timeline of `windows` windows of `window_size` micro-batches on len(times) stages."""
    n = len(times)
    if n < 1 or window_size < 1 or windows < 2:
        raise ValueError("need at least one stage, a window of at least one micro-batch and two windows")
    total = windows * window_size
    # PipeDream has no flush: fed num_stages-1 more micro-batches (as the bench does), its stages
    # never drain early; those are left out of every figure
    fed = total + (n - 1 if method == "pipedream" else 0)
    actions = [_until_step(schedule(method, k, n, window_size, total=fed), windows - 1) for k in range(n)]
    t_link = link.transfer_s()
    up, down = [_Channel() for _ in range(n)], [_Channel() for _ in range(n)]
    h_at = [dict() for _ in range(n)]             # stage k: arrival of its input for micro-batch i
    g_at = [dict() for _ in range(n)]             # stage k: arrival of dL/dh_k for micro-batch i
    h_at[0] = {i: 0.0 for i in range(fed)}
    credits = [inflight_depth] * n                # stage k's credits towards stage k+1
    unsent: list[list[tuple[float, int]]] = [[] for _ in range(n)]  # (ready, mb) waiting for a credit
    spans: list[list[tuple[str, int, float, float]]] = [[] for _ in range(n)]
    window_end: dict[int, float] = {}
    pos, free = [0] * n, [0.0] * n
    events: list[tuple[float, int, str, int, int]] = []  # (time, seq, kind, stage, mb)
    seq = 0

    def push(t: float, kind: str, k: int, mb: int) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, k, mb))

    def send(src: int, dst: int, ready: float) -> float:
        """A frame through src's upload and dst's download; its arrival time."""
        start = ready
        if t_link > 0:
            while True:  # the first time both are free for the whole transfer
                t = down[dst].earliest(up[src].earliest(start, t_link), t_link)
                if t == start:
                    break
                start = t
            up[src].book(start, t_link)
            down[dst].book(start, t_link)
        return start + t_link + link.delay_s

    def try_send(k: int, now: float) -> None:
        while unsent[k] and credits[k] > 0:
            ready, mb = unsent[k].pop(0)
            credits[k] -= 1
            push(send(k, k + 1, max(ready, now)), "h", k + 1, mb)

    def advance(k: int, now: float) -> None:
        """Run stage k's next actions from `now` while their inputs are there."""
        while pos[k] < len(actions[k]):
            a = actions[k][pos[k]]
            start = max(free[k], now)
            if a.op == "F":
                if a.mb not in h_at[k]:
                    return
                start = max(start, h_at[k][a.mb])
                if k > 0:  # taking the input returns a credit upstream
                    push(start + link.delay_s, "credit", k - 1, a.mb)
                dur = times[k].forward
            elif a.op == "B" and k < n - 1:
                if a.mb not in g_at[k]:
                    return
                start = max(start, g_at[k][a.mb])
                dur = times[k].phase2
            elif a.op == "STEP":
                dur = times[k].step
            else:  # L, or the last stage's B (its loss is its own)
                dur = times[k].phase2
            end = start + dur
            spans[k].append((a.op, a.mb, start, end))
            free[k] = end
            pos[k] += 1
            if a.op == "F" and k < n - 1:
                unsent[k].append((end, a.mb))
                try_send(k, end)
            elif a.op == "B" and k > 0:
                push(send(k, k - 1, end), "g", k - 1, a.mb)
            if a.op in ("L", "B") and a.mb < total:
                w = a.mb // window_size
                window_end[w] = max(window_end.get(w, 0.0), end)

    for k in range(n):
        advance(k, 0.0)
    while events:
        t, _, kind, k, mb = heapq.heappop(events)
        if kind == "h":
            h_at[k][mb] = t
        elif kind == "g":
            g_at[k][mb] = t
        else:
            credits[k] += 1
            try_send(k, t)
        advance(k, t)
    stuck = [k for k in range(n) if pos[k] < len(actions[k])]
    if stuck:
        raise RuntimeError(f"stages {stuck} never got the inputs of {[actions[k][pos[k]] for k in stuck]}")
    return Timeline(spans, window_end)

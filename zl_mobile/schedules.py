"""Pipeline schedules as data: what one stage does, in order, as a stream of actions.

ZeroLock and the back-propagation baselines run on the same stage runtime and links; they
differ only here (cf. torch.distributed.pipelining's schedule classes). Actions:
  F(i)    forward of micro-batch i; h_k goes downstream at once
  L(i)    ZeroLock's local step: readout, local loss, LoRA grads (phase 2)
  B(i)    back-propagation: wait for dL/dh_k from downstream (the last stage computes the
          loss itself), backward, send dL/dh_{k-1} upstream
  STEP(w) AdamW on the window's accumulated gradients, then the checkpoint
Windows are W consecutive micro-batches; window w = [w*W, (w+1)*W)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator


@dataclass(frozen=True)
class Action:
    op: str   # "F", "L", "B", "STEP"
    mb: int   # micro-batch id (window id for STEP)

    def __repr__(self) -> str:
        return f"{self.op}{self.mb}"


def _window(w: int, size: int) -> range:
    return range(w * size, (w + 1) * size)


def zerolock(stage: int, num_stages: int, size: int, first_window: int = 0, total: int | None = None) -> Iterator[Action]:
    """Forward, send, local step — no stage ever waits for another's backward."""
    w = first_window
    while True:
        for i in _window(w, size):
            yield Action("F", i)
            yield Action("L", i)
        yield Action("STEP", w)
        w += 1


def gpipe(stage: int, num_stages: int, size: int, first_window: int = 0, total: int | None = None) -> Iterator[Action]:
    """All forwards of the window, then all backwards (in reverse), then the flush and step."""
    w = first_window
    while True:
        mbs = _window(w, size)
        yield from (Action("F", i) for i in mbs)
        yield from (Action("B", i) for i in reversed(mbs))
        yield Action("STEP", w)
        w += 1


def one_f_one_b(stage: int, num_stages: int, size: int, first_window: int = 0, total: int | None = None) -> Iterator[Action]:
    """1F1B with a flush per window: warm-up forwards, alternate, drain, step."""
    w = first_window
    while True:
        mbs = list(_window(w, size))
        warm = min(num_stages - stage - 1, size)
        yield from (Action("F", i) for i in mbs[:warm])
        for j, i in enumerate(mbs[warm:]):
            yield Action("F", i)
            yield Action("B", mbs[j])
        yield from (Action("B", i) for i in mbs[size - warm:])
        yield Action("STEP", w)
        w += 1


def pipedream(stage: int, num_stages: int, size: int, first_window: int = 0, total: int | None = None) -> Iterator[Action]:
    """1F1B without a flush: the next window's forwards run before this window's backwards
    finish; each backward uses the weights its forward used (weight stashing), and the step of
    window w happens after its last backward."""
    warm = num_stages - stage - 1
    start = first_window * size
    end = total if total is not None else float("inf")  # the run's end drains the pipeline
    nxt_f = start
    for _ in range(warm):
        if nxt_f < end:
            yield Action("F", nxt_f)
        nxt_f += 1
    b = start
    while b < end:
        if nxt_f < end:
            yield Action("F", nxt_f)
        nxt_f += 1
        yield Action("B", b)
        if (b + 1) % size == 0:
            yield Action("STEP", b // size)
        b += 1


SCHEDULES = {"zerolock": zerolock, "gpipe": gpipe, "1f1b": one_f_one_b, "pipedream": pipedream}


def forwards_held(name: str, stage: int, num_stages: int, size: int, windows: int = 2) -> int:
    """The most forwards a stage holds at once (run, their L/B not yet) over the first `windows`.
    1 means every phase 2 runs before the next phase 1, so phase 1's outputs may stay in its
    arena until then (zl_common.program.ChunkProgram(in_place=True)): ZeroLock everywhere, and
    the last stage of 1F1B and PipeDream; GPipe holds the whole window."""
    held = peak = 0
    for a in schedule(name, stage, num_stages, size, total=windows * size):
        if a.op == "F":
            held += 1
            peak = max(peak, held)
        elif a.op in ("L", "B"):
            held -= 1
        elif a.mb == windows - 1:  # STEP of the last window looked at
            break
    return peak


def schedule(name: str, stage: int, num_stages: int, size: int, first_window: int = 0,
             total: int | None = None) -> Iterator[Action]:
    """The stage's actions from `first_window` on; `total` micro-batches end the run (a schedule
    without a flush, PipeDream, needs it to drain)."""
    try:
        fn = SCHEDULES[name]
    except KeyError:
        raise ValueError(f"unknown schedule {name!r}: use one of {', '.join(SCHEDULES)}") from None
    return fn(stage, num_stages, size, first_window, total)

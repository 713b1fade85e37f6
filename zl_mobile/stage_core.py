"""One stage's training core, without a transport: what every runtime of a chunk shares.

Restore (the export's LoRA init, or the last committed checkpoint), phase 1, phase 2 and the
window gradient (accumulate.py's WindowGradients: each micro-batch weighted by its valid
positions), the AdamW step, the atomic commit, the window's statistics and their telemetry
records, and the fault-injection points. Its transports only move tensors: zl_mobile.Stage (a
phone's TCP links) and host/dist/ranks.py's ranks (torch.distributed p2p). As torch.distributed.pipelining's
one PipelineStage serves every schedule, one core serves every transport, so they cannot drift
apart (the ranks once averaged micro-batch means where the phones weight by positions).

A stage whose LR is 0 under the ZeroLock schedule is forward-only: phase 1 and its forwarding,
no phase 2, no optimizer step; its LoRA stays the export's init and its windows still commit (the
upstream prunes its replay buffer and recovery resumes as for any stage)."""
from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .accumulate import WindowGradients
from .adamw import AdamWConfig
from .checkpoint import Checkpoint, CheckpointStore, restore_training_state
from .telemetry import ActivityClock

log = logging.getLogger("zl_mobile.stage")
FAILURE_POINTS = ("after-phase1", "before-commit", "mid-checkpoint")
STALL_POINT = "hold-gil-in-phase1"  # not a failure: phase 1 holds the interpreter for `seconds` more
SLOW_POINT = "slow-phase1"  # not a failure: every phase 1 (of `window`, or of all when absent) sleeps `seconds` more
FAILURE_EXIT_CODE = 86


class AppFailure(Exception):
    """Fault injection: the stage fails inside the running app (mode "app")."""

    def __init__(self, detect: str):
        super().__init__(detect)
        self.detect = detect


@dataclass(frozen=True)
class FaultSpec:
    point: str
    window: int | None  # None: every window (SLOW_POINT only)
    mode: str = "process"  # process: the process exits; app: the stage's memory goes, the app lives on
    detect: str = "connection"
    seconds: float = 0.0


class Faults:
    """Injected faults (tests, benchmarks), parsed once: each fires once per marker file, so a
    restarted process goes past the point it died at."""

    def __init__(self, specs: list[dict] | None, marker: Callable[[str, int], Path], store: CheckpointStore | None = None,
                 on_fire: Callable[[str, int], None] | None = None, stage: int | None = None):
        self.specs = [FaultSpec(point=sp.get("point", "after-phase1"), window=sp.get("window"),
                                mode=sp.get("mode", "process"), detect=sp.get("detect", "connection"),
                                seconds=float(sp.get("seconds", 0.0))) for sp in specs or []]
        self._marker = marker
        self._store = store
        self._on_fire = on_fire
        self._stage = stage  # named in the log line tests and people look for ("stage K: injected failure ...")
        self._stalled: set[int] = set()

    def due(self, point: str, window: int) -> FaultSpec | None:
        spec = next((sp for sp in self.specs if sp.point == point and sp.window == window), None)
        return None if spec is None or self._marker(point, window).exists() else spec

    def fail(self, point: str, window: int) -> None:
        """Kill this stage at `point` of `window` if a spec names it and it has not fired yet."""
        spec = self.due(point, window)
        if spec is None:
            return
        self._marker(point, window).write_text("injected")
        log.warning("stage %s: injected failure (%s) at %s of window %d", self._stage, spec.mode, point, window)
        if self._on_fire is not None:
            self._on_fire(point, window)
        if point == "mid-checkpoint" and self._store is not None:  # a half-written checkpoint, as a crash leaves
            self._store.tear_pending()
        if spec.mode == "app":
            raise AppFailure(spec.detect)
        os._exit(FAILURE_EXIT_CODE)

    def slow_seconds(self, window: int) -> float:
        """Seconds every phase 1 of `window` sleeps more (slow-phase1: a slower phone); as the
        Kotlin core's FaultInjector.slowSeconds."""
        return sum(sp.seconds for sp in self.specs if sp.point == SLOW_POINT and sp.window in (None, window))

    def stall_seconds(self, window: int) -> float | None:
        """hold-gil-in-phase1 of `window`: its seconds the first time that window's phase 1 runs
        here, else None; as the Kotlin core's FaultInjector.stallSeconds."""
        spec = next((sp for sp in self.specs if sp.point == STALL_POINT and sp.window == window), None)
        if spec is None or window in self._stalled:
            return None
        self._stalled.add(window)
        return spec.seconds

    def slow_down(self, window: int) -> None:
        """Phase 1 made slower, as on a slower phone (other threads run), or holding the
        interpreter once, as a long runtime call does (no other thread runs)."""
        slow = self.slow_seconds(window)
        if slow > 0:
            time.sleep(slow)
        stall = self.stall_seconds(window)
        if stall is not None:
            old = sys.getswitchinterval()
            sys.setswitchinterval(stall + 1.0)
            try:
                end = time.time() + stall
                while time.time() < end:
                    pass
            finally:
                sys.setswitchinterval(old)


class StageCore:
    """Chunk `stage`'s LoRA, AdamW and checkpoints, and the rules of its update windows."""

    def __init__(self, program, lora_init: Path, store: CheckpointStore, *, stage: int, window_size: int, lr: float,
                 weight_decay: float, schedule: str = "zerolock", faults: Faults | None = None,
                 busy: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext):
        self.program = program
        self.k = stage
        self.W = window_size
        self.schedule = schedule
        self.store = store
        self.faults = faults or Faults(None, lambda point, window: Path(os.devnull))
        self.busy = busy  # around each runtime call (a phone tells its host it may go silent)
        self.clock = ActivityClock()
        self.forward_only = lr == 0 and schedule == "zerolock"
        self.lora, self.opt, self.committed, self.checkpoint = restore_training_state(
            Path(lora_init), program.lora_names, store, AdamWConfig(lr=lr, weight_decay=weight_decay))
        self.window = -1  # the window being computed (the checkpoint store's fault hook names it)
        store.fail_hook = lambda point: self.faults.fail(point, self.window)
        self._grads = WindowGradients(self.lora)
        self._stats: dict[int, dict] = {}
        self.done_micro_batches = 0
        self.phase2_calls = 0

    @property
    def next_micro_batch(self) -> int:
        return (self.committed + 1) * self.W

    # ---- per micro-batch
    def phase1(self, mb: int, lora: dict, batch: dict):
        """(h_k, saved, times): phase 1 of micro-batch `mb` with `lora`."""
        self.window = mb // self.W
        t0 = time.time()
        with self.clock.span("phase1"), self.busy():
            self.faults.slow_down(self.window)
            h, saved = self.program.phase1(lora, batch)
        return h, saved, {"phase1_start": t0, "phase1_end": time.time()}

    def local_step(self, w: int, lora: dict, saved: dict, batch: dict, t: dict) -> dict:
        """ZeroLock's phase 2 on what phase 1 saved, into window `w`'s gradient; its losses (none
        on a forward-only stage, which drops what phase 1 saved and computes nothing more)."""
        if self.forward_only:
            self.add(w, None, batch["loss_weight"], t, {})
            return {}
        t["phase2_start"] = time.time()
        with self.clock.span("phase2"), self.busy():
            res = self.program.phase2(lora, saved, batch)
        self.phase2_calls += 1
        losses = {"loss": res.loss, "task_loss": res.task_loss, "consis_loss": res.consis_loss}
        self.add(w, res.grads, batch["loss_weight"], t, losses)
        return losses

    def add(self, w: int, grads: dict | None, loss_weight, t: dict, losses: dict) -> None:
        """One micro-batch's gradient (None: forward-only) into window `w`, weighted by its valid
        positions (accumulate.py), and its times and losses into the window's statistics."""
        if grads is not None:
            self._grads.add(w, grads, float(loss_weight.sum()))
        self.done_micro_batches += 1
        ws = self._stats.setdefault(w, {"micro_batches": 0, "phase1_s": 0.0, "phase2_s": 0.0, "phase2_calls": 0,
                                        "sums": {}, "rss_peak": 0})
        ws["micro_batches"] += 1
        ws["phase1_s"] += t["phase1_end"] - t["phase1_start"]
        t["phase2_end"] = time.time()  # a forward-only micro-batch: when it was done with
        if "phase2_start" in t:
            ws["phase2_s"] += t["phase2_end"] - t["phase2_start"]
            ws["phase2_calls"] += 1
        for k, v in losses.items():
            if v is not None:
                ws["sums"][k] = ws["sums"].get(k, 0.0) + v

    def note_rss_peak(self, w: int, rss_peak: int | None) -> None:
        if w in self._stats:
            self._stats[w]["rss_peak"] = max(self._stats[w]["rss_peak"], rss_peak or 0)

    def micro_batch_record(self, mb: int, w: int, losses: dict, t: dict) -> dict:
        """A micro-batch TELEMETRY record's transport-free part (pass it through `present`)."""
        return {"kind": "micro_batch", "stage": self.k, "micro_batch": mb, "window": w, "step": self.opt.step_count,
                "schedule": self.schedule, **losses, **t,
                "active_s": self.clock.active_s, "wait_s": self.clock.wait_s,
                "wait_downstream_s": self.clock.wait_downstream_s, "cpu_s": time.process_time()}

    # ---- per window
    def end_window(self, w: int, before_commit: Callable[[], None] = lambda: None) -> tuple[str, dict]:
        """The AdamW step on the window's token-level mean gradient (none on a forward-only stage),
        then the atomic commit. (sha256 of the checkpoint, the window's TELEMETRY record's core)."""
        self.window = w
        grads = self._grads.mean(w) if not self.forward_only else None
        t0, cpu0 = time.time(), time.process_time()
        with self.clock.span("step"):
            if grads is not None:
                self.opt.step(grads)
            self.faults.fail("before-commit", w)
            before_commit()
            sha = self.store.commit(Checkpoint(window=w, step=self.opt.step_count, lora=self.lora,
                                               optimizer=self.opt.state_tensors(),
                                               meta={"next_micro_batch": (w + 1) * self.W}))
        self.committed = w
        return sha, self._window_record(w, time.time() - t0, time.process_time() - cpu0)

    def _window_record(self, w: int, step_s: float, step_cpu_s: float) -> dict:
        ws = self._stats.pop(w, None) or {"micro_batches": 0, "phase1_s": 0.0, "phase2_s": 0.0, "phase2_calls": 0,
                                          "sums": {}, "rss_peak": 0}
        n = max(ws["micro_batches"], 1)
        return {"kind": "window", "stage": self.k, "window": w, "step": self.opt.step_count, "schedule": self.schedule,
                "micro_batches": ws["micro_batches"], **{k: v / n for k, v in ws["sums"].items()},
                "phase1_s": ws["phase1_s"], "phase2_s": ws["phase2_s"], "phase2_calls": ws["phase2_calls"],
                "forward_only": self.forward_only or None, "step_s": step_s, "step_cpu_s": step_cpu_s,
                "_rss_peak": ws["rss_peak"]}

    def drop(self) -> None:
        """An in-app failure: the in-memory state goes; only what was committed to disk remains."""
        self.lora = self.opt = self._grads = None
        self._stats.clear()


def present(meta: dict) -> dict:
    """Drop unavailable readings: absent on the wire, never a made-up value. A NaN or infinite
    reading (a diverging run: a loss of NaN) has no JSON form: it is left out and its key listed
    in `nonfinite` (PROTOCOL.md 5.5), so the host hears of the divergence and the stage goes on."""
    out = {k: v for k, v in meta.items() if v is not None}
    bad = sorted(k for k, v in out.items() if isinstance(v, float) and not math.isfinite(v))
    for k in bad:
        del out[k]
    if bad:
        out["nonfinite"] = bad
    return out

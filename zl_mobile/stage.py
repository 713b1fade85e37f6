"""The stage runtime: one chunk, the seed's Algorithms 1 and 2 on one device.

Per micro-batch: take h_{k-1} from the inbound queue, phase 1, publish h_k downstream at once
(early forwarding), phase 2 (local loss + LoRA grads), accumulate. At the end of each update
window: AdamW step, then an atomic checkpoint, then tell the host and the upstream stage (which
may then prune its replay buffer). After a restart the stage resumes at the first micro-batch
after its last committed window, so no window is lost or applied twice.

This module is the phone's transport (TCP links, the host session, replay buffer); the training
itself (restore, accumulate, step, commit, window statistics, faults) is stage_core.StageCore,
which host/dist/ranks.py's ranks run too."""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from zl_common.manifest import ChunkEntry
from zl_common.program import ChunkProgram

from .checkpoint import CheckpointStore
from .link_rules import STALL_S, InboundQueue, link_frame_limit, unusable_reason
from .links import InboundLink, OutboundLink
from .protocol import Message, MsgType
from .readout import readout_positions
from .replay_store import ReplayStore
from .schedules import forwards_held, schedule
from .stage_core import FAILURE_EXIT_CODE, FAILURE_POINTS, SLOW_POINT, STALL_POINT, Faults, StageCore  # noqa: F401
from .stage_core import AppFailure as _AppFailure
from .stage_core import present as _present
from .telemetry import PssSampler, read_pss_by_backing, read_pss_bytes, read_temperature_c, runtime_pss_bytes, take_peak_rss_bytes

log = logging.getLogger("zl_mobile.stage")


# where each StageConfig field sits in STAGE_ASSIGN: top level, or inside its `config` object
_ASSIGN_KEYS = ("run_id", "downstream_token", "downstream", "window_size", "inflight_depth", "replay_horizon",
                "schedule", "listen_port")
_CONFIG_KEYS = ("lr", "weight_decay", "alpha", "keep_checkpoints", "total_micro_batches", "rollback_to_window",
                "inject_failure", "busy_ms", "restart")


@dataclass
class StageConfig:
    """What STAGE_ASSIGN tells a device (see docs/PROTOCOL.md 5.3). The defaults are what the device
    takes for a key the assignment leaves out; the host sends every key (but keep_checkpoints), so
    they decide nothing in a zl-host run. tests/vectors/stage_assign/stage_assign_defaults.json pins
    them, and the Kotlin core's StageAssignment passes the same file."""
    stage: int
    num_stages: int
    upstream_token: str
    run_id: str = "run"
    downstream_token: str | None = None
    downstream: str | None = None
    window_size: int = 4
    inflight_depth: int = 2
    replay_horizon: int = 16
    schedule: str = "zerolock"
    listen_port: int = 0  # 0: any port (the ACK says which)
    lr: float = 2e-3  # zl-host run's default (host/run/settings.py RunSettings)
    weight_decay: float = 0.0
    alpha: float | None = None  # None: the export's default
    keep_checkpoints: int = 2  # this device's own count; the Kotlin core keeps 1
    total_micro_batches: int | None = None
    rollback_to_window: int | None = None  # global-rollback baseline: restart from this window's checkpoint
    inject_failure: list | None = field(default_factory=list)  # [{"window": W, "point": one of FAILURE_POINTS}, ...]
    busy_ms: int = 600_000  # the longest a runtime call may keep this stage silent (HEARTBEAT busy_ms)
    restart: bool = False  # start afresh even when this device runs the same run_id and stage

    @classmethod
    def from_assign(cls, meta: dict) -> "StageConfig":
        conf = meta.get("config") or {}
        given = {**{k: meta[k] for k in _ASSIGN_KEYS if k in meta}, **{k: conf[k] for k in _CONFIG_KEYS if k in conf}}
        return cls(stage=meta["stage"], num_stages=meta["num_stages"], upstream_token=meta["upstream_token"], **given)


class Stage:
    def __init__(self, export_dir: Path, chunk: ChunkEntry, export: dict, cfg: StageConfig, workdir: Path,
                 to_host, limiter=None, data_port: int = 0, bind: str = "0.0.0.0", load_program=ChunkProgram,
                 link_delay=None, on_failure=None, listener=None, io_s: float = STALL_S):
        self.cfg = cfg
        self.on_failure = on_failure  # callable(stage, detect): an in-app failure dropped this stage
        self.alpha = torch.tensor([cfg.alpha if cfg.alpha is not None else export["alpha"]], dtype=torch.float32)
        readout_rows = export["readout_rows"]
        self.k = cfg.stage
        self.bp = cfg.schedule != "zerolock"  # BP baselines run the chunk's BP program
        entry = chunk.for_schedule(cfg.schedule)
        # zl_mobile.backends.Backend.load picks the runtime; a schedule that runs each phase 2
        # before the next phase 1 lets phase 1's saved activations stay in its arena (ChunkProgram)
        in_place = forwards_held(cfg.schedule, cfg.stage, cfg.num_stages, cfg.window_size) == 1
        self.runtime_pss = runtime_pss_bytes()  # before the first load: the memory breakdown's "runtime"
        self._weights_pss = None
        self._pss = PssSampler()
        self.program = load_program(export_dir, entry.json, in_place=in_place)
        self.first_input = entry.first_input
        self.is_last = cfg.stage == cfg.num_stages - 1
        probe = next((t for t in self.program.input_spec("phase1") if t["name"] == "grad_probe"), None)
        self._probe = {"grad_probe": torch.zeros(probe["shape"])} if probe else {}
        self.readout_rows = readout_rows
        self.to_host = to_host  # callable(Message), best effort
        self.workdir = Path(workdir)
        self.store = CheckpointStore(self.workdir / "stages" / cfg.run_id / f"stage_{self.k}", keep=cfg.keep_checkpoints)
        if cfg.rollback_to_window is not None:
            self.store.rollback(cfg.rollback_to_window)
        faults = Faults(cfg.inject_failure, store=self.store, stage=self.k,
                        marker=lambda point, w: self.workdir / f"failure-injected-{cfg.run_id}-{self.k}-{w}-{point}")
        self.core = StageCore(self.program, Path(export_dir) / entry.lora_init, self.store, stage=self.k,
                              window_size=cfg.window_size, lr=cfg.lr, weight_decay=cfg.weight_decay,
                              schedule=cfg.schedule, faults=faults, busy=self._busy)
        self.clock = self.core.clock
        ckpt = self.core.checkpoint
        W = cfg.window_size
        self.next_mb = self.core.next_micro_batch
        self._pending: dict[int, dict] = {}   # micro-batch -> what its L/B step needs (saved activations...)
        self.grads_in = InboundQueue(drop_older=False)  # BP: dL/dh_k from downstream, by micro-batch
        take_peak_rss_bytes()  # peaks count from here, not from loading

        self.queue = InboundQueue()
        max_frame = link_frame_limit(self._link_elements())
        self.inbound = InboundLink(f"stage{self.k}-in", cfg.upstream_token, self.queue,
                                   inflight_depth=cfg.inflight_depth,
                                   next_needed=lambda: self.queue.next_after(self.next_mb), port=data_port,
                                   bind=bind, delay=link_delay, listener=listener, max_frame=max_frame,
                                   stall_s=io_s, unusable=self._unusable)
        if ckpt is not None:
            self.inbound.last_commit = {"window": ckpt.window, "step": ckpt.step, "sha256": self.store.pointer()["sha256"]}
        self.outbound = None
        if cfg.downstream_token:
            # the replay buffer's on-disk copy: what this stage sent and its downstream has not
            # committed survives a restart of this stage (reloaded up to its resume point)
            self.outbound = OutboundLink(f"stage{self.k}-out", cfg.downstream_token, window_size=W,
                                         replay_horizon=cfg.replay_horizon, limiter=limiter,
                                         on_error=lambda text: self._report_error(text, fatal=True),
                                         on_gradient=self.grads_in.put, delay=link_delay,
                                         store=ReplayStore(self.store.dir / "replay"), first_mb=self.next_mb,
                                         max_frame=max_frame, stall_s=io_s)
            self.outbound.set_address(cfg.downstream)
        self._window_mark = self._counters()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"stage{self.k}", daemon=True)
        self._thread.start()
        log.info("stage %d: resumed after window %d, next micro-batch %d", self.k, self.committed, self.next_mb)

    # the core's state, read by the device (STATE_GET, RESUME_STATE)
    lora = property(lambda self: self.core.lora)
    opt = property(lambda self: self.core.opt)
    committed = property(lambda self: self.core.committed)
    done_micro_batches = property(lambda self: self.core.done_micro_batches)

    @property
    def data_port(self) -> int:
        return self.inbound.port

    def _link_elements(self) -> int:
        """Elements of the tensors a link carries for this chunk: its data inputs (h or token ids,
        masks, positions; not the LoRA weights) and its output h (GRADIENT comes back that big)."""
        lora = set(self.program.lora_names)
        n = sum(int(np.prod(t["shape"])) for t in self.program.input_spec("phase1") if t["name"] not in lora)
        outputs = self.program.methods["phase1"].get("outputs") or []
        return n + (int(np.prod(outputs[0]["shape"])) if outputs else 0)

    def _unusable(self, msg: Message) -> str | None:
        """Why the stage could never use this HIDDEN_STATE (None: it can). Checked as it arrives,
        so a peer cannot park frames the stage will never take, nor kill it with a bad label."""
        return unusable_reason(msg["micro_batch"], msg["window"], self.next_mb, inflight_depth=self.cfg.inflight_depth,
                               window_size=self.cfg.window_size, total=self.cfg.total_micro_batches)

    def rewire(self, downstream: str | None) -> None:
        if self.outbound is not None:
            self.outbound.set_address(downstream)

    def stop(self) -> None:
        self._stop.set()
        self.queue.stop()
        self.grads_in.stop()
        if threading.current_thread() is not self._thread:  # an in-app failure stops it from inside
            self._thread.join(timeout=10)
        self.inbound.close()
        if self.outbound is not None:
            self.outbound.close()
        if not self._thread.is_alive():
            # the program holds the .pte/.ptd descriptors (and its mapped weights): a replaced stage
            # gives them back now, not whenever the collector finds this object's cycles
            self.program = self.core.program = None

    # ---- the loop: run the schedule's actions in order
    def _run(self) -> None:
        actions = schedule(self.cfg.schedule, self.k, self.cfg.num_stages, self.cfg.window_size,
                           first_window=self.committed + 1, total=self.cfg.total_micro_batches)
        for action in actions:
            if self._stop.is_set():
                return
            try:
                {"F": self._forward, "L": self._local_step, "B": self._backward, "STEP": self._end_window}[action.op](action.mb)
            except _Stopped:
                return
            except _AppFailure as e:
                self._drop_state(e.detect)
                return
            except Exception as e:  # report, then stop this stage: the host decides what to do
                log.exception("stage %d failed at %r", self.k, action)
                self._report_error(f"stage {self.k} failed at {action!r}: {e}")
                return

    def _wait(self, q: InboundQueue, mb: int) -> Message:
        with self.clock.span("wait"):
            while not self._stop.is_set():
                msg = q.take(mb, timeout=0.5)
                if msg is not None:
                    return msg
        raise _Stopped

    def _batch(self, msg: Message) -> dict:
        t = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in msg.tensors.items()}
        index, target, weight, dropped = readout_positions(t["labels"].numpy(), self.readout_rows)
        if dropped:  # the host checks this before a run (zl_common.data.check_loss_positions); never silently
            raise ValueError(f"micro-batch {msg['micro_batch']} has {int(weight.sum()) + dropped} valid positions, more "
                             f"than the program's {self.readout_rows}; re-export with zl-export --loss-positions "
                             f"{int(weight.sum()) + dropped} or more")
        return {self.first_input: t["h"], "attention_mask": t["attention_mask"], "position_ids": t["position_ids"],
                "loss_index": torch.from_numpy(index), "loss_target": torch.from_numpy(target),
                "loss_weight": torch.from_numpy(weight), "alpha": self.alpha, "_dropped": dropped}

    def _forward(self, mb: int) -> None:
        """Phase 1, then h_k downstream at once (early forwarding)."""
        if self.outbound is not None and self.outbound.full():
            # backpressure: the replay buffer holds its bound of uncommitted hidden states, so wait
            # for the downstream to commit a window rather than forget one it may need to replay
            with self.clock.span("wait_downstream"):
                self.outbound.wait_for_room(self._stop)
            if self._stop.is_set():
                raise _Stopped
        msg = self._wait(self.queue, mb)
        self.next_mb = mb + 1  # before the credit goes out: the frame it allows is then in range
        self.inbound.grant(1)
        w = msg["window"]
        W = self.cfg.window_size
        if w != mb // W:
            raise ValueError(f"micro-batch {mb} labelled window {w}, expected {mb // W} for window size {W}")
        batch = self._batch(msg)
        # PipeDream's weight stashing: the backward must use the weights this forward used
        lora = {n: t.clone() for n, t in self.lora.items()} if self.cfg.schedule == "pipedream" else self.lora
        h, saved, t = self.core.phase1(mb, lora, {**batch, **self._probe})
        if self.outbound is not None:
            extras = {k: v for k, v in msg.tensors.items() if k != "h"}
            self.outbound.publish(Message(MsgType.HIDDEN_STATE, {"micro_batch": mb, "window": w},
                                          {"h": h.detach().clone().numpy(), **extras}))
            self.outbound.pump()
            self.outbound.persist(mb)
        self._pending[mb] = {"saved": saved, "batch": batch, "lora": lora, "window": w,
                             "t": {**t, "published": time.time(), "received": self.inbound.received_at.pop(mb, None)}}
        self.core.faults.fail("after-phase1", w)

    def _local_step(self, mb: int) -> None:
        """ZeroLock phase 2: local loss and LoRA grads from what phase 1 saved (none when forward-only)."""
        p = self._pending.pop(mb)
        # the saved activations go as soon as phase 2 has run: only the core holds them
        losses = self.core.local_step(p["window"], p["lora"], p.pop("saved"), p["batch"], p["t"])
        self._telemetry(mb, p, losses)

    def _backward(self, mb: int) -> None:
        """BP baselines: backward from dL/dh_k (or the loss, on the last stage); dL/dh_{k-1} goes upstream."""
        p = self._pending.pop(mb)
        values = {**p["batch"], **p["saved"], **p["lora"]}
        if not self.is_last:
            g = self._wait(self.grads_in, mb)
            values["grad_h_out"] = torch.from_numpy(np.ascontiguousarray(g.tensors["grad_h"]))
        t0 = time.time()
        with self.clock.span("phase2"), self._busy():
            out = self.program.run("phase2", values)
        del p["saved"], values
        p["t"]["phase2_start"] = t0
        if "grad_h_in" in out and self.k > 0:
            self.inbound.send_gradient(mb, out["grad_h_in"].detach().clone().numpy())
        grads = {n[5:]: t for n, t in out.items() if n.startswith("grad:")}
        loss = float(out["loss"]) if "loss" in out else None
        losses = {"loss": loss, "task_loss": loss}
        self.core.add(p["window"], grads, p["batch"]["loss_weight"], p["t"], losses)
        self._telemetry(mb, p, losses)

    def _telemetry(self, mb: int, p: dict, losses: dict) -> None:
        pss = self._pss.read()  # after phase 2: the saved activations are gone, so near the resting level
        mb_peak = take_peak_rss_bytes()  # this micro-batch's peak RSS, inside phases 1 and 2 included
        self.core.note_rss_peak(p["window"], mb_peak)
        self.to_host(Message(MsgType.TELEMETRY, _present({
            **self.core.micro_batch_record(mb, p["window"], losses, p["t"]),
            # when h_k was handed to the link (None: no credit yet, the link thread sends it later)
            "forwarded": self.outbound.sent_at.pop(mb, None) if self.outbound else None,
            "bytes_in": self.inbound.bytes_received, "bytes_out": self._bytes_out(),
            "replay_held": self.outbound.held() if self.outbound else None,
            "replay_held_peak": self.outbound.peak_buffered if self.outbound else None,
            "pss_bytes": pss, "rss_peak_bytes": mb_peak, "temperature_c": read_temperature_c(),
            "readout_dropped": p["batch"]["_dropped"], "in_flight": len(self._pending),
            "spans": [[k, a, b] for k, a, b in self.clock.drain_spans()],
        })))

    def _bytes_out(self) -> int:
        return self.outbound.bytes_sent if self.outbound else 0

    def _counters(self) -> dict:
        return {"active_s": self.clock.active_s, "wait_s": self.clock.wait_s,
                "wait_downstream_s": self.clock.wait_downstream_s, "seconds": time.time(),
                "cpu_s": time.process_time(),  # the process's, every thread: what a CPU budget counts
                "bytes_in": self.inbound.bytes_received, "bytes_out": self._bytes_out()}

    def _window_telemetry(self, rec: dict) -> None:
        """One record per update window: the core's (mean losses, time split), traffic and the window's peak RSS."""
        now, then = self._counters(), self._window_mark
        self._window_mark = now
        rss_peak = rec.pop("_rss_peak")
        self.to_host(Message(MsgType.TELEMETRY, _present({
            **rec, **{k: now[k] - then[k] for k in now},  # active/wait time, wall time and traffic of this window
            "pss_bytes": read_pss_bytes(), "rss_peak_bytes": max(rss_peak, take_peak_rss_bytes() or 0) or None,
            "temperature_c": read_temperature_c(), "pss_runtime_bytes": self.runtime_pss,
            "pss_weights_bytes": self._weights_pss_bytes(),
        })))

    def _weights_pss_bytes(self) -> int | None:
        """PSS of the mapped weights file, read after the first window (every page has been used by
        then) and kept: reading smaps takes ~15 ms, too long for every window. None when the
        weights are not a mapped file (the eager backend loads them onto the heap)."""
        if self._weights_pss is None:
            self._weights_pss = (read_pss_by_backing() or {}).get("weights") or 0
        return self._weights_pss or None

    def _end_window(self, w: int) -> None:
        # the window's hidden states are durable before its commit
        sha, rec = self.core.end_window(w, before_commit=self.outbound.sync if self.outbound is not None else lambda: None)
        self._window_telemetry(rec)
        self.to_host(Message(MsgType.CHECKPOINT_COMMITTED, {"window": w, "step": self.opt.step_count, "sha256": sha,
                                                            "stage": self.k}))
        self.inbound.committed(w, self.opt.step_count, sha)

    @contextlib.contextmanager
    def _busy(self):
        """Tell the host before a runtime call that this stage may be silent for a while: the
        ExecuTorch binding holds the Python interpreter while it computes, so the heartbeat
        thread cannot run until the call returns (PROTOCOL.md, HEARTBEAT busy_ms)."""
        self.to_host(Message(MsgType.HEARTBEAT, {"seq": 0, "busy_ms": self.cfg.busy_ms}))
        try:
            yield
        finally:
            self.to_host(Message(MsgType.HEARTBEAT, {"seq": 0, "busy_ms": 0}))

    def _drop_state(self, detect: str) -> None:
        """An in-app failure: the stage thread ends, its links close and its in-memory state (LoRA,
        optimizer, pending activations, gradients) is dropped; only what it committed to disk
        remains. The device then loses the host session (`connection`) or goes silent
        (`heartbeat`), and a new STAGE_ASSIGN restores the stage from its checkpoint."""
        self.stop()
        self._pending.clear()
        self.core.drop()
        if self.on_failure is not None:
            self.on_failure(self, detect)

    def _report_error(self, text: str, fatal: bool = True) -> None:
        """`fatal`: the run cannot go on as it is (PROTOCOL.md 5.4.1); the host stops it with `text`."""
        log.error(text)
        self.to_host(Message(MsgType.ERROR, {"code": "REJECTED", "message": text, "fatal": fatal}))

    def lora_state(self) -> dict:
        return {n: t.clone() for n, t in self.lora.items()}


class _Stopped(Exception):
    """The stage was stopped while waiting."""

"""The stage runtime: one chunk, the seed's Algorithms 1 and 2 on one device.

Per micro-batch: take h_{k-1} from the inbound queue, phase 1, publish h_k downstream at once
(early forwarding), phase 2 (local loss + LoRA grads), accumulate. At the end of each update
window: AdamW step, then an atomic checkpoint, then tell the host and the upstream stage (which
may then prune its replay buffer). After a restart the stage resumes at the first micro-batch
after its last committed window, so no window is lost or applied twice."""
from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from .adamw import AdamW, AdamWConfig
from .checkpoint import Checkpoint, CheckpointStore
from .links import InboundLink, InboundQueue, OutboundLink
from .program import ChunkProgram
from .protocol import Message, MsgType
from .readout import readout_positions
from .telemetry import ActivityClock, read_pss_bytes, read_temperature_c

log = logging.getLogger("zl_mobile.stage")
FAILURE_POINTS = ("after-phase1", "before-commit", "mid-checkpoint")
FAILURE_EXIT_CODE = 86


@dataclass
class StageConfig:
    """What STAGE_ASSIGN tells a device (see docs/PROTOCOL.md 5.3)."""
    run_id: str
    stage: int
    num_stages: int
    upstream_token: str
    downstream_token: str | None = None
    downstream: str | None = None
    window_size: int = 4
    inflight_depth: int = 2
    replay_horizon: int = 16
    schedule: str = "zerolock"
    lr: float = 1e-3
    weight_decay: float = 0.0
    alpha: float | None = None  # None: the export's default
    inject_failure: list | None = None  # [{"window": W, "point": one of FAILURE_POINTS}, ...]
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_assign(cls, meta: dict) -> "StageConfig":
        conf = dict(meta.get("config") or {})
        return cls(run_id=meta.get("run_id", "run"), stage=meta["stage"], num_stages=meta["num_stages"],
                   upstream_token=meta["upstream_token"], downstream_token=meta.get("downstream_token"),
                   downstream=meta.get("downstream"), window_size=meta.get("window_size", 4),
                   inflight_depth=meta.get("inflight_depth", 2), replay_horizon=meta.get("replay_horizon", 16),
                   schedule=meta.get("schedule", "zerolock"), lr=conf.get("lr", 1e-3),
                   weight_decay=conf.get("weight_decay", 0.0), alpha=conf.get("alpha"),
                   inject_failure=conf.get("inject_failure"))


class Stage:
    def __init__(self, export_dir: Path, chunk: dict, export: dict, cfg: StageConfig, workdir: Path,
                 to_host, limiter=None, data_port: int = 0, bind: str = "0.0.0.0"):
        self.cfg = cfg
        self.alpha = torch.tensor([cfg.alpha if cfg.alpha is not None else export["alpha"]], dtype=torch.float32)
        readout_rows = export["readout_rows"]
        self.k = cfg.stage
        self.program = ChunkProgram(export_dir, chunk)
        self.first_input = chunk["first_input"]
        self.readout_rows = readout_rows
        self.to_host = to_host  # callable(Message), best effort
        self.workdir = Path(workdir)
        self.store = CheckpointStore(self.workdir / "stages" / cfg.run_id / f"stage_{self.k}")
        self.store.fail_hook = lambda point: self._maybe_fail(point, self._window)
        self.clock = ActivityClock()
        self._window = -1

        init = load_file(str(Path(export_dir) / chunk["lora_init"]))
        self.lora = {n: init[n].clone() for n in self.program.lora_names}
        self.opt = AdamW(self.lora, AdamWConfig(lr=cfg.lr, weight_decay=cfg.weight_decay))
        ckpt = self.store.load()
        self.committed = -1
        if ckpt is not None:
            for n, t in ckpt.lora.items():
                self.lora[n].copy_(t)
            self.opt.load_state_tensors(ckpt.optimizer, ckpt.step)
            self.committed = ckpt.window
        W = cfg.window_size
        self.next_mb = (self.committed + 1) * W
        self._acc = {n: torch.zeros_like(p) for n, p in self.lora.items()}
        self._in_window = 0
        self.done_micro_batches = 0
        self.pss_peak = 0

        self.queue = InboundQueue()
        self.inbound = InboundLink(f"stage{self.k}-in", cfg.upstream_token, self.queue,
                                   inflight_depth=cfg.inflight_depth,
                                   next_needed=lambda: self.queue.next_after(self.next_mb), port=data_port,
                                   bind=bind)
        self.outbound = None
        if cfg.downstream_token:
            self.outbound = OutboundLink(f"stage{self.k}-out", cfg.downstream_token, window_size=W,
                                         replay_horizon=cfg.replay_horizon, limiter=limiter,
                                         on_error=self._report_error)
            self.outbound.set_address(cfg.downstream)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"stage{self.k}", daemon=True)
        self._thread.start()
        log.info("stage %d: resumed after window %d, next micro-batch %d", self.k, self.committed, self.next_mb)

    @property
    def data_port(self) -> int:
        return self.inbound.port

    def rewire(self, downstream: str | None) -> None:
        if self.outbound is not None:
            self.outbound.set_address(downstream)

    def stop(self) -> None:
        self._stop.set()
        self.queue.stop()
        self._thread.join(timeout=10)
        self.inbound.close()
        if self.outbound is not None:
            self.outbound.close()

    # ---- the loop
    def _run(self) -> None:
        while not self._stop.is_set():
            with self.clock.span("wait"):
                msg = self.queue.take(self.next_mb, timeout=0.5)
            if msg is None:
                continue
            self.inbound.grant(1)
            try:
                self._micro_batch(msg)
            except Exception as e:  # report, then keep serving: the host decides what to do
                log.exception("stage %d failed on micro-batch %d", self.k, msg["micro_batch"])
                self._report_error(f"stage {self.k} failed on micro-batch {msg['micro_batch']}: {e}")
                self._stop.wait(1.0)

    def _batch(self, msg: Message) -> dict:
        t = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in msg.tensors.items()}
        index, target, weight, dropped = readout_positions(t["labels"].numpy(), self.readout_rows)
        return {self.first_input: t["h"], "attention_mask": t["attention_mask"], "position_ids": t["position_ids"],
                "loss_index": torch.from_numpy(index), "loss_target": torch.from_numpy(target),
                "loss_weight": torch.from_numpy(weight), "alpha": self.alpha, "_dropped": dropped}

    def _micro_batch(self, msg: Message) -> None:
        mb, w = msg["micro_batch"], msg["window"]
        W = self.cfg.window_size
        if w != mb // W:
            raise ValueError(f"micro-batch {mb} labelled window {w}, expected {mb // W} for window size {W}")
        self._window = w
        batch = self._batch(msg)
        t0 = time.time()
        with self.clock.span("phase1"):
            h, saved = self.program.phase1(self.lora, batch)
        t1 = time.time()
        if self.outbound is not None:  # early forwarding: h_k leaves before phase 2 starts
            extras = {k: v for k, v in msg.tensors.items() if k != "h"}
            self.outbound.publish(Message(MsgType.HIDDEN_STATE, {"micro_batch": mb, "window": w},
                                          {"h": h.detach().clone().numpy(), **extras}))
            self.outbound.pump()
        t_pub = time.time()
        self._maybe_fail("after-phase1", w)
        with self.clock.span("phase2"):
            res = self.program.phase2(self.lora, saved, batch)
        del saved, h  # saved activations go as soon as phase 2 has run
        t2 = time.time()
        for n, g in res.grads.items():
            self._acc[n].add_(g)
        self._in_window += 1
        self.next_mb = mb + 1
        self.done_micro_batches += 1
        pss = read_pss_bytes()
        self.pss_peak = max(self.pss_peak, pss or 0)
        self.to_host(Message(MsgType.TELEMETRY, _present({
            "kind": "micro_batch", "stage": self.k, "micro_batch": mb, "window": w, "step": self.opt.step_count,
            "loss": res.loss, "task_loss": res.task_loss, "consis_loss": res.consis_loss,
            "phase1_start": t0, "phase1_end": t1, "published": t_pub, "phase2_end": t2,
            "received": self.inbound.received_at.pop(mb, None),
            # when h_k was handed to the link (None: no credit yet, the link thread sends it later)
            "forwarded": self.outbound.sent_at.pop(mb, None) if self.outbound else None,
            "active_s": self.clock.active_s, "wait_s": self.clock.wait_s,
            "bytes_in": self.inbound.bytes_received, "bytes_out": self.outbound.bytes_sent if self.outbound else 0,
            "pss_bytes": pss, "temperature_c": read_temperature_c(), "readout_dropped": batch["_dropped"],
            "spans": [[k, a, b] for k, a, b in self.clock.drain_spans()],
        })))
        if (mb + 1) % W == 0:
            self._end_window(w)

    def _end_window(self, w: int) -> None:
        n = max(self._in_window, 1)
        with self.clock.span("step"):
            self.opt.step({k: g / n for k, g in self._acc.items()})
            self._maybe_fail("before-commit", w)
            sha = self.store.commit(Checkpoint(window=w, step=self.opt.step_count, lora=self.lora,
                                               optimizer=self.opt.state_tensors(),
                                               meta={"next_micro_batch": (w + 1) * self.cfg.window_size}))
        self.committed = w
        for g in self._acc.values():
            g.zero_()
        self._in_window = 0
        self.to_host(Message(MsgType.CHECKPOINT_COMMITTED, {"window": w, "step": self.opt.step_count, "sha256": sha,
                                                            "stage": self.k}))
        self.inbound.committed(w, self.opt.step_count, sha)

    # ---- fault injection (tests, benchmarks): kill this process at a named point, once
    def _maybe_fail(self, point: str, window: int) -> None:
        specs = self.cfg.inject_failure or []
        if not any(sp.get("point", "after-phase1") == point and sp.get("window") == window for sp in specs):
            return
        marker = self.workdir / f"failure-injected-{self.cfg.run_id}-{self.k}-{window}-{point}"
        if marker.exists():
            return
        marker.write_text("injected")
        log.warning("stage %d: injected failure at %s of window %d", self.k, point, window)
        if point == "mid-checkpoint":  # leave a half-written checkpoint behind, as a crash would
            tmp = next(self.store.dir.glob("*.tmp"), None)
            if tmp is not None:
                with open(tmp, "r+b") as f:
                    f.truncate(max(1, tmp.stat().st_size // 2))
        os._exit(FAILURE_EXIT_CODE)

    def _report_error(self, text: str) -> None:
        log.error(text)
        self.to_host(Message(MsgType.ERROR, {"code": "REJECTED", "message": text}))

    def lora_state(self) -> dict:
        return {n: t.clone() for n, t in self.lora.items()}


def _present(meta: dict) -> dict:
    """Drop unavailable readings: absent on the wire, never a made-up value."""
    return {k: v for k, v in meta.items() if v is not None}

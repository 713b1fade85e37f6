"""ZeroLock stages as torch.distributed ranks: one stage per rank under `torchrun`.

    torchrun --nproc-per-node 3 -m host.dist --program build/tiny --steps 8 --out runs/d1

Rank k runs chunk k on the eager backend (zl_mobile/eager_program.py), on CPU or its CUDA device,
from the same exported directory and data options as `zl-host run`; rank 0 writes the same run
directory (PEFT adapter, metrics.jsonl, report with plots, run.json, summary.json) with the host's
own code (host/run/data.py prepare_data, host/outputs/adapter.py, host/run/report.py).

Hidden states go rank to rank with torch.distributed point-to-point ops (Gloo, or NCCL with
--wire device between CUDA ranks): the isend of h_k starts right after phase 1, before phase 2
(early forwarding); receives for the next `--inflight` micro-batches are posted ahead (the seed's
preposted receive, Algorithm 2 line 13); at most `--inflight` sends are outstanding per link. Stage
0 reads the data itself; every rank reads it too for the labels and masks of its micro-batches
(the phones get those along with h), so only h crosses a link. The actions come from
zl_mobile/schedules.py (ZeroLock: F, L, STEP); `--schedule gpipe|1f1b|zerobubble` runs the
back-propagation baselines through torch.distributed.pipelining instead (host/dist/pipelining.py).

Recovery under `torchrun --max-restarts N`: a killed rank makes torchrun restart every rank; each
resumes from its own last committed checkpoint (zl_mobile/checkpoint.py), so ranks may resume at
different windows. Every sending rank keeps the h_k it sent in a replay log on disk until its
downstream says (a commit notice, a key in the rendezvous store) that it committed
the window that used them. After a restart the ranks exchange their committed windows; rank k then
re-sends from its log what rank k+1 lacks ([s_{k+1}, s_k), s = first micro-batch after the
committed window), recomputes from s_k on, and sends nothing rank k+1 has already committed. The
re-sent h_k are the bytes first sent (computed with the LoRA of their time; recomputing them with
today's LoRA would change the result), so no window is lost or applied twice and the LoRA equals
that of an uninterrupted run."""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from collections import deque
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from zl_common.manifest import Manifest, ManifestError
from zl_mobile.checkpoint import CheckpointStore
from zl_mobile.readout import readout_positions
from zl_mobile.schedules import schedule
from zl_mobile.stage_core import FAILURE_POINTS, Faults, StageCore, present
from zl_mobile.telemetry import read_pss_bytes, read_temperature_c, take_peak_rss_bytes

from ..run.settings import RunSettings
from ..run.config import add_run_options

SCHEDULES = ("zerolock", "gpipe", "1f1b", "zerobubble")
STORE = None  # this attempt's rendezvous store (commit notices go through it)


class DistError(Exception):
    """A one-line error for the user."""


# ------------------------------------------------------------------ options
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zl-dist", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--program", required=True, help="zl-export output dir (exported with --eager-weights)")
    p.add_argument("--data", default=None, help="AG News CSV or JSONL; omit for the tiny model's synthetic set")
    add_run_options(p, ["steps", "epochs", "micro_batches", "window"])  # zl-host run's definitions
    p.add_argument("--inflight", type=int, default=RunSettings.inflight_depth,
                   help="hidden states in flight per link (sends and preposted receives)")
    p.add_argument("--lr", type=float, default=RunSettings.lr)
    p.add_argument("--weight-decay", type=float, default=RunSettings.weight_decay,
                   help="AdamW weight decay (zl-host run's default)")
    p.add_argument("--alpha", type=float, default=None, help="override the export's task/consistency blend")
    p.add_argument("--out", required=True, help="run dir (the same on every rank of a machine; rank 0 writes the report)")
    p.add_argument("--schedule", default="zerolock",
                   help="zerolock (this runtime), or a BP baseline through torch.distributed.pipelining: gpipe, "
                        "1f1b, zerobubble; several, comma-separated, run one after another in RUN_DIR/<schedule>/")
    p.add_argument("--torch-device", default="auto",
                   help="auto (cuda:LOCAL_RANK when CUDA is there, else cpu), cpu, cuda, cuda:N")
    p.add_argument("--wire", default="cpu", choices=["cpu", "device"],
                   help="cpu: hidden states over Gloo (CPU copies; works for ranks sharing a GPU); device: CUDA "
                        "tensors over NCCL (one GPU per rank)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads per rank")
    p.add_argument("--inject-failure", action="append",
                   help="stage=K,window=W[,point=after-phase1|before-commit|mid-checkpoint]: "
                        "kill that rank there, once (torchrun --max-restarts restarts the ranks)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a rank waits on a peer before giving up")
    p.add_argument("--save-grads", action="store_true",
                   help="BP baselines: write each rank's LoRA and gradients per window to RUN_DIR/grads (checks)")
    return p


# before-commit-behind: at the end of window W, wait until the first h_{k-1} of window W+1 has
# arrived (so upstream has committed W), then die before committing W: the restart then has a gap
# of one window that upstream must re-send from its replay log (a deterministic test of it)
DIST_FAILURE_POINTS = (*FAILURE_POINTS, "before-commit-behind")


def parse_failures(specs) -> list[dict]:
    out = []
    for spec in specs or []:
        try:
            d = dict(part.split("=", 1) for part in spec.split(","))
            f = {"stage": int(d["stage"]), "window": int(d["window"]), "point": d.get("point", "after-phase1")}
        except (KeyError, ValueError):
            raise DistError(f"--inject-failure {spec!r}: expected stage=K,window=W[,point=...]") from None
        if f["point"] not in DIST_FAILURE_POINTS:
            raise DistError(f"--inject-failure point {f['point']!r}: use one of {', '.join(DIST_FAILURE_POINTS)}")
        out.append(f)
    return out


def pick_device(spec: str) -> torch.device:
    from zl_mobile.eager_program import check_torch_device

    if spec == "auto":
        spec = f"cuda:{int(os.environ.get('LOCAL_RANK', 0)) % max(torch.cuda.device_count(), 1)}" \
            if torch.cuda.is_available() else "cpu"
    try:
        return check_torch_device(spec)
    except ValueError as e:
        raise DistError(str(e)) from None


def load_run_inputs(a):
    """(manifest (zl_common.manifest.Manifest), train micro-batches, windows): the data exactly as
    `zl-host run` prepares it."""
    from ..cli.error import CliError
    from ..evaluation.evaluate import split_held_out
    from ..run.config import RunConfig
    from ..run.data import prepare_data

    program = Path(a.program)
    try:
        manifest = Manifest.load(program)
        train, _ = split_held_out(prepare_data(program, manifest.json, a.data))
    except (ManifestError, CliError) as e:
        raise DistError(str(e)) from None
    return manifest, train, RunConfig.from_args(a).windows_for(len(train))  # zl-host run's rule


# ------------------------------------------------------------------ the rank's stage
class DistStage:
    """Chunk k on rank k: the schedule's actions, hidden states over torch.distributed p2p; the
    training itself is the phones' (zl_mobile/stage_core.StageCore)."""

    def __init__(self, a, manifest: Manifest, train: list, windows: int, device: torch.device, ctrl, wire_device):
        from zl_mobile.eager_program import EagerChunkProgram

        self.a = a
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.k = self.rank
        chunks = manifest.chunks
        if self.world != len(chunks):
            raise DistError(f"{len(chunks)} chunks need {len(chunks)} ranks, torchrun started {self.world}: "
                            f"use --nproc-per-node {len(chunks)} (or nnodes x nproc-per-node = {len(chunks)})")
        try:  # the rank runs the ZeroLock program's methods, in eager PyTorch
            chunk = chunks[self.k].for_mode("zerolock")
        except ManifestError as e:
            raise DistError(f"schedule zerolock: {e}") from None
        export = manifest.export
        self.W, self.windows, self.total = a.window, windows, windows * a.window
        self.train = train
        self.ctrl = ctrl
        self.rdzv = STORE
        self.run_id = f"{Path(a.out).resolve().name}-{a.schedule}"
        self.wire = wire_device  # (device of h on the link from k-1, device of h on the link to k+1)
        self.device = device
        self.program = EagerChunkProgram(Path(a.program), chunk.json, device)
        self.first_input = chunk.first_input
        self.readout_rows = export["readout_rows"]
        self.alpha = torch.tensor([a.alpha if a.alpha is not None else export["alpha"]], dtype=torch.float32)
        self.shape = (export["micro_batch"], export["seq_len"], manifest.model["hf_config"]["hidden_size"])
        run_dir = Path(a.out)
        self.run_dir = run_dir
        self.store = CheckpointStore(run_dir / "stages" / f"stage_{self.k}")
        self.log_dir = run_dir / "stages" / f"stage_{self.k}" / "sent"  # replay log of the h_k sent downstream
        self.log_dir.mkdir(parents=True, exist_ok=True)
        # micro-batches in the replay log, a restart's included (telemetry: replay_held)
        self.log_held: set[int] = {int(f.stem[3:]) for f in self.log_dir.glob("mb_*.pt")}
        self.log_held_peak = len(self.log_held)
        self.faults = Faults([f for f in (a.inject_failure or []) if f["stage"] == self.k], store=self.store, stage=self.k,
                             marker=lambda point, w: run_dir / f"failure-injected-{self.k}-{w}-{point}",
                             on_fire=lambda point, w: self._record("FAILURE_INJECTED", {"window": w, "point": point}))
        self.core = StageCore(self.program, Path(a.program) / chunk.lora_init, self.store, stage=self.k,
                              window_size=a.window, lr=a.lr, weight_decay=a.weight_decay, faults=self.faults)
        self.clock = self.core.clock
        self._pending = {}
        self.sends: deque = deque()       # outstanding isends (mb, work, tensor)
        self.recvs: dict[int, tuple] = {}  # preposted irecvs: mb -> (work, buffer)
        self.bytes_in = self.bytes_out = 0
        self.peak_rss = 0
        self.incarnation = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
        self.device_name = f"rank{self.k}@{socket.gethostname()}:{device}"
        (run_dir / "ranks").mkdir(parents=True, exist_ok=True)
        self.metrics = open(run_dir / "ranks" / f"rank_{self.k}.jsonl", "a")
        from ..run.tensorboard_log import RunEvents  # each rank its own stage's curves, live (tensorboard --logdir)
        self.board = RunEvents(run_dir, export["micro_batch"])
        take_peak_rss_bytes()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    lora = property(lambda self: self.core.lora)
    opt = property(lambda self: self.core.opt)
    committed = property(lambda self: self.core.committed)

    # ---- records, as the phones' TELEMETRY lands in metrics.jsonl (NaN named in `nonfinite`, as theirs)
    def _record(self, type_: str, meta: dict) -> None:
        rec = {"t": time.time(), "device": self.device_name, "stage": self.k, "type": type_, **present(meta)}
        self.metrics.write(json.dumps(rec) + "\n")
        self.metrics.flush()
        self.board.on_event(type_.lower(), rec)

    def _cuda_peak(self):
        return torch.cuda.max_memory_allocated(self.device) if self.device.type == "cuda" else None

    # ---- links
    def _micro_batch(self, mb: int) -> dict:
        b = self.train[mb % len(self.train)]
        t = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in b.items()}
        index, target, weight, dropped = readout_positions(b["labels"], self.readout_rows)
        return {"input_ids": t["input_ids"], "attention_mask": t["attention_mask"], "position_ids": t["position_ids"],
                "loss_index": torch.from_numpy(index), "loss_target": torch.from_numpy(target),
                "loss_weight": torch.from_numpy(weight), "alpha": self.alpha, "_dropped": dropped}

    def _prepost(self, start: int) -> None:
        """Keep irecvs posted for the next `inflight` micro-batches from `start` (Algorithm 2, line 13)."""
        if self.k == 0:
            return
        for mb in range(start, min(start + self.a.inflight, self.total)):
            if mb not in self.recvs:
                buf = torch.empty(self.shape, dtype=torch.float32, device=self.wire[0])
                self.recvs[mb] = (dist.irecv(buf, src=self.k - 1, tag=mb), buf)

    def _receive(self, mb: int) -> torch.Tensor:
        self._prepost(mb)
        work, buf = self.recvs.pop(mb)
        with self.clock.span("wait"):
            work.wait()
        self.bytes_in += buf.numel() * buf.element_size()
        self._prepost(mb + 1)
        return buf

    def _send(self, mb: int, h: torch.Tensor) -> None:
        """isend h_k for `mb`, with at most `inflight` sends outstanding on the link."""
        while len(self.sends) >= self.a.inflight:
            _, work, _ = self.sends.popleft()
            with self.clock.span("wait_downstream"):  # held back by the link's bound, as a phone's backpressure
                work.wait()
        h = h.detach().to(self.wire[1]).contiguous()
        self.sends.append((mb, dist.isend(h, dst=self.k + 1, tag=mb), h))
        self.bytes_out += h.numel() * h.element_size()

    def _log(self, mb: int, h: torch.Tensor) -> None:
        """Keep h_k for `mb` on disk until downstream commits its window (the replay source)."""
        final = self.log_dir / f"mb_{mb:09d}.pt"
        tmp = final.with_suffix(".tmp")
        with open(tmp, "wb") as f:
            torch.save(h.detach().to("cpu").clone(), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        self.log_held.add(mb)
        self.log_held_peak = max(self.log_held_peak, len(self.log_held))

    def _prune_log(self, downstream_committed: int) -> None:
        keep_from = (downstream_committed + 1) * self.W
        for f in self.log_dir.glob("mb_*.pt"):
            if int(f.stem[3:]) < keep_from:
                f.unlink(missing_ok=True)
        self.log_held = {mb for mb in self.log_held if mb >= keep_from}

    # ---- commit notices: downstream -> upstream, after each of its commits, through the rendezvous
    # store (a Gloo irecv cannot be polled: its is_completed() stays False until wait() is called)
    def _notice_key(self, k: int, w: int) -> str:
        return f"{self.run_id}/committed/{k}/{w}"

    def _poll_notices(self, block: bool = False) -> None:
        while self.k + 1 < self.world and self._notice_next <= self.windows - 1:
            key = self._notice_key(self.k + 1, self._notice_next)
            if block:
                with self.clock.span("wait"):
                    self.rdzv.wait([key])
            elif not self.rdzv.check([key]):
                return
            self._prune_log(self._notice_next)
            self._notice_next += 1

    # ---- the run
    def run(self) -> None:
        W = self.W
        committed = [None] * self.world
        dist.all_gather_object(committed, self.committed, group=self.ctrl)
        start = [(c + 1) * W for c in committed]
        self._record("DIST_RESUME", {"incarnation": self.incarnation, "committed_window": self.committed,
                                     "committed_windows": committed, "next_micro_batch": start[self.k]})
        self._down_start = start[self.k + 1] if self.k + 1 < self.world else None
        self._notice_next = committed[self.k + 1] + 1 if self.k + 1 < self.world else self.windows
        if self._down_start is not None:
            self._prune_log(committed[self.k + 1])
            for mb in range(self._down_start, min(start[self.k], self.total)):  # the gap downstream lacks
                path = self.log_dir / f"mb_{mb:09d}.pt"
                if not path.exists():
                    raise DistError(f"rank {self.k}: the replay log lacks micro-batch {mb} that rank {self.k + 1} "
                                    f"needs ({path}); was {self.run_dir} cleared between restarts?")
                self._send(mb, torch.load(path, weights_only=True))
        self._prepost(start[self.k])
        self._mark = self._counters()
        for action in schedule("zerolock", self.k, self.world, W, first_window=self.committed + 1, total=self.total):
            if action.op == "STEP" and action.mb >= self.windows:
                break
            if action.op != "STEP" and action.mb >= self.total:
                break
            {"F": self._forward, "L": self._local_step, "STEP": self._end_window}[action.op](action.mb)
            self._poll_notices()
        while self.sends:
            self.sends.popleft()[1].wait()
        self._poll_notices(block=True)  # downstream has committed every window: nothing left to replay

    def _forward(self, mb: int) -> None:
        w = mb // self.W
        batch = self._micro_batch(mb)
        received = None
        if self.k > 0:
            batch[self.first_input] = self._receive(mb)
            received = time.time()
        _, saved, t = self.core.phase1(mb, self.lora, batch)
        forwarded = None
        if self.k + 1 < self.world and mb >= self._down_start:
            h = saved["_autograd"].h  # on the rank's device; h_out is its CPU copy
            self._log(mb, h)
            self._send(mb, h)  # early forwarding: the send starts before phase 2
            forwarded = time.time()
        self._pending[mb] = {"saved": saved, "batch": batch, "window": w,
                             "t": {**t, "published": forwarded, "received": received}, "forwarded": forwarded}
        self.faults.fail("after-phase1", w)

    def _local_step(self, mb: int) -> None:
        p = self._pending.pop(mb)
        losses = self.core.local_step(p["window"], self.lora, p.pop("saved"), p["batch"], p["t"])
        peak = take_peak_rss_bytes()
        self.core.note_rss_peak(p["window"], peak)
        self.peak_rss = max(self.peak_rss, peak or 0)
        self._record("TELEMETRY", {
            **self.core.micro_batch_record(mb, p["window"], losses, p["t"]), "forwarded": p["forwarded"],
            "bytes_in": self.bytes_in, "bytes_out": self.bytes_out,
            "replay_held": len(self.log_held) if self.k < self.world - 1 else None,
            "replay_held_peak": self.log_held_peak if self.k < self.world - 1 else None,
            "pss_bytes": read_pss_bytes(), "rss_peak_bytes": peak, "temperature_c": read_temperature_c(),
            "readout_dropped": p["batch"]["_dropped"], "in_flight": len(self.sends),
            "cuda_max_allocated_bytes": self._cuda_peak(),
            "spans": [[k, a, b] for k, a, b in self.clock.drain_spans()]})

    def _counters(self) -> dict:
        return {"active_s": self.clock.active_s, "wait_s": self.clock.wait_s,
                "wait_downstream_s": self.clock.wait_downstream_s, "seconds": time.time(),
                "cpu_s": time.process_time(), "bytes_in": self.bytes_in, "bytes_out": self.bytes_out}

    def _end_window(self, w: int) -> None:
        sha, rec = self.core.end_window(w, before_commit=lambda: self._before_commit_behind(w))
        if self.k > 0:  # tell upstream: it may drop the h_k of this window from its replay log
            self.rdzv.set(self._notice_key(self.k, w), "1")
        now, then = self._counters(), self._mark
        self._mark = now
        rss = rec.pop("_rss_peak")
        self._record("TELEMETRY", {
            **rec, **{k: now[k] - then[k] for k in now}, "pss_bytes": read_pss_bytes(),
            "rss_peak_bytes": max(rss, take_peak_rss_bytes() or 0) or None,
            "temperature_c": read_temperature_c(), "cuda_max_allocated_bytes": self._cuda_peak()})
        self._record("CHECKPOINT_COMMITTED", {"window": w, "step": self.opt.step_count, "sha256": sha})

    def _before_commit_behind(self, w: int) -> None:
        """The rank-only fault point: die before committing `w` once upstream has committed it."""
        if self.k > 0 and (w + 1) * self.W < self.total and self.faults.due("before-commit-behind", w):
            self._prepost((w + 1) * self.W)
            self.recvs[(w + 1) * self.W][0].wait()  # upstream has committed w: it sent window w + 1
            self.faults.fail("before-commit-behind", w)

    def lora_state(self) -> dict:
        return {n: t.numpy().copy() for n, t in self.lora.items()}


# ------------------------------------------------------------------ the run directory (rank 0)
def write_run_dir(a, manifest: Manifest, windows: int, run_id: str, seconds: float, lora: dict, records: list,
                  extra: dict | None = None) -> Path:
    """The same run directory `zl-host run` writes, with the host's code."""
    from ..outputs.adapter import base_model_path, write_peft_adapter
    from ..run.report import write_report

    run_dir = Path(a.out)
    program = Path(a.program)
    records = sorted(records, key=lambda r: r["t"])
    with open(run_dir / "metrics.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    adapter = write_peft_adapter(lora, manifest.json, run_dir / "adapter", base_model_path(program, manifest.json))
    mbs = windows * a.window
    rows = mbs * manifest.export["micro_batch"]
    summary = {"run_id": run_id, "program": str(program), "data": a.data or "synthetic", "windows": windows,
               "window_size": a.window, "micro_batches": mbs, "lr": a.lr, "seconds": seconds,
               "samples_per_s": rows / seconds if seconds else 0.0, "schedule": a.schedule,
               "recoveries": sum(1 for r in records if r["type"] == "DIST_RESUME" and r.get("incarnation", 0) > 0
                                 and r["stage"] == 0),
               "link_bytes": max((r.get("bytes_out", 0) for r in records if r.get("kind") == "micro_batch"), default=0),
               "errors": [], **(extra or {})}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    write_report(run_dir, summary)
    return adapter


def _write_run_json(a, windows: int, run_id: str, world: int) -> None:
    rec = {"program": str(Path(a.program).absolute()), "data": a.data, "devices": f"torch.distributed:{world}",
           "run_id": run_id, "launcher": "host.dist",
           "settings": {"windows": windows, "window_size": a.window, "inflight_depth": a.inflight, "lr": a.lr,
                        "weight_decay": a.weight_decay,
                        "alpha": a.alpha, "schedule": a.schedule, "inject_failure": a.inject_failure,
                        "torch_device": a.torch_device, "wire": a.wire},
           "argv": sys.argv[1:]}
    tmp = Path(a.out) / "run.json.tmp"
    tmp.write_text(json.dumps(rec, indent=2))
    tmp.replace(Path(a.out) / "run.json")


def _attempt_store(timeout: float):
    """torchrun's store, with this restart's keys apart from the last one's. torchrun (the c10d
    rendezvous and the static one alike, sharing the agent's TCPStore) keeps the store across
    --max-restarts, and Gloo's connectFullMesh then reads the previous attempt's addresses:
    "Connection refused" on every restart (seen with torch 2.13; pytorch/pytorch#135712)."""
    from datetime import timedelta

    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
                         is_master=not agent and os.environ["RANK"] == "0", timeout=timedelta(seconds=timeout))
    return dist.PrefixStore(f"zl_dist/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", base)


def init_distributed(a):
    """The default process group (Gloo for CPU tensors, NCCL for CUDA ones where CUDA is there) and
    a Gloo group for control (the committed windows, the final gather). (device, ctrl, wire devices)."""
    if "RANK" not in os.environ:
        raise DistError("not started by torchrun: run torchrun --nproc-per-node K -m host.dist ... "
                        "(K = the export's chunk count)")
    device = pick_device(a.torch_device)
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    from datetime import timedelta

    global STORE
    STORE = _attempt_store(a.timeout)
    dist.init_process_group(backend=backend, store=STORE, rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]), timeout=timedelta(seconds=a.timeout))
    ctrl = dist.new_group(backend="gloo", timeout=timedelta(seconds=a.timeout))
    types = [None] * dist.get_world_size()
    dist.all_gather_object(types, device.type, group=ctrl)
    k = dist.get_rank()

    def link(i, j):  # the device of h on the link between ranks i and j
        if a.wire == "device" and 0 <= i and j < len(types) and types[i] == types[j] == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    if a.wire == "device" and "cpu" in types:
        raise DistError(f"--wire device needs CUDA on every rank (devices: {types}): use --wire cpu")
    return device, ctrl, (link(k - 1, k), link(k, k + 1))


def run(a) -> int:
    import copy

    a.inject_failure = parse_failures(a.inject_failure)
    schedules = [x.strip() for x in a.schedule.split(",") if x.strip()]
    bad = [x for x in schedules if x not in SCHEDULES]
    if bad or not schedules:
        raise DistError(f"--schedule {a.schedule!r}: use one or more (comma-separated) of {', '.join(SCHEDULES)}")
    if a.threads:
        torch.set_num_threads(a.threads)
    manifest, train, windows = load_run_inputs(a)
    if a.inflight < 1:
        raise DistError("--inflight must be >= 1")
    device, ctrl, wire = init_distributed(a)
    for name in schedules:  # side by side in one launch: RUN_DIR/<schedule>/ each
        one = copy.copy(a)
        one.schedule = name
        if len(schedules) > 1:
            one.out = str(Path(a.out) / name)
        Path(one.out).mkdir(parents=True, exist_ok=True)
        _run_one(one, manifest, train, windows, device, ctrl, wire)
    dist.destroy_process_group()
    return 0


def _run_one(a, manifest: Manifest, train, windows, device, ctrl, wire) -> None:
    rank = dist.get_rank()
    run_id = f"dist-{Path(a.out).resolve().name}"
    if rank == 0:
        _write_run_json(a, windows, run_id, dist.get_world_size())
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if a.schedule == "zerolock":
        stage = DistStage(a, manifest, train, windows, device, ctrl, wire)
        stage.run()
        lora = stage.lora_state()
        extra = {"schedule": "zerolock", "rss_peak_bytes": stage.peak_rss or None,
                 "cuda_max_allocated_bytes": stage._cuda_peak()}
        stage.metrics.close()
        stage.board.close()
        del stage
    else:
        from .pipelining import run_baseline

        if a.window < dist.get_world_size() and a.schedule != "gpipe":
            raise DistError(f"--schedule {a.schedule} (torch.distributed.pipelining) needs --window >= the number "
                            f"of stages ({dist.get_world_size()}), got {a.window}")
        lora, extra = run_baseline(a, manifest, train, windows, device, ctrl)
    lines = (Path(a.out) / "ranks" / f"rank_{rank}.jsonl").read_text().splitlines()
    got = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object((lora, lines, extra), got, dst=0, group=ctrl)
    if rank == 0:
        merged = {n: v for part in got for n, v in part[0].items()}
        records = [json.loads(x) for part in got for x in part[1]]
        first = min((r["t"] for r in records if r["type"] == "DIST_RESUME"), default=time.time())
        per_rank = {f"rank_{i}": part[2] for i, part in enumerate(got) if part[2]}
        if a.schedule != "zerolock":  # torch's schedules log windows only, at the end: rank 0 writes their events
            from ..run.tensorboard_log import RunEvents
            board = RunEvents(Path(a.out), manifest.export["micro_batch"])
            for r in sorted(records, key=lambda r: r["t"]):
                board.on_event(r["type"].lower(), r)
            board.close()
        adapter = write_run_dir(a, manifest, windows, run_id, time.time() - first, merged, records,
                                {"ranks": per_rank} if per_rank else None)
        print(f"zl-dist: {a.schedule}: adapter {adapter}  report {Path(a.out) / 'report.md'}", file=sys.stderr)
    dist.barrier(group=ctrl)


def main(argv=None) -> int:
    import faulthandler
    import signal

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # kill -USR1 PID: where a rank waits
    a = build_parser().parse_args(argv)
    try:
        rc = run(a)
    except DistError as e:
        print(f"zl-dist: error: {e}", file=sys.stderr)
        rc = 2
    # Gloo's threads outlive destroy_process_group, and at interpreter exit a joinable std::thread's
    # destructor can abort the rank ("terminate called without an active exception", exit -6) after
    # the adapter and report are written (about 1 run in 6 after a restart). Everything is written
    # and closed by now: leave without running the C++ static destructors.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


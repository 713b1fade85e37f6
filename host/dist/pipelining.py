"""The back-propagation baselines on the same ranks through torch.distributed.pipelining itself.

Same chunks (the export's chunk_k_weights.safetensors, built as zl_mobile/eager_program.py builds
them), same LoRA (the export's lora_init, peft's modules), same micro-batches and update window,
and the same AdamW (zl_mobile/adamw.py) after each window; what differs is the schedule and that
gradients cross the ranks:

  gpipe       torch.distributed.pipelining.ScheduleGPipe
  1f1b        torch.distributed.pipelining.Schedule1F1B
  zerobubble  torch.distributed.pipelining.ScheduleInterleavedZeroBubble with one stage per rank
              (ZB1P: the backward split into input and weight gradients, the weight part filling
              the bubble)

One update window is one `schedule.step` over the window's W micro-batches (the batch of W*B rows
split into W micro-batches of B), with `scale_grads` (the mean over micro-batches, as the ZeroLock
stages average theirs). The stage module runs the chunk's layers with an all-ones attention mask:
the micro-batches are right-padded and attention is causal, so the valid positions, the only ones
the loss reads, see the same keys as with the padding mask (the gradient test checks it against
backprop through the whole model with the real mask). Only the last stage has a readout; its
loss is the global CE over the valid positions (the BP programs' global_loss).

With --wire cpu (default) the stage's buffers are CPU tensors over Gloo and the module moves them
to its CUDA device and back (what ranks sharing one GPU need: NCCL refuses two ranks on a GPU);
with --wire device the stage lives on the GPU and torch sends CUDA tensors over NCCL."""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

from zl_common.manifest import Manifest
from zl_common.program import ProgramError
from zl_mobile.adamw import AdamW, AdamWConfig
from zl_mobile.readout import readout_positions
from zl_mobile.telemetry import read_pss_bytes, take_peak_rss_bytes

BASELINES = ("gpipe", "1f1b", "zerobubble")


def build_bp_chunk(export_dir: Path, manifest: Manifest, k: int, device: torch.device):
    """Chunk k as a BPChunkModel with trainable LoRA parameters set to the export's lora_init.
    Returns (chunk, {manifest LoRA name: parameter})."""
    from safetensors.torch import load_file

    from exporter.chunk_model import PROBE, peft_name
    from zl_mobile.eager_program import EAGER_FIX, _build_chunk, _export_config

    entry = manifest.chunks[k]  # eager: the chunk's frozen weights and LoRA init, no program of either mode
    if entry.eager_weights is None:
        raise ProgramError(f"the export has no eager-backend weights for chunk {k}: {EAGER_FIX}")
    first, last = entry.layers
    cfg = _export_config(manifest.export)
    chunk = _build_chunk(Path(export_dir) / entry.eager_weights, manifest.model["hf_config"], cfg,
                         first, last, bp_last=k == len(manifest.chunks) - 1)
    if hasattr(chunk, PROBE):  # the BP programs' zero probe for dL/dh_{k-1}: autograd gives it here
        getattr(chunk, PROBE).requires_grad_(False)
    init = load_file(str(Path(export_dir) / entry.lora_init))
    lora = {}
    for n, p in chunk.lora_parameters().items():
        name = peft_name(n, first)
        with torch.no_grad():
            p.copy_(init[name])
        p.requires_grad_(True)
        lora[name] = p
    return chunk.to(device), lora


class PipeChunk(nn.Module):
    """forward(x) -> h_k: embedding (chunk 0) and the chunk's layers; `wire` is where the
    pipeline's buffers live, `device` where the chunk computes."""

    def __init__(self, chunk, device: torch.device, wire: torch.device):
        super().__init__()
        self.chunk, self.device, self.wire = chunk, device, wire

    def forward(self, x):
        c = self.chunk
        x = x.to(self.device)
        h = c.embed(x) if c.is_first else x
        B, S = h.shape[:2]
        mask = torch.ones(B, S, dtype=torch.long, device=self.device)
        pos = torch.arange(S, device=self.device).expand(B, S)
        return c.run_layers(h, mask, pos).to(self.wire)


def make_loss_fn(chunk, readout_rows: int, device: torch.device):
    def loss_fn(h, labels):
        idx, tgt, w, _ = readout_positions(labels.cpu().numpy(), readout_rows)
        t = [torch.from_numpy(v).to(device) for v in (idx, tgt, w)]
        return chunk.global_loss(h.to(device), *t)
    return loss_fn


def _not_last(*_):
    raise RuntimeError("the loss is computed on the last stage only")


def make_schedule(name: str, stage, n_microbatches: int, loss_fn):
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleavedZeroBubble

    if name == "gpipe":
        return ScheduleGPipe(stage, n_microbatches, loss_fn=loss_fn, scale_grads=True)
    if name == "1f1b":
        return Schedule1F1B(stage, n_microbatches, loss_fn=loss_fn, scale_grads=True)
    if name == "zerobubble":
        return ScheduleInterleavedZeroBubble([stage], n_microbatches, loss_fn=loss_fn, scale_grads=True)
    raise ValueError(f"unknown baseline {name!r}: use one of {', '.join(BASELINES)}")


def run_baseline(a, manifest: Manifest, train: list, windows: int, device: torch.device, ctrl):
    """Train `windows` update windows with torch's schedule; writes window TELEMETRY records to the
    rank's metrics file. Returns (LoRA as numpy, per-rank summary)."""
    from safetensors.torch import save_file
    from torch.distributed.pipelining import PipelineStage

    k, world = dist.get_rank(), dist.get_world_size()
    wire = device if a.wire == "device" else torch.device("cpu")
    chunk, lora = build_bp_chunk(Path(a.program), manifest, k, device)
    # static shapes (the export's micro-batch): no metadata round at the first step (which, inferred
    # at run time, deadlocked here); the inputs' requires_grad tells the stage to send dL/dh_{k-1}
    B, S = manifest.export["micro_batch"], manifest.export["seq_len"]
    d = manifest.model["hf_config"]["hidden_size"]
    h = torch.empty(B, S, d, device=wire, requires_grad=True)  # requires_grad: dL/dh crosses this link
    x_in = torch.empty(B, S, dtype=torch.long, device=wire) if k == 0 else h
    stage = PipelineStage(PipeChunk(chunk, device, wire), k, world, wire, input_args=(x_in,), output_args=(h,),
                          input_grads=(None,) if k == 0 else (h,), output_grads=(None,) if k == world - 1 else (h,))
    chunk.to(device)  # where it computes, whatever the stage did with it (its buffers live on `wire`)
    opt = AdamW({n: p.data for n, p in lora.items()}, AdamWConfig(lr=a.lr, weight_decay=a.weight_decay))
    W = a.window
    # every rank passes a loss_fn: torch's schedules run backward only where one is given (only the
    # last stage calls it)
    loss_fn = make_loss_fn(chunk, manifest.export["readout_rows"], device) if k == world - 1 else _not_last
    sched = make_schedule(a.schedule, stage, W, loss_fn)
    out = Path(a.out)
    (out / "ranks").mkdir(parents=True, exist_ok=True)
    metrics = open(out / "ranks" / f"rank_{k}.jsonl", "a")
    name = f"rank{k}@{__import__('socket').gethostname()}:{device}"

    def record(type_, meta):
        metrics.write(json.dumps({"t": time.time(), "device": name, "stage": k, "type": type_,
                                  **{x: v for x, v in meta.items() if v is not None}}) + "\n")
        metrics.flush()

    record("DIST_RESUME", {"incarnation": 0, "committed_window": -1, "next_micro_batch": 0})
    take_peak_rss_bytes()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    peak_rss, seconds = 0, []
    for w in range(windows):
        mbs = [train[i % len(train)] for i in range(w * W, (w + 1) * W)]
        x = torch.from_numpy(np.concatenate([b["input_ids"] for b in mbs])).to(wire)
        labels = torch.from_numpy(np.concatenate([b["labels"] for b in mbs])).to(wire)
        if a.save_grads:
            start_lora = {n: p.detach().cpu().clone() for n, p in lora.items()}
        t0 = time.time()
        losses = []
        if k == 0:
            sched.step(x)
        elif k == world - 1:
            sched.step(target=labels, losses=losses)
        else:
            sched.step()
        t1 = time.time()
        grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in lora.items()}
        if a.save_grads:
            d = out / "grads"
            d.mkdir(exist_ok=True)
            save_file({**{f"lora/{n}": t for n, t in start_lora.items()},
                       **{f"grad/{n}": g.detach().cpu().contiguous() for n, g in grads.items()}},
                      str(d / f"rank_{k}_window_{w}.safetensors"))
        opt.step({n: g.detach() for n, g in grads.items()})
        for p in lora.values():
            p.grad = None
        t2 = time.time()
        rss = take_peak_rss_bytes()
        peak_rss = max(peak_rss, rss or 0)
        seconds.append(t2 - t0)
        loss = float(torch.stack([mb_loss.detach().cpu() for mb_loss in losses]).mean()) if losses else None
        record("TELEMETRY", {
            "kind": "window", "stage": k, "window": w, "step": opt.step_count, "schedule": a.schedule,
            "micro_batches": W, "loss": loss, "task_loss": loss, "phase1_s": None, "phase2_s": None,
            "step_s": t2 - t1, "seconds": t2 - t0,
            # torch's schedule does not tell compute from waiting: the whole step is counted active
            "active_s": t1 - t0, "wait_s": 0.0, "split": "schedule.step (compute and waiting together)",
            "bytes_in": 0, "bytes_out": 0, "pss_bytes": read_pss_bytes(), "rss_peak_bytes": rss,
            "cuda_max_allocated_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None})
        record("CHECKPOINT_COMMITTED", {"window": w, "step": opt.step_count})
    metrics.close()
    summary = {"schedule": a.schedule, "rss_peak_bytes": peak_rss or None, "window_seconds": seconds,
               "cuda_max_allocated_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None}
    return {n: p.detach().cpu().numpy().copy() for n, p in lora.items()}, summary

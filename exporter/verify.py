"""--verify: run each chunk's program in ExecuTorch's runtime on a sample batch and compare
loss, h_k and LoRA gradients with eager PyTorch for the same chunk and weights."""
from __future__ import annotations

from pathlib import Path

import torch

from zl_mobile.program import ChunkProgram

from .chunk_model import example_inputs, input_names
from .errors import VerifyError

# fp32 on different kernels: differences of a few ulps per op accumulate over layers.
TOLERANCE = {"loss": 1e-4, "h_out": 1e-3, "grads": 1e-3}


def sample_lora(chunk_entry: dict, seed: int) -> dict[str, torch.Tensor]:
    """The exported init with lora_B made nonzero, so every gradient is exercised."""
    g = torch.Generator().manual_seed(seed)
    lora = {}
    for t in chunk_entry["lora"]:
        scale = 0.02 if "lora_B" in t["name"] else 0.2
        lora[t["name"]] = torch.randn(t["shape"], generator=g) * scale
    return lora


def eager_step(chunk, inputs, lora_global: dict, to_local: dict):
    params = chunk.lora_parameters()
    with torch.no_grad():
        for gname, value in lora_global.items():
            params[to_local[gname]].copy_(value)
    for p in params.values():
        p.grad = None
    loss, task, consis, h = chunk(*inputs)
    loss.backward()
    grads = {g: params[to_local[g]].grad.detach().clone() for g in lora_global}
    return loss.item(), task.item(), consis.item(), h, grads


def verify_chunk(out_dir: Path, art, cfg, hf_cfg, seed: int = 0) -> dict:
    entry = art.entry
    from .chunk_model import peft_name

    to_local = {peft_name(n, art.first): n for n in art.chunk.lora_parameters()}
    inputs = example_inputs(art.chunk, cfg, hf_cfg.vocab_size, hf_cfg.hidden_size, seed=seed + 1)
    batch = dict(zip(input_names(art.chunk.is_first), inputs))
    lora = sample_lora(entry, seed)

    prog = ChunkProgram(out_dir, entry)
    h, saved = prog.phase1(lora, batch)
    res = prog.phase2(lora, saved, batch)
    loss, task, consis, h_e, grads_e = eager_step(art.chunk, inputs, lora, to_local)

    def rel(a, b):
        return ((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item()

    diffs = {
        "loss": abs(res.loss - loss), "task_loss": abs(res.task_loss - task),
        "consis_loss": abs(res.consis_loss - consis),
        "h_out": (h - h_e).abs().max().item(),
        "grads": max(rel(res.grads[n], grads_e[n]) for n in grads_e),
    }
    return diffs


def verify_all(out_dir: Path, artifacts, cfg, hf_cfg, report=print) -> list[dict]:
    rows = []
    for art in artifacts:
        d = verify_chunk(out_dir, art, cfg, hf_cfg)
        rows.append(d)
        report(f"chunk {art.index}: |loss| {d['loss']:.2e}  |task| {d['task_loss']:.2e}  "
               f"|consis| {d['consis_loss']:.2e}  max|h_k| {d['h_out']:.2e}  max rel grad {d['grads']:.2e}")
    for art, d in zip(artifacts, rows):
        for key, tol in TOLERANCE.items():
            if d[key] > tol:
                raise VerifyError(f"chunk {art.index}: {key} differs from eager PyTorch by {d[key]:.3g} "
                                  f"(tolerance {tol}): the exported program is wrong; report it with the manifest")
    return rows

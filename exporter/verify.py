"""--verify: run each chunk's program in ExecuTorch's runtime on a sample batch and compare
loss, h_k and LoRA gradients with eager PyTorch for the same chunk and weights (the BP stage
programs too: h_k, grad_h_in, LoRA gradients and, on the last stage, the global loss)."""
from __future__ import annotations

from pathlib import Path

import torch

from zl_mobile.program import ChunkProgram

from .chunk_model import PROBE, PROBE_GRAD, bp_example_inputs, bp_input_names, example_inputs, input_names
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


def run_named(prog: ChunkProgram, method: str, values: dict) -> dict[str, torch.Tensor]:
    """Call a method of a loaded program with inputs picked by name from `values`; returns its
    outputs by the names the manifest records (what a BP stage's phase2 needs: ChunkProgram's
    phase2 reads ZeroLock's loss triple)."""
    outs = prog._module.run_method(method, prog._args(method, values))
    return dict(zip([o["name"] for o in prog.methods[method]["outputs"]], outs))


def bp_zero_probe(bp_entry_or_chunk: dict) -> dict[str, torch.Tensor]:
    """The zero input probe a non-first BP stage's phase1 takes ({} for the first stage)."""
    methods = bp_entry_or_chunk.get("bp", bp_entry_or_chunk)["methods"]
    return {t["name"]: torch.zeros(t["shape"]) for t in methods["phase1"]["inputs"] if t["name"] == PROBE}


def eager_bp_step(chunk, inputs, lora_global: dict, to_local: dict):
    """Eager forward + backward of a BP stage: (loss, h_k, grad_h_in or None, LoRA grads)."""
    params = chunk.lora_parameters()
    probe = getattr(chunk, PROBE, None)
    with torch.no_grad():
        for gname, value in lora_global.items():
            params[to_local[gname]].copy_(value)
        if probe is not None:
            probe.zero_()
    for p in list(params.values()) + ([probe] if probe is not None else []):
        p.grad = None
    loss, h = chunk(*inputs)
    loss.backward()
    grads = {g: params[to_local[g]].grad.detach().clone() for g in lora_global}
    return loss.item(), h, (probe.grad.detach().clone() if probe is not None else None), grads


def verify_bp_chunk(out_dir: Path, art, cfg, hf_cfg, seed: int = 0) -> dict:
    from .chunk_model import peft_name
    from .manifest import chunk_entry_for

    chunk = art.bp_chunk
    entry = chunk_entry_for(art.entry, "bp")
    to_local = {peft_name(n, art.first): n for n in chunk.lora_parameters()}
    inputs = bp_example_inputs(chunk, cfg, hf_cfg.vocab_size, hf_cfg.hidden_size, seed=seed + 1)
    batch = dict(zip(bp_input_names(chunk.is_first, chunk.is_last), inputs))
    lora = sample_lora(entry, seed)

    prog = ChunkProgram(out_dir, entry)
    fwd = run_named(prog, "phase1", {**batch, **lora, **bp_zero_probe(entry)})
    bwd = run_named(prog, "phase2", {**batch, **fwd, **lora})
    loss, h_e, gin_e, grads_e = eager_bp_step(chunk, inputs, lora, to_local)

    def rel(a, b):
        return ((a - b).abs().max() / b.abs().max().clamp(min=1e-12)).item()

    return {
        "loss": abs(float(bwd["loss"]) - loss) if chunk.is_last else 0.0,
        "h_out": (fwd["h_out"] - h_e).abs().max().item(),
        "grad_h_in": rel(bwd[PROBE_GRAD], gin_e) if gin_e is not None else 0.0,
        "grads": max(rel(bwd["grad:" + n], grads_e[n]) for n in grads_e),
    }


def verify_all(out_dir: Path, artifacts, cfg, hf_cfg, report=print) -> list[dict]:
    rows = []  # (label, diffs, tolerances)
    for art in artifacts:
        if art.chunk is not None:
            d = verify_chunk(out_dir, art, cfg, hf_cfg)
            rows.append((f"chunk {art.index}", d, TOLERANCE))
            report(f"chunk {art.index}: |loss| {d['loss']:.2e}  |task| {d['task_loss']:.2e}  "
                   f"|consis| {d['consis_loss']:.2e}  max|h_k| {d['h_out']:.2e}  max rel grad {d['grads']:.2e}")
        if art.bp_chunk is not None:
            d = verify_bp_chunk(out_dir, art, cfg, hf_cfg)
            rows.append((f"chunk {art.index} (BP stage)", d, {**TOLERANCE, "grad_h_in": TOLERANCE["grads"]}))
            report(f"chunk {art.index} BP: |loss| {d['loss']:.2e}  max|h_k| {d['h_out']:.2e}  "
                   f"max rel grad_h_in {d['grad_h_in']:.2e}  max rel grad {d['grads']:.2e}")
    for label, d, tols in rows:
        for key, tol in tols.items():
            if d[key] > tol:
                raise VerifyError(f"{label}: {key} differs from eager PyTorch by {d[key]:.3g} "
                                  f"(tolerance {tol}): the exported program is wrong; report it with the manifest")
    return [d for _, d, _ in rows]

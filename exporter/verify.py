"""--verify: run each chunk's program in ExecuTorch's runtime on a sample batch and compare
loss, h_k and LoRA gradients with eager PyTorch for the same chunk and weights (the BP stage
programs too: h_k, grad_h_in, LoRA gradients and, on the last stage, the global loss).

Each output is judged on its own scale, one that holds for real models: its relative error
||program - eager|| / ||eager|| (L2 over each token's hidden state, the worst token, for h_k and
grad_h_in; over the tensor for a LoRA gradient; |a - b| / |b| for a loss), against what fp32
itself costs on this model and input, measured by running the same chunk in eager PyTorch in
float64: an output passes when its error is within NOISE_FACTOR times fp32's own (eager fp32 vs
float64), or within FLOOR. Real LLMs have massive activations (SmolLM2-135M's h_k reaches 26,271
after layer 19), where an absolute tolerance fails correct programs (a 0.012 difference there is
~5e-7 of the value) and a max-normalised one lets wrong ones through (a dropped LoRA moves the
ordinary channels, ~1e-4 of the largest); a per-token relative error against fp32's own error does
neither.
"""
from __future__ import annotations

import copy
from pathlib import Path

import torch

from zl_common.program import ChunkProgram

from .chunk_model import PROBE, PROBE_GRAD, bp_example_inputs, bp_input_names, example_inputs, input_names
from .errors import VerifyError

# Different kernels (XNNPACK, portable, eager) round differently; each stays within a few times
# fp32's own error against float64, measured per output. FLOOR: ~8 ulps of fp32, for outputs
# whose measured fp32 error happens to be near zero.
NOISE_FACTOR = 32.0
FLOOR = 1e-6


def sample_lora(chunk_entry: dict, seed: int) -> dict[str, torch.Tensor]:
    """The exported init with lora_B made nonzero, so every gradient is exercised."""
    g = torch.Generator().manual_seed(seed)
    lora = {}
    for t in chunk_entry["lora"]:
        scale = 0.02 if "lora_B" in t["name"] else 0.2
        lora[t["name"]] = torch.randn(t["shape"], generator=g) * scale
    return lora


# hidden states [B, S, d] are judged per token: each position's vector on its own scale, so a
# massive activation at one token (real LLMs have them at the first) does not hide errors at others
PER_TOKEN = ("h_out", PROBE_GRAD)


def rel_error(x, ref, per_row: bool = False) -> float:
    """||x - ref||_2 / ||ref||_2 (tensors) or |x - ref| / |ref| (numbers), in float64; per_row:
    the largest such error over the rows of the last dimension (each row's norm floored at 1e-6
    of the largest, so an all-but-zero row does not divide by zero)."""
    x, ref = torch.as_tensor(x, dtype=torch.float64), torch.as_tensor(ref, dtype=torch.float64)
    if not per_row or ref.dim() < 2:
        return float((x - ref).norm() / ref.norm().clamp(min=1e-300))
    d = ref.shape[-1]
    num, den = (x - ref).reshape(-1, d).norm(dim=1), ref.reshape(-1, d).norm(dim=1)
    return float((num / den.clamp(min=max(float(den.max()) * 1e-6, 1e-300))).max())


def judge(program: dict, eager: dict, eager64: dict) -> dict[str, dict]:
    """Per output name: {"err": program vs eager fp32, "noise": eager fp32 vs float64,
    "tol": the tolerance that follows, "max_abs": the largest absolute difference}."""
    rows = {}
    for name, ref in eager.items():
        per_row = name in PER_TOKEN
        noise = rel_error(ref, eager64[name], per_row)
        a, b = torch.as_tensor(program[name], dtype=torch.float64), torch.as_tensor(ref, dtype=torch.float64)
        rows[name] = {"err": rel_error(a, b, per_row), "noise": noise, "tol": max(NOISE_FACTOR * noise, FLOOR),
                      "max_abs": float((a - b).abs().max())}
    return rows


def failures(rows: dict[str, dict]) -> list[str]:
    return [n for n, r in rows.items() if not r["err"] <= r["tol"]]  # `not <=`: NaN fails


class ExportedModelSizes:
    """The vocab and hidden size of an exported model, read from its manifest: what verify's sample
    batches need, where the model's own (HF) config is not at hand."""

    def __init__(self, manifest):
        self.vocab_size = manifest["model"]["config"]["vocab_size"]
        self.hidden_size = manifest["model"]["config"]["hidden_size"]


def float64_copy(module):
    """A float64 copy of an eager chunk (the fp32 one is left as it is)."""
    return copy.deepcopy(module).double()


def as_float64(inputs):
    """The inputs with every float tensor as float64 (what float64_copy runs on)."""
    return tuple(x.double() if torch.is_floating_point(x) else x for x in inputs)


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


def eager_outputs(chunk, inputs, lora: dict, to_local: dict) -> dict:
    """The outputs a ZeroLock program returns, from eager PyTorch (in the chunk's dtype)."""
    loss, task, consis, h, grads = eager_step(chunk, inputs, lora, to_local)
    return {"loss": loss, "task_loss": task, "consis_loss": consis, "h_out": h,
            **{"grad:" + n: g for n, g in grads.items()}}


def program_outputs(prog: ChunkProgram, lora: dict, batch: dict) -> dict:
    h, saved = prog.phase1(lora, batch)
    res = prog.phase2(lora, saved, batch)
    return {"loss": res.loss, "task_loss": res.task_loss, "consis_loss": res.consis_loss, "h_out": h.clone(),
            **{"grad:" + n: g for n, g in res.grads.items()}}


def verify_chunk(out_dir: Path, art, cfg, hf_cfg, seed: int = 0, inputs=None, chunk=None) -> dict[str, dict]:
    """judge()'s rows for one chunk's ZeroLock program on a sample batch (or `inputs`), against
    `chunk` (default: the exported one) in eager PyTorch."""
    entry = art.entry
    from .chunk_model import peft_name

    chunk = chunk if chunk is not None else art.chunk
    to_local = {peft_name(n, art.first): n for n in chunk.lora_parameters()}
    if inputs is None:
        inputs = example_inputs(chunk, cfg, hf_cfg.vocab_size, hf_cfg.hidden_size, seed=seed + 1)
    batch = dict(zip(input_names(chunk.is_first), inputs))
    lora = sample_lora(entry, seed)

    got = program_outputs(ChunkProgram(out_dir, entry), lora, batch)
    ref = eager_outputs(chunk, inputs, lora, to_local)
    ref64 = eager_outputs(float64_copy(chunk), as_float64(inputs), lora, to_local)
    return judge(got, ref, ref64)


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


def verify_bp_chunk(out_dir: Path, art, cfg, hf_cfg, seed: int = 0) -> dict[str, dict]:
    from .chunk_model import peft_name
    from .manifest import ChunkEntry

    chunk = art.bp_chunk
    entry = ChunkEntry.from_json(art.entry).for_mode("bp").json
    to_local = {peft_name(n, art.first): n for n in chunk.lora_parameters()}
    inputs = bp_example_inputs(chunk, cfg, hf_cfg.vocab_size, hf_cfg.hidden_size, seed=seed + 1)
    batch = dict(zip(bp_input_names(chunk.is_first, chunk.is_last), inputs))
    lora = sample_lora(entry, seed)

    prog = ChunkProgram(out_dir, entry)
    fwd = run_named(prog, "phase1", {**batch, **lora, **bp_zero_probe(entry)})
    bwd = run_named(prog, "phase2", {**batch, **fwd, **lora})
    got = {"h_out": fwd["h_out"].clone(), **{"grad:" + n: bwd["grad:" + n] for n in lora}}
    if chunk.is_last:
        got["loss"] = float(bwd["loss"])
    if PROBE_GRAD in bwd:
        got[PROBE_GRAD] = bwd[PROBE_GRAD]

    def eager(c, xs):
        loss, h, gin, grads = eager_bp_step(c, xs, lora, to_local)
        out = {"h_out": h, **{"grad:" + n: g for n, g in grads.items()}}
        if c.is_last:
            out["loss"] = loss
        if gin is not None:
            out[PROBE_GRAD] = gin
        return out

    return judge(got, eager(chunk, inputs), eager(float64_copy(chunk), as_float64(inputs)))


def _summary(rows: dict[str, dict]) -> str:
    grads = {n: r for n, r in rows.items() if n.startswith("grad:")}
    parts = [f"{n} {rows[n]['err']:.1e}" for n in ("loss", "task_loss", "consis_loss", "h_out", PROBE_GRAD) if n in rows]
    if grads:
        worst = max(grads, key=lambda n: grads[n]["err"] / grads[n]["tol"])
        parts.append(f"LoRA grads <= {grads[worst]['err']:.1e}")
    ratio = max(r["err"] / r["tol"] for r in rows.values())
    return "relative error " + "  ".join(parts) + f"  (worst {ratio:.2g} of its tolerance)"


def verify_all(out_dir: Path, artifacts, cfg, hf_cfg, report=print) -> list[dict]:
    """Verify every program; raise VerifyError naming the first output out of tolerance."""
    rows = []  # (label, judge rows)
    for art in artifacts:
        if art.chunk is not None:
            rows.append((f"chunk {art.index}", verify_chunk(out_dir, art, cfg, hf_cfg)))
            report(f"chunk {art.index}: {_summary(rows[-1][1])}")
        if art.bp_chunk is not None:
            rows.append((f"chunk {art.index} (BP stage)", verify_bp_chunk(out_dir, art, cfg, hf_cfg)))
            report(f"chunk {art.index} BP: {_summary(rows[-1][1])}")
    for label, r in rows:
        for name in failures(r):
            x = r[name]
            raise VerifyError(f"{label}: {name} differs from eager PyTorch by {x['err']:.3g} relative (L2; max abs "
                              f"{x['max_abs']:.3g}), over its tolerance {x['tol']:.3g} ({NOISE_FACTOR:g} x fp32's own "
                              f"error {x['noise']:.2g} against float64): the exported program is wrong; report it "
                              "with the export")
    return [r for _, r in rows]

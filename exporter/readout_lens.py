"""A calibrated readout for a chunk whose hidden state the model's own final norm cannot read.

The static readout (the seed's option (a)) applies the frozen final norm and lm_head to every
chunk's h_k. On a real model the early layers' states are not in the space the head reads
(SmolLM2-135M: task CE 44 nats at layers 9 and 19, four times the uniform distribution's), so the
local loss and the consistency target are noise. The lens maps h_k to the normed space the head
reads: u = A rms(h_k) + b (rms: RMS-normalisation without the norm's weight), fitted once, before
training, by ridge least squares to the final layer's normed state u_L = norm(h_L) on calibration
text (the linear short-cut of Din et al. 2023, "Jump to Conclusions"; a tuned lens fitted in
closed form). The final norm is the lens A = diag(weight), b = 0, so the last chunk keeps it.
A and b stay frozen: they are part of the readout, never of the adapter's forward path.
"""
from __future__ import annotations

import torch


def rms(h: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS-normalise the last dimension (LlamaRMSNorm without its weight), in h's own dtype."""
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


class LensFit:
    """Accumulates X^T X and X^T Y over calibration positions; solve() gives (A, b)."""

    def __init__(self, hidden: int, eps: float):
        self.eps = eps
        d = hidden + 1  # the bias as a constant input column
        self.xtx = torch.zeros(d, d, dtype=torch.float64)
        self.xty = torch.zeros(d, hidden, dtype=torch.float64)
        self.n = 0

    def add(self, h: torch.Tensor, u_final: torch.Tensor) -> None:
        """h: [N, d] the chunk's hidden states; u_final: [N, d] the final norm's output there."""
        x = rms(h, self.eps).to(torch.float64)
        x = torch.cat([x, torch.ones(x.shape[0], 1, dtype=torch.float64)], dim=1)
        self.xtx += x.T @ x
        self.xty += x.T @ u_final.to(torch.float64)
        self.n += x.shape[0]

    def solve(self, ridge: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(A [d, d], b [d]) minimising ||A x + b - u||^2 + ridge * n * ||A||^2 (bias unpenalised)."""
        if self.n == 0:
            raise ValueError("no calibration positions: the lens needs text to be fitted on")
        d = self.xtx.shape[0] - 1
        reg = torch.eye(d + 1, dtype=torch.float64) * ridge * self.n
        reg[d, d] = 0.0
        w = torch.linalg.solve(self.xtx + reg, self.xty)  # [d + 1, d]
        return w[:d].T.contiguous().to(torch.float32), w[d].contiguous().to(torch.float32)


def apply(h: torch.Tensor, a: torch.Tensor, b: torch.Tensor, eps: float) -> torch.Tensor:
    """The lens's readout input u = A rms(h) + b, [..., d]."""
    return rms(h, eps) @ a.T + b


DEFAULT_RIDGE = 1e-3
EMBEDDING = -1  # the boundary "after layer -1": the first chunk's input, the token embedding
FILE = "readout_lens.safetensors"


def key(after_layer: int) -> str:
    return f"readout_lens.after_layer_{after_layer}"


def fit_model_lenses(model, batches, after_layers, ridge: float = DEFAULT_RIDGE, progress=None) -> tuple[dict, int]:
    """{after_layer: (A, b)} for each boundary in `after_layers` (EMBEDDING for the embedding),
    fitted to the final norm's output over every real token of `batches` (dicts with input_ids and
    attention_mask, as zl_common.data.make_microbatches gives); and the number of positions used.
    `model`: a LlamaForCausalLM (or its LlamaModel) held whole."""
    core = getattr(model, "model", model)
    return fit_lenses(core, core.layers, batches, after_layers, ridge, progress)


@torch.no_grad()
def fit_lenses(core, layers, batches, after_layers, ridge: float = DEFAULT_RIDGE, progress=None) -> tuple[dict, int]:
    """fit_model_lenses, one layer at a time: every batch goes through a layer before the next
    layer is asked for, so `layers` (the decoder layers in order) may be read from disk as they
    are iterated and dropped after (exporter/streamed_model.py: a model too large to hold in fp32).
    `core`: the LlamaModel whose embed_tokens, rotary_emb and norm are loaded. `progress(done,
    total)` after each layer. Each batch is cut after its last real token (padding is at the end
    and attention causal, so the real tokens' states are the same; a short text costs its own length)."""
    cfg = core.config
    fits = {i: LensFit(cfg.hidden_size, cfg.rms_norm_eps) for i in after_layers}
    runs = [_LensBatch(core, b) for b in batches]
    kept = {i: [] for i in fits}
    if EMBEDDING in kept:
        kept[EMBEDDING] = [r.real() for r in runs]
    total = cfg.num_hidden_layers
    for i, layer in enumerate(layers):
        for r in runs:
            r.h = layer(r.h, attention_mask=r.mask, position_embeddings=r.rope, position_ids=r.pos)
        if i in kept:
            kept[i] = [r.real() for r in runs]
        if progress:
            progress(i + 1, total)
    for n, r in enumerate(runs):
        u = core.norm(r.h)[r.att > 0]
        for i, fit in fits.items():
            fit.add(kept[i][n], u)
    positions = next(iter(fits.values())).n if fits else 0
    return {i: f.solve(ridge) for i, f in fits.items()}, positions


class _LensBatch:
    """One calibration batch on its way up the layers: its state and what each layer reads
    beside it (the causal + padding mask, the rotary tables, positions), as LlamaModel.forward makes them."""

    def __init__(self, core, b):
        from transformers.masking_utils import create_causal_mask

        att = torch.as_tensor(b["attention_mask"])
        cols = int(att.any(0).nonzero().max()) + 1 if att.any() else 1
        self.att = att[:, :cols]
        self.h = core.embed_tokens(torch.as_tensor(b["input_ids"])[:, :cols])
        self.pos = torch.arange(cols).unsqueeze(0)
        self.mask = create_causal_mask(config=core.config, inputs_embeds=self.h, attention_mask=self.att, cache=None,
                                       position_ids=self.pos)
        self.rope = core.rotary_emb(self.h, position_ids=self.pos)

    def real(self) -> torch.Tensor:
        return self.h[self.att > 0]


def to_tensors(lenses: dict) -> dict:
    out = {}
    for i, (a, b) in lenses.items():
        out[f"{key(i)}.weight"], out[f"{key(i)}.bias"] = a.contiguous(), b.contiguous()
    return out


def from_tensors(tensors: dict) -> dict:
    """The inverse of to_tensors; other keys are ignored."""
    out, prefix = {}, "readout_lens.after_layer_"
    for name, t in tensors.items():
        if name.startswith(prefix) and name.endswith(".weight"):
            i = int(name[len(prefix):-len(".weight")])
            out[i] = (t, tensors[f"{key(i)}.bias"])
    return out

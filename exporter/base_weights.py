"""How the frozen base weights are stored: fp32 as loaded, or int8 with one fp32 scale per row.

On a phone the frozen weights are most of a stage's memory (TinyLlama, 3 chunks: 1.2-1.7 GiB of
fp32 per stage, ~70% of its peak). With --base-weights int8 each frozen Linear (the layers' and
lm_head) and the embedding keep int8 rows with a symmetric per-row scale (absmax / 127), a
quarter of the bytes; LoRA, activations and all arithmetic stay fp32, as in QLoRA. A Linear
computes (x @ q^T) * scale: the cast q -> fp32 is the only full-size temporary, one weight at a
time, and it depends on weights alone, so the two-phase split recomputes it in phase 2 instead of
saving it as an activation (graph_passes.sink_weight_only_nodes keeps each cast next to its use).
In eager PyTorch, autograd would save that cast for the backward; _Int8LinearFn recomputes it."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import BASE_WEIGHTS


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [rows, cols] float -> (q int8 [rows, cols], scale fp32 [rows]) with w ~= q * scale[:, None]."""
    scale = (w.detach().abs().amax(dim=1).float() / 127.0).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round(w.detach().float() / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


class _Int8LinearFn(torch.autograd.Function):
    """(x @ q^T) * scale, whose backward casts q again instead of keeping an fp32 copy."""

    @staticmethod
    def forward(ctx, x, q, scale):
        ctx.save_for_backward(q, scale)  # weights: saving them holds no new memory
        return F.linear(x, q.to(x.dtype)) * scale

    @staticmethod
    def backward(ctx, g):
        q, scale = ctx.saved_tensors
        return (g * scale) @ q.to(g.dtype), None, None


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if torch.compiler.is_exporting():  # traced as plain ops; the joint graph differentiates them
        y = F.linear(x, q.to(x.dtype)) * scale
    else:
        y = _Int8LinearFn.apply(x, q, scale)
    return y if bias is None else y + bias


class Int8Linear(nn.Linear):
    """A frozen Linear as int8 rows (`weight`) and their scales (`weight_scale`); a bias, where
    the model has one (Llama's attention_bias), stays fp32. An nn.Linear, so peft wraps it with
    LoRA like the Linear it replaces."""

    def __init__(self, linear: nn.Linear):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q, scale = quantize_rows(linear.weight)
        self.weight = nn.Parameter(q, requires_grad=False)
        self.register_buffer("weight_scale", scale)
        self.bias = linear.bias

    def forward(self, x):
        return int8_linear(x, self.weight, self.weight_scale, self.bias)


class Int8Embedding(nn.Embedding):
    """A frozen embedding table as int8 rows and their scales: a lookup dequantizes only the rows it reads."""

    def __init__(self, emb: nn.Embedding):
        nn.Module.__init__(self)
        self.num_embeddings, self.embedding_dim = emb.num_embeddings, emb.embedding_dim
        self.padding_idx, self.max_norm, self.sparse = emb.padding_idx, None, False
        q, scale = quantize_rows(emb.weight)
        self.weight = nn.Parameter(q, requires_grad=False)
        self.register_buffer("weight_scale", scale)

    def forward(self, ids):
        flat = ids.reshape(-1)
        rows = self.weight.index_select(0, flat).to(torch.float32) * self.weight_scale.index_select(0, flat)[:, None]
        return rows.reshape(*ids.shape, self.embedding_dim)


def quantize_base(model, base_weights: str) -> int:
    """Store a LlamaForCausalLM's frozen Linears and embedding as `base_weights` (in place; before
    peft wraps it). Returns how many modules were replaced."""
    if base_weights not in BASE_WEIGHTS:
        raise ValueError(f"unknown base weights {base_weights!r}: use {' or '.join(BASE_WEIGHTS)}")
    if base_weights == "fp32":
        return 0
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                setattr(parent, name, Int8Linear(child))
            elif type(child) is nn.Embedding:
                setattr(parent, name, Int8Embedding(child))
            else:
                continue
            replaced += 1
    return replaced


def linear(x: torch.Tensor, w) -> torch.Tensor:
    """x @ W^T for a frozen W given as an fp32 tensor or (int8 rows, row scales)."""
    if isinstance(w, tuple):
        q, scale = w
        return F.linear(x, q.to(x.dtype)) * scale
    return F.linear(x, w)


def matmul(g: torch.Tensor, w) -> torch.Tensor:
    """g @ W for a frozen W given as an fp32 tensor or (int8 rows, row scales)."""
    if isinstance(w, tuple):
        q, scale = w
        return (g * scale) @ q.to(g.dtype)
    return g @ w

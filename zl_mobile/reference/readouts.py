"""How a chunk's hidden state h_k becomes a distribution p_k: what the frozen head reads.

Every readout maps h [rows, d] (or, for a tail, the whole [B, S, d]) to the head's input; p_k is
log_softmax(lm_head(readout.read(k, h, sel))). k = -1 is the embedding: chunk 0's p_{k-1}.

  StaticReadout   the frozen final norm on every chunk (the seed's option a)
  AdapterReadout  norm(h + W_d gelu(W_u h)), a small adapter per chunk trained with it (option b)
  LensReadout     the frozen lens fitted after each chunk's last layer (zl-export --readout lens)
  TailReadout     D of the model's own later layers at their base weights, then the lens at that
                  depth, or the final norm at the top (zl-export --readout tail:D)
"""
from __future__ import annotations

import contextlib
import math
import time

import torch
import torch.nn.functional as F


def causal_lm(pm_or_base):
    """The LlamaForCausalLM under a peft model, or the model itself."""
    from peft import PeftModel

    return pm_or_base.base_model.model if isinstance(pm_or_base, PeftModel) else pm_or_base


class StaticReadout:
    """The seed's option (a): the frozen final norm on every chunk's h (k = -1: the embedding)."""

    def __init__(self, pm_or_base):
        self.norm = causal_lm(pm_or_base).model.norm

    def u(self, k, h):
        return self.norm(h)

    def read(self, k, h, sel, attention_mask=None, position_ids=None):
        """What the head reads of chunk k's whole h [B, S, d] at the positions `sel` (a readout of
        depth 0 reads the selected rows alone; the tail runs its layers over the sequence first)."""
        return self.u(k, h[sel])

    def parameters(self) -> dict:
        """Tensors the readout trains with the chunk's LoRA (none but the adapter's)."""
        return {}


RA_RANK = 64


def make_readout_adapters(d, n, rank=RA_RANK):
    """Option (b): per chunk, W_u [rank, d] small random, W_d [d, rank] zero (starts as identity)."""
    g = torch.Generator().manual_seed(1234)
    return [{"up": (torch.randn(rank, d, generator=g) / math.sqrt(d)).requires_grad_(True),
             "down": torch.zeros(d, rank, requires_grad=True)} for _ in range(n)]


def adapt(h, ad):
    return h if ad is None else h + F.gelu(h @ ad["up"].T) @ ad["down"].T


class AdapterReadout(StaticReadout):
    """Option (b): norm(h + W_d gelu(W_u h)) for chunks 0..K-2 (the last chunk has none), trained
    with the chunk by its local loss; never in the model's own forward path."""

    def __init__(self, pm, adapters):
        super().__init__(pm)
        self.adapters = adapters

    def u(self, k, h):
        return self.norm(adapt(h, self.adapters[k] if 0 <= k < len(self.adapters) else None))

    def parameters(self) -> dict:
        return {f"readout_adapter.{k}.{n}": t for k, ad in enumerate(self.adapters) for n, t in ad.items()}


class LensReadout(StaticReadout):
    """A frozen lens per boundary (exporter/readout_lens.py, what zl-export --readout lens puts in the
    programs): {after_layer: (A, b)} for the embedding (-1) and each chunk's last layer but the model's;
    the last chunk reads through the final norm."""

    def __init__(self, pm, lenses, chunks):
        super().__init__(pm)
        self.lenses, self.chunks, self.eps = lenses, tuple(chunks), self.norm.variance_epsilon

    def u(self, k, h):
        from exporter.readout_lens import EMBEDDING, apply

        if k == len(self.chunks) - 1:
            return self.norm(h)
        a, b = self.lenses[EMBEDDING if k == -1 else self.chunks[k][1]]
        return apply(h, a, b, self.eps)


def tail_span(k, depth, chunks, n_layers):
    """(first, last) of the frozen layers chunk k's tail:`depth` readout runs (k = -1: the
    embedding's, chunk 0's p_{k-1}); first > last when none. The readout after them: the final norm
    if last is the model's top layer, else the lens after layer `last`."""
    first = 0 if k == -1 else chunks[k][1] + 1
    last = n_layers - 1 if depth == "all" else min(first + depth - 1, n_layers - 1)
    return first, last


def tail_lens_boundaries(depth, chunks, n_layers) -> list:
    """The lens boundaries (after_layer) a tail:`depth` readout needs besides the lens readout's
    (chunk ends, embedding): the depths below the top its tails stop at."""
    default = {-1} | {last for _, last in chunks[:-1]}
    ends = {tail_span(k, depth, chunks, n_layers)[1] for k in range(-1, len(chunks))}
    return sorted(e for e in ends if e != n_layers - 1 and e not in default)


class TailReadout(LensReadout):
    """Issue 49's tail readout: chunk k's h runs through the next D layers of the model at its base
    weights (LoRA off for them, whatever the later chunks have trained), then the lens at that depth
    or, at the top, the final norm; tail:all is the whole rest of the model (for chunk k, the exact
    backprop gradient with the later chunks at the base). The frozen layers are readout only: the
    gradient flows through them to h_k, none reaches their LoRA."""

    def __init__(self, pm, lenses, depth, seq_len, chunks):
        from exporter.chunk_model import ChunkModel
        from exporter.config import ExportConfig

        super().__init__(pm, lenses or {}, chunks)
        self.pm, self.depth = pm, depth
        self.n_layers = causal_lm(pm).config.num_hidden_layers
        cfg = ExportConfig(seq_len=seq_len, micro_batch=1)
        self.tails = {}
        for k in range(-1, len(self.chunks)):
            first, last = tail_span(k, depth, self.chunks, self.n_layers)
            if first <= last:
                self.tails[k] = ChunkModel(pm, first, last, cfg, num_layers=self.n_layers)
            if last != self.n_layers - 1 and last not in self.lenses:
                raise ValueError(f"tail:{depth}: no lens after layer {last} (fit_lenses(..., extra={[last]}))")

    def read(self, k, h, sel, attention_mask=None, position_ids=None):
        from peft import PeftModel

        from exporter.readout_lens import apply

        _, last = tail_span(k, self.depth, self.chunks, self.n_layers)
        if k in self.tails:
            if position_ids is None:
                position_ids = torch.arange(h.shape[1])[None].expand(h.shape[0], -1)
            if attention_mask is None:
                attention_mask = torch.ones(h.shape[:2], dtype=torch.long)
            ctx = self.pm.disable_adapter() if isinstance(self.pm, PeftModel) else contextlib.nullcontext()
            with ctx:
                h = self.tails[k].run_layers(h, attention_mask, position_ids)
        if last == self.n_layers - 1:
            return self.norm(h[sel])
        a, b = self.lenses[last]
        return apply(h[sel], a, b, self.eps)


def fit_lenses(base, mbs, chunks, log=print, extra=()) -> dict:
    """The lenses zl-export fits (after the embedding and every chunk but the last), on these
    micro-batches' text (every real token, no labels); `extra`: more boundaries (after_layer), fitted
    the same way (a tail:D readout's, tail_lens_boundaries)."""
    from exporter.readout_lens import EMBEDDING, fit_model_lenses

    t0 = time.time()
    lenses, positions = fit_model_lenses(base, mbs, sorted({EMBEDDING, *[last for _, last in chunks[:-1]], *extra}))
    log(f"lens: fitted on {positions} positions in {time.time() - t0:.0f} s")
    return lenses

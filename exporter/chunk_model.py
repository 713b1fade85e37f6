"""One chunk of the model as an nn.Module computing the seed's local loss (Eqs. 2-5).

forward(x, attention_mask, position_ids, loss_index, loss_target, loss_weight, alpha)
  x: input_ids [B,S] (first chunk, which owns the embedding) or h_{k-1} [B,S,d]
  loss_index/target/weight [N]: flat (b*S+i) positions of Omega, their targets, 1/0 weights
  alpha [1]: the task/consistency blend (an input, so a run can override the export default)
returns (loss, task_loss, consis_loss, h_k) with h_k detached.
The readout (frozen final norm + lm_head; a calibrated lens instead of the norm where the export
fitted one, exporter/readout_lens.py) runs only on the N gathered rows. With --readout tail:D it
first runs the state through D of the model's own later layers, frozen at the base (base_view):
readout only, in phase 2, never part of the adapter."""
from __future__ import annotations

import copy
import re
from dataclasses import replace

import torch
import torch.nn as nn

from . import readout_lens, readout_loss
from .base_weights import dequantize
from .config import ExportConfig, tail_depth, tail_end
from .marker import pipeline_marker


def add_lora(model, cfg: ExportConfig):
    """Wrap the full HF model with peft LoRA (so parameter names match what peft saves)."""
    from peft import get_peft_model

    for p in model.parameters():
        p.requires_grad_(False)
    torch.manual_seed(cfg.seed)
    peft_model = get_peft_model(model, lora_config(cfg))
    return peft_model


def lora_config(cfg: ExportConfig):
    from peft import LoraConfig

    return LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=0.0,
                      target_modules=list(cfg.target_modules), bias="none")


_LOCAL = re.compile(r"^layers\.(\d+)\.(.*)\.(lora_[AB])\.default\.weight$")


def peft_name(local_name: str, first_layer: int) -> str:
    """layers.J.self_attn.q_proj.lora_A.default.weight (chunk-local) -> the key peft writes in
    adapter_model.safetensors for the full model."""
    m = _LOCAL.match(local_name)
    if not m:
        raise ValueError(f"not a LoRA parameter name: {local_name}")
    j, mod, ab = m.groups()
    return f"base_model.model.model.layers.{first_layer + int(j)}.{mod}.{ab}.weight"


def readout_block_rows(hidden: int, layers, block_weights: int | None) -> int:
    """Rows per lm_head block (`hidden` columns): as many as keep a block within the largest
    frozen weight of the chunk's layers (all of the vocabulary when it already is), and, for a
    quantized lm_head, within the weights a quantized base decodes at once (`block_weights`; None
    for fp32): blocks made here are constants of their own, where a split made in the program
    would copy them."""
    largest = max((m.in_features * m.out_features for layer in layers for m in layer.modules()
                   if isinstance(m, nn.Linear) and not m.weight.requires_grad), default=0)
    if block_weights is not None:
        largest = min(largest, block_weights)
    return max(1, largest // hidden)


def _frozen_list(tensors) -> nn.ParameterList:
    return nn.ParameterList(nn.Parameter(t, requires_grad=False) for t in tensors)


def base_view(module: nn.Module) -> nn.Module:
    """`module` without its LoRA: a shallow copy whose peft-wrapped Linears are their base layers.
    The frozen weights are the same Parameter objects (no copy, stored once by the export); no
    LoRA tensor is reachable from it, so the tail is never part of the adapter."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    if isinstance(module, BaseTunerLayer):
        return module.get_base_layer()
    new = copy.copy(module)
    new._parameters, new._buffers = dict(module._parameters), dict(module._buffers)
    new._modules = {n: (base_view(c) if c is not None else None) for n, c in module._modules.items()}
    return new


class ChunkModel(nn.Module):
    def __init__(self, peft_model, first: int, last: int, cfg: ExportConfig, layer_offset: int = 0,
                 lenses: dict | None = None, num_layers: int | None = None):
        """`layer_offset`: the global index of peft_model's first layer (0 for the whole model; the
        eager runtime builds a model holding only layers first..last, so it passes `first`).
        `lenses`: {after_layer: (A, b)} (exporter/readout_lens.py): the chunk reads its h out
        through the lens after its last layer and p_{k-1} through the one before its first, where
        given; the final norm otherwise (always for the model's last layer, whose state the norm
        reads). `num_layers`: the whole model's (default: peft_model's)."""
        super().__init__()
        base = peft_model.base_model.model  # LlamaForCausalLM with LoRA layers injected
        self.first, self.last = first, last
        self.is_first = first == 0
        self.embed = base.model.embed_tokens if self.is_first else None
        self.layers = nn.ModuleList(base.model.layers[first - layer_offset:last - layer_offset + 1])
        self.rotary = base.model.rotary_emb
        self.norm = base.model.norm
        # The frozen lm_head as row blocks no larger than the chunk's largest layer weight: the
        # runtime packs a frozen weight into XNNPACK's (process-wide) workspace at each call, so
        # one [vocab, hidden] GEMM would size that workspace to the whole lm_head (250 MiB for
        # TinyLlama) where a layer needs 44 MiB. Same numbers; views, so no copy in eager.
        # int8 / int4 base weights (base_weights.py): the blocks are quantized rows with their scales beside.
        scale = getattr(base.lm_head, "weight_scale", None)  # a QuantizedLinear's
        rows = readout_block_rows(base.lm_head.in_features, self.layers,
                                  None if scale is None else cfg.decode_block_weights)
        self.lm_head_blocks = _frozen_list(base.lm_head.weight.split(rows))
        self.lm_head_scales = _frozen_list(scale.split(rows)) if scale is not None else None
        # Tied embeddings (SmolLM2, ...: lm_head is the embedding matrix): the first chunk reads
        # its token rows out of the readout's blocks, so the program holds that matrix once.
        self.tied_embedding = self.is_first and bool(getattr(base.config, "tie_word_embeddings", False))
        if self.tied_embedding:
            self.embed = None
        n_layers = num_layers or base.config.num_hidden_layers
        lenses = lenses or {}
        # tail:D: h_k is read through layers last+1..end_out and h_{k-1} (consistency, as chunk k-1
        # reads its own) through first..end_in, all at the base; ends below the top need a lens
        depth = tail_depth(cfg.readout, n_layers)
        self.end_out, self.end_in = tail_end(last, depth, n_layers), tail_end(first - 1, depth, n_layers)
        held = base.model.layers
        tail = lambda a, b: nn.ModuleList(base_view(held[i - layer_offset]) for i in range(a, b + 1))  # noqa: E731
        self.tail_out, self.tail_in = tail(last + 1, self.end_out), tail(first, self.end_in)
        for end in (self.end_out, self.end_in):
            if depth and end != n_layers - 1 and end not in lenses:
                raise ValueError(f"--readout {cfg.readout}: no lens after layer {end}, where a tail ends below "
                                 "the top: export with zl-export, which fits one there")
        top = n_layers - 1
        self.lens_out = _frozen_list(lenses[self.end_out]) if self.end_out in lenses and self.end_out != top else None
        self.lens_in = _frozen_list(lenses[self.end_in]) if self.end_in in lenses and self.end_in != top else None
        S = cfg.seq_len
        self.register_buffer("causal", torch.ones(S, S, dtype=torch.bool).tril(), persistent=False)

    def lora_parameters(self) -> dict[str, nn.Parameter]:
        """Chunk-local name -> parameter, in a fixed order."""
        return {n: p for n, p in self.named_parameters() if "lora_" in n}

    @property
    def vocab_size(self) -> int:
        return sum(w.shape[0] for w in self.lm_head_blocks)

    def readout_blocks(self) -> list:
        """lm_head's row blocks as readout_loss takes them: fp32 tensors or (quantized rows, scales)."""
        if self.lm_head_scales is None:
            return list(self.lm_head_blocks)
        return list(zip(self.lm_head_blocks, self.lm_head_scales))

    def embed_ids(self, ids):
        """The first chunk's input: the embedding of `ids` [B,S] -> [B,S,d]; with tied embeddings,
        gathered from the lm_head blocks (one gather per block, masked to the ids it holds)."""
        if not self.tied_embedding:
            return self.embed(ids)
        flat = ids.reshape(-1)
        out, start = None, 0
        scales = self.lm_head_scales or [None] * len(self.lm_head_blocks)
        for block, scale in zip(self.lm_head_blocks, scales):
            n = block.shape[0]
            local = (flat - start).clamp(0, n - 1)
            rows = block.index_select(0, local)
            if scale is not None:  # quantized rows and their scales (base_weights.py)
                rows = dequantize(rows, scale.index_select(0, local))
            inside = ((flat >= start) & (flat < start + n))[:, None]
            out = torch.where(inside, rows, 0.0) if out is None else torch.where(inside, rows, out)
            start += n
        return out.reshape(*ids.shape, out.shape[-1])

    def attention(self, h, attention_mask, position_ids):
        """(additive causal mask, rotary tables, position_ids): what every layer of this micro-batch reads."""
        allowed = self.causal[None, None] & (attention_mask[:, None, None, :] > 0)
        # an fp32 mask (what the scalars make) for any h: a float64 copy (--verify's reference) adds it as is
        mask = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)
        return mask, self.rotary(h, position_ids), position_ids

    def run_layers(self, h, attention_mask, position_ids, layers=None, attn=None):
        """h through `layers` (the chunk's own by default); `attn`: attention()'s, if already made."""
        mask, pos, position_ids = attn or self.attention(h, attention_mask, position_ids)
        for layer in self.layers if layers is None else layers:
            h = layer(h, attention_mask=mask, position_ids=position_ids, position_embeddings=pos)
        return h

    def through_tail(self, h, tail, attn):
        """h [B,S,d] through a readout tail (frozen later layers; nothing when the tail is empty)."""
        return self.run_layers(h, None, None, tail, attn) if len(tail) else h

    def local_loss(self, h_in, h, loss_index, loss_target, loss_weight, alpha, attn=None):
        """alpha * CE + (1 - alpha) * KL(p_k || stopgrad p_{k-1}) over the valid rows; p_{k-1} is
        recomputed here from h_{k-1}. The readout's gradient is written out (readout_loss).
        `attn`: attention()'s tuple for this micro-batch; a readout tail needs it."""
        d = h.shape[-1]
        h = self.through_tail(h, self.tail_out, attn)
        u = self.read(h.reshape(-1, d).index_select(0, loss_index), self.lens_out)  # [N, d]
        a = alpha.reshape(())
        with torch.no_grad():
            h_in = self.through_tail(h_in, self.tail_in, attn)
            u_prev = self.read(h_in.reshape(-1, d).index_select(0, loss_index), self.lens_in)
            task, consis, grad_u = readout_loss.loss_and_grad(u, u_prev, loss_target, loss_weight, a,
                                                              self.readout_blocks())
        loss = readout_loss.with_gradient(a * task + (1.0 - a) * consis, u, grad_u)
        return loss, task, consis

    def lens_tensors(self) -> dict:
        """The chunk's lenses under readout_lens.to_tensors names (what the eager weights file keeps)."""
        out = {}
        for after, lens in ((self.end_out, self.lens_out), (self.end_in, self.lens_in)):
            if lens is not None:
                out.update(readout_lens.to_tensors({after: (lens[0].detach(), lens[1].detach())}))
        return out

    def read(self, h, lens):
        """What the frozen lm_head reads of h: the final norm, or a lens (readout_lens.py)."""
        if lens is None:
            return self.norm(h)
        return readout_lens.apply(h, lens[0], lens[1], self.norm.variance_epsilon)

    def forward(self, x, attention_mask, position_ids, loss_index, loss_target, loss_weight, alpha):
        h_in = self.embed_ids(x) if self.is_first else x
        attn = self.attention(h_in, attention_mask, position_ids)
        h = self.run_layers(h_in, attention_mask, position_ids, attn=attn)
        h = pipeline_marker(h)  # phase boundary: everything before it is phase 1
        loss, task, consis = self.local_loss(h_in, h, loss_index, loss_target, loss_weight, alpha, attn)
        return loss, task.detach(), consis.detach(), h.detach()


def input_names(is_first: bool) -> list[str]:
    return ["input_ids" if is_first else "h_in", "attention_mask", "position_ids",
            "loss_index", "loss_target", "loss_weight", "alpha"]


def example_inputs(chunk: ChunkModel, cfg: ExportConfig, vocab: int, hidden: int, seed: int = 0):
    """A sample micro-batch of the exported shapes (static; the runtime pads to them)."""
    g = torch.Generator().manual_seed(seed)
    B, S, N = cfg.micro_batch, cfg.seq_len, cfg.readout_rows
    x = (torch.randint(0, vocab, (B, S), generator=g) if chunk.is_first
         else torch.randn(B, S, hidden, generator=g))
    attn = torch.ones(B, S, dtype=torch.long)
    attn[-1, S - S // 4:] = 0  # some right padding
    pos = torch.arange(S).repeat(B, 1)
    n_valid = max(1, min(N, B * S // 2))
    idx = torch.zeros(N, dtype=torch.long)
    idx[:n_valid] = torch.randperm(B * S, generator=g)[:n_valid].sort().values
    tgt = torch.zeros(N, dtype=torch.long)
    tgt[:n_valid] = torch.randint(0, vocab, (n_valid,), generator=g)
    w = torch.zeros(N)
    w[:n_valid] = 1.0
    return (x, attn, pos, idx, tgt, w, torch.tensor([cfg.alpha]))


# ---------------------------------------------------------------------------------------------
# Back-propagation (BP) baseline stages: same chunks, same LoRA, ordinary end-to-end gradients.

PROBE = "grad_probe"      # zero input probe added to h_{k-1}; its gradient is dL/dh_{k-1}
PROBE_GRAD = "grad_h_in"  # the name of that gradient among the backward's outputs


class BPChunkModel(ChunkModel):
    """One chunk as a stage of a back-propagation pipeline (GPipe / 1F1B / PipeDream baselines).

    forward(x, attention_mask, position_ids, *tail) -> (loss, h_k detached)
      non-last chunk: tail = (grad_h_out,), dL/dh_k from the next stage, and
                      loss = <h_k, grad_h_out>, so d loss/d theta is the chain rule's term;
      last chunk:     tail = (loss_index, loss_target, loss_weight), and loss is the ordinary
                      global CE at the gathered valid positions through the frozen readout.
    A non-first chunk computes on h_in + grad_probe, a zero [B,S,d] parameter: its gradient is
    dL/dh_{k-1}, the gradient the previous stage needs (the joint trace gives parameter
    gradients only). The marker after the layers splits forward (phase1) from backward (phase2)."""

    def __init__(self, peft_model, first: int, last: int, cfg: ExportConfig, is_last: bool, layer_offset: int = 0):
        # a BP stage reads out only at the end, through the final norm: no tail, no lens
        super().__init__(peft_model, first, last, replace(cfg, readout="static"), layer_offset)
        self.is_last = is_last
        if not is_last:  # only the last stage owns the readout
            self.norm = None
            self.lm_head_blocks = self.lm_head_scales = None
            if self.tied_embedding:  # no readout blocks to read the embedding from
                self.tied_embedding = False
                self.embed = peft_model.base_model.model.model.embed_tokens
        if not self.is_first:
            hidden = peft_model.base_model.model.config.hidden_size
            probe = torch.zeros(cfg.micro_batch, cfg.seq_len, hidden)
            self.register_parameter(PROBE, nn.Parameter(probe, requires_grad=True))

    def global_loss(self, h, loss_index, loss_target, loss_weight):
        d = h.shape[-1]
        u = self.norm(h.reshape(-1, d).index_select(0, loss_index))
        task, _, grad_u = readout_loss.loss_and_grad(u, None, loss_target, loss_weight, 1.0, self.readout_blocks())
        return readout_loss.with_gradient(task, u, grad_u)

    def forward(self, x, attention_mask, position_ids, *tail):
        h_in = self.embed_ids(x) if self.is_first else x + getattr(self, PROBE)
        h = self.run_layers(h_in, attention_mask, position_ids)
        h = pipeline_marker(h)  # phase boundary: phase 1 = BP forward, phase 2 = BP backward
        if self.is_last:
            loss = self.global_loss(h, *tail)
        else:
            (grad_h_out,) = tail
            loss = (h * grad_h_out).sum()
        return loss, h.detach()


def bp_input_names(is_first: bool, is_last: bool) -> list[str]:
    tail = ["loss_index", "loss_target", "loss_weight"] if is_last else ["grad_h_out"]
    return ["input_ids" if is_first else "h_in", "attention_mask", "position_ids"] + tail


def bp_example_inputs(chunk: BPChunkModel, cfg: ExportConfig, vocab: int, hidden: int, seed: int = 0):
    x, attn, pos, idx, tgt, w, _ = example_inputs(chunk, cfg, vocab, hidden, seed)
    if chunk.is_last:
        return (x, attn, pos, idx, tgt, w)
    g = torch.Generator().manual_seed(seed + 1000)
    return (x, attn, pos, torch.randn(cfg.micro_batch, cfg.seq_len, hidden, generator=g))

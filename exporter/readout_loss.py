"""The readout losses with their gradient written out, a few positions at a time.

Autograd through log_softmax over the vocabulary keeps several [N, vocab] tensors alive from the
loss to the backward (logits, log-probabilities, probabilities, the KL terms and their
gradients): 16 MiB each for TinyLlama at N=128, most of phase 2's memory. The gradient of the
loss with respect to the logits has a closed form, so it is computed right after the logits,
a block of positions at a time (`position_block`), and only its image in hidden space (dL/du, [N, hidden])
is kept; autograd takes over from there (the final norm and the chunk's layers) through a
surrogate <u, dL/du>. Same values and gradients as autograd (tests/test_readout_loss.py).

For z the logits of one position, p = softmax(z), q = softmax(z_prev), target t:
  d CE / dz            = p - onehot(t)
  d KL(p || q) / dz    = p * (log p - log q - KL)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .base_weights import linear, matmul

# A block's [rows, vocab] f32 logits: 4 MiB, 32 positions at TinyLlama's 32000. That keeps a
# block's working set small while its GEMMs keep enough rows to run at full rate; a small
# vocabulary gets more positions per block, not more blocks (each block is ~20 kernel calls).
BLOCK_ELEMENTS = 32 * 32000
# A quantized lm_head is decoded for each use, once per block for the logits and once for
# dL/du; blocks twice the size halve that work for 4 MiB more per [rows, vocab] tensor.
QUANTIZED_BLOCK_ELEMENTS = 2 * BLOCK_ELEMENTS


def position_block(vocab: int, quantized: bool = False) -> int:
    """Positions per block for this vocabulary size (and a quantized lm_head or not)."""
    return max(1, (QUANTIZED_BLOCK_ELEMENTS if quantized else BLOCK_ELEMENTS) // vocab)


def _rows(w) -> int:
    return (w[0] if isinstance(w, tuple) else w).shape[0]


def _logits(u, lm_head_blocks):
    return torch.cat([linear(u, w) for w in lm_head_blocks], dim=-1)


def _to_hidden(g, lm_head_blocks):
    """dL/du = dL/dz @ lm_head, one lm_head block at a time (the same GEMMs autograd runs)."""
    out, start = None, 0
    for w in lm_head_blocks:
        part = matmul(g[:, start:start + _rows(w)], w)
        out = part if out is None else out + part
        start += _rows(w)
    return out


@torch.no_grad()
def loss_and_grad(u, u_prev, target, weight, alpha, lm_head_blocks, block: int | None = None):
    """Task (CE) and consistency (KL(p || stopgrad q)) means over weighted positions and
    dL/du for L = alpha * task + (1 - alpha) * consis.

    u, u_prev: [N, hidden] normed hidden states of this chunk and the previous one (u_prev None:
    no consistency term, L = task); target [N] int64; weight [N] (1 valid, 0 padding);
    alpha: 0-d tensor; lm_head_blocks: row blocks of lm_head, each an fp32 tensor or (quantized rows,
    row scales) (base_weights); block: positions per block (default: position_block of the vocabulary).
    Returns (task, consis or None, grad_u [N, hidden])."""
    quantized = isinstance(lm_head_blocks[0], tuple)
    block = block or position_block(sum(_rows(w) for w in lm_head_blocks), quantized)
    denom = weight.sum().clamp(min=1.0)
    coef = weight / denom
    d = u.shape[1]
    # One buffer carries the blocks from one to the next: rows not yet done hold (u, u_prev),
    # done rows hold (dL/du, u_prev). Each block reads its rows from the previous block's
    # buffer, so the blocks are a chain, not independent work: a backend cannot fuse all of
    # them into one call (XNNPACK's partitioner would, and every block's [rows, vocab] logits
    # would then be live at once).
    work = torch.cat([u, u_prev], dim=1) if u_prev is not None else u.clone()
    task, consis = 0.0, 0.0
    for s in range(0, u.shape[0], block):
        rows = work[s:s + block]
        c, t = coef[s:s + block].unsqueeze(1), target[s:s + block].unsqueeze(1)
        if u_prev is not None and quantized:  # both readouts in one product: one decode of lm_head
            logp, logq = F.log_softmax(_logits(torch.cat([rows[:, :d], rows[:, d:]]), lm_head_blocks),
                                       dim=-1).split(rows.shape[0])
        else:
            logp = F.log_softmax(_logits(rows[:, :d], lm_head_blocks), dim=-1)
        p = logp.exp()
        task = task + (-logp.gather(1, t) * c).sum()
        g = alpha * p
        if u_prev is not None:
            if not quantized:
                logq = F.log_softmax(_logits(rows[:, d:], lm_head_blocks), dim=-1)
            diff = logp - logq
            kl = (p * diff).sum(-1, keepdim=True)
            consis = consis + (kl * c).sum()
            g = g + (1.0 - alpha) * p * (diff - kl)
        g = (g * c).scatter_add(1, t, -alpha * c)
        done = _to_hidden(g, lm_head_blocks)
        if u_prev is not None:
            done = torch.cat([done, rows[:, d:]], dim=1)
        work = work.slice_scatter(done, dim=0, start=s, end=s + rows.shape[0])
    return task, (consis if u_prev is not None else None), work[:, :d]

def with_gradient(value, u, grad_u):
    """`value` in the forward, d/du = grad_u in the backward: value + (<u, g> - <u, g>), where the
    bracket is exactly 0 and only its first term carries a gradient."""
    surrogate = (u * grad_u).sum()
    return value + (surrogate - surrogate.detach())

"""How the frozen base weights are stored: fp32 as loaded, int8 rows, or 4-bit groups.

On a phone the frozen weights are most of a stage's memory (TinyLlama, 3 chunks: 1.2-1.7 GiB of
fp32 per stage, ~70% of its peak). Each frozen Linear (the layers' and lm_head) and the embedding
can instead keep
- int8: int8 rows with a symmetric per-row scale (absmax / 127), a quarter of the bytes;
- int4: llama.cpp's blocks of 32 weights: Q4_0 (an fp16 scale, values -8..7 chosen by its rule,
  two per byte; 0.14x the bytes), unless the weight's values are a GGUF's Q4_1 or Q8_0 blocks
  (what transformers dequantizes them to), which are kept as they are, bit-exact: SmolLM2's file
  is Q4_1 with a Q8_0 embedding, so its int4 base holds the file's own numbers (0.16x / 0.27x of
  fp32 for those weights) instead of quantizing them a second time. A Q4_0 file's values come
  through bit-exact as Q4_0 (requantizing Q4_0 values gives back the same blocks); other GGUF
  types (Q6_K, ...) and float weights are quantized to Q4_0.
A Linear computes x @ (q * scale)^T: the weight decoded to fp32, then an fp32 GEMM; int8 rows
as (x @ q^T) * scale, the per-row scales applied to the product (tokens x rows) rather than to
the weight (rows x cols: a pass over the decoded weight, 13% of int8's step). LoRA,
activations and all arithmetic stay fp32, as in QLoRA. The decoded fp32 weight (and int4's
decode steps) are the only weight-sized temporaries, one row block of one weight at a time
(row_blocks; the export's decode_block_weights). They depend on weights alone, so the two-phase
split recomputes them in phase 2 instead of saving them as activations
(graph_passes.sink_weight_only_nodes keeps each decode next to its use). In eager PyTorch autograd would save
the decoded weight for the backward; _FrozenLinearFn decodes it again instead.

Both decodes are written so that XNNPACK runs all of them, multi-threaded and vectorised: the
int8 -> fp32 cast (as a dequantize with scale 1: graph_passes.casts_as_dequantize; ExecuTorch's own
cast kernel is scalar), int4's nibble split (one floor for both halves, subtract: dequantize_halves), the
scales and the GEMMs."""
from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from .config import BASE_WEIGHTS, DECODE_BLOCK_WEIGHTS

GROUP = 32  # int4: weights per scale (a Q4_0 block)
# rows quantized at once: each row is quantized alone, so blocks give the same values, with fp32
# temporaries of one block (Llama-3.2-3B's head, 128,256 x 3,072: ~50 MiB each, not 1.5 GiB)
QUANTIZE_ROWS = 4096


def _by_row_blocks(quantize):
    """`quantize` (w [rows, cols] -> per-row results) applied QUANTIZE_ROWS rows at a time, joined."""
    @functools.wraps(quantize)
    def blocked(w: torch.Tensor):
        if w.shape[0] <= QUANTIZE_ROWS:
            return quantize(w)
        parts = [quantize(w[i:i + QUANTIZE_ROWS]) for i in range(0, w.shape[0], QUANTIZE_ROWS)]
        return tuple(torch.cat(p) for p in zip(*parts))
    return blocked


@_by_row_blocks
def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [rows, cols] float -> (q int8 [rows, cols], scale fp32 [rows]) with w ~= q * scale[:, None]."""
    scale = (w.detach().abs().amax(dim=1).float() / 127.0).clamp(min=torch.finfo(torch.float32).tiny)
    q = torch.round(w.detach().float() / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


@_by_row_blocks
def quantize_groups(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [rows, cols] float -> (packed int8 [rows, cols / 2], scale fp16 [rows, cols / 32]): each
    row as Q4_0 blocks of 32 columns. Per block: d = (the entry of largest magnitude, signed) / -8,
    q = min(15, floor(x / d + 8.5)), w ~= (q - 8) * fp16(d): ggml's rule, so the values (and
    scales) are a Q4_0 file's. Two per byte, ordered for the decode, not as ggml stores them: byte
    j of a row is q_j + 16 (q_{j + cols/2} - 8), column j in the low nibble, column j + cols / 2 as
    a signed high nibble. Signed, so that the byte is an int8, whose cast XNNPACK runs (it takes no
    uint8), and the high half needs no offset."""
    rows, cols = w.shape
    if cols % (2 * GROUP):
        raise ValueError(f"int4 base weights need a multiple of {2 * GROUP} columns, got {cols}")
    g = w.detach().float().reshape(rows, cols // GROUP, GROUP)
    extreme = g.gather(-1, g.abs().argmax(dim=-1, keepdim=True))  # ggml keeps the first of ties; so does argmax
    d = extreme / -8
    inv = torch.where(d == 0, 0.0, 1.0 / d)
    q = torch.floor(g * inv + 8.5).clamp(0, 15).to(torch.int16).reshape(rows, cols)  # ggml truncates; > 0 here
    return _pack_nibbles(q), d.squeeze(-1).half()


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """4-bit values q [rows, cols] (0..15, int16) -> int8 [rows, cols / 2]: byte j = q_j + 16 (q_{j + cols/2} - 8)."""
    half = q.shape[1] // 2
    return (q[:, :half] + 16 * (q[:, half:] - 8)).to(torch.int8)


def quantize_q4_1(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """w [rows, cols] whose 32-column blocks are Q4_1 values (q * d + m, q 0..15, d and m fp16)
    -> (packed int8 [rows, cols / 2] as quantize_groups packs, scale fp16 [rows, cols / 32, 2]
    holding (d, m)), bit-exact; None where w is not such values. The minimum is the q = 0 entry
    and the maximum the q = 15 one, by ggml's rule, so both are read off the values."""
    rows, cols = w.shape
    if cols % (2 * GROUP):
        return None
    g = w.detach().float().reshape(rows, cols // GROUP, GROUP)
    lo, hi = g.amin(dim=-1, keepdim=True), g.amax(dim=-1, keepdim=True)
    d, m = ((hi - lo) / 15).half(), lo.half()
    if not (torch.isfinite(d).all() and torch.equal(m.float(), lo)):
        return None
    df = d.float()
    q = torch.round(torch.where(df == 0, 0.0, (g - lo) / torch.where(df == 0, 1.0, df))).clamp(0, 15)
    if not torch.equal(q * df + lo, g):
        return None
    return _pack_nibbles(q.to(torch.int16).reshape(rows, cols)), torch.cat([d, m], dim=-1)


def quantize_q8_0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """w [rows, cols] whose 32-column blocks are Q8_0 values (q * d, q -127..127, d fp16) ->
    (int8 [rows, cols], scale fp16 [rows, cols / 32]), bit-exact; None where w is not such values."""
    rows, cols = w.shape
    if cols % GROUP:
        return None
    g = w.detach().float().reshape(rows, cols // GROUP, GROUP)
    d = (g.abs().amax(dim=-1, keepdim=True) / 127).half().float()
    q = torch.round(torch.where(d == 0, 0.0, g / torch.where(d == 0, 1.0, d)))
    if not (torch.isfinite(d).all() and q.abs().max() <= 127 and torch.equal(q * d, g)):
        return None
    return q.to(torch.int8).reshape(rows, cols), d.squeeze(-1).half()


def quantize_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """--base-weights int4: a GGUF's Q4_1 or Q8_0 values kept as those blocks, bit-exact; anything
    else as Q4_0 (quantize_groups). One format per weight; the first row is tried before the rest,
    so float weights cost one row's failed tries. A meta tensor (a module built to be loaded) gets
    Q4_0's shapes; adopt_stored then takes whichever form the stored weights have."""
    for keep in (() if w.is_meta else (quantize_q4_1, quantize_q8_0)):
        if keep(w[:1]) is not None and (kept := keep(w)) is not None:
            return kept
    return quantize_groups(w)


def block_format(q: torch.Tensor, scale: torch.Tensor) -> str:
    """Which stored form (q, scale) is, from their shapes: "rows" (int8 rows, a scale per row),
    "q4_0" (packed nibbles, a scale per 32 columns), "q4_1" (packed nibbles, (d, m) per 32
    columns) or "q8_0" (int8, a scale per 32 columns)."""
    if scale.dim() == q.dim() - 1:
        return "rows"
    if scale.dim() == q.dim() + 1:
        return "q4_1"
    return "q8_0" if q.shape[-1] == GROUP * scale.shape[-1] else "q4_0"


def dequantize_halves(packed: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> tuple:
    """Q4_0 or Q4_1 rows (quantize_groups, quantize_q4_1) [..., cols / 2] -> their two column
    halves in `dtype`, columns j < cols / 2 (the low nibbles) and the rest (the high ones), each
    [..., cols / 2]. Arithmetic on the bytes' float values rather than bit operations, so that
    XNNPACK runs all of it: with v = lo + 16 (hi - 8) (0 <= lo, hi < 16), f = floor(v / 16) = hi - 8
    and lo / 16 = (v + 128) / 16 - (f + 8). Q4_0: the high half is f d and the low one
    (lo - 8) d = 16 d ((v - 8) / 16 - f); Q4_1 (with a = (v + 128) / 16, f = floor(a) = hi): f d + m
    and 16 d (a - f) + m. One floor serves both halves: six passes over a half per use for Q4_0
    (two casts, floor, subtract, two multiplies), seven for Q4_1, where deriving each half on its
    own took eight and ten (the decode was a fifth of int4's step). Exact (powers of two; each
    product is exact in fp32, and Q4_1's one rounding is ggml's own, of q d + m). Each cast with
    the integer added and the fraction multiplied after it is one op (graph_passes.casts_as_dequantize);
    all XNNPACK's, and no concatenation: the products take the halves as they are (linear, matmul)."""
    if packed.dtype != torch.int8:  # the first int4 exports packed unsigned bytes, decoded otherwise
        raise ValueError(f"int4 weights packed as {packed.dtype}, not int8: an export older than this "
                         "zl-export; export the model again")
    *lead, half = packed.shape
    groups = half // GROUP
    offset = scale.dim() == packed.dim() + 1  # Q4_1: (d, m) per block
    d = (scale[..., 0] if offset else scale).to(dtype)
    if offset:
        a = (packed.to(dtype) + 128) * (1 / 16)
        f = torch.floor(a)
        frac = a - f
    else:
        f = torch.floor(packed.to(dtype) * (1 / 16))
        frac = (packed.to(dtype) + -8) * (1 / 16) - f
    low = frac.reshape(*lead, groups, GROUP) * (16 * d[..., :groups, None])
    high = f.reshape(*lead, groups, GROUP) * d[..., groups:, None]
    if offset:
        m = scale[..., 1].to(dtype)
        low, high = low + m[..., :groups, None], high + m[..., groups:, None]
    return low.reshape(*lead, half), high.reshape(*lead, half)


def dequantize_groups(packed: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """Q4_0 or Q4_1 rows [..., cols / 2] -> `dtype` [..., cols]."""
    return torch.cat(dequantize_halves(packed, scale, dtype), dim=-1)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """Quantized rows in any stored form (block_format) -> `dtype`."""
    fmt = block_format(q, scale)
    if fmt in ("q4_0", "q4_1"):
        return dequantize_groups(q, scale, dtype)
    if fmt == "q8_0":
        *lead, cols = q.shape
        return (q.to(dtype).reshape(*lead, cols // GROUP, GROUP) * scale.to(dtype)[..., None]).reshape(*lead, cols)
    return q.to(dtype) * scale.to(dtype)[..., None]


def block_rows(cols: int, block_weights: int) -> int:
    """Rows per decoded block of a weight with `cols` columns: at most `block_weights` weights."""
    return max(1, block_weights // cols)


def row_blocks(q: torch.Tensor, scale: torch.Tensor, rows: int | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A quantized weight as blocks of `rows` rows (all of it for None): what is decoded to fp32
    at once. Rows carry their own scales, so any row split is exact."""
    if rows is None or rows >= q.shape[0]:
        return [(q, scale)]
    return list(zip(q.split(rows), scale.split(rows)))


def linear(x: torch.Tensor, w, rows: int | None = None) -> torch.Tensor:
    """x @ W^T for a frozen W given as an fp32 tensor or (quantized rows, their scales). The weight
    is decoded first, then fp32 GEMMs (a GEMM fed straight from an int8 cast XNNPACK would read as a
    quantized one: lower.xnnpack_partitioners has its GEMMs partitioned as fp32). int8 rows: the
    cast, then the row scales on the product. int4: one product per column half.
    `rows`: decode and multiply the weight in blocks of that many rows (row_blocks), each block's
    output a slice of y, so that the decode's working set is a block's, not the weight's."""
    if not isinstance(w, tuple):
        return F.linear(x, w)
    # 2-D, so that each product is one GEMM (a strided 3-D input would be a batched matmul over
    # copies of the weight)
    x2 = x.reshape(-1, x.shape[-1])
    blocks = row_blocks(*w, rows)
    fmt = block_format(*w)
    if fmt in ("q4_0", "q4_1"):  # x's column halves, split once for all blocks (a split is a copy in the program;
        # its backward a concatenation: a slice's would be zeros + scatters)
        x_low, x_high = x2.split(x2.shape[-1] // 2, dim=-1)
        ys = [F.linear(x_low, low) + F.linear(x_high, high)
              for low, high in (dequantize_halves(q, scale, x.dtype) for q, scale in blocks)]
    elif fmt == "rows":  # the row scales on the output: tokens x rows products, not rows x cols
        ys = [F.linear(x2, q.to(x.dtype)) * scale.to(x.dtype) for q, scale in blocks]
    else:
        ys = [F.linear(x2, dequantize(q, scale, x.dtype)) for q, scale in blocks]
    y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=-1)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def _matmul_block(g: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    fmt = block_format(q, scale)
    if fmt == "rows":  # the row scales on g's columns, as linear puts them on y's
        return (g * scale.to(g.dtype)) @ q.to(g.dtype)
    if fmt == "q8_0":
        return g @ dequantize(q, scale, g.dtype)
    low, high = dequantize_halves(q, scale, g.dtype)
    return torch.cat([g @ low, g @ high], dim=-1)


def matmul(g: torch.Tensor, w, rows: int | None = None) -> torch.Tensor:
    """g @ W for a frozen W given as an fp32 tensor or (quantized rows, their scales): in blocks
    of `rows` rows as linear decodes them, g's matching columns times each block, summed."""
    if not isinstance(w, tuple):
        return g @ w
    blocks = row_blocks(*w, rows)
    parts = g.split([q.shape[0] for q, _ in blocks], dim=-1)
    return sum(_matmul_block(part, q, scale) for part, (q, scale) in zip(parts, blocks))


class _FrozenLinearFn(torch.autograd.Function):
    """linear(x, (q, scale)), whose backward decodes q again instead of keeping an fp32 copy."""

    @staticmethod
    def forward(ctx, x, q, scale, rows):
        ctx.save_for_backward(q, scale)  # weights: saving them holds no new memory
        ctx.rows = rows
        return linear(x, (q, scale), rows)

    @staticmethod
    def backward(ctx, g):
        q, scale = ctx.saved_tensors
        return matmul(g, (q, scale), ctx.rows), None, None, None


def quantized_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                     bias: torch.Tensor | None = None, rows: int | None = None) -> torch.Tensor:
    if torch.compiler.is_exporting():  # traced as plain ops; the joint graph differentiates them
        y = linear(x, (q, scale), rows)
    else:
        y = _FrozenLinearFn.apply(x, q, scale, rows)
    return y if bias is None else y + bias


class QuantizedLinear(nn.Linear):
    """A frozen Linear as quantized rows (`weight`) and their scales (`weight_scale`); a bias, where
    the model has one (Llama's attention_bias), stays fp32. An nn.Linear, so peft wraps it with
    LoRA like the Linear it replaces. Decoded in blocks of `decode_rows` rows (at most
    `block_weights` weights each)."""

    def __init__(self, linear: nn.Linear, quantize, block_weights: int = DECODE_BLOCK_WEIGHTS):
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        q, scale = quantize(linear.weight)
        self.weight = nn.Parameter(q, requires_grad=False)
        self.register_buffer("weight_scale", scale)
        self.bias = linear.bias
        self.decode_rows = block_rows(self.in_features, block_weights)

    def forward(self, x):
        return quantized_linear(x, self.weight, self.weight_scale, self.bias, self.decode_rows)


class QuantizedEmbedding(nn.Embedding):
    """A frozen embedding table as quantized rows and their scales: a lookup decodes only the rows it reads."""

    def __init__(self, emb: nn.Embedding, quantize):
        nn.Module.__init__(self)
        self.num_embeddings, self.embedding_dim = emb.num_embeddings, emb.embedding_dim
        self.padding_idx, self.max_norm, self.sparse = emb.padding_idx, None, False
        q, scale = quantize(emb.weight)
        self.weight = nn.Parameter(q, requires_grad=False)
        self.register_buffer("weight_scale", scale)

    def forward(self, ids):
        flat = ids.reshape(-1)
        rows = dequantize(self.weight.index_select(0, flat), self.weight_scale.index_select(0, flat))
        return rows.reshape(*ids.shape, self.embedding_dim)


QUANTIZERS = {"int8": quantize_rows, "int4": quantize_int4}


def quantize_base(model, base_weights: str, block_weights: int = DECODE_BLOCK_WEIGHTS) -> int:
    """Store a LlamaForCausalLM's frozen Linears and embedding as `base_weights` (in place; before
    peft wraps it), each Linear decoded at most `block_weights` weights at a time (the export's
    decode_block_weights). Returns how many modules were replaced."""
    if base_weights not in BASE_WEIGHTS:
        raise ValueError(f"unknown base weights {base_weights!r}: use {', '.join(BASE_WEIGHTS)}")
    if base_weights == "fp32":
        return 0
    quantize = QUANTIZERS[base_weights]
    replaced = 0
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if type(child) not in (nn.Linear, nn.Embedding):
                continue
            try:
                new = (QuantizedLinear(child, quantize, block_weights) if type(child) is nn.Linear
                       else QuantizedEmbedding(child, quantize))
            except ValueError as e:
                where = f"{parent_name}.{name}" if parent_name else name
                raise ValueError(f"--base-weights {base_weights}: {where}: {e}; use --base-weights int8") from None
            setattr(parent, name, new)
            replaced += 1
    return replaced


def adopt_stored(model, tensors: dict) -> None:
    """Give each quantized module of a model built on the meta device (quantize_base) the stored
    weight and scale `tensors` (state-dict names) hold, in whichever form they were stored
    (block_format), which the shapes quantize_base guessed need not match."""
    for name, m in model.named_modules():
        if isinstance(m, (QuantizedLinear, QuantizedEmbedding)):
            q, scale = tensors.get(f"{name}.weight"), tensors.get(f"{name}.weight_scale")
            if q is not None and scale is not None:
                m.weight = nn.Parameter(q, requires_grad=False)
                m.weight_scale = scale


FORMAT_NAMES = {"rows": "int8 rows", "q4_0": "Q4_0", "q4_1": "Q4_1 (the file's)", "q8_0": "Q8_0 (the file's)"}


def stored_formats(model) -> str:
    """How a quantize_base'd model stores its frozen weights, for the export's log: "7 Q4_0, 14
    Q4_1 (the file's)"."""
    counts: dict[str, int] = {}
    for m in model.modules():
        if isinstance(m, (QuantizedLinear, QuantizedEmbedding)):
            name = FORMAT_NAMES[block_format(m.weight, m.weight_scale)]
            counts[name] = counts.get(name, 0) + 1
    return ", ".join(f"{counts[name]} {name}" for name in sorted(counts))

"""What an export is asked to do, separate from the model it is applied to (cf. peft's LoraConfig)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

BASE_WEIGHTS = ("fp32", "int8", "int4")  # how the frozen base weights are stored (exporter/base_weights.py)
# The most frozen weights a quantized base decodes to fp32 at once (16 MiB): a TinyLlama MLP
# weight (11.5 M) decodes in 3 row blocks, its attention weights (4 M) whole, lm_head in blocks of
# 2,048 rows. The decode keeps ~4 tensors of a block's half live: with whole weights they were
# most of a TinyLlama-shape chunk's working arena (phase 1 / phase 2: 76 / 97 MiB; 42 / 61 in blocks).
DECODE_BLOCK_WEIGHTS = 1 << 22
READOUTS = ("static", "lens")  # what the frozen lm_head reads a chunk's h through (exporter/readout_lens.py)
TAIL = "tail:"  # tail:D, tail:all: the readout runs D of the model's own frozen later layers first


def readout_problem(readout: str) -> str | None:
    """Why `readout` is not a readout --readout takes (one line with the fix), or None."""
    if readout in READOUTS:
        return None
    fix = "give static, lens, tail:D (D >= 1 later layers, e.g. tail:2) or tail:all"
    if not readout.startswith(TAIL):
        return f"--readout {readout!r} is not a readout: {fix}"
    d = readout[len(TAIL):]
    if d != "all" and not (d.isdigit() and int(d) >= 1):
        return f"--readout {readout!r}: D must be a whole number of layers >= 1 or all: {fix}"
    return None


def tail_depth(readout: str, num_layers: int) -> int:
    """How many of the model's own later layers a chunk's readout runs through: 0 for static and
    lens, D for tail:D, num_layers for tail:all (either is capped at the model's top by the chunk)."""
    if not readout.startswith(TAIL):
        return 0
    d = readout[len(TAIL):]
    return num_layers if d == "all" else int(d)


def tail_end(after_layer: int, depth: int, num_layers: int) -> int:
    """The last layer the readout of the state after `after_layer` runs (after_layer itself for
    depth 0): a state there is read by the final norm when it is the model's last, else by a lens."""
    return min(after_layer + depth, num_layers - 1)


def readout_lens_layers(ranges, depth: int, num_layers: int) -> list[int]:
    """The layers after which the chunks' readouts need a lens (tail ends below the top): each
    chunk reads its own h and, for the consistency term, h_{k-1} (the embedding for chunk 0)."""
    ends = {tail_end(a, depth, num_layers) for first, last in ranges for a in (first - 1, last)}
    return sorted(e for e in ends if e != num_layers - 1)


@dataclass(frozen=True)
class ExportConfig:
    lora_rank: int = 8
    lora_alpha: float = 16.0  # peft's lora_alpha; the LoRA scale is lora_alpha / lora_rank
    target_modules: tuple[str, ...] = ("q_proj", "v_proj")
    alpha: float = 0.5  # blend of task CE and consistency KL, seed Eq. (3)
    seq_len: int = 128
    micro_batch: int = 1
    # Readout rows per micro-batch: the loss is computed only at valid positions, gathered into
    # this many slots (padding slots carry weight 0). None means micro_batch * seq_len (all).
    loss_positions: int | None = None
    backend: str = "xnnpack"  # or "portable"
    # What XNNPACK runs: "all" (GEMMs and the element-wise/transpose/norm ops: faster steps) or
    # "gemm" (GEMMs only: lower peak memory); see exporter/lower.py and docs/BENCHMARKS.md
    xnnpack_ops: str = "all"
    seed: int = 0  # LoRA initialisation
    # How the frozen base weights are stored: "fp32", "int8" rows with per-row scales (0.25x the
    # weight memory) or "int4" Q4_0 blocks (0.14x; a GGUF's Q4_1 / Q8_0 blocks kept as they are);
    # see exporter/base_weights.py
    base_weights: str = "fp32"
    # int8 / int4: the most weights decoded at once (a Linear's rows in blocks; lm_head's blocks)
    decode_block_weights: int = DECODE_BLOCK_WEIGHTS
    # "static": the final norm on every chunk's h (the seed's option (a)); "lens": a calibrated
    # lens per chunk boundary, fitted at export time on calibration text (readout_lens.py);
    # "tail:D" / "tail:all": D of the model's own frozen later layers, then the norm (at the top)
    # or a lens fitted at the tail's end (chunk_model.ChunkModel)
    readout: str = "static"
    extra: dict = field(default_factory=dict)

    @property
    def readout_rows(self) -> int:
        return self.loss_positions or self.micro_batch * self.seq_len

    @property
    def lora_scale(self) -> float:
        return self.lora_alpha / self.lora_rank

    def to_json(self) -> dict:
        d = asdict(self)
        d["target_modules"] = list(self.target_modules)
        d["readout_rows"] = self.readout_rows
        d.pop("extra")
        return d

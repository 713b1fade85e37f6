"""Parse and validate a chunk spec such as "0-6,7-13,14-21" (inclusive layer ranges)."""
from __future__ import annotations

from .errors import ChunkSpecError

DEFAULT_CHUNKS = "0-6,7-13,14-21"


def parse_chunk_spec(spec: str, num_layers: int) -> list[tuple[int, int]]:
    """Return inclusive (first, last) layer ranges; they must be contiguous, ordered,
    non-overlapping and cover layers 0..num_layers-1 exactly."""
    hint = f"the model has {num_layers} layers (0-{num_layers - 1}); give contiguous ranges like 0-6,7-13,14-21"
    parts = [p.strip() for p in (spec or "").split(",")]
    if not spec or any(not p for p in parts):
        raise ChunkSpecError(f"empty chunk spec {spec!r}: {hint}")
    ranges = []
    for p in parts:
        lo_s, sep, hi_s = p.partition("-")
        try:
            lo = int(lo_s)
            hi = int(hi_s) if sep else lo
        except ValueError:
            raise ChunkSpecError(f"chunk range {p!r} is not FIRST-LAST: {hint}") from None
        if lo < 0 or hi < lo:
            raise ChunkSpecError(f"chunk range {p!r} is empty or negative: {hint}")
        ranges.append((lo, hi, p))
    expected = 0
    for lo, hi, text in ranges:
        if lo < expected:
            raise ChunkSpecError(f"chunk range {text!r} overlaps the previous one: {hint}")
        if lo > expected:
            raise ChunkSpecError(f"chunk range {text!r} leaves layers {expected}-{lo - 1} uncovered: {hint}")
        if hi >= num_layers:
            raise ChunkSpecError(f"chunk range {text!r} goes past the last layer {num_layers - 1}: {hint}")
        expected = hi + 1
    if expected != num_layers:
        raise ChunkSpecError(f"chunk spec {spec!r} leaves layers {expected}-{num_layers - 1} uncovered: {hint}")
    return [(lo, hi) for lo, hi, _ in ranges]


def chunks_from_arg(arg: str) -> str:
    """--chunks: a spec, or a file holding one: a zl-host plan (JSON with "chunks") or the spec as text."""
    import json
    from pathlib import Path

    p = Path(arg)
    if not arg or not p.is_file():
        return arg
    text = p.read_text().strip()
    if text.startswith("{"):
        try:
            spec = json.loads(text).get("chunks")
        except json.JSONDecodeError as e:
            raise ChunkSpecError(f"--chunks {arg}: not valid JSON ({e.msg}); give a zl-host plan file or a spec "
                                 "like 0-6,7-13,14-21") from None
        if not isinstance(spec, str):
            raise ChunkSpecError(f"--chunks {arg}: the file has no \"chunks\" spec; write it with zl-host plan --out")
        return spec
    return text

"""Checks of a Llama model directory's config values and weight files, before transformers loads
them: a bad value or a torn file is one line naming the file and the fix, not a traceback from
deep inside a library."""
from __future__ import annotations

from pathlib import Path

from .errors import ExportError, ModelDirError

LLAMA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_POSITIVE_INTS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def check_target_modules(modules: tuple) -> None:
    bad = [m for m in modules if m not in LLAMA_LINEARS]
    if not modules or bad:
        raise ExportError(f"--target-modules {','.join(bad) or '(none)'}: "
                          f"{'not a linear layer of a Llama block' if bad else 'name at least one module'}; "
                          f"use some of {', '.join(LLAMA_LINEARS)} (e.g. q_proj,v_proj)")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_config_values(path: Path, cfg: dict) -> None:
    where = f"{Path(path) / 'config.json'}"
    fix = "correct it (copy the model's original config.json)"
    for key in _POSITIVE_INTS:
        if key not in cfg:
            raise ModelDirError(f"{where} has no {key}: {fix}")
        if not _is_int(cfg[key]) or cfg[key] < 1:
            raise ModelDirError(f"{where}: {key} is {cfg[key]!r}, must be a positive integer: {fix}")
    kv = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    if kv is not None and (not _is_int(kv) or kv < 1 or cfg["num_attention_heads"] % kv):
        raise ModelDirError(f"{where}: num_key_value_heads is {kv!r}, must be a positive integer dividing "
                            f"num_attention_heads ({cfg['num_attention_heads']}): {fix}")
    head_dim = cfg.get("head_dim")
    if head_dim is None and cfg["hidden_size"] % cfg["num_attention_heads"]:
        raise ModelDirError(f"{where}: hidden_size {cfg['hidden_size']} is not a multiple of num_attention_heads "
                            f"{cfg['num_attention_heads']}: {fix}")
    eps = cfg.get("rms_norm_eps", 1e-6)
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not 0 < eps < 1:
        raise ModelDirError(f"{where}: rms_norm_eps is {eps!r}, must be a number between 0 and 1: {fix}")


def check_weight_files(path: Path) -> None:
    """Each *.safetensors must parse (header and sizes); safe_open reads no tensor data."""
    from safetensors import safe_open

    for f in sorted(Path(path).glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as st:
                st.keys()
        except Exception as e:  # safetensors' own error type for a torn or foreign file
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ModelDirError(f"{f} is not a readable safetensors file ({why}): the download or copy is corrupt "
                                "or incomplete; fetch the model files again") from None

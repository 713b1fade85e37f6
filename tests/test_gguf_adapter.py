"""zl-host export: the run's adapter as llama.cpp's GGUF LoRA adapter (names, shapes, dtypes and
metadata as convert_lora_to_gguf.py writes them, q/k rows in llama.cpp's rotary order) and the
merged model (HF directory and GGUF); an adapter for another base or other targets is refused.

The GGUF base is a small random Llama written with the gguf package (conftest.write_gguf_llama);
the adapter has random, non-zero A and B so every layout mistake shows in the numbers. The check
with llama.cpp itself is bench/llama_cpp_adapter.py (it compiles llama.cpp)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from host.cli.zl_host import main
from host.outputs.adapter_check import AdapterError

from .conftest import cli_error_line, write_gguf_llama

TARGETS = ["q_proj", "k_proj", "v_proj"]  # k_proj: 2 kv heads of 4, its own row permutation


def _peft_adapter(model, out, targets=TARGETS, r=4, alpha=8.0, seed=5):
    """A PEFT adapter dir for `model` with random A and B (B is zero at init: that would hide a wrong B layout)."""
    from peft import LoraConfig, get_peft_model

    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, bias="none",
                     task_type="CAUSAL_LM")
    pm = get_peft_model(model, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    pm.save_pretrained(str(out))
    pm.unload()  # leave `model` as it was
    return out


@pytest.fixture(scope="module")
def base_and_adapter(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf_adapter")
    path, model = write_gguf_llama(d / "base.gguf")
    adapter = _peft_adapter(model, d / "adapter")
    return path, adapter, d


def _tensors(path):
    from gguf import GGUFReader

    r = GGUFReader(str(path))
    return r, {t.name: t for t in r.tensors}


def test_adapter_gguf_has_llama_cpps_names_shapes_and_metadata(base_and_adapter):
    from host.outputs.gguf_adapter import write_gguf_adapter

    base, adapter, d = base_and_adapter
    out = write_gguf_adapter(adapter, base, d / "adapter.gguf")
    r, ts = _tensors(out)
    meta = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}
    assert meta["general.architecture"] == "llama" and meta["general.type"] == "adapter"
    assert meta["adapter.type"] == "lora" and meta["adapter.lora.alpha"] == pytest.approx(8.0)
    assert r.fields["adapter.lora.alpha"].types[0].name == "FLOAT32"
    want = {f"blk.{i}.attn_{m}.weight.lora_{ab}" for i in range(2) for m in "qkv" for ab in "ab"}
    assert set(ts) == want
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    assert cfg["r"] == 4
    for name, t in ts.items():
        assert t.tensor_type.name == "F32"
        rows = {"q": 64, "k": 32, "v": 32}[name.split("attn_")[1][0]]  # 4 heads x 16; 2 kv heads x 16
        # ggml's ne (GGUFReader.shape) is numpy's shape reversed: lora_a ne=[in, r], lora_b ne=[r, out]
        assert list(t.shape) == ([64, 4] if name.endswith("lora_a") else [4, rows]), name


def test_adapter_applied_as_llama_cpp_does_gives_the_merged_weights(base_and_adapter):
    """llama.cpp adds alpha/r * lora_b @ lora_a to the base file's tensor, in the file's own (rotary)
    row order. Done here on the base GGUF's tensors, it must give the merged model's tensors as
    the merged GGUF holds them, and that file, read by transformers' GGUF loader, must give
    peft's logits: so the adapter's lora_b rows are in the base file's order (q/k permuted)."""
    from peft import PeftModel

    from exporter.gguf_model import load_gguf_model
    from host.outputs.gguf_adapter import write_gguf_adapter
    from host.outputs.merged_model import merged_model, write_merged_gguf

    base, adapter, d = base_and_adapter
    _, ad = _tensors(write_gguf_adapter(adapter, base, d / "a2.gguf"))
    merged = merged_model(adapter, base)
    _, mg = _tensors(write_merged_gguf(merged, base, None, d / "merged.gguf"))
    _, bs = _tensors(base)
    scale = 8.0 / 4
    for i in range(2):
        for m in "qkv":
            stem = f"blk.{i}.attn_{m}.weight"
            want = bs[stem].data + scale * ad[f"{stem}.lora_b"].data @ ad[f"{stem}.lora_a"].data
            assert mg[stem].tensor_type.name == "F16"
            np.testing.assert_allclose(mg[stem].data.astype(np.float32), want, atol=2e-3, rtol=2e-3)
            assert np.abs(want - bs[stem].data).max() > 0.05  # the adapter changes it
    ids = torch.tensor([[5, 9, 12, 40, 7, 3, 100]])
    with torch.no_grad():
        want = PeftModel.from_pretrained(load_gguf_model(base), str(adapter)).eval()(input_ids=ids).logits
        got = load_gguf_model(d / "merged.gguf")(input_ids=ids).logits
        plain = load_gguf_model(base)(input_ids=ids).logits
    assert (want - got).abs().max() < 2e-2 < (want - plain).abs().max()


def test_merged_hf_dir_loads_in_transformers_with_peft_logits(base_and_adapter, tmp_path):
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    from exporter.gguf_model import load_gguf_model
    from host.outputs.merged_model import merged_model, write_merged_hf
    from tests.conftest import build_bpe_tokenizer

    base, adapter, _ = base_and_adapter
    build_bpe_tokenizer().save_pretrained(tmp_path / "tok")
    out = write_merged_hf(merged_model(adapter, base), tmp_path / "tok", tmp_path / "merged")
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    ids = torch.tensor([[5, 9, 12, 40]])
    with torch.no_grad():
        want = PeftModel.from_pretrained(load_gguf_model(base), str(adapter)).eval()(input_ids=ids).logits
        got = LlamaForCausalLM.from_pretrained(out).eval()(input_ids=ids).logits
    assert (want - got).abs().max() < 1e-4


def test_adapter_for_another_base_or_targets_is_refused(base_and_adapter, tmp_path):
    from transformers import LlamaForCausalLM

    from exporter.model_source import llama_config
    from host.outputs.gguf_adapter import write_gguf_adapter

    base, adapter, _ = base_and_adapter
    other = _peft_adapter(LlamaForCausalLM(llama_config(num_hidden_layers=2, hidden_size=32, intermediate_size=64)),
                          tmp_path / "other")
    with pytest.raises(AdapterError, match="do not belong together") as e:
        write_gguf_adapter(other, base, tmp_path / "x.gguf")
    assert "\n" not in str(e.value)
    with pytest.raises(AdapterError, match="exported with rank 4 for q_proj, v_proj"):
        write_gguf_adapter(adapter, base, tmp_path / "x.gguf", {"rank": 4, "target_modules": ["q_proj", "v_proj"]})
    assert not (tmp_path / "x.gguf").exists() and not (tmp_path / "x.gguf.tmp").exists()


def test_cli_exports_a_run(small_export, small_model_dir, tmp_path, capsys):
    """zl-host export RUN --gguf --merged on a run of the small export (a HF base with a word-level
    tokenizer: adapter.gguf and merged/ are written, merged.gguf is skipped with the reason)."""
    from transformers import LlamaForCausalLM

    out_dir, manifest, _, _ = small_export
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"program": str(out_dir)}))
    _peft_adapter(LlamaForCausalLM.from_pretrained(small_model_dir), run / "adapter", targets=["q_proj", "v_proj"])
    assert main(["export", str(run), "--gguf", "--merged"]) == 0
    cap = capsys.readouterr()
    assert "--lora" in cap.out and "merged.gguf not written" in cap.err and "WordLevel" in cap.err
    _, ts = _tensors(run / "export" / "adapter.gguf")
    assert len(ts) == 3 * 2 * 2  # 3 layers x (q, v) x (a, b)
    assert (run / "export" / "merged" / "model.safetensors").is_file()

    assert main(["export", str(run)]) == 2
    assert "--gguf" in cli_error_line(capsys)
    assert main(["export", str(tmp_path), "--gguf"]) == 2
    assert "is not a finished zl-host run" in cli_error_line(capsys)
    _peft_adapter(LlamaForCausalLM.from_pretrained(small_model_dir), run / "adapter", targets=["q_proj", "o_proj"])
    assert main(["export", str(run), "--gguf"]) == 2
    assert "o_proj" in cli_error_line(capsys)

"""bench/llama_shape.py writes an ordinary Hugging Face Llama directory shard by shard: transformers
loads it with no missing or unexpected tensor, in bf16 as stored, tied where the shape ties; no shard
is over the limit; the exporter's own check takes the directory."""
from __future__ import annotations

import json

import torch

from bench.llama_shape import shape_config, write_shape

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, vocab_size=1000)  # llama-3.2-3b's kind (tied, GQA), tiny


def test_a_sharded_shape_loads_as_written(tmp_path):
    from transformers import LlamaForCausalLM

    from exporter.model_source import check_model_dir

    out = tmp_path / "shape"
    limit = 100_000
    r = write_shape(out, shape_config("llama-3.2-3b", **SMALL), seed=1, shard_bytes=limit, say=lambda _: None)
    shards = sorted(out.glob("*.safetensors"))
    assert r["shards"] == len(shards) > 1
    assert all(f.name.endswith(f"-of-{len(shards):05d}.safetensors") for f in shards)
    # a shard holds at most the limit, unless one tensor alone is larger (the embedding here: 128,000 bytes)
    assert all(f.stat().st_size <= limit + 200_000 for f in shards)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {f.name for f in shards}
    assert index["metadata"]["total_size"] == r["bytes"]
    check_model_dir(out)

    model, info = LlamaForCausalLM.from_pretrained(out, output_loading_info=True, dtype="auto")
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert model.dtype == torch.bfloat16
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied, as the shape
    w = model.model.layers[1].mlp.down_proj.weight.float()
    assert abs(w.std().item() - model.config.initializer_range) < 0.002 and abs(w.mean().item()) < 0.002
    assert torch.equal(model.model.norm.weight, torch.ones(64, dtype=torch.bfloat16))


def test_the_same_seed_writes_the_same_weights_and_another_does_not(tmp_path):
    from safetensors.torch import load_file

    cfg = shape_config("tinyllama-1.1b", **{**SMALL, "head_dim": None})
    a, b, c = (write_shape(tmp_path / n, cfg, seed=s, say=lambda _: None) for n, s in (("a", 0), ("b", 0), ("c", 1)))
    assert a["shards"] == 1  # one file: model.safetensors, no index
    wa, wb, wc = (load_file(str(tmp_path / n / "model.safetensors")) for n in "abc")
    assert "lm_head.weight" in wa  # tinyllama does not tie
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not torch.equal(wa["lm_head.weight"], wc["lm_head.weight"])

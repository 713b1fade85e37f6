"""exporter/streamed_model.py: a model directory read one layer at a time, each frozen weight stored
as the base weights are as it is read, is the model transformers' from_pretrained + quantize_base
gives, tensor for tensor; the readout lenses fitted as the layers pass are those fitted on the whole
fp32 model; a directory whose weights do not fit its config is one line naming the tensor."""
from __future__ import annotations

import json

import pytest
import torch

from exporter.base_weights import quantize_base
from exporter.errors import ModelDirError
from exporter.model_source import llama_config, load_model_dir
from exporter.readout_lens import EMBEDDING, fit_model_lenses
from exporter.streamed_model import read_model_dir


def _state(model) -> dict:
    return {n: t for n, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]}


def _assert_same_model(a, b):
    sa, sb = _state(a), _state(b)
    assert sa.keys() == sb.keys()
    for name in sa:
        assert sa[name].dtype == sb[name].dtype, name
        assert torch.equal(sa[name], sb[name]), name
    assert {type(m).__name__ for m in a.modules()} == {type(m).__name__ for m in b.modules()}
    assert a.config.to_dict() == {**b.config.to_dict(), "_name_or_path": a.config.to_dict()["_name_or_path"]}


@pytest.fixture(scope="module")
def tied_sharded_dir(tmp_path_factory):
    """A small tied-embedding Llama saved in several shards (as Llama-3.2-3B is: tied, 4 shards)."""
    from transformers import LlamaForCausalLM

    d = tmp_path_factory.mktemp("tied") / "model"
    torch.manual_seed(11)
    LlamaForCausalLM(llama_config(num_hidden_layers=3, tie_word_embeddings=True)).save_pretrained(d, max_shard_size="100KB")
    assert len(list(d.glob("*.safetensors"))) > 2 and (d / "model.safetensors.index.json").is_file()
    return d


@pytest.mark.parametrize("base", ["fp32", "int8", "int4"])
def test_streamed_read_is_the_loaded_then_quantized_model(small_model_dir, base):
    expected = load_model_dir(small_model_dir)
    quantize_base(expected, base)
    got, lenses, positions = read_model_dir(small_model_dir, base)
    _assert_same_model(got, expected)
    assert (lenses, positions) == ({}, 0)
    ids = torch.arange(4, 20).reshape(2, 8)
    assert torch.equal(got(input_ids=ids).logits, expected(input_ids=ids).logits)


@pytest.mark.parametrize("base", ["fp32", "int4"])
def test_tied_and_sharded_weights_are_read(tied_sharded_dir, base):
    expected = load_model_dir(tied_sharded_dir)
    quantize_base(expected, base)
    got, _, _ = read_model_dir(tied_sharded_dir, base)
    _assert_same_model(got, expected)
    if base == "fp32":  # one tensor for both, as from_pretrained ties them
        assert got.lm_head.weight is got.model.embed_tokens.weight


def test_lenses_fitted_as_the_layers_pass_are_the_whole_models(small_model_dir):
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(3):
        att = torch.ones(4, 16, dtype=torch.long)
        att[1, 9:] = 0
        att[:, 13:] = 0  # padding at the end, as make_microbatches pads
        batches.append({"input_ids": torch.randint(4, 512, (4, 16), generator=g), "attention_mask": att})
    after = [EMBEDDING, 0, 1]
    want, want_n = fit_model_lenses(load_model_dir(small_model_dir), batches, after)
    model, got, n = read_model_dir(small_model_dir, "int4", lens_after=after, batches=batches)
    assert n == want_n == int(sum(b["attention_mask"].sum() for b in batches))
    for i in after:
        assert torch.equal(got[i][0], want[i][0]) and torch.equal(got[i][1], want[i][1])
    expected = load_model_dir(small_model_dir)
    quantize_base(expected, "int4")
    _assert_same_model(model, expected)  # fitted on fp32 layers, stored int4 after


def _copy_dir(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_weights_that_do_not_fit_the_config_are_one_line(small_model_dir, tmp_path):
    d = _copy_dir(small_model_dir, tmp_path / "wider")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "intermediate_size": cfg["intermediate_size"] * 2}))
    with pytest.raises(ModelDirError) as e:
        read_model_dir(d)
    msg = str(e.value)
    assert "\n" not in msg and "model.layers.0.mlp." in msg and "config.json" in msg and "fetch the model files" in msg

    d = _copy_dir(small_model_dir, tmp_path / "deeper")
    (d / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": cfg["num_hidden_layers"] + 1}))
    with pytest.raises(ModelDirError, match=rf"no tensor model\.layers\.{cfg['num_hidden_layers']}\."):
        read_model_dir(d)

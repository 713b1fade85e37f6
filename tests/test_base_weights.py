"""--base-weights int8 / int4: frozen weights stored as int8 rows with per-row scales, or as
Q4_0 blocks, decoded one weight at a time in both phases, never held as an activation."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from exporter.base_weights import (
    QuantizedEmbedding,
    QuantizedLinear,
    block_format,
    dequantize,
    dequantize_groups,
    linear,
    matmul,
    quantize_base,
    quantize_groups,
    quantize_int4,
    quantize_rows,
    row_blocks,
    stored_formats,
)
from exporter.verify import ExportedModelSizes, verify_all
from tests.conftest import SMALL_DECODE_BLOCK, as_gguf_blocks, small_export_config


def test_quantize_rows_is_within_half_a_step_per_row():
    w = torch.randn(64, 48) * torch.logspace(-3, 1, 64)[:, None]  # rows of very different ranges
    w[5] = 0.0  # an all-zero row must not divide by zero
    q, scale = quantize_rows(w)
    assert q.dtype == torch.int8 and scale.shape == (64,) and torch.isfinite(scale).all()
    assert q.abs().max() <= 127
    err = (q.float() * scale[:, None] - w).abs()
    assert (err <= scale[:, None] / 2 + 1e-12).all()
    assert torch.equal(q[5], torch.zeros(48, dtype=torch.int8))
    # each row uses its full range: the largest entry maps to +-127
    assert (q.abs().amax(dim=1)[torch.arange(64) != 5] == 127).all()


def test_int4_groups_are_q4_0_and_a_q4_0_file_comes_through_bit_exact():
    """quantize_groups picks ggml's Q4_0 values and scales (the gguf package's reference quantizer),
    and requantizing a Q4_0 file's weights (what transformers dequantizes) gives back the same
    blocks: nothing is lost a second time."""
    from gguf import GGMLQuantizationType, quants

    torch.manual_seed(0)
    w = torch.randn(16, 256) * torch.logspace(-3, 1, 16)[:, None]  # rows of very different ranges
    w[3, :32] = 0.0  # an all-zero block must not divide by zero
    packed, scale = quantize_groups(w)
    assert packed.dtype == torch.int8 and packed.shape == (16, 128)
    assert scale.dtype == torch.float16 and scale.shape == (16, 8)
    q4_0 = GGMLQuantizationType.Q4_0
    ggml = torch.from_numpy(quants.dequantize(quants.quantize(w.numpy(), q4_0), q4_0))
    assert torch.equal(dequantize_groups(packed, scale), ggml)
    assert torch.equal(dequantize_groups(packed, scale)[3, :32], torch.zeros(32))
    again = quantize_groups(ggml)
    assert torch.equal(again[0], packed) and torch.equal(again[1], scale)
    with pytest.raises(ValueError, match="multiple of 64 columns, got 96"):
        quantize_groups(torch.randn(4, 96))
    with pytest.raises(ValueError, match="packed as torch.uint8.*export the model again"):  # an older export's bytes
        dequantize_groups(packed.view(torch.uint8), scale)


def test_int4_keeps_a_gguf_s_q4_1_and_q8_0_blocks_bit_exact():
    """A weight whose values are a Q4_1 or Q8_0 file's (what transformers dequantizes) is stored
    as those blocks and decodes to the same fp32 numbers, in the halves the products read too;
    float weights and a Q4_0 file's values become Q4_0."""
    torch.manual_seed(1)
    w = torch.randn(48, 256) * torch.logspace(-3, 1, 48)[:, None]
    w[2, :64] = 0.5  # a constant block: d = 0
    assert block_format(*quantize_int4(w)) == "q4_0"
    assert block_format(*quantize_int4(as_gguf_blocks(w, "Q4_0"))) == "q4_0"
    x, g = torch.randn(5, 256), torch.randn(5, 48)
    for kind, size in (("Q4_1", 48 * 128 + 48 * 8 * 4), ("Q8_0", 48 * 256 + 48 * 8 * 2)):
        values = as_gguf_blocks(w, kind)
        q, scale = quantize_int4(values)
        assert block_format(q, scale) == kind.lower()
        assert q.dtype == torch.int8 and q.numel() * 1 + scale.numel() * 2 == size  # bytes
        assert torch.equal(dequantize(q, scale), values)
        # the products read the weight's column halves: the same terms summed in another order, so
        # equal to a float's rounding (a wrong nibble would be off by a block's step, ~1e-2 here)
        torch.testing.assert_close(linear(x, (q, scale)), F.linear(x, values), rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(matmul(g, (q, scale)), g @ values, rtol=1e-5, atol=1e-4)
        off = values.clone()
        off[7, 3] += 1e-3  # one value off the grid: not that file's blocks, so Q4_0
        assert block_format(*quantize_int4(off)) == "q4_0"


def _gguf_quantizer(kind):
    return lambda w: quantize_int4(as_gguf_blocks(w, kind))


QUANTIZERS = {"int8": quantize_rows, "int4": quantize_groups, "q4_1": _gguf_quantizer("Q4_1"),
              "q8_0": _gguf_quantizer("Q8_0")}


@pytest.mark.parametrize("fmt", ["int8", "int4", "q4_1", "q8_0"])
@pytest.mark.parametrize("bias,block_weights", [(False, 1 << 22), (True, 1 << 22), (False, 32 * 128)])
def test_quantized_linear_backward_decodes_the_weight_again_instead_of_saving_it(fmt, bias, block_weights):
    """... and, where the weight is larger than block_weights, decodes it in row blocks (32 rows
    of 128 columns: 32 + 32 + 16), with the same result."""
    torch.manual_seed(0)
    lin = QuantizedLinear(nn.Linear(128, 80, bias=bias), QUANTIZERS[fmt], block_weights)
    assert block_format(lin.weight, lin.weight_scale) == {"int8": "rows", "int4": "q4_0"}.get(fmt, fmt)
    assert lin.decode_rows == (32 if block_weights == 32 * 128 else 32768)
    assert len(row_blocks(lin.weight, lin.weight_scale, lin.decode_rows)) == (3 if block_weights == 32 * 128 else 1)
    x = torch.randn(4, 128, requires_grad=True)
    saved = []

    def keep(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        y = lin(x)
    (y * torch.arange(80.0)).sum().backward()
    # what autograd keeps for the backward: the quantized rows and their scales, no fp32 weight
    assert not [t for t in saved if t.dtype == torch.float32 and t.numel() >= 80 * 128 // 2]
    assert any(t.dtype == torch.int8 for t in saved)

    x2 = x.detach().clone().requires_grad_(True)
    ref = F.linear(x2, dequantize(lin.weight, lin.weight_scale), lin.bias)  # the bias stays fp32
    (ref * torch.arange(80.0)).sum().backward()
    torch.testing.assert_close(y, ref)
    torch.testing.assert_close(x.grad, x2.grad)


def test_int8_row_scales_multiply_the_products_not_the_weight():
    """int8 rows: in the traced forward and backward the scales multiply tokens x rows products,
    never a decoded weight (a pass over rows x cols per use, 13% of the step)."""
    from torch.export import export

    lin = QuantizedLinear(nn.Linear(128, 80, bias=False), quantize_rows, 32 * 128)

    class Step(nn.Module):
        def forward(self, x, g):
            return lin(x), matmul(g, (lin.weight, lin.weight_scale), lin.decode_rows)

    ep = export(Step(), (torch.randn(4, 128), torch.randn(4, 80)))
    muls = [n.meta["val"].shape for n in ep.graph.nodes if n.target == torch.ops.aten.mul.Tensor]
    assert len(muls) == 6  # 3 row blocks, forward and input gradient
    assert all(s[0] == 4 for s in muls), muls  # a token dimension: products, not weights


@pytest.mark.parametrize("fmt,tol", [("int8", 0.05), ("int4", 0.3)])
def test_quantize_base_replaces_every_frozen_linear_and_the_embedding(small_model_dir, fmt, tol):
    from exporter.chunk_model import add_lora
    from exporter.model_source import load_model_dir

    model = load_model_dir(small_model_dir)
    linears = sum(type(m) is nn.Linear for m in model.modules())
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    ref = model(ids).logits
    assert quantize_base(model, fmt) == linears + 1  # + the embedding
    assert not any(type(m) in (nn.Linear, nn.Embedding) for m in model.modules())
    assert isinstance(model.model.embed_tokens, QuantizedEmbedding)
    assert model.model.embed_tokens.weight.dtype == torch.int8
    out = model(ids).logits
    assert 0 < (out - ref).abs().max() < tol * ref.abs().max()  # close, not equal: 8 or 4 bits per weight
    peft_model = add_lora(model, small_export_config())  # peft wraps a QuantizedLinear like a Linear
    q_proj = peft_model.base_model.model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj.base_layer, QuantizedLinear) and "default" in q_proj.lora_A
    with pytest.raises(ValueError, match="unknown base weights 'int3'"):
        quantize_base(model, "int3")


def test_int4_refuses_a_model_whose_rows_do_not_split_into_blocks():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(hidden_size=96, intermediate_size=128, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=64))
    with pytest.raises(ValueError, match=r"--base-weights int4: lm_head: .*multiple of 64 columns, "
                                         r"got 96; use --base-weights int8"):
        quantize_base(model, "int4")


def test_int8_export_is_a_quarter_of_the_weights_and_matches_eager(small_export, small_export_int8):

    out8, manifest8, artifacts8, cfg8 = small_export_int8
    out32, manifest32, _, _ = small_export
    assert manifest8["export"]["base_weights"] == "int8" and manifest32["export"]["base_weights"] == "fp32"
    for c8, c32 in zip(manifest8["chunks"], manifest32["chunks"]):
        ratio = (out8 / c8["weights"]).stat().st_size / (out32 / c32["weights"]).stat().st_size
        assert 0.2 < ratio < 0.32, (c8["index"], ratio)  # int8 + one fp32 scale per row, norms in fp32
        assert c8["bp"]["weights"] == c8["weights"]  # the BP program shares the chunk's .ptd
    # every program (ZeroLock and BP) against the same int8 chunk in eager PyTorch
    diffs = verify_all(out8, artifacts8, cfg8, ExportedModelSizes(manifest8), report=lambda m: None)
    assert len(diffs) == 6


def test_int4_export_keeps_a_gguf_s_blocks_and_matches_its_own_reference(small_model_dir, small_model_dir_gguf_blocks,
                                                                         small_export, small_export_int4):
    """An int4 export stores float weights as Q4_0 and a GGUF's Q4_1 / Q8_0 values as those blocks,
    bit-exact through the export; --verify judges the programs on the same weights in eager
    PyTorch, and still tells a program apart from a reference with other weights (int8)."""
    from safetensors.torch import load_file

    from exporter.chunk_model import ChunkModel, add_lora
    from exporter.model_source import load_model_dir
    from exporter.verify import failures, verify_chunk

    out4, manifest4, artifacts4, cfg4 = small_export_int4
    out32, manifest32, _, _ = small_export
    assert manifest4["export"]["base_weights"] == "int4"
    for c4, c32 in zip(manifest4["chunks"], manifest32["chunks"]):
        ratio = (out4 / c4["weights"]).stat().st_size / (out32 / c32["weights"]).stat().st_size
        assert 0.12 < ratio < 0.25, (c4["index"], ratio)  # 4.5 to 8.5 bits per weight, norms in fp32
        assert c4["bp"]["weights"] == c4["weights"]
    source = load_model_dir(small_model_dir_gguf_blocks).state_dict()
    for c in manifest4["chunks"]:
        stored = load_file(str(out4 / c["eager_weights"]))
        for name, q in stored.items():
            if name.endswith(".weight") and (scale := stored.get(name[:-len("weight")] + "weight_scale")) is not None:
                fmt = block_format(q, scale)
                want = ("q8_0" if name.startswith(("lm_head", "model.embed_tokens")) else
                        "q4_1" if name.startswith("model.layers.1.") else "q4_0")
                assert fmt == want, (name, fmt)
                if fmt != "q4_0":
                    assert torch.equal(dequantize(q, scale), source[name]), name
    diffs = verify_all(out4, artifacts4, cfg4, ExportedModelSizes(manifest4), report=lambda m: None)
    assert len(diffs) == 6
    art = artifacts4[0]
    model8 = load_model_dir(small_model_dir)
    quantize_base(model8, "int8")
    on_int8 = ChunkModel(add_lora(model8, cfg4), art.first, art.last, cfg4).eval()
    assert failures(verify_chunk(out4, art, cfg4, ExportedModelSizes(manifest4), chunk=on_int8))
    assert not failures(verify_chunk(out4, art, cfg4, ExportedModelSizes(manifest4)))


@pytest.mark.parametrize("fmt,rel,cos_min", [("int8", 0.02, 0.95), ("int4", 0.05, 0.8)])
def test_quantized_training_loss_stays_close_to_fp32(small_export, fmt, rel, cos_min, request):
    """The quantized base computes nearly the fp32 model's local loss and LoRA gradients."""
    from exporter.verify import sample_lora
    from tests.test_export_bp import _batch
    from zl_common.program import ChunkProgram

    (out32, m32, _, cfg), (out8, m8, _, _) = small_export, request.getfixturevalue(f"small_export_{fmt}")
    b = {**_batch(cfg, 512, seed=3), "alpha": torch.tensor([cfg.alpha])}
    in32 = in8 = b["input_ids"]
    for c32, c8 in zip(m32["chunks"], m8["chunks"]):
        lora = sample_lora(c32, seed=c32["index"])
        p32, p8 = ChunkProgram(out32, c32), ChunkProgram(out8, c8)
        x = c32["first_input"]
        h32, s32 = p32.phase1(lora, {**b, x: in32})
        h8, s8 = p8.phase1(lora, {**b, x: in8})
        r32, r8 = p32.phase2(lora, s32, {**b, x: in32}), p8.phase2(lora, s8, {**b, x: in8})
        in32, in8 = h32, h8
        assert r8.loss == pytest.approx(r32.loss, rel=rel), c32["index"]
        assert r8.loss != r32.loss  # the quantized base, not the fp32 one
        for n, g in r32.grads.items():
            cos = F.cosine_similarity(r8.grads[n].flatten(), g.flatten(), dim=0)
            assert cos > cos_min, (n, cos.item())


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_no_two_dequantized_weights_are_live_at_once(small_model_dir, fmt, request):
    """In the lowered phases each quantized weight's fp32 cast is freed before the next one is made:
    the arena holds one layer weight in fp32, not the chunk's (phase 2 recomputes the casts, which
    the joint graph orders first, and XNNPACK's partitioner re-sorts the graph and, for int4's
    decodes, would merge independent ones into one delegate)."""
    from exporter.chunk_model import ChunkModel, add_lora, example_inputs, input_names
    from exporter.graph_passes import weight_only_nodes
    from exporter.lower import joint_program, lower_two_phase
    from exporter.model_source import load_model_dir
    from exporter.two_phase import split_at_marker

    # int4: the model with a GGUF's blocks in places, so Q4_1's decode is among them, decoded in row
    # blocks as the int4 export is (the MLP's weights in 2)
    cfg = small_export_config(base_weights=fmt, backend="xnnpack",
                              **({"decode_block_weights": SMALL_DECODE_BLOCK} if fmt == "int4" else {}))
    model = load_model_dir(small_model_dir if fmt == "int8" else request.getfixturevalue("small_model_dir_gguf_blocks"))
    quantize_base(model, fmt, cfg.decode_block_weights)
    if fmt == "int4":
        assert stored_formats(model) == "14 Q4_0, 7 Q4_1 (the file's), 2 Q8_0 (the file's)"
    chunk = ChunkModel(add_lora(model, cfg), 0, 2, cfg).eval()  # three layers: 21 weights + readout
    inputs = example_inputs(chunk, cfg, model.config.vocab_size, model.config.hidden_size)
    et = lower_two_phase(split_at_marker(joint_program(chunk, inputs), input_names(True)), "xnnpack", "w",
                         quantized_base=True)
    for method in ("phase1", "phase2"):
        ep = et.exported_program(method)
        weights = weight_only_nodes(ep)  # the stored weights and the row blocks split off them
        stored = [a for a in weights if getattr(a.meta.get("val"), "dtype", None) == torch.int8]
        # each weight's int8 cast: an XNNPACK call of its own (graph_passes.casts_as_dequantize)
        casts = [g for n in ep.graph.nodes if "executorch_call_delegate" in str(n.target)
                 and any(a in stored for a in n.all_input_nodes)
                 for g in n.users]
        assert not [n for n in ep.graph.nodes if "to_dim_order_copy" in str(n.target)
                    and n.args[0].meta["val"].dtype == torch.int8], method  # no portable cast of a weight
        assert len(casts) >= 21, method  # every layer weight is dequantized in both phases
        # int4: the MLP's 9 weights each decoded as 2 row blocks; a Q4_0 block's bytes cast twice (for
        # the floor and the low half), a Q4_1 one's once (layer 1: 3 of the 9)
        from_blocks = [g for g in casts if any(a in stored and a.op != "placeholder" for a in g.args[0].all_input_nodes)]
        if fmt == "int4":
            assert len(from_blocks) >= 6 * 2 * 2 + 3 * 2, (method, len(from_blocks))
        # a block's casts (int4: the floor and the low half, one floor serving both halves) may be
        # live together; two blocks' (or weights') may not
        spans = sorted((*n.meta["spec"].lifetime, frozenset(a for a in n.args[0].all_input_nodes if a in stored))
                       for n in casts)
        overlapping = [(a[:2], b[:2]) for i, a in enumerate(spans) for b in spans[i + 1:]
                       if b[0] <= a[1] and a[2] != b[2]]
        assert not overlapping, (method, overlapping[:3])
        # and what each cast feeds: one weight's decode per delegate call
        for n in casts:
            assert all(sum(a in casts for a in u.all_input_nodes) == 1 for u in n.users), (method, n.name)


def test_cli_rejects_an_unknown_base_weight_format(tmp_path):
    r = subprocess.run([sys.executable, "-m", "exporter.cli", "--base-weights", "int3", "--out", str(tmp_path / "x")],
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert "--base-weights: invalid choice: 'int3'" in r.stderr and "'fp32', 'int8', 'int4'" in r.stderr
    assert not (tmp_path / "x").exists()


def test_cli_decode_block_reaches_the_config_and_a_bad_one_is_refused(tmp_path, capsys):
    from exporter.cli import build_parser, config_from_args, main
    from exporter.config import DECODE_BLOCK_WEIGHTS

    args = ["--model", "tiny", "--base-weights", "int4", "--out", str(tmp_path / "o")]
    assert config_from_args(build_parser().parse_args(args)).decode_block_weights == DECODE_BLOCK_WEIGHTS
    cfg = config_from_args(build_parser().parse_args(args + ["--decode-block", str(SMALL_DECODE_BLOCK)]))
    assert cfg.decode_block_weights == SMALL_DECODE_BLOCK and cfg.to_json()["decode_block_weights"] == SMALL_DECODE_BLOCK
    assert main(args + ["--decode-block", "0"]) == 2
    err = capsys.readouterr().err
    assert "--decode-block must be at least 1 weight, got 0" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("fmt,rel", [("int8", 0.02), ("int4", 0.1)])
def test_eval_uses_the_base_weights_the_adapter_was_trained_on(small_model_dir, small_export, fmt, rel):
    from host.evaluation.evaluate import evaluate
    from tests.conftest import small_micro_batches

    batches = small_micro_batches(small_export[0], n_examples=4)
    fp32 = evaluate(str(small_model_dir), None, batches)
    quantized = evaluate(str(small_model_dir), None, batches, base_weights=fmt)
    assert quantized["tokens"] == fp32["tokens"] > 0
    assert quantized["nll"] != fp32["nll"]  # the quantized base, not the fp32 one
    assert quantized["nll"] == pytest.approx(fp32["nll"], rel=rel)


@pytest.mark.parametrize("ops", ["gemm", "all"])
def test_quantized_partitioners_take_only_the_ops_asked_for(ops):
    """--xnnpack-ops gemm with a quantized base: the GEMMs and the weights' decodes, nothing else
    (an XnnpackPartitioner given no configs would take every op it knows)."""
    from exporter.lower import DECODE_CONFIGS, XNNPACK_CONFIGS, xnnpack_partitioners

    taken = {c.__class__.__mro__[1 if c.__class__.__name__.startswith(("Frozen", "Live")) else 0].__name__
             for p in xnnpack_partitioners(ops, quantized_base=True) for c in p.target_partitioner_configs.values()}
    assert taken == set(XNNPACK_CONFIGS[ops]) | set(DECODE_CONFIGS)


@pytest.mark.parametrize("name", ["quantize_rows", "quantize_groups"])
def test_large_weights_are_quantized_in_row_blocks_to_the_same_values(name):
    """A weight with more rows than QUANTIZE_ROWS (a 3B model's head) is quantized a block of rows at
    a time, so its temporaries stay small: the stored values are those of quantizing it whole."""
    from exporter import base_weights

    w = torch.randn(2 * base_weights.QUANTIZE_ROWS + 5, 64, generator=torch.Generator().manual_seed(3))
    blocked, whole = getattr(base_weights, name), getattr(base_weights, name).__wrapped__
    for a, b in zip(blocked(w), whole(w)):
        assert a.dtype == b.dtype and torch.equal(a, b)

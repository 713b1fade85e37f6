"""exporter.graph_passes: the phase programs lose every transpose of a frozen weight that fed a
matmul (ZeroLock and BP programs, both phases), compute exactly the same values, and still
lower with both backends. End-to-end numerics (program == eager) are checked by
test_export_programs.py / test_export_bp.py (portable) and test_export_errors.py (xnnpack)."""
import copy

import pytest
import torch
from peft import get_peft_model

from exporter.chunk_model import (
    BPChunkModel,
    ChunkModel,
    bp_example_inputs,
    bp_input_names,
    example_inputs,
    input_names,
    lora_config,
)
from exporter.graph_passes import drop_identity_ops, fold_weight_transposes, frozen_placeholders, op_counts, weight_transposes
from exporter.lower import joint_program, lower_two_phase
from exporter.model_source import load_model_dir
from exporter.two_phase import split_at_marker

from .conftest import small_export_config

MM = ("aten.mm.default", "aten.addmm.default")


@pytest.fixture(scope="module")
def peft_model(small_model_dir):
    cfg = small_export_config()
    torch.manual_seed(0)
    model = get_peft_model(load_model_dir(small_model_dir), lora_config(cfg))  # as the exporter loads it
    with torch.no_grad():  # nonzero lora_B, so every LoRA gradient is exercised
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    return model, cfg


def _splits(peft_model, cfg):
    """(label, chunk, split, {input name: value}) for a middle ZeroLock chunk and the first / last BP stages."""
    out = []
    chunk = ChunkModel(peft_model, 1, 1, cfg).eval()
    inputs = example_inputs(chunk, cfg, 512, 64)
    names = input_names(False)
    out.append(("zerolock", chunk, split_at_marker(joint_program(chunk, inputs), names), dict(zip(names, inputs))))
    for first, last in ((0, 0), (2, 2)):
        bp = BPChunkModel(peft_model, first, last, cfg, is_last=last == 2).eval()
        inputs = bp_example_inputs(bp, cfg, 512, 64)
        names = bp_input_names(bp.is_first, bp.is_last)
        split = split_at_marker(joint_program(bp, inputs), names, ("loss",) if bp.is_last else ())
        out.append((f"bp{first}", bp, split, dict(zip(names, inputs))))
    return out


@pytest.fixture(scope="module")
def splits(peft_model):
    return _splits(*peft_model)


def _transposed_weight_matmuls(ep):
    """matmuls whose operand is (a chain of transposes of) a frozen weight."""
    wt = set(weight_transposes(ep))
    return [n for n in ep.graph.nodes if str(n.target) in MM and any(a in wt for a in n.args)]


def test_pass_removes_every_weight_transpose(splits):
    for label, _, split, _ in splits:
        for phase in (split.phase1, split.phase2):
            ep = copy.deepcopy(phase.program)
            before = op_counts(ep)
            n_wt = len(weight_transposes(ep))
            n_mm = len(_transposed_weight_matmuls(ep))
            assert n_wt > 0 and n_mm > 0, label
            stats = fold_weight_transposes(ep)
            after = op_counts(ep)
            assert weight_transposes(ep) == [] and _transposed_weight_matmuls(ep) == [], label
            assert stats["weight_transposes"] == [n_wt, 0]
            # each folded matmul became one linear; nothing else but transposes went away
            assert after["aten.linear.default"] == stats["linear"]
            assert stats["linear"] + stats["cancelled_pairs"] > 0  # a BP backward only cancels pairs
            assert sum(after[k] for k in MM) == sum(before[k] for k in MM) - stats["linear"]
            assert after["aten.permute.default"] <= before["aten.permute.default"] - n_wt
            for op in set(before) | set(after):
                if op not in MM and op not in ("aten.linear.default", "aten.permute.default"):
                    assert after[op] == before[op], (label, op)
            # signature still names the graph's outputs; a second run finds nothing to do
            outs = [o.name for o in ep.graph.output_node().args[0]]
            assert [s.arg.name for s in ep.graph_signature.output_specs] == outs
            assert fold_weight_transposes(ep) == {"cancelled_pairs": 0, "linear": 0, "weight_transposes": [0, 0]}


def _run(ep, values: dict, names: list[str]):
    return ep.module()(*[values[n] for n in names])


def test_pass_keeps_the_values_exactly(splits):
    """phase1 then phase2 on real inputs: every output is bit-identical with and without the pass."""
    for label, chunk, split, inputs in splits:
        values = {n: p.detach() for n, p in chunk.named_parameters()}
        values.update(inputs)
        for which in ("phase1", "phase2"):
            ph = getattr(split, which)
            ep = copy.deepcopy(ph.program)
            fold_weight_transposes(ep)
            ref, got = _run(ph.program, values, ph.inputs), _run(ep, values, ph.inputs)
            assert len(ref) == len(got)
            for name, a, b in zip(ph.outputs, ref, got):
                assert torch.equal(a, b), (label, which, name)
            if which == "phase1":
                values.update(zip(ph.outputs, ref))
        assert any(o.startswith("grad:") for o in split.phase2.outputs)


def test_identity_ops_go_and_the_values_stay(splits):
    """drop_identity_ops leaves no alias (but a method output), pow(x, 1) or pow(x, 3), and
    phase 2's outputs are bit-identical (eager PyTorch computes x ** 3 as x * x * x too)."""
    def leftovers(ep):
        outs = set(ep.graph.output_node().args[0])
        return [n for n in ep.graph.nodes if n.op == "call_function" and n not in outs and (
            n.target is torch.ops.aten.alias.default
            or (n.target is torch.ops.aten.pow.Tensor_Scalar and n.args[1] in (1, 3)))]

    for label, chunk, split, inputs in splits:
        values = {n: p.detach() for n, p in chunk.named_parameters()}
        values.update(inputs)
        values.update(zip(split.phase1.outputs, _run(split.phase1.program, values, split.phase1.inputs)))
        ep = copy.deepcopy(split.phase2.program)
        fold_weight_transposes(ep)
        ref = _run(ep, values, split.phase2.inputs)
        assert leftovers(ep), label  # the joint backward has them: RMSNorm, autograd's saved aliases
        stats = drop_identity_ops(ep)
        assert leftovers(ep) == [] and stats["alias"] > 0 and stats["pow1"] + stats["pow3"] > 0, label
        assert drop_identity_ops(ep) == {"alias": 0, "pow1": 0, "pow3": 0}
        got = _run(ep, values, split.phase2.inputs)
        for name, a, b in zip(split.phase2.outputs, ref, got):
            assert torch.equal(a, b), (label, name)


@pytest.mark.parametrize("backend", ["portable", "xnnpack"])
def test_lowered_programs_copy_no_frozen_weight(peft_model, backend):
    """lower_two_phase applies the pass. XNNPACK: no permute_copy outside a delegate reads a
    frozen weight (linear takes W in place). Portable: to_edge turns linear back into
    permute_copy + mm, so only the cancelled backward pairs go: phase 2 copies fewer weights."""
    model, cfg = peft_model
    chunk = ChunkModel(model, 1, 1, cfg).eval()
    split = split_at_marker(joint_program(chunk, example_inputs(chunk, cfg, 512, 64)), input_names(False))
    before = {m: len(weight_transposes(getattr(split, m).program)) for m in ("phase1", "phase2")}
    et = lower_two_phase(split, backend, "w")
    for m in ("phase1", "phase2"):
        ep = et.exported_program(m)
        frozen = frozen_placeholders(ep)
        assert frozen, m
        copies = [n for n in ep.graph.nodes if "permute_copy" in str(n.target) and n.args[0] in frozen]
        if backend == "xnnpack":
            assert copies == [], m
        else:
            assert len(copies) < before[m] if m == "phase2" else len(copies) <= before[m], m


def test_xnnpack_runs_a_layers_elementwise_work(peft_model):
    """xnnpack_ops="all" (the default): phase 1 (a layer's forward) leaves no GEMM, transpose,
    element-wise, softmax or RMSNorm op to the portable kernels; they all run inside delegates
    (few large calls, not hundreds of single-threaded kernels). "gemm": only the GEMMs do."""
    model, cfg = peft_model
    chunk = ChunkModel(model, 1, 1, cfg).eval()
    split = split_at_marker(joint_program(chunk, example_inputs(chunk, cfg, 512, 64)), input_names(False))
    gemms = ("aten.mm", "aten.linear", "aten.bmm")
    elementwise = ("permute_copy", "aten.mul.", "aten.add.", "aten.sub.", "aten.neg", "aten.sigmoid", "_softmax",
                   "aten.rsqrt", "aten.pow")
    left = {}
    for ops in ("all", "gemm"):
        ep = lower_two_phase(split, "xnnpack", "w", xnnpack_ops=ops).exported_program("phase1")
        targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
        assert any("executorch_call_delegate" in t for t in targets), ops
        left[ops] = [t for t in targets if any(d in t for d in gemms + elementwise)]
    assert left["all"] == [], left["all"]
    assert left["gemm"] and not any(g in t for t in left["gemm"] for g in gemms), left["gemm"]
    with pytest.raises(ValueError, match="unknown xnnpack_ops 'most'"):
        lower_two_phase(split, "xnnpack", "w", xnnpack_ops="most")


def test_int8_casts_become_dequantizes_that_take_in_the_offset_and_scale_after_them():
    """A decode's cast, +1 and 1/16 become one dequantize_per_tensor (zero point -1, scale
    1/16), an int8 weight's plain cast one with scale 1; an add that is not an integer or a cast
    with another use stays; the values are the same."""
    from exporter.graph_passes import casts_as_dequantize

    class Decode(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("w", torch.randint(-128, 128, (8, 64), dtype=torch.int8))

        def forward(self, x):
            t = (self.w.to(torch.float32) + 1) * (1 / 16)  # folded whole
            plain = self.w.to(torch.float32)  # scale 1
            shared = self.w.to(torch.float32)
            kept = shared * 0.5 + shared  # two uses: only the cast is folded
            return x @ (torch.ceil(t) + plain + kept).T

    m, x = Decode(), torch.randn(2, 64)
    ep = torch.export.export(m, (x,)).run_decompositions()
    want = ep.module()(x)
    assert casts_as_dequantize(ep) == 3
    dq = [n for n in ep.graph.nodes if "dequantize_per_tensor" in str(n.target)]
    assert sorted((n.args[1], n.args[2]) for n in dq) == [(0.0625, -1), (1.0, 0), (1.0, 0)]
    assert not [n for n in ep.graph.nodes if n.target is torch.ops.aten._to_copy.default]
    assert [n.args[1] for n in ep.graph.nodes if n.target is torch.ops.aten.mul.Tensor] == [0.5]  # kept's
    assert torch.equal(ep.module()(x), want)

"""Forward products on int8 base weights as XNNPACK's dynamically quantized GEMM (QD8-F32-QC8W).

An int8 base weight (base_weights.py) traces as `linear(x, _to_copy(q, fp32)) * scale`. This pass
rewrites it into the decomposed-quantization pattern XNNPACK's partitioner lowers to one int8
fully-connected op (activations quantized per token on the fly, weights per channel):

    s, zp = choose_qparams_per_token_asymmetric(x); xq = quantize_per_token(x, s, zp)
    linear(dequantize_per_token(xq, s, zp), dequantize_per_channel(q, scale, axis 0))

The weight must be a frozen placeholder of the method (XNNPACK packs it once, at load), so only
products whose right operand is a weight in its stored [out, in] layout qualify: the forward
products of phase 1 and phase 2's readout. The input gradient (g * scale) @ q has q the other
way round and stays an fp32 GEMM on q's cast. Measured: docs/BENCHMARKS.md, Base weights."""
from __future__ import annotations

import operator

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, InputSpec, TensorArgument

from .graph_passes import frozen_placeholders

aten = torch.ops.aten
_CASTS = (aten._to_copy.default, aten.to.dtype)
_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def _quantized_decomposed():
    import torch.ao.quantization.fx._decomposed  # noqa: F401  (registers the quantized_decomposed ops)

    return torch.ops.quantized_decomposed


def _int8_weight(cast, frozen):
    """q if `cast` is an fp32 cast of a 2-D int8 frozen placeholder q, else None."""
    if cast.op != "call_function" or cast.target not in _CASTS or cast.meta["val"].dtype != torch.float32:
        return None
    q = cast.args[0]
    return q if q in frozen and q.meta["val"].dtype == torch.int8 and q.meta["val"].dim() == 2 else None


def use_quantized_gemms(ep: ExportedProgram) -> int:
    """Rewrite every `linear(x, cast(q)) * scale` (q int8 [N, K], scale [N], both frozen) in place.
    Run after graph_passes.fold_weight_transposes (which makes the linears). Returns the count."""
    qd = _quantized_decomposed()
    g = ep.graph
    frozen = frozen_placeholders(ep)
    rewritten = 0
    zero_points: dict[int, torch.fx.Node] = {}

    def zeros(n):  # symmetric weights: zero points 0, one shared constant per row count
        if n not in zero_points:
            zero_points[n] = _add_constant(ep, f"_qd8_zero_points_{n}", torch.zeros(n, dtype=torch.int64))
        return zero_points[n]

    for lin in list(g.nodes):
        if lin.op != "call_function" or lin.target is not aten.linear.default or len(lin.args) != 2:
            continue
        x, cast = lin.args
        q = _int8_weight(cast, frozen)
        if q is None or len(lin.users) != 1:
            continue
        # a 3-D x traces as a view to 2-D, the product, and a view back before the scale
        view = next(iter(lin.users)) if next(iter(lin.users)).target in _VIEWS else None
        mul = next(iter((view or lin).users)) if len((view or lin).users) == 1 else None
        if mul is None or mul.target is not aten.mul.Tensor:
            continue
        scale = mul.args[1] if mul.args[0] is (view or lin) else mul.args[0]
        n_out = q.meta["val"].shape[0]
        if scale not in frozen or tuple(scale.meta["val"].shape) != (n_out,) or x.meta["val"].dtype != torch.float32:
            continue

        def call(target, args, _g=g):
            node = _g.call_function(target, args)
            vals = [a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args]
            node.meta["val"] = target(*vals)
            return node

        with g.inserting_before(view or mul):
            qp = call(qd.choose_qparams_per_token_asymmetric.default, (x, torch.int8))
            s, zp = call(operator.getitem, (qp, 0)), call(operator.getitem, (qp, 1))
            xq = call(qd.quantize_per_token.default, (x, s, zp, -128, 127, torch.int8))
            xd = call(qd.dequantize_per_token.default, (xq, s, zp, -128, 127, torch.int8, torch.float32))
            wd = call(qd.dequantize_per_channel.default, (q, scale, zeros(n_out), 0, -127, 127, torch.int8))
            new = call(aten.linear.default, (xd, wd))
        new.meta = {**lin.meta, "val": new.meta["val"]}
        lin.replace_all_uses_with(new)
        mul.replace_all_uses_with(view or new)
        g.erase_node(mul)
        g.erase_node(lin)
        if not cast.users:
            g.erase_node(cast)
        rewritten += 1
    g.lint()
    ep.graph_module.recompile()
    return rewritten



def _add_constant(ep: ExportedProgram, name: str, value: torch.Tensor) -> torch.fx.Node:
    """A new constant-tensor input of `ep`, placed after its state inputs (before the user inputs)."""
    specs = ep.graph_signature.input_specs
    placeholders = [n for n in ep.graph.nodes if n.op == "placeholder"]
    first_user = next((i for i, s in enumerate(specs) if s.kind == InputKind.USER_INPUT), len(specs))
    anchor = placeholders[first_user] if first_user < len(placeholders) else None
    if anchor is not None:
        with ep.graph.inserting_before(anchor):
            node = ep.graph.placeholder(name)
    else:
        with ep.graph.inserting_after(placeholders[-1]):
            node = ep.graph.placeholder(name)
    fake_mode = next(n.meta["val"].fake_mode for n in placeholders if hasattr(n.meta.get("val"), "fake_mode"))
    node.meta["val"] = fake_mode.from_tensor(value)
    specs.insert(first_user, InputSpec(InputKind.CONSTANT_TENSOR, TensorArgument(node.name), name))
    ep.constants[name] = value
    return node

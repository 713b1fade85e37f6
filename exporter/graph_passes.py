"""Graph passes run on each phase program (ATen dialect) before it is lowered.

Tracing turns every `x @ W.T` into `mm(x, permute(W, [1, 0]))`, and the joint backward adds
`mm(g, permute(permute(W)))` for the input gradient. In ExecuTorch every permute is a
`permute_copy`: a full copy of the weight at every call, in the single-threaded portable
kernel, into the method's planned arena (at TinyLlama shape, 90% of the step time and most
of the arenas). Two rewrites remove them:

  1. cancel_transpose_pairs: permute(permute(x, p), q) -> x when q undoes p (any tensor);
  2. mm_to_linear: mm(a, permute(W, [1, 0])) -> linear(a, W) and
     addmm(b, a, permute(W, [1, 0])) -> linear(a, W, b), when W is a frozen weight: a
     parameter / buffer / constant placeholder of the method, or computed from those alone
     (an int8 weight's fp32 cast); LoRA tensors are user inputs and are left alone. XNNPACK's
     LinearConfig consumes W in place; with no delegate, to_edge decomposes linear back into
     permute_copy + mm, which is what it was before.

Both are exact: they only drop data movement, never reorder arithmetic. The transpose forms
handled are aten.permute / aten.t / aten.transpose (and their *_copy variants); the traced
phase programs only contain aten.permute.default, with no view/reshape between a weight and
its transpose, so no view handling is needed."""
from __future__ import annotations

from collections import Counter

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputSpec, TensorArgument

aten = torch.ops.aten

_PERMUTES = (aten.permute.default, aten.permute_copy.default)
_TRANSPOSES = (aten.transpose.int, aten.transpose_copy.int)
_TS = (aten.t.default, aten.t_copy.default)
_FROZEN_KINDS = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)


def permutation(node) -> list[int] | None:
    """The dims permutation a transpose-like node applies (out dim i = in dim p[i]), or None
    if `node` is not one."""
    if node.op != "call_function" or node.target not in _PERMUTES + _TRANSPOSES + _TS:
        return None
    ndim = node.args[0].meta["val"].dim()
    if node.target in _PERMUTES:
        return [d % ndim for d in node.args[1]] if ndim else []
    if node.target in _TRANSPOSES:
        p = list(range(ndim))
        a, b = node.args[1] % ndim, node.args[2] % ndim
        p[a], p[b] = p[b], p[a]
        return p
    if node.target in _TS:
        return [1, 0] if ndim == 2 else list(range(ndim))
    return None


def frozen_placeholders(ep: ExportedProgram) -> set:
    """Placeholders that hold frozen state (weights, buffers, constants), not user inputs."""
    kinds = {s.arg.name: s.kind for s in ep.graph_signature.input_specs}
    return {n for n in ep.graph.nodes if n.op == "placeholder" and kinds.get(n.name) in _FROZEN_KINDS}


def weight_only_nodes(ep: ExportedProgram) -> set:
    """Frozen placeholders and the nodes computed from them alone (an int8 weight's cast to fp32,
    an int4 weight's decode, RoPE and mask tables): what does not change from one micro-batch to
    the next. A lowered delegate (get_attr) counts as frozen, so a delegate call on frozen inputs
    (a step of an int4 decode) is one too."""
    out = frozen_placeholders(ep) | {n for n in ep.graph.nodes if n.op == "get_attr"}
    for n in ep.graph.nodes:  # topological: inputs are classified before their users
        if n.op == "call_function" and all(a in out for a in n.all_input_nodes):
            out.add(n)
    return out


def weight_transposes(ep: ExportedProgram) -> list:
    """Transpose-like nodes whose input is a frozen weight, or a chain of such transposes
    starting at one: what the passes are meant to remove (used by tests and reports)."""
    frozen = frozen_placeholders(ep)

    def from_weight(n):
        while permutation(n) is not None:
            n = n.args[0]
        return n in frozen

    return [n for n in ep.graph.nodes if permutation(n) is not None and from_weight(n)]


def cancel_transpose_pairs(ep: ExportedProgram) -> int:
    """Replace permute(permute(x, p), q) by x when the two compose to the identity. Uses by
    the graph output are rewired too (and the output signature renamed), unless x is a
    placeholder or already an output, where a program output would alias an input or another
    output. Returns the number of pairs removed."""
    g = ep.graph
    out_node = g.output_node()
    removed = 0
    for n in list(g.nodes):
        q = permutation(n)
        if q is None or not n.users:
            continue
        inner = n.args[0]
        p = permutation(inner)
        if p is None or len(p) != len(q) or any(p[q[j]] != j for j in range(len(q))):
            continue
        src = inner.args[0]
        keep_out = src.op == "placeholder" or src in out_node.all_input_nodes
        n.replace_all_uses_with(src, delete_user_cb=lambda u: not (keep_out and u is out_node))
        removed += 1
    _sync_output_names(ep)
    _drop_dead_transposes(ep)
    return removed


def mm_to_linear(ep: ExportedProgram) -> int:
    """mm(a, W^T) -> linear(a, W); addmm(b, a, W^T) -> linear(a, W, b) (beta = alpha = 1, 1-D
    bias), for a 2-D frozen (or frozen-derived) weight W. Returns the number of matmuls rewritten."""
    g = ep.graph
    frozen = weight_only_nodes(ep)  # a weight, or its fp32 cast when stored as int8
    rewritten = 0
    for n in list(g.nodes):
        if n.op != "call_function" or n.target not in (aten.mm.default, aten.addmm.default):
            continue
        if n.target is aten.mm.default:
            a, wt = n.args
            bias = None
        else:
            if n.kwargs.get("beta", 1) != 1 or n.kwargs.get("alpha", 1) != 1:
                continue
            bias, a, wt = n.args
            if bias.meta["val"].dim() != 1:
                continue
        if permutation(wt) != [1, 0] or wt.args[0] not in frozen:
            continue
        w = wt.args[0]
        with g.inserting_before(n):
            lin = g.call_function(aten.linear.default, (a, w) if bias is None else (a, w, bias))
        lin.meta = dict(n.meta)  # same value: [M, N] contiguous, same dtype
        n.replace_all_uses_with(lin)
        g.erase_node(n)
        rewritten += 1
    _sync_output_names(ep)
    _drop_dead_transposes(ep)
    return rewritten


def fold_weight_transposes(ep: ExportedProgram) -> dict:
    """Run both rewrites on `ep` in place (cancellation first: it exposes permute(W) nodes
    whose only other user was the second transpose). Returns counts, for logs and tests."""
    before = len(weight_transposes(ep))
    stats = {"cancelled_pairs": cancel_transpose_pairs(ep), "linear": mm_to_linear(ep)}
    stats["weight_transposes"] = [before, len(weight_transposes(ep))]
    ep.graph.lint()
    ep.graph_module.recompile()
    return stats


def drop_identity_ops(ep: ExportedProgram) -> dict:
    """The joint backward's no-op and power nodes, which ExecuTorch runs as portable kernels
    (copies) between XNNPACK partitions (TinyLlama chunk, phase 2: 48 alias_copy, 28 pow, ~40 ms):
      alias(x) -> x        (autograd's saved-tensor aliases; kept where it is a method output)
      pow(x, 1) -> x       (RMSNorm backward: d/dx x^2 = 2 * x^1)
      pow(x, 3) -> x*x*x   (RMSNorm backward of rsqrt; XNNPACK's Multiply takes it, and eager
                            PyTorch computes an integer power 3 as the same products)
    Exact up to the last bit of pow(x, 3). Returns counts."""
    outs = set(ep.graph.output_node().args[0])
    stats = {"alias": 0, "pow1": 0, "pow3": 0}
    for n in list(ep.graph.nodes):
        if n.op != "call_function" or n in outs:
            continue
        if n.target in (aten.alias.default, aten.alias_copy.default):
            n.replace_all_uses_with(n.args[0])
            stats["alias"] += 1
        elif n.target is aten.pow.Tensor_Scalar and n.args[1] == 1:
            n.replace_all_uses_with(n.args[0])
            stats["pow1"] += 1
        elif n.target is aten.pow.Tensor_Scalar and n.args[1] == 3:
            x = n.args[0]
            with ep.graph.inserting_before(n):
                sq = ep.graph.call_function(aten.mul.Tensor, (x, x))
                cube = ep.graph.call_function(aten.mul.Tensor, (sq, x))
            sq.meta, cube.meta = dict(n.meta), dict(n.meta)  # same shape and dtype as x ** 3
            n.replace_all_uses_with(cube)
            stats["pow3"] += 1
        else:
            continue
        ep.graph.erase_node(n)
    ep.graph.lint()
    ep.graph_module.recompile()
    return stats


def casts_as_dequantize(ep: ExportedProgram) -> int:
    """int8 -> fp32 casts (a quantized base weight's decode) -> dequantize_per_tensor, taking in
    the integer added next and the scalar multiplied after (each the only use of what it follows;
    int4's -8 or +128 and 1/16) as its zero point and scale: the same values, but an op XNNPACK runs (its
    Convert, multi-threaded and vectorised), where ExecuTorch runs a dtype cast in a scalar
    portable kernel (~1.7 ns per element here: most of a quantized base's step). Only for
    programs lowered to XNNPACK: the phones' runtime carries no quantized kernels for the
    portable backend. Returns the count."""
    from torch.ao.quantization.fx import _decomposed  # noqa: F401  (registers quantized_decomposed)

    def next_op(node, target, ok):
        users = list(node.users)
        if len(users) == 1 and users[0].target is target and users[0].args[0] is node and ok(users[0].args[1]):
            return users[0]
        return None

    count = 0
    for n in list(ep.graph.nodes):
        if not (n.op == "call_function" and n.target is aten._to_copy.default and len(n.args) == 1
                and n.args[0].meta["val"].dtype == torch.int8 and n.meta["val"].dtype == torch.float32):
            continue
        chain, zero_point, scale = [n], 0, 1.0
        add = next_op(n, aten.add.Tensor, lambda c: isinstance(c, int) and -127 <= c <= 128)
        if add is not None:
            chain.append(add)
            zero_point = -add.args[1]
        mul = next_op(chain[-1], aten.mul.Tensor, lambda c: isinstance(c, float) and c > 0)
        if mul is not None:
            chain.append(mul)
            scale = mul.args[1]
        with ep.graph.inserting_before(n):
            dq = ep.graph.call_function(torch.ops.quantized_decomposed.dequantize_per_tensor.default,
                                        (n.args[0], scale, zero_point, -128, 127, torch.int8))
        dq.meta = dict(chain[-1].meta)
        chain[-1].replace_all_uses_with(dq)
        for c in reversed(chain):
            ep.graph.erase_node(c)
        count += 1
    ep.graph.lint()
    ep.graph_module.recompile()
    return count


def sink_weight_only_nodes(ep: ExportedProgram) -> int:
    """Move every node computed from frozen state alone (a quantized weight's cast or decode, RoPE
    and mask tables) to just before the first node that uses it, or anything computed from it,
    together with a micro-batch's data. The split copies phase 2's recomputed nodes in the joint
    graph's order, where the forward's come first, and XNNPACK's partitioner re-sorts the graph
    breadth first: a weight's fp32 cast or decode would then be live from the start of a phase to
    its use, all of the chunk's weights in fp32 at once in the planned arena. "Before the first
    user" is not enough for a decode that branches (int4: the high nibbles feed both the low
    ones and the result), so each node goes where its weight is needed. Run on the edge programs
    after partitioning (exporter/lower.py). Order only; the values are the same. Returns the
    number of nodes moved."""
    weight_only = weight_only_nodes(ep)
    nodes = list(ep.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    needed_at = {}  # weight-only node -> the first non-weight-only node that depends on it
    for n in reversed(nodes):  # users first
        if n.op != "call_function" or n not in weight_only or not n.users:
            continue
        needed_at[n] = min((needed_at.get(u, len(nodes)) if u in weight_only else order[u]) for u in n.users)
    moved = 0
    for n in nodes:  # in the original order, so nodes sent to the same place keep their order
        at = needed_at.get(n, len(nodes))
        if at < len(nodes):
            if n.next is not nodes[at]:
                moved += 1
            nodes[at].prepend(n)
    ep.graph.lint()
    ep.graph_module.recompile()
    return moved


def op_counts(ep: ExportedProgram) -> Counter:
    return Counter(str(n.target) for n in ep.graph.nodes if n.op == "call_function")


def _drop_dead_transposes(ep: ExportedProgram) -> None:
    """Erase transpose nodes left without users (repeatedly: chains). Nothing else is touched."""
    changed = True
    while changed:
        changed = False
        for n in reversed(list(ep.graph.nodes)):
            if not n.users and permutation(n) is not None:
                ep.graph.erase_node(n)
                changed = True


def _sync_output_names(ep: ExportedProgram) -> None:
    """Output specs name the node each output is; keep them in step after rewiring outputs."""
    outs = ep.graph.output_node().args[0]
    specs = ep.graph_signature.output_specs
    for i, (spec, o) in enumerate(zip(specs, outs)):
        if isinstance(spec.arg, TensorArgument) and spec.arg.name != o.name:
            specs[i] = OutputSpec(spec.kind, TensorArgument(o.name), spec.target)

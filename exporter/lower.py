"""Trace a chunk into the joint training graph and lower the two phases to one .pte + .ptd."""
from __future__ import annotations

import contextlib
import logging

import torch
from torch.export.experimental import _export_forward_backward

from .chunk_model import ChunkModel
from .graph_passes import (
    casts_as_dequantize,
    drop_identity_ops,
    fold_weight_transposes,
    sink_weight_only_nodes,
    weight_only_nodes,
)
from .lowering_cache import PreprocessCache, cached_xnnpack_preprocess
from .partition_dependencies import walked_dependencies
from .partition_sort import sort_methods, sort_partitions_once
from .redundant_decompositions import skip_redundant_decompositions
from .two_phase import SplitResult, strip_markers


def joint_program(chunk: ChunkModel, inputs: tuple):
    """torch.export + joint forward/backward with LoRA parameters as the trainable ones."""
    ep = torch.export.export(chunk, inputs, strict=False)
    ep = _export_forward_backward(ep, joint_loss_index=0)
    _rewrite_empty_permuted(ep.graph_module)
    _rewrite_full_like(ep.graph_module)
    return ep


def _rewrite_full_like(gm) -> None:
    """The backward is seeded with full_like(loss, 1), which reads only loss's (static) shape
    but makes the seed depend on the loss value: a split that returns no loss (a BP stage's
    backward) would recompute the loss, and ship its inputs, just for that. aten.full with the
    same shape and dtype is the same tensor without the dependency."""
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target is not torch.ops.aten.full_like.default:
            continue
        val = n.args[0].meta["val"]
        if n.kwargs.get("memory_format", torch.preserve_format) not in (torch.preserve_format, torch.contiguous_format) \
                or not val.is_contiguous() or any(not isinstance(s, int) for s in val.shape):
            continue
        kw = {"dtype": n.kwargs.get("dtype") or val.dtype, "layout": n.kwargs.get("layout") or val.layout,
              "device": n.kwargs.get("device") or val.device, "pin_memory": False}
        with gm.graph.inserting_before(n):
            new = gm.graph.call_function(torch.ops.aten.full.default, (list(val.shape), n.args[1]), kw)
        new.meta = dict(n.meta)
        n.replace_all_uses_with(new)
        gm.graph.erase_node(n)
    gm.graph.lint()
    gm.recompile()


def _rewrite_empty_permuted(gm) -> None:
    """SiLU's backward decomposes into aten.empty_permuted, which is not core ATen and makes
    to_edge fail; with an identity permutation it is just aten.empty."""
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target is torch.ops.aten.empty_permuted.default:
            size, perm = n.args
            if list(perm) != list(range(len(perm))):
                raise RuntimeError(f"unsupported empty_permuted permutation {perm}")
            with gm.graph.inserting_before(n):
                new = gm.graph.call_function(torch.ops.aten.empty.memory_format, (size,), dict(n.kwargs))
            new.meta = dict(n.meta)
            n.replace_all_uses_with(new)
            gm.graph.erase_node(n)
    gm.graph.lint()
    gm.recompile()


# XNNPACK configs for the two phase programs, by ExportConfig.xnnpack_ops. "all": beyond the
# GEMMs, the element-wise, transpose and RMSNorm ops go in too, so a layer runs as a few large
# delegate calls instead of hundreds of portable kernel calls (TinyLlama chunk: step -15%, peak
# PSS +10%); "gemm": GEMMs only. Left out of both: Clone/Unsqueeze (they make a partition whose
# output is its own input, "pass through arguments", which XNNPACK rejects), and what is not
# listed (not measured).
GEMM_CONFIGS = ("MMConfig", "AddmmConfig", "LinearConfig", "BMMConfig")
XNNPACK_CONFIGS = {
    "gemm": GEMM_CONFIGS,
    "all": GEMM_CONFIGS + ("PermuteConfig", "ViewCopyConfig", "SliceCopyConfig", "CatConfig",
                           "AddConfig", "SubConfig", "MulConfig", "DivConfig", "NegConfig", "ClampConfig",
                           "SigmoidConfig", "SoftmaxConfig", "ExpConfig", "LogConfig", "FloorConfig",
                           "PowConfig", "MeanDimConfig", "ReciprocalSquareRootConfig"),
}


# A quantized weight's decode (exporter/base_weights.py: dequantize): its int8 cast (a dequantize
# with scale 1, graph_passes.casts_as_dequantize), int4's nibble split, the scales. Not its
# reshapes: a view left to ExecuTorch is free, one XNNPACK runs on its own is a copy.
DECODE_CONFIGS = ("DeQuantizedPerTensorConfig", "FloorConfig", "MulConfig", "SubConfig", "AddConfig",
                  "CatConfig")


def _frozen_or_not(config, frozen: bool):
    """`config` restricted to nodes computed from frozen state alone (an int4 weight's decode:
    frozen=True), or to the others (frozen=False)."""
    seen = {}

    def weight_only(ep):
        key = (id(ep.graph), len(ep.graph.nodes))
        if key not in seen:
            seen.clear()
            seen[key] = weight_only_nodes(ep)
        return seen[key]

    class Restricted(config):
        def check_constraints(self, node, ep):
            return (node in weight_only(ep)) == frozen and super().check_constraints(node, ep)

    Restricted.__name__ = Restricted.__qualname__ = f"{'Frozen' if frozen else 'Live'}{config.__name__}"
    return Restricted


def xnnpack_partitioners(ops: str = "all", quantized_base: bool = False) -> list:
    """`quantized_base` (int8 / int4 base weights): each GEMM its own delegate call, each op of a
    weight's decode its own call, and no weight-only node in the last partitioner's delegates: a
    delegate that runs several GEMMs takes all their decoded weights as inputs, live at once, and
    XNNPACK's partitioner merges independent partitions, so the decodes of a layer's gate and up,
    or of all lm_head blocks (down to their final reshapes), would otherwise run as one delegate
    with all their fp32 weights live."""
    # force_non_static_weights_for_f32_linear keeps frozen weights as named constants, so they
    # live in the .ptd (once, shared by both methods) rather than packed into each delegate;
    # the price is a repack of each weight per call (see docs/BENCHMARKS.md, Export).
    from executorch.backends.xnnpack import XnnpackPartitioner
    from executorch.backends.xnnpack.partition.config import ALL_PARTITIONER_CONFIGS
    from executorch.backends.xnnpack.partition.config.xnnpack_config import ConfigPrecisionType

    by_name = {c.__name__: c for c in ALL_PARTITIONER_CONFIGS}

    def partitioner(configs, per_op=False, **kw):
        return XnnpackPartitioner(configs=configs, per_op_mode=per_op, force_non_static_weights_for_f32_linear=True, **kw)

    if not quantized_base:
        return [partitioner([by_name[n] for n in XNNPACK_CONFIGS[ops]])]
    # Applied one after the other (to_backend), not as one list: to_edge_transform_and_lower
    # decomposes each partitioner's unclaimed ops, and the second one would split every linear.
    # The casts go unrestricted: an embedding lookup's rows are cast too (the phones' runtime has
    # no portable dequantize kernel); the other decode ops only on weights (activations' Mul and
    # Sub belong in the merged partitions).
    rest = [n for n in XNNPACK_CONFIGS[ops] if n not in GEMM_CONFIGS]
    decode = [by_name[n] if n == "DeQuantizedPerTensorConfig" else _frozen_or_not(by_name[n], True)
              for n in DECODE_CONFIGS]
    # The GEMMs as fp32 only: an int8 weight's cast feeds its GEMM directly (the row scales go on
    # the product), which XNNPACK's configs would otherwise read as a statically quantized GEMM
    # and leave out (its activations are not quantized); fp32, the cast stays its own Convert.
    gemms = partitioner([by_name[n] for n in GEMM_CONFIGS], per_op=True, config_precisions=ConfigPrecisionType.FP32)
    return ([gemms, partitioner(decode, per_op=True)]
            + ([partitioner([_frozen_or_not(by_name[n], False) for n in rest])] if rest else []))  # no configs: all


def lower_two_phase(split: SplitResult, backend: str, data_tag: str, constant_methods: dict | None = None,
                    xnnpack_ops: str = "all", quantized_base: bool = False, cache: PreprocessCache | None = None):
    """Return an ExecutorchProgramManager with methods phase1 and phase2; frozen weights are
    external constants tagged `data_tag` (one .ptd for the chunk's weights + readout);
    `constant_methods` (name -> value) are added as methods that return that value;
    `xnnpack_ops` picks what XNNPACK runs (XNNPACK_CONFIGS); `quantized_base`: see xnnpack_partitioners;
    `cache`: XNNPACK partitions already lowered (lowering_cache), shared by the chunks of one export."""
    if xnnpack_ops not in XNNPACK_CONFIGS:
        raise ValueError(f"unknown xnnpack_ops {xnnpack_ops!r}: use {' or '.join(XNNPACK_CONFIGS)}")
    from executorch.exir import EdgeCompileConfig, ExecutorchBackendConfig, to_edge, to_edge_transform_and_lower

    methods = {"phase1": split.phase1.program, "phase2": split.phase2.program}
    # Drop the per-call copies of transposed frozen weights and the backward's no-op/power
    # nodes (see graph_passes): rewrites the phase programs in place; their inputs and outputs
    # (what the manifest describes) stay.
    for ep in methods.values():
        fold_weight_transposes(ep)
        drop_identity_ops(ep)
        if backend == "xnnpack" and quantized_base:
            casts_as_dequantize(ep)
    edge_cfg = EdgeCompileConfig(_check_ir_validity=True)
    if backend == "xnnpack":
        first, *later = xnnpack_partitioners(xnnpack_ops, quantized_base)
        with cached_xnnpack_preprocess(cache), skip_redundant_decompositions(), walked_dependencies():
            with sort_partitions_once():
                edge = to_edge_transform_and_lower(methods, partitioner=[first], compile_config=edge_cfg,
                                                   constant_methods=constant_methods)
            sort_methods(edge, methods)
            for p in later:
                with sort_partitions_once(), _quiet_to_backend_deprecation():
                    edge = edge.to_backend(p)
                sort_methods(edge, methods)
    elif backend == "portable":
        with skip_redundant_decompositions():
            edge = to_edge(methods, compile_config=edge_cfg, constant_methods=constant_methods)
    else:
        raise ValueError(f"unknown backend {backend!r}: use xnnpack or portable")
    for name in methods:  # after partitioning, which re-sorts the graph (breadth first)
        ep = edge.exported_program(name)
        left = [n.name for n in ep.graph.nodes if "dequantize_per_tensor" in str(n.target)]
        if left:  # a phone would refuse the program at load (no portable dequantize kernel there)
            raise RuntimeError(f"{name}: XNNPACK did not take {len(left)} weight cast(s) ({', '.join(left[:3])})")
        sink_weight_only_nodes(ep)
    return edge.to_executorch(ExecutorchBackendConfig(external_constants=lambda node: data_tag,
                                                      memory_planning_pass=memory_plans()))


@contextlib.contextmanager
def _quiet_to_backend_deprecation():
    """XNNPACK's partitioner warns that to_backend after to_edge is deprecated; here it is the
    second step on purpose (see xnnpack_partitioners), so its warning would only confuse."""
    log = logging.getLogger("executorch.backends.xnnpack.partition.xnnpack_partitioner")
    drop = lambda record: "DEPRECATION WARNING" not in record.getMessage()  # noqa: E731
    log.addFilter(drop)
    try:
        yield
    finally:
        log.removeFilter(drop)


# Phase 1's outputs get a memory id of their own: ids 1 and 2 are what ExecuTorch's C++ Module
# shares across methods (share_memory_arenas), higher ids stay with their method.
PHASE1_OUTPUTS_MEM_ID = 3


def memory_plans() -> dict:
    """Phase 2's inputs are not planned into its arena: the runtime binds the caller's tensors
    in place (ExecuTorch shares the data pointer of an input that has no planned storage), so
    the saved activations are not copied into a second arena, and a caller that keeps phase 1's
    outputs where phase 1 wrote them (ChunkProgram(in_place=True)) holds them exactly once.
    Outputs stay planned: ExecuTorch's C++ Module (Android) binds no storage for unplanned outputs.
    Phase 1's outputs are planned apart from its working memory (PHASE1_OUTPUTS_MEM_ID), so a
    runtime that gives both methods one arena (the Kotlin bridge) keeps the saved activations
    while phase 2 reuses the memory phase 1 worked in."""
    from executorch.exir.passes import MemoryPlanningPass
    from executorch.exir.tensor import TensorSpec
    from torch.utils._pytree import tree_leaves

    class OutputsApart(MemoryPlanningPass):
        def run(self, graph_module, graph_signature=None):
            out = next(n for n in graph_module.graph.nodes if n.op == "output")
            for node in tree_leaves(out.args):
                spec = getattr(node, "meta", {}).get("spec")
                for s in spec if isinstance(spec, (list, tuple)) else [spec]:
                    if isinstance(s, TensorSpec) and not s.const:
                        s.mem_id = PHASE1_OUTPUTS_MEM_ID
            return super().run(graph_module, graph_signature)

    return {"phase1": OutputsApart(), "phase2": MemoryPlanningPass(alloc_graph_input=False)}


def lower_joint(ep):
    """The one-method training program (forward+backward in one call), for comparison."""
    from executorch.exir import to_edge

    strip_markers(ep.graph_module)
    return to_edge(ep).to_executorch()

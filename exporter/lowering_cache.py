"""Lower each distinct XNNPACK partition once.

A chunk is a stack of identical decoder layers, so XNNPACK's partitioner cuts phase 1 and phase 2
into the same few partitions again and again, layer after layer; XNNPACK's preprocess (17 graph
passes, each a full retrace, then serialization) ran on every one of them, nearly half of an
export's time. Two partitions with the same graph, the same tensor metadata and the same frozen
constant bytes compile to the same XNNPACK graph (weights that differ between layers are
delegate inputs, not constants: lower.xnnpack_partitioners), so the first one's result serves
the others. The key is the partition's canonical form, with node names and debug handles left
out (they are the only things that differ between layers), so nothing that reaches the blob's
computation is ignored.

Also skipped: XNNPACK passes that rewrite ops a Llama chunk never contains (upsampling, SDPA
patterns, batch norm, conv1d, PReLU, padding), each one still a full retrace per partition.
`tests/test_export_programs.py` checks programs lowered with both against eager PyTorch, and
bench/export_tinyllama.py compares the bytes of a chunk lowered with and without them."""
from __future__ import annotations

import contextlib
import hashlib
import os

import torch

# Ops whose presence makes a skipped pass relevant: lowering refuses to skip it for such a graph.
_SKIPPED_PASSES_OPS = ("upsample", "convolution", "batch_norm", "prelu", "constant_pad_nd",
                       "scaled_dot_product_attention")


def _val_key(v) -> tuple:
    if isinstance(v, torch.Tensor):
        return ("t", tuple(v.shape), str(v.dtype), tuple(v.stride()))
    if isinstance(v, (list, tuple)):
        return tuple(_val_key(x) for x in v)
    return (type(v).__name__, repr(v))


def _arg_key(a, index: dict):
    if isinstance(a, torch.fx.Node):
        return ("n", index[a])
    if isinstance(a, (list, tuple)):
        return tuple(_arg_key(x, index) for x in a)
    if isinstance(a, dict):
        return tuple(sorted((k, _arg_key(v, index)) for k, v in a.items()))
    return (type(a).__name__, repr(a))


def _constant(ep, name: str):
    sig = ep.graph_signature
    for mapping in (sig.inputs_to_parameters, sig.inputs_to_buffers, sig.inputs_to_lifted_tensor_constants):
        if name in mapping:
            target = mapping[name]
            return ep.state_dict[target] if target in ep.state_dict else ep.constants[target]
    return None


def partition_key(ep, compile_specs) -> str:
    """A digest of everything of the partition that reaches XNNPACK's blob, except names."""
    h = hashlib.sha256()
    index = {}
    for i, n in enumerate(ep.graph.nodes):
        index[n] = i
        item = [n.op, str(n.target) if n.op != "placeholder" else "",
                _arg_key(n.args, index), _arg_key(n.kwargs, index), _val_key(n.meta.get("val"))]
        if n.op == "placeholder":
            c = _constant(ep, n.name)
            if c is not None:
                c = c.detach().contiguous()
                item.append(("const", hashlib.sha256(c.view(torch.uint8).numpy().tobytes()).hexdigest()
                             if c.numel() else "empty"))
        h.update(repr(item).encode())
    for spec in compile_specs:
        h.update(spec.key.encode() + b"=" + bytes(spec.value))
    return h.hexdigest()


class PreprocessCache:
    def __init__(self):
        self.results: dict[str, object] = {}
        self.hits = self.misses = 0


@contextlib.contextmanager
def cached_xnnpack_preprocess(cache: PreprocessCache | None = None):
    """Within the block, XNNPACK's preprocess runs once per distinct partition (see above).
    ZL_LOWERING_CACHE=off lowers every partition as ExecuTorch does (bench/export_speed.py's
    "before")."""
    from executorch.backends.xnnpack import xnnpack_preprocess as xp

    if os.environ.get("ZL_LOWERING_CACHE") == "off":
        yield cache
        return

    cache = cache or PreprocessCache()
    original = xp.XnnpackBackend.__dict__["preprocess"]
    original_manager = xp.XNNPACKPassManager

    def preprocess(edge_program, compile_specs):
        key = partition_key(edge_program, compile_specs)
        if key in cache.results:
            cache.hits += 1
            return cache.results[key]
        cache.misses += 1
        xp.XNNPACKPassManager = _manager_for(edge_program, original_manager)
        try:
            result = original.__func__(edge_program, compile_specs)
        finally:
            xp.XNNPACKPassManager = original_manager
        cache.results[key] = result
        return result

    xp.XnnpackBackend.preprocess = staticmethod(preprocess)
    try:
        yield cache
    finally:
        xp.XnnpackBackend.preprocess = original


def _manager_for(edge_program, manager):
    """XNNPACK's pass manager without the passes for ops this partition does not contain."""
    targets = " ".join(str(n.target) for n in edge_program.graph.nodes if n.op == "call_function")
    if any(op in targets for op in _SKIPPED_PASSES_OPS):
        return manager
    from executorch.backends.xnnpack import _passes as p

    skip = {p.ConvertToUpsampleBilinear2d, p.ConvertToSDPAPass, p.FuseBatchNormPass, p.DecomposeBatchNorm,
            p.InsertPadQDQPass, p.Conv1dUnsqueezePass, p.PReLUReshapePass}

    class Manager(manager):
        def __init__(self, exported_program, passes=None):
            super().__init__(exported_program, passes)
            self.passes = [q for q in self.passes if q not in skip]

    return Manager

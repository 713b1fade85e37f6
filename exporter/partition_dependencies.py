"""Partition without holding every node's transitive dependencies.

ExecuTorch's GroupBasedPartitioner (XNNPACK's merged partitions) and torch's
CapabilityBasedPartitioner, which it extends, each build a `_DependencyViewer` when constructed:
every node's transitive downstream (and upstream) nodes as a Python set, memory quadratic in the
graph's nodes. With an int4 base a chunk's graph is large (each weight block's decode is ~20
nodes): lowering a one-layer chunk of Llama-3.2-3B's shape went from 2.1 to 13.1 GiB of RSS inside
those constructors, and the 4-chunk 3B export was killed there.

While lowering, both are replaced by a viewer that stores nothing and walks the graph when asked,
yielding as it goes. torch's is built and never read (the group partitioner replaces it and its own
propose_partitions does not call torch's); the group partitioner's is read only in
`_can_merge_partitions`, as `any(node in the merged partition for node in downstreams_of(user))`
right before `validate_partition` walks the same paths, so the partitions are the ones the sets
gave (tests/test_lowering_cache.py compares the programs' bytes).

Also quadratic at that size: torch's `_is_node_supported` rebuilds the dict of every submodule of
the graph module for each node it asks about, and by the last XNNPACK pass a 3B chunk's graph
module holds thousands of lowered delegates (88% of a 7-layer chunk's time in that pass went to
`named_modules`). The dict is built once per partitioner while the graph module's submodules stay
the same."""
from __future__ import annotations

import contextlib


class WalkedDependencies:
    """A node's downstream / upstream nodes, found by walking the graph's edges when asked."""

    def __init__(self, graph_module=None):
        pass  # nothing precomputed: the graph is read as it is when asked

    @staticmethod
    def downstreams_of(node):
        return _walk(node, lambda n: n.users)

    @staticmethod
    def upstreams_of(node):
        return _walk(node, lambda n: n.all_input_nodes)


def _walk(node, next_nodes):
    """Every node reachable from `node` (not itself), each once, depth first; lazily, so that a
    caller looking for one of them stops at the first."""
    seen = set()
    stack = list(next_nodes(node))
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        yield n
        stack.extend(next_nodes(n))


def _is_node_supported(self, node) -> bool:
    """torch's CapabilityBasedPartitioner._is_node_supported, its submodule dict built once."""
    modules = self.graph_module._modules
    cached = getattr(self, "_zl_submodules", None)
    if cached is None or cached[0] != len(modules):
        cached = self._zl_submodules = (len(modules), dict(self.graph_module.named_modules()))
    return self.operator_support.is_node_supported(cached[1], node)


@contextlib.contextmanager
def walked_dependencies():
    """Inside: torch's and ExecuTorch's partitioners get WalkedDependencies, and ask about each node
    with one dict of the graph module's submodules."""
    from executorch.exir.backend.canonical_partitioners import group_partitioner
    from torch.fx.passes.infra import partitioner

    modules = (partitioner, group_partitioner)
    originals = [m._DependencyViewer for m in modules]
    asks = partitioner.CapabilityBasedPartitioner._is_node_supported
    for m in modules:
        m._DependencyViewer = WalkedDependencies
    partitioner.CapabilityBasedPartitioner._is_node_supported = _is_node_supported
    try:
        yield
    finally:
        for m, original in zip(modules, originals):
            m._DependencyViewer = original
        partitioner.CapabilityBasedPartitioner._is_node_supported = asks

"""Sort the graph once per partitioning pass, not once per partition.

When ExecuTorch carves a delegate's nodes out of a method (backend_api's
_create_partitions_in_graph_module), it re-sorts the whole graph after every partition
(`legalize_graph`), and assigning the sorted graph regenerates the GraphModule's Python code,
its and every fused submodule's: O(partitions x nodes), 20% of a tiny chunk's export (a 7-layer
phase 2 has ~1,500 nodes and ~170 partitions). Nothing reads the code between partitions, so
within the block the sort runs as before, the same nodes in the same order, but the code is
regenerated once per graph module at the end. The programs' bytes are unchanged
(tests/test_lowering_cache.py)."""
from __future__ import annotations

import contextlib
import os


@contextlib.contextmanager
def sort_partitions_once():
    if os.environ.get("ZL_LOWERING_CACHE") == "off":  # bench/export_speed.py's "before"
        yield
        return
    import torch
    from executorch.exir import lowered_backend_module as lbm

    original = lbm.legalize_graph
    stale: dict[int, torch.fx.GraphModule] = {}

    def legalize_graph(gm):
        sorted_graph = original(_CodeFree(gm)).graph
        gm._graph = sorted_graph  # the setter would regenerate the code: deferred to the end
        sorted_graph.owning_module = gm
        stale[id(gm)] = gm
        return gm

    lbm.legalize_graph = legalize_graph
    try:
        yield
    finally:
        lbm.legalize_graph = original
        for gm in stale.values():
            gm.recompile()


class _CodeFree:
    """What legalize_graph needs of a GraphModule (its graph, to read and to replace), without
    the code generation that replacing a real module's graph triggers."""

    def __init__(self, gm):
        self.graph = gm.graph

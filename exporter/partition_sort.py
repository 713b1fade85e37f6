"""Sort the graph in place after each partition, and regenerate its code once per pass.

When ExecuTorch carves a delegate's nodes out of a method (backend_api's
_create_partitions_in_graph_module), it re-sorts the whole graph after every partition
(torch's `legalize_graph`): a copy of every node into a new graph, then assigning that graph
regenerates the GraphModule's Python code. Both are O(partitions x nodes): an int4 base lowers
one delegate per decode op, ~1,900 for the tiny model, and the copies alone took 43% of its
export (8.3 million node copies). Here the same sort (the same queue discipline, so the same
order) moves the existing nodes into place instead of copying them, and rebuilds each node's
users in the order the copy would have made them, so every later sort sees the graph it would
have seen; the code is regenerated once per graph module at the end. The programs' bytes are
unchanged (tests/test_lowering_cache.py)."""
from __future__ import annotations

import collections
import contextlib
import functools
import os


@contextlib.contextmanager
def sort_partitions_once(sort=None):
    """`sort(gm)`: how each partition's graph module is re-sorted (default: sort_in_place on its graph;
    bench/quantized_export_speed.py passes torch's copying sort as its "before")."""
    if os.environ.get("ZL_LOWERING_CACHE") == "off":  # bench/export_speed.py's "before"
        yield
        return
    import torch
    from executorch.exir import lowered_backend_module as lbm

    original = lbm.legalize_graph
    stale: dict[int, torch.fx.GraphModule] = {}

    def legalize_graph(gm):
        if sort is None:
            sort_in_place(gm.graph)
        else:
            sort(gm)
        stale[id(gm)] = gm
        return gm

    lbm.legalize_graph = legalize_graph
    try:
        yield
    finally:
        lbm.legalize_graph = original
        for gm in stale.values():
            gm.recompile()


def sort_in_place(graph) -> None:
    """torch.fx.passes.tools_common.legalize_graph's order, reached by moving nodes, not copying them."""
    prioritized = _prioritized_ops()
    nodes = list(graph.nodes)
    indeg = dict.fromkeys(nodes, 0)
    for node in nodes:
        for user in node.users:
            indeg[user] += 1
    queue = collections.deque(n for n in nodes if indeg[n] == 0)
    order = []
    while queue:
        cur = queue.popleft()
        order.append(cur)
        for user in cur.users:
            indeg[user] -= 1
            if indeg[user] == 0:
                if user.op == "call_function" and user.target in prioritized:
                    queue.appendleft(user)
                else:
                    queue.append(user)
    if len(order) < len(nodes):
        raise RuntimeError(f"Input graph has cycles, unable to add {[n for n in indeg if indeg[n] != 0]}")
    prev = graph._root
    for node in order:
        if prev._next is not node:
            prev.append(node)
        prev = node
    # users as the copy registers them (each node's inputs, in creation order), which the next sort reads
    for node in order:
        node.users.clear()
    for node in order:
        for inp in node._input_nodes:
            inp.users[node] = None


@functools.cache
def _prioritized_ops() -> frozenset:
    """The ops torch 2.13's legalize_graph moves to the queue's front (tests/test_lowering_cache.py
    compares the programs' bytes with torch's own sort, so a torch that changes the list fails there)."""
    import operator

    import torch

    return frozenset([
        operator.add, operator.mul, operator.sub, operator.floordiv, operator.truediv, operator.mod,
        operator.le, operator.lt, operator.ge, operator.gt, operator.eq, operator.ne,
        torch.ops.aten.sym_constrain_range.default, torch.ops.aten.sym_constrain_range_for_size.default,
        torch.ops.aten._assert_async.msg, torch.ops.aten.scalar_tensor.default, torch.ops.aten._assert_scalar.default,
    ])

"""Keep the graph in order after each partition without re-sorting all of it, and regenerate its
code once per pass.

When ExecuTorch carves a delegate's nodes out of a method (backend_api's
_create_partitions_in_graph_module), it re-sorts the whole graph after every partition
(torch's `legalize_graph`: a copy of every node into a new graph, then the GraphModule's Python
code regenerated). That is O(partitions x nodes): an int4 base lowers one delegate per decode op,
~1,900 for the tiny model and 5,284 in one phase of a 3B chunk, where sorting was 66% of a
67-minute lowering. Fusing a partition changes only the edges into and out of its new call node,
which torch places after the partition's last output: when those edges still point forward (always
for a one-node partition, which is what a quantized base's GEMMs and decodes are) the graph is
still in order and nothing moves. Otherwise the whole graph is sorted, in place (torch's queue
discipline, moving nodes rather than copying them). Each pass then ends with one breadth-first
sort of each method (sort_methods), the order torch's last sort of the pass gave before and that
the memory plans were measured with; the code is regenerated once per graph module."""
from __future__ import annotations

import collections
import contextlib
import functools
import operator
import os


@contextlib.contextmanager
def sort_partitions_once(sort=None):
    """`sort(gm)`: sort after every partition with this (bench/quantized_export_speed.py passes
    torch's copying sort as its "before"); default: only where a fused partition left the graph out
    of order (sort_in_place), the caller sorting each method once at the end (sort_methods)."""
    if os.environ.get("ZL_LOWERING_CACHE") == "off":  # bench/export_speed.py's "before"
        yield
        return
    import torch
    from executorch.exir import lowered_backend_module as lbm

    original_sort, original_insert = lbm.legalize_graph, lbm.insert_subgm
    stale: dict[int, torch.fx.GraphModule] = {}
    fused: dict[int, torch.fx.Node] = {}  # graph module -> the call node of the partition fused last

    def insert_subgm(gm, sub_gm, orig_inputs, orig_outputs, insertion_point=None):
        if insertion_point is None and orig_outputs:
            insertion_point = max(orig_outputs)  # the last output in graph order, as torch's scan from the end finds it
        gm = original_insert(gm, sub_gm, orig_inputs, orig_outputs, insertion_point)
        fused[id(gm)] = insertion_point.next
        return gm

    def legalize_graph(gm):
        call = fused.pop(id(gm), None)
        if sort is not None:
            sort(gm)
        elif call is None or not _edges_point_forward(call):
            sort_in_place(gm.graph)
        stale[id(gm)] = gm
        return gm

    lbm.legalize_graph, lbm.insert_subgm = legalize_graph, insert_subgm
    try:
        yield
    finally:
        lbm.legalize_graph, lbm.insert_subgm = original_sort, original_insert
        for gm in stale.values():
            gm.recompile()


def _edges_point_forward(call) -> bool:
    """Whether a fused partition's call node comes after its inputs and before every user of its
    outputs (torch.fx keeps each node's position as a comparable key: O(edges), not O(graph))."""
    if any(not inp < call for inp in call._input_nodes):
        return False
    for out in call.users:  # the getitems torch adds just after the call, then the outputs' users
        if not call < out:
            return False
        if out.target is operator.getitem and any(not out < user for user in out.users):
            return False
    return True


def sort_methods(edge, names) -> None:
    """One breadth-first sort of each named method of an EdgeProgramManager (after a partitioning pass)."""
    for name in names:
        ep = edge.exported_program(name)
        sort_in_place(ep.graph)
        ep.graph_module.recompile()


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

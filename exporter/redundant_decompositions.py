"""Skip ExecuTorch's re-decomposition of phase programs that are decomposed already.

to_edge_transform_and_lower runs `run_decompositions` three times per method (functionalise;
decompose all but the partitioner's ops; decompose the rest), each one a full retrace of the
graph: with the lowered partitions reused (lowering_cache), these retraces were 43% of a chunk's
lowering. The phase programs come from the joint forward/backward export, which is already
functional core ATen, so a retrace with a table that names none of the graph's ops, over a graph
with no mutating op, gives the same program back. Within the block such calls return the program
as it is; any other call runs as usual. bench/export_speed.py checks the programs' bytes."""
from __future__ import annotations

import contextlib
import os


def _needs_work(ep, table) -> bool:
    from executorch.exir.graph_module import contains_any_call_fn_target_op

    for n in ep.graph.nodes:
        if n.op != "call_function":
            continue
        schema = getattr(n.target, "_schema", None)
        if schema is None or schema.is_mutable:
            return True  # something functionalisation would rewrite (or that we cannot judge)
    return bool(table) and contains_any_call_fn_target_op(ep.graph_module, table)


@contextlib.contextmanager
def skip_redundant_decompositions(stats: dict | None = None):
    from torch.export import ExportedProgram

    stats = stats if stats is not None else {}
    if os.environ.get("ZL_LOWERING_CACHE") == "off":  # bench/export_speed.py's "before"
        yield stats
        return
    original = ExportedProgram.run_decompositions

    def run_decompositions(self, decomp_table=None, decompose_custom_triton_ops=False):
        if decomp_table is not None and not decompose_custom_triton_ops and not _needs_work(self, decomp_table):
            stats["skipped"] = stats.get("skipped", 0) + 1
            return self
        stats["run"] = stats.get("run", 0) + 1
        return original(self, decomp_table, decompose_custom_triton_ops)

    ExportedProgram.run_decompositions = run_decompositions
    try:
        yield stats
    finally:
        ExportedProgram.run_decompositions = original

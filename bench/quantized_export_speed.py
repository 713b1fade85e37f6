"""zl-export with a quantized base against the same export in fp32, side by side in one run (issue 53:
an int4 export within 1.5x of the fp32 one).

Each export runs zl-export as shipped, in a fresh process, alternating (ABBA over --reps) so both see
the same machine; reported per base: the command's wall and CPU seconds (its children's, so other
jobs on a shared machine count less), each chunk's export_seconds, the programs' sizes, and the
ratios to fp32.

  python bench/quantized_export_speed.py --model smollm2 --chunks 0-9,10-19,20-29 --seq-len 64 --loss-positions 8
  python bench/quantized_export_speed.py --model tiny --bases int4:torch-sort,int4 --out bench/results/int4_sort.json
  python bench/quantized_export_speed.py --model smollm2 --chunks 0-9,10-19,20-29 --seq-len 64 --loss-positions 8 \
      --bases fp32,int4:sort-each,int4
Results: bench/results/quantized_export_speed.json.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, machine, median, now_iso  # noqa: E402
from export_speed import timed_export  # noqa: E402

# "BASE:torch-sort": the export as it was before exporter/partition_sort.py sorted in place: torch's
# legalize_graph, a copy of every node after each partition (the code still regenerated once per pass)
TORCH_SORT = """
import functools, sys
from exporter import lower, partition_sort
from executorch.exir import lowered_backend_module as lbm

torch_sort = lbm.legalize_graph

class CodeFree:  # the graph without its module: the code is regenerated once per pass, not per sort
    def __init__(self, gm):
        self.graph = gm.graph

def copying_sort(gm):
    g = torch_sort(CodeFree(gm)).graph
    gm._graph, g.owning_module = g, gm

def sort_each(gm):  # the in-place sort after every partition (what zl-export did before it checked the edges)
    partition_sort.sort_in_place(gm.graph)

lower.sort_partitions_once = functools.partial(partition_sort.sort_partitions_once,
                                               sort=sort_each if "sort-each" in sys.argv[1] else copying_sort)
sys.argv.pop(1)
from exporter.cli import main
sys.argv[0] = "zl-export"
sys.exit(main())
"""


def export(variant: str, a, out: Path) -> dict:
    base, _, how = variant.partition(":")
    entry = ["-c", TORCH_SORT, how] if how in ("torch-sort", "sort-each") else ["-m", "exporter.cli"]
    shutil.rmtree(out, ignore_errors=True)
    return timed_export(entry, a, out, ["--base-weights", base], what=variant)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--chunks", default="0-6,7-13,14-21")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--loss-positions", type=int, default=None)
    p.add_argument("--bases", default="fp32,int4", help="the first is the reference; BASE:torch-sort exports "
                   "BASE with torch's copying sort after each partition (before exporter/partition_sort.py), "
                   "BASE:sort-each with the in-place sort after each partition (before the forward-edge check)")
    p.add_argument("--reps", type=int, default=1, help="export rounds (ABBA order)")
    p.add_argument("--work", type=Path, default=Path("/tmp/zl_bench_quantized_export"))
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "quantized_export_speed.json")
    a = p.parse_args(argv)
    bases = a.bases.split(",")
    runs: dict[str, list] = {b: [] for b in bases}
    for r in range(a.reps):
        for b in (bases if r % 2 == 0 else bases[::-1]):
            res = export(b, a, a.work / b.replace(":", "-"))
            runs[b].append(res)
            print(f"round {r} {b}: {res['wall_s']:.0f} s wall, {res['cpu_s']:.0f} s CPU, chunks "
                  + ", ".join(f"{s:.0f}" for s in res["chunk_s"]) + " s", flush=True)
    ref = bases[0]
    summary = {"date": now_iso(), "machine": machine(), "model": a.model, "chunks": a.chunks, "seq_len": a.seq_len,
               "loss_positions": a.loss_positions, "runs": runs,
               "median_wall_s": {b: median([x["wall_s"] for x in runs[b]]) for b in bases},
               "median_cpu_s": {b: median([x["cpu_s"] for x in runs[b]]) for b in bases}}
    summary["wall_ratio"] = {b: summary["median_wall_s"][b] / summary["median_wall_s"][ref] for b in bases}
    summary["cpu_ratio"] = {b: summary["median_cpu_s"][b] / summary["median_cpu_s"][ref] for b in bases}
    for b in bases:
        print(f"{b}: {summary['median_wall_s'][b]:.0f} s wall ({summary['wall_ratio'][b]:.2f}x {ref}), "
              f"{summary['median_cpu_s'][b]:.0f} s CPU ({summary['cpu_ratio'][b]:.2f}x)")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(summary, indent=1) + "\n")
    print(f"written {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""How fast can ExecuTorch run one chunk's GEMMs on this CPU, against eager PyTorch?

A TinyLlama chunk step is GEMM-bound (see docs/BENCHMARKS.md, Export: Dynamic Fully Connected is
~75% of phase 1 and phase 2), so the export benchmark's step-time ratio cannot be lower than the
ratio of the runtime's GEMMs to eager PyTorch's (MKL/oneDNN) on the same shapes. This script
measures that floor, side by side in one process, for every frozen weight of a TinyLlama layer
and an lm_head block, in the two layouts a training step uses:
  forward   y  = x @ W^T   (F.linear(x, W); phase 1 and the readout)
  backward  dx = dy @ W    (torch.mm(dy, W); phase 2's gradient for the layer below)
with M = B*S = 128 rows, and W a frozen constant of the program, in three ExecuTorch variants:
  xnnpack-dynamic  XNNPACK, W repacked at every call (what zl-export writes: weights in the .ptd)
  xnnpack-static   XNNPACK, W packed once at load (a packed copy per use: more memory)
  optimized        no delegate: ExecuTorch's optimized CPU kernels (linear.out / mm.out)
Times are medians; ratio = ExecuTorch / eager; "layer" rows sum a layer's seven GEMMs.

  python bench/gemm_floor.py                    # TinyLlama shapes, 2 threads
  python bench/gemm_floor.py --threads 1 --reps 20
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, machine, median, now_iso  # noqa: E402

RESULTS = REPO / "bench" / "results" / "gemm_floor.json"
# (name, out_features, in_features) of a TinyLlama layer's frozen weights, and one lm_head block
# (exporter/chunk_model.py: readout_block_rows keeps a block within the largest layer weight)
SHAPES = [("q_proj", 2048, 2048), ("k_proj", 256, 2048), ("v_proj", 256, 2048), ("o_proj", 2048, 2048),
          ("gate_proj", 5632, 2048), ("up_proj", 5632, 2048), ("down_proj", 2048, 5632),
          ("lm_head block", 5632, 2048)]
LAYER = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
VARIANTS = ("xnnpack-dynamic", "xnnpack-static", "optimized")


def _programs(w, layout: str):
    """ExecuTorch modules computing the GEMM with W as a frozen constant, one per variant."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from executorch.backends.xnnpack import XnnpackPartitioner
    from executorch.exir import EdgeCompileConfig, to_edge, to_edge_transform_and_lower

    from zl_common.et_runtime import runtime

    class Gemm(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(w, requires_grad=False)

        def forward(self, a):
            return F.linear(a, self.w) if layout == "forward" else torch.mm(a, self.w)

    rows = 128
    a = torch.randn(rows, w.shape[1] if layout == "forward" else w.shape[0])
    ep = lambda: torch.export.export(Gemm(), (a,))  # noqa: E731  (each lowering consumes its program)
    bufs = {
        "xnnpack-dynamic": to_edge_transform_and_lower(
            ep(), partitioner=[XnnpackPartitioner(force_non_static_weights_for_f32_linear=True)]).to_executorch().buffer,
        "xnnpack-static": to_edge_transform_and_lower(ep(), partitioner=[XnnpackPartitioner()]).to_executorch().buffer,
        "optimized": to_edge(ep(), compile_config=EdgeCompileConfig(
            _check_ir_validity=False, preserve_ops=[torch.ops.aten.linear.default])).to_executorch().buffer,
    }
    # the runtime reads the program from the buffer for the module's life: keep both
    return a, {v: (b, runtime()._load_for_executorch_from_buffer(b)) for v, b in bufs.items()}


def _time(fn, reps: int) -> float:
    fn()  # warm-up: packing at load, first-touch of buffers
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return median(ts)


def measure(reps: int, say) -> list[dict]:
    import torch
    import torch.nn.functional as F

    rows = []
    for name, out_f, in_f in SHAPES:
        w = torch.randn(out_f, in_f) * 0.02
        for layout in ("forward", "backward"):
            a, progs = _programs(w, layout)
            eager = (lambda: F.linear(a, w)) if layout == "forward" else (lambda: torch.mm(a, w))
            ref = eager()
            row = {"weight": name, "shape": [out_f, in_f], "layout": layout,
                   "gflop": 2 * a.shape[0] * out_f * in_f / 1e9, "eager_s": _time(eager, reps)}
            for v, (_, m) in progs.items():
                out = m.forward((a,))[0]
                row[f"max_abs_diff_{v}"] = float((out - ref).abs().max())
                row[f"{v}_s"] = _time(lambda: m.forward((a,)), reps)
            rows.append(row)
            say(f"{name:14s} {layout:8s} eager {row['eager_s'] * 1e3:6.1f} ms  " + "  ".join(
                f"{v} {row[f'{v}_s'] * 1e3:6.1f} ms ({row[f'{v}_s'] / row['eager_s']:.2f}x)" for v in VARIANTS))
    return rows


def layer_totals(rows: list[dict]) -> list[dict]:
    """A layer's seven GEMMs summed, per layout, and the lm_head block alone."""
    out = []
    for label, names in (("layer (7 GEMMs)", LAYER), ("lm_head block", ("lm_head block",))):
        for layout in ("forward", "backward"):
            sel = [r for r in rows if r["weight"] in names and r["layout"] == layout]
            tot = {"what": label, "layout": layout, "gflop": sum(r["gflop"] for r in sel),
                   "eager_s": sum(r["eager_s"] for r in sel)}
            for v in VARIANTS:
                tot[f"{v}_s"] = sum(r[f"{v}_s"] for r in sel)
                tot[f"{v}_ratio"] = tot[f"{v}_s"] / tot["eager_s"]
            out.append(tot)
    return out


def print_tables(rows, totals, console) -> None:
    from rich.table import Table

    def table(title, key, items):
        t = Table(title=title)
        for c in (key, "layout", "GFLOP", "eager", *VARIANTS):
            t.add_column(c, justify="left" if c in (key, "layout") else "right")
        for r in items:
            t.add_row(r[key], r["layout"], f"{r['gflop']:.2f}", f"{r['eager_s'] * 1e3:.1f} ms",
                      *(f"{r[f'{v}_s'] * 1e3:.1f} ms ({r[f'{v}_s'] / r['eager_s']:.2f}x)" for v in VARIANTS))
        console.print(t)

    table("GEMM time, M=128 rows: ExecuTorch / eager PyTorch (same process, same threads)", "weight", rows)
    table("summed: the floor under the export benchmark's step-time ratio", "what", totals)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--reps", type=int, default=10, help="timed calls per GEMM (median reported)")
    p.add_argument("--results", type=Path, default=RESULTS)
    a = p.parse_args(argv)

    import torch
    from rich.console import Console

    from zl_common.et_runtime import runtime

    torch.set_num_threads(a.threads)
    runtime()._unsafe_reset_threadpool(a.threads)
    console = Console()
    t0 = time.time()
    rows = measure(a.reps, lambda m: console.print(f"[dim]{time.time() - t0:6.1f}s[/] {m}"))
    totals = layer_totals(rows)
    print_tables(rows, totals, console)
    from exporter.export import versions

    a.results.parent.mkdir(parents=True, exist_ok=True)
    a.results.write_text(json.dumps({"date": now_iso(), "machine": machine(), "versions": versions(),
                                     "threads": a.threads, "reps": a.reps, "rows": rows, "totals": totals},
                                    indent=1))
    console.print(f"results: {a.results}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""zl-export's time, before and after its speed-ups, side by side in one run.

"before" lowers every partition as ExecuTorch does, one chunk after another (ZL_LOWERING_CACHE=off,
--jobs 1); "after" is zl-export as shipped (each distinct XNNPACK partition lowered once,
exporter/lowering_cache.py; no redundant re-decompositions; one graph sort per partitioning pass,
exporter/partition_sort.py; the chunks side by side in worker processes, exporter/chunk_jobs.py).
The two exports alternate (ABBA over --reps), each in a fresh process, so both see the same
machine. Per variant it reports the wall time of the whole command and each chunk's export time
(the manifest's export_seconds), and then, for each chunk's program of each variant, the median
phase 1 + phase 2 step in ExecuTorch and the peak RSS of a fresh process that loads it and steps
(the programs must be no slower and no bigger), and how far the two variants' outputs differ on
the same inputs (they must agree to fp32 rounding).

  python bench/export_speed.py                                   # tiny model, default chunks
  python bench/export_speed.py --model smollm2 --chunks 0-9,10-19,20-29 --seq-len 64 --loss-positions 8
Results: bench/results/export_speed.json and the "## Export time (bench/export_speed.py)" section of docs/BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, machine, median, now_iso, replace_md_section  # noqa: E402

RESULTS = REPO / "bench" / "results" / "export_speed.json"
DOC = REPO / "docs" / "BENCHMARKS.md"
HEADING = "## Export time (bench/export_speed.py)"
VARIANTS = {"before": "off", "after": "on"}


def _children_cpu_s() -> float:
    """CPU seconds (user + system) of this process's finished children: on a machine other jobs
    share, a fairer measure of the exporter's work than wall time."""
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def timed_export(entry: list[str], a, out: Path, extra: list[str], env=None, what: str = "") -> dict:
    """zl-export (`entry`: ["-m", "exporter.cli"], or ["-c", a patched copy]) of a.model in a.chunks at
    a.seq_len (a.loss_positions), XNNPACK, with `extra` arguments, in a fresh process: its wall and CPU
    seconds (its children's, so other jobs on a shared machine count less), each chunk's
    export_seconds and program size."""
    cmd = [sys.executable, *entry, "--model", a.model, "--chunks", a.chunks, "--out", str(out),
           "--backend", "xnnpack", "--seq-len", str(a.seq_len), *extra]
    if a.loss_positions:
        cmd += ["--loss-positions", str(a.loss_positions)]
    t0, c0 = time.perf_counter(), _children_cpu_s()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=REPO)
    wall, cpu = time.perf_counter() - t0, _children_cpu_s() - c0
    if r.returncode != 0:
        raise SystemExit(f"export ({what}) failed:\n{r.stderr[-3000:]}")
    m = json.loads((out / "manifest.json").read_text())
    return {"wall_s": wall, "cpu_s": cpu, "chunk_s": [c["export_seconds"] for c in m["chunks"]],
            "pte_bytes": [(out / c["program"]).stat().st_size for c in m["chunks"]]}


def export(variant: str, a, out: Path) -> dict:
    return timed_export(["-m", "exporter.cli"], a, out, ["--jobs", "1" if variant == "before" else "auto"],
                        env=dict(os.environ, ZL_LOWERING_CACHE=VARIANTS[variant]), what=variant)


STEP = r"""
import json, resource, statistics, sys, time
from pathlib import Path
import torch
from exporter.chunk_model import example_inputs, input_names
from exporter.config import ExportConfig
from exporter.verify import sample_lora
from zl_mobile.backends import Backend
out, k, steps = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
m = json.loads((out / "manifest.json").read_text())
entry, e, mc = m["chunks"][k], m["export"], m["model"]["config"]
backend = Backend.from_args("executorch"); backend.check_runtime(); backend.set_threads(1)
prog = backend.load(out, entry, in_place=False)
class C: is_first = entry["layers"][0] == 0
cfg = ExportConfig(seq_len=e["seq_len"], micro_batch=e["micro_batch"], loss_positions=e["loss_positions"])
batch = dict(zip(input_names(C.is_first), example_inputs(C, cfg, mc["vocab_size"], mc["hidden_size"], seed=1)))
lora = sample_lora(entry, 0)
times = []
for i in range(steps + 1):
    t0 = time.perf_counter()
    h, saved = prog.phase1(lora, batch)
    r = prog.phase2(lora, saved, batch)
    times.append(time.perf_counter() - t0)
torch.save({"h": h, "loss": r.loss}, sys.argv[4])
print(json.dumps({"step_s": statistics.median(times[1:]), "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def step(out: Path, k: int, steps: int, dump: Path) -> dict:
    r = subprocess.run([sys.executable, "-c", STEP, str(out), str(k), str(steps), str(dump)],
                       capture_output=True, text=True, cwd=REPO)
    if r.returncode != 0:
        raise SystemExit(f"stepping chunk {k} of {out} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--chunks", default="0-6,7-13,14-21")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--loss-positions", type=int, default=None)
    p.add_argument("--reps", type=int, default=1, help="export pairs (ABBA order)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per program")
    p.add_argument("--work", type=Path, default=Path("/tmp/zl_bench_export_speed"))
    p.add_argument("--no-doc", action="store_true")
    a = p.parse_args(argv)
    import shutil

    import torch

    shutil.rmtree(a.work, ignore_errors=True)
    runs = {v: [] for v in VARIANTS}
    for rep in range(a.reps):
        for v in (("before", "after") if rep % 2 == 0 else ("after", "before")):
            res = export(v, a, a.work / f"{v}_{rep}")
            runs[v].append(res)
            print(f"rep {rep} {v:6s}: {res['wall_s']:7.1f} s wall, {res['cpu_s']:7.1f} s CPU, chunks {res['chunk_s']}",
                  flush=True)
    programs = []
    n_chunks = len(runs["after"][0]["chunk_s"])
    for k in range(n_chunks):
        row = {"chunk": k}
        for v in VARIANTS:
            row[v] = step(a.work / f"{v}_0", k, a.steps, a.work / f"{v}_{k}.pt")
        b, f = (torch.load(a.work / f"{v}_{k}.pt") for v in VARIANTS)
        row["h_rel_diff"] = float((b["h"] - f["h"]).abs().max() / b["h"].abs().max())
        row["loss_rel_diff"] = float(abs(b["loss"] - f["loss"]) / abs(b["loss"]))
        programs.append(row)
        print(f"chunk {k}: step {row['before']['step_s'] * 1e3:.1f} -> {row['after']['step_s'] * 1e3:.1f} ms, "
              f"peak RSS {row['before']['peak_rss'] / 2**20:.0f} -> {row['after']['peak_rss'] / 2**20:.0f} MiB, "
              f"h differs by {row['h_rel_diff']:.1e} of its max", flush=True)
    wall = {v: median([r["wall_s"] for r in runs[v]]) for v in VARIANTS}
    cpu = {v: median([r["cpu_s"] for r in runs[v]]) for v in VARIANTS}
    per_chunk = {v: [median([r["chunk_s"][k] for r in runs[v]]) for k in range(n_chunks)] for v in VARIANTS}
    result = {"date": now_iso(), "machine": machine(), "load_avg_at_end": os.getloadavg(),
              "settings": {k: str(v) for k, v in vars(a).items()}, "runs": runs, "programs": programs,
              "wall_s": wall, "cpu_s": cpu, "chunk_s": per_chunk, "speedup": wall["before"] / wall["after"],
              "cpu_ratio": cpu["before"] / cpu["after"]}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1))
    print(f"zl-export {a.model} {a.chunks}: {wall['before']:.1f} s -> {wall['after']:.1f} s wall "
          f"({result['speedup']:.2f}x), {cpu['before']:.1f} s -> {cpu['after']:.1f} s CPU ({result['cpu_ratio']:.2f}x)")
    if not a.no_doc:
        replace_md_section(DOC, HEADING, markdown(result, a), "Benchmarks", keep_from="Where the time went")
    return 0


def markdown(r, a) -> str:
    lines = [f"`python bench/export_speed.py --model {a.model} --chunks {a.chunks} --seq-len {a.seq_len}"
             + (f" --loss-positions {a.loss_positions}" if a.loss_positions else "") + f" --reps {a.reps}`, "
             f"{r['date']}, {r['machine'].get('cpu', '')}, load average at the end {r['load_avg_at_end'][0]:.1f}.",
             "", "| | before (ExecuTorch as is, one chunk after another) | after (zl-export as shipped) | ratio |",
             "|---|---|---|---|",
             f"| zl-export wall time | {r['wall_s']['before']:.1f} s | {r['wall_s']['after']:.1f} s | "
             f"{r['speedup']:.2f}x |",
             f"| zl-export CPU time (user + system) | {r['cpu_s']['before']:.1f} s | {r['cpu_s']['after']:.1f} s | "
             f"{r['cpu_ratio']:.2f}x |"]
    for k, (b, f) in enumerate(zip(r["chunk_s"]["before"], r["chunk_s"]["after"])):
        lines.append(f"| chunk {k} export (after: the chunks at once, sharing the cores) | {b:.1f} s | {f:.1f} s | "
                     f"{b / f:.2f}x |")
    for row in r["programs"]:
        b, f = row["before"], row["after"]
        lines.append(f"| chunk {row['chunk']} step (phase 1 + 2) | {b['step_s'] * 1e3:.1f} ms | "
                     f"{f['step_s'] * 1e3:.1f} ms | {f['step_s'] / b['step_s']:.2f} |")
        lines.append(f"| chunk {row['chunk']} peak RSS of a stepping process | {b['peak_rss'] / 2**20:.0f} MiB | "
                     f"{f['peak_rss'] / 2**20:.0f} MiB | {f['peak_rss'] / b['peak_rss']:.2f} |")
    worst = max(row["h_rel_diff"] for row in r["programs"])
    lines += ["", f"The two variants' programs agree on h_k to {worst:.1e} of its largest value."]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

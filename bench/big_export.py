"""zl-export of a model larger than the exporter may hold in fp32 (issue 53: Llama-3.2-3B's shape,
12.8 GB in fp32, on a 24 GiB machine where the export's peak must stay within 12 GiB).

Runs zl-export as a user does, in a fresh process, and samples from outside, every --interval s,
the PSS of its whole process tree (the exporter and its forked chunk workers, which share the
model's pages: PSS counts a shared page once in the sum) and each process's RSS. Prints and
writes (bench/results/big_export_NAME.json) the peak tree PSS, the largest single RSS, the wall
time, each chunk's export seconds and each chunk's program and weights sizes. zl-export's own
log lines go to --log as they come (its progress).

  python bench/llama_shape.py --shape llama-3.2-3b --out /tmp/llama-3.2-3b-shape
  nice -n 10 python bench/big_export.py --model /tmp/llama-3.2-3b-shape --chunks 0-6,7-13,14-20,21-27 \\
      --seq-len 256 --loss-positions 32 --base-weights int4 --out /tmp/l3b-4 --name llama-3.2-3b-4
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def tree_memory(pid: int) -> tuple[int, int] | None:
    """(summed PSS, largest RSS) in bytes of process `pid` and its descendants; None once it is gone."""
    import psutil

    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return None
    pss, rss = 0, 0
    for p in procs:
        try:
            info = p.memory_full_info()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        pss += info.pss
        rss = max(rss, info.rss)
    return pss, rss


def run(a) -> dict:
    from bench.common import gib, machine, now_iso

    cmd = [sys.executable, "-m", "exporter.cli", "--model", a.model, "--chunks", a.chunks, "--out", a.out,
           "--seq-len", str(a.seq_len), "--base-weights", a.base_weights, "--jobs", a.jobs]
    if a.loss_positions:
        cmd += ["--loss-positions", str(a.loss_positions)]
    peak_pss = peak_rss = 0
    t0 = time.perf_counter()
    with open(a.log, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        while proc.poll() is None:
            mem = tree_memory(proc.pid)
            if mem:
                peak_pss, peak_rss = max(peak_pss, mem[0]), max(peak_rss, mem[1])
            time.sleep(a.interval)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:  # the peaks are the finding then (a worker the kernel's OOM killer ended)
        raise SystemExit(f"zl-export failed (exit {proc.returncode}) after {wall:.0f} s, peak PSS {gib(peak_pss)} "
                         f"(process tree), largest RSS {gib(peak_rss)}: see {a.log}")
    out = Path(a.out)
    m = json.loads((out / "manifest.json").read_text())
    chunks = [{"layers": c["layers"], "export_s": c["export_seconds"],
               "pte_bytes": (out / c["program"]).stat().st_size, "ptd_bytes": (out / c["weights"]).stat().st_size}
              for c in m["chunks"]]
    result = {"when": now_iso(), "machine": machine(), "command": " ".join(cmd[1:]), "wall_s": round(wall, 1),
              "peak_tree_pss_bytes": peak_pss, "peak_process_rss_bytes": peak_rss, "chunks": chunks,
              "readout": m["export"].get("readout"), "config": m["model"]["config"]}
    print(f"{a.model} -> {a.out}: {wall:.0f} s wall, peak PSS {gib(peak_pss)} (process tree), largest RSS "
          f"{gib(peak_rss)}")
    for c in chunks:
        print(f"  chunk {c['layers'][0]}-{c['layers'][1]}: {c['export_s']:.0f} s, program {c['pte_bytes'] / 2**20:.1f} MiB, "
              f"weights {c['ptd_bytes'] / 2**20:.1f} MiB")
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a Hugging Face Llama directory (bench/llama_shape.py writes one)")
    p.add_argument("--chunks", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--loss-positions", type=int, default=32)
    p.add_argument("--base-weights", default="int4")
    p.add_argument("--jobs", default="auto")
    p.add_argument("--interval", type=float, default=0.5)
    p.add_argument("--name", default="model", help="the result file: bench/results/big_export_NAME.json")
    p.add_argument("--log", default=None, help="zl-export's output (default OUT.log)")
    a = p.parse_args(argv)
    a.log = a.log or a.out.rstrip("/") + ".log"
    result = run(a)
    path = REPO / "bench" / "results" / f"big_export_{a.name}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"written {path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

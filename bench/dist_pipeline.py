"""ZeroLock on torch.distributed ranks vs torch.distributed.pipelining's GPipe, 1F1B and zero bubble
(ZB1P), side by side in one torchrun launch: the same ranks, chunks, LoRA, micro-batches and AdamW.

    python bench/dist_pipeline.py --program build/tiny --steps 6 --window 4 [--torch-device cuda]

Runs `torchrun --nproc-per-node K -m host.dist --schedule zerolock,gpipe,1f1b,zerobubble`
(K = the export's chunks) and reads each schedule's run directory. Reports per schedule:
  throughput   samples/s of the last stage over the windows after the first (warm-up left out)
  peak RSS     per rank, the largest window peak (VmHWM reset per micro-batch / window)
  CUDA peak    per rank, torch.cuda.max_memory_allocated (with --torch-device cuda)
Ranks on one GPU share it (cuda:0 for every rank with --share-gpu): hidden states and gradients then
go over Gloo as CPU copies (--wire cpu), since NCCL refuses two ranks on one GPU; that is what is
measured then, and the JSON says so. Writes bench/results/dist_pipeline[_TAG].json."""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, MiB  # noqa: E402

SCHEDULES = ("zerolock", "gpipe", "1f1b", "zerobubble")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def summarise(run_dir: Path, schedule: str, rows_per_mb: int) -> dict:
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    wins = [r for r in recs if r["type"] == "TELEMETRY" and r.get("kind") == "window"]
    stages = sorted({r["stage"] for r in wins})
    last = sorted((r for r in wins if r["stage"] == stages[-1]), key=lambda r: r["window"])
    steady = last[1:] or last
    secs = sum(r["seconds"] for r in steady)
    mbs = sum(r["micro_batches"] for r in steady)
    per_rank = {}
    for k in stages:
        rs = [r for r in wins if r["stage"] == k]
        per_rank[k] = {"rss_peak_mib": round(max(r.get("rss_peak_bytes") or 0 for r in rs) / MiB, 1),
                       "cuda_max_allocated_mib": (round(max(r.get("cuda_max_allocated_bytes") or 0 for r in rs) / MiB, 1)
                                                  if any("cuda_max_allocated_bytes" in r for r in rs) else None),
                       "device": next((r["device"] for r in rs), None)}
    return {"schedule": schedule, "samples_per_s": round(mbs * rows_per_mb / secs, 2) if secs else None,
            "steady_windows": len(steady), "steady_seconds": round(secs, 3),
            "final_task_loss_last_stage": last[-1].get("task_loss"), "per_rank": per_rank}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--program", required=True, help="zl-export output (with --eager-weights)")
    p.add_argument("--data", default=None)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--window", type=int, default=4)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per rank")
    p.add_argument("--torch-device", default="cpu", help="cpu, or cuda (cuda:LOCAL_RANK; see --share-gpu)")
    p.add_argument("--share-gpu", action="store_true", help="every rank on cuda:0 (one GPU machine)")
    p.add_argument("--wire", default="cpu", choices=["cpu", "device"])
    p.add_argument("--schedules", default=",".join(SCHEDULES))
    p.add_argument("--out", default=None, help="run dir (default: a fresh one under /tmp)")
    p.add_argument("--tag", default="", help="results file suffix: bench/results/dist_pipeline_TAG.json")
    p.add_argument("--note", default="", help="what else to record about the machine (shared, budgeted, ...)")
    p.add_argument("--timeout", type=int, default=900)
    a = p.parse_args(argv)

    manifest = json.loads((Path(a.program) / "manifest.json").read_text())
    k = len(manifest["chunks"])
    out = Path(a.out or f"/tmp/zl_dist_bench_{os.getpid()}")
    device = "cuda:0" if a.share_gpu else a.torch_device
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(k), "--master-addr", "127.0.0.1",
           "--master-port", str(_port()), "-m", "host.dist", "--program", str(a.program), "--steps", str(a.steps),
           "--window", str(a.window), "--threads", str(a.threads), "--torch-device", device, "--wire", a.wire,
           "--schedule", a.schedules, "--out", str(out)] + (["--data", a.data] if a.data else [])
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(a.threads)}
    t0 = time.time()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout)
    if r.returncode != 0:
        print(r.stderr[-4000:], file=sys.stderr)
        return r.returncode
    rows_per_mb = manifest["export"]["micro_batch"]
    schedules = a.schedules.split(",")
    results = [summarise(out / s if len(schedules) > 1 else out, s, rows_per_mb) for s in schedules]
    import torch

    rec = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "wall_s": round(time.time() - t0, 1),
           "command": " ".join(cmd[2:]), "ranks": k, "torch": torch.__version__, "device": device, "wire": a.wire,
           "ranks_share_gpu": a.share_gpu, "cpus": os.cpu_count(), "threads_per_rank": a.threads,
           "note": a.note, "model": manifest["model"]["config"], "chunks": [c["layers"] for c in manifest["chunks"]],
           "micro_batch": rows_per_mb, "seq_len": manifest["export"]["seq_len"], "window": a.window,
           "steps": a.steps, "lora_rank": manifest["lora"]["rank"], "results": results}
    if device.startswith("cuda"):
        rec["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    dest = REPO / "bench" / "results" / f"dist_pipeline{'_' + a.tag if a.tag else ''}.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(rec, indent=2))
    cuda = device.startswith("cuda")
    print("| schedule | samples/s | " + " | ".join(f"rank {i} peak RSS MiB" + (" / CUDA MiB" if cuda else "")
                                                    for i in range(k)) + " |")
    print("|---|---|" + "---|" * k)
    for res in results:
        cells = [f"{v['rss_peak_mib']:.0f}" + (f" / {v['cuda_max_allocated_mib']:.0f}" if cuda else "")
                 for v in res["per_rank"].values()]
        print(f"| {res['schedule']} | {res['samples_per_s']} | " + " | ".join(cells) + " |")
    print(f"wrote {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

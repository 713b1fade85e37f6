"""What backpressure costs: a bounded replay buffer (the default horizon, 2W + depth: an
upstream waits before its next forward while it holds that many uncommitted hidden states) vs an
unbounded one (a horizon no run reaches: the upstream never waits and keeps everything its
downstream has not committed), side by side in ONE script run, on 2 and 3 stages, with and
without a failure.

Phone 1 is slowed (every phase 1 sleeps --slow-s more, zl_mobile.stage SLOW_POINT), so stage 0
is the faster upstream that backpressure holds back. The failure kills stage 0 (before-commit of
window --fail-window): the stage that ran ahead, whose replay buffer the downstream needs.

Reported per configuration: samples/s, stage 0's time waiting for its downstream (backpressure),
the most hidden states stage 0 held (and their bytes, and the same count at TinyLlama-1.1B size:
S=128, hidden 2048, fp32 = 1 MiB each), stage 0's peak RSS, recovery time, and the largest LoRA
difference to the uninterrupted bounded run (must be 0: same windows, applied once).

Usage:
  python bench/backpressure.py                   # ~3-5 min on 2 shared cores
  python bench/backpressure.py --windows 20 --slow-s 0.05
Results: bench/results/backpressure.json; section "Backpressure" of docs/BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, MiB, bench_micro_batches, machine, now_iso, replace_md_section, run_on_phones  # noqa: E402

warnings.filterwarnings("ignore")
sys.path.insert(0, str(REPO))

TINYLLAMA_STATE_BYTES = 128 * 2048 * 4  # one micro-batch's h_k at TinyLlama-1.1B size, b=1, S=128, fp32
UNBOUNDED = 10**6


def make_export(out: Path, chunks: str) -> Path:
    """The tests' small Llama (3 layers, tests/conftest.py), portable backend, seq 16."""
    from exporter.export import export_model
    from tests.conftest import small_export_config, write_small_model_dir

    model = out.parent / "model"
    if not (model / "config.json").exists():
        write_small_model_dir(model)
    if not (out / "manifest.json").exists():
        export_model(str(model), chunks, out, small_export_config())
    return out


def summarize(name: str, result: dict, records: list, wall_s: float, rows: int, base_lora=None) -> dict:
    import numpy as np

    tel = [r for r in records if r["type"] == "TELEMETRY" and r.get("kind", "micro_batch") == "micro_batch"]
    s0 = [r for r in tel if r["stage"] == 0]
    state_bytes = max((r["bytes_out"] / max(1, r["micro_batch"] + 1) for r in s0), default=0)
    wins0 = [r for r in records if r["type"] == "TELEMETRY" and r.get("kind") == "window" and r["stage"] == 0]
    held = max(r.get("replay_held_peak", 0) for r in s0)
    rec = result["recoveries"][0] if result["recoveries"] else None
    out = {"config": name, "wall_s": wall_s, "run_s": result["seconds"], "samples_per_s": rows / result["seconds"],
           "stage0_wait_downstream_s": sum(r["wait_downstream_s"] for r in wins0),
           "stage0_held_peak": held, "stage0_held_peak_bytes": int(held * state_bytes),
           "stage0_held_peak_tinyllama_mib": held * TINYLLAMA_STATE_BYTES / MiB,
           "stage0_rss_peak_bytes": max((r.get("rss_peak_bytes") or 0) for r in s0),
           "recovery_s": (rec["caught_up"] - rec["detected"]) if rec and rec["caught_up"] else None,
           "windows_committed": len({(r["stage"], r["window"]) for r in records if r["type"] == "CHECKPOINT_COMMITTED"})}
    if base_lora is not None:
        out["lora_max_diff"] = max(float(np.abs(result["lora"][n] - base_lora[n]).max()) for n in base_lora)
    return out


def main(argv=None) -> int:
    from host.run.settings import RunSettings

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default="/tmp/zl-bench-backpressure")
    ap.add_argument("--windows", type=int, default=20)
    ap.add_argument("--window-size", type=int, default=2)
    ap.add_argument("--slow-s", type=float, default=0.05, help="extra seconds per phase 1 on phone 1")
    ap.add_argument("--fail-window", type=int, default=10)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "backpressure.json"))
    ap.add_argument("--no-md", action="store_true", help="do not rewrite the section in docs/BENCHMARKS.md")
    a = ap.parse_args(argv)

    work = Path(a.work)
    results = []
    t_start = time.time()
    for n, chunks in ((2, "0-0,1-2"), (3, "0-0,1-1,2-2")):
        export = make_export(work / f"export{n}" / "out", chunks)
        mbs = bench_micro_batches(export, 8, micro_batch=2, seq_len=16)
        rows = a.windows * a.window_size * 2
        slow = {"stage": 1, "point": "slow-phase1", "seconds": a.slow_s}
        fail = {"stage": 0, "window": a.fail_window, "point": "before-commit"}
        base_lora = None
        for horizon in (None, UNBOUNDED):
            for failure in (False, True):
                label = f"{n} stages, {'bounded (default horizon)' if horizon is None else 'unbounded'}, " \
                        f"{'stage 0 fails' if failure else 'no failure'}"
                settings = RunSettings(windows=a.windows, window_size=a.window_size, lr=2e-2, inflight_depth=2,
                                       replay_horizon=horizon, inject_failure=[slow, *([fail] if failure else [])])
                root = work / f"run-{n}-{horizon or 'default'}-{int(failure)}"
                t0 = time.time()
                result, records = run_on_phones(export, root, settings, mbs, n, prefix="bp", max_seconds=600)
                row = summarize(label, result, records, time.time() - t0, rows, base_lora)
                row.update(stages=n, horizon=settings.checked_horizon(n), bounded=horizon is None, failure=failure)
                if base_lora is None:
                    base_lora = result["lora"]
                results.append(row)
                print(json.dumps(row), flush=True)
    doc = {"benchmark": "backpressure", "when": now_iso(), "machine": {**machine(), "shared": True},
           "settings": {"windows": a.windows, "window_size": a.window_size, "inflight_depth": 2, "slow_phone": 1,
                        "slow_s": a.slow_s, "fail": f"stage 0, window {a.fail_window}, before-commit",
                        "model": "tests' small Llama, 3 layers, portable backend, seq 16, micro-batch 2"},
           "total_s": time.time() - t_start, "results": results}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=2))
    if not a.no_md:
        write_md(doc)
    return 0


def write_md(doc: dict) -> None:
    rows = ["| stages | replay buffer | failure | samples/s | stage 0 waits for downstream, s | stage 0 peak held "
            "(hidden states) | same at TinyLlama size, MiB | stage 0 peak RSS, MiB | recovery, s | LoRA diff |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["results"]:
        rec = "-" if r["recovery_s"] is None else f"{r['recovery_s']:.1f}"
        rows.append(f"| {r['stages']} | {'bounded, ' + str(r['horizon']) if r['bounded'] else 'unbounded'} | "
                    f"{'stage 0' if r['failure'] else '-'} | {r['samples_per_s']:.1f} | "
                    f"{r['stage0_wait_downstream_s']:.1f} | {r['stage0_held_peak']} | "
                    f"{r['stage0_held_peak_tinyllama_mib']:.0f} | {r['stage0_rss_peak_bytes'] / MiB:.0f} | "
                    f"{rec} | "
                    f"{'ref' if 'lora_max_diff' not in r else format(r['lora_max_diff'], '.0g')} |")
    s = doc["settings"]
    m = doc["machine"]
    body = f"""`bench/backpressure.py`, {doc['when']}, on a **shared** machine ({m['cpu']}, {m['cores']} cores, with other
engineers' jobs running: the load average was far above the core count, so absolute times are noisy; the
comparison is within one script run). {s['model']}; {s['windows']} windows of {s['window_size']}, in-flight
depth {s['inflight_depth']}; phone {s['slow_phone']} is slowed by {s['slow_s']} s per phase 1 so stage 0 is the faster
upstream; the failure kills {s['fail']}. "Bounded" is the default replay horizon (2W + depth): stage 0 waits
before its next forward while it holds that many uncommitted hidden states. "Unbounded" is a horizon no run
reaches: stage 0 never waits and keeps every hidden state stage 1 has not committed. Total {doc['total_s']:.0f} s.

{chr(10).join(rows)}

Raw: `bench/results/backpressure.json`."""
    # the hand-written reading of the figures (### Reading) is kept when the table is rewritten
    replace_md_section(REPO / "docs" / "BENCHMARKS.md", "## Backpressure: bounded replay buffer vs unbounded", body,
                       "Benchmarks", keep_from="### Reading")


if __name__ == "__main__":
    sys.exit(main())

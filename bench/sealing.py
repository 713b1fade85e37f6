"""What sealed sessions cost (issue 54, PROTOCOL.md 6.1): the same export, data, settings and
pipeline, sealed and unsealed (the benchmark-only switch ZL_BENCHMARK_ONLY_UNSEALED=1, inherited by
the phones), interleaved for --rounds rounds; per mode the pipeline's samples/s (windows after the
first) and the median step time per stage (phase1 + phase2 of a micro-batch). Target: sealed
within 2% of unsealed throughput.

On a shared machine two runs differ by more than sealing does, so the record layer's own cost is also
measured directly: the CPU time of the phones' own AES-256-GCM (the real Seal on OpenSSL for Python
phones; javax.crypto on this JDK for Kotlin phones, bench/jvm/GcmCost.java) to seal and open
every byte a stage moves per micro-batch (its telemetry's bytes in + out), against the pipeline's time
per micro-batch. Each stage does that work beside its compute, so the largest share bounds what
sealing can take from throughput.

Usage:
  python bench/sealing.py [--program EXPORT | (default) the tests' tiny model, exported here]
        [--runtime python|kotlin] [--windows 4] [--window 2] [--rounds 3] [--out bench/results/sealing.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import bench.common  # noqa: E402,F401  (quiet libraries, SIGTERM unwinds)
from zl_mobile.protocol.seal import BENCH_ENV  # noqa: E402


def tiny_export(work: Path) -> Path:
    """The tests' small Llama (tests/conftest.py), three chunks, portable backend."""
    from exporter.export import export_model
    from tests.conftest import SMALL_CHUNKS, small_export_config, write_small_model_dir

    out = work / "tiny_export"
    if not (out / "manifest.json").exists():
        model = write_small_model_dir(work / "tiny_model")
        export_model(str(model), SMALL_CHUNKS, out, small_export_config(), modes=("zerolock",))
    return out


FRAMES_PER_MICRO_BATCH = 8


def seal_open_seconds_per_byte(frame_bytes: int, min_seconds: float = 0.3) -> float:
    """CPU seconds to seal and then open one byte, in frames of `frame_bytes` (the real Seal)."""
    from zl_mobile.protocol.seal import Seal

    key_a, key_b = os.urandom(32), os.urandom(32)
    tx, rx = Seal(key_a, key_b), Seal(key_b, key_a)
    header, body = os.urandom(16), os.urandom(max(frame_bytes, 1))
    n, t0 = 0, time.process_time()
    while time.process_time() - t0 < min_seconds:
        rx.open(header, tx.seal(header, body), "bench")
        n += 1
    return (time.process_time() - t0) / (n * len(body))


def jdk_seal_open_seconds_per_byte(frame_bytes: int) -> float:
    """The same on the JDK the Kotlin phones run on (javax.crypto AES/GCM, bench/jvm/GcmCost.java)."""
    import subprocess

    src = Path(__file__).resolve().parent / "jvm" / "GcmCost.java"
    out = subprocess.run(["java", str(src), str(frame_bytes)], capture_output=True, text=True, check=True)
    return float(out.stdout.split()[-1])


def record_layer_share(runs: dict, tp_unsealed: float, micro: int, n: int, runtime: str = "python") -> dict:
    """Per stage: seal + open CPU seconds per micro-batch (the phones' own AEAD: OpenSSL for Python,
    javax.crypto for Kotlin), and its share of the pipeline's time per micro-batch (micro / unsealed
    samples/s)."""
    per_byte = jdk_seal_open_seconds_per_byte if runtime == "kotlin" else seal_open_seconds_per_byte
    per_mb_s = micro / tp_unsealed if tp_unsealed else None
    out = {}
    for k in range(n):
        moved = statistics.median(r["stages"][k]["link_bytes_per_micro_batch"] for r in runs["sealed"])
        # the bytes as two frames (h in, h out: the JDK's cost per byte grows with the frame, ~45x
        # above ~256 KiB on JDK 17, so one frame of both would overstate it), plus a small frame's
        # fixed cost for each of FRAMES_PER_MICRO_BATCH (CREDITs, TELEMETRY, ACKs: fewer on every stage)
        cpu = moved * per_byte(int(moved / 2)) + FRAMES_PER_MICRO_BATCH * 64 * per_byte(64)
        out[k] = {"bytes_per_micro_batch": moved, "seal_open_s": cpu, "share": cpu / per_mb_s if per_mb_s else None}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--program", type=Path, default=None, help="a zl-export output dir (default: the tiny model)")
    ap.add_argument("--runtime", choices=("python", "kotlin"), default="python")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--window", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("bench/results/sealing.json"))
    ap.add_argument("--work", type=Path, default=Path("/tmp/zl-bench-sealing"))
    ap.add_argument("--bound-only", action="store_true",
                    help="no runs: recompute the record layer's bound in --out from the runs it holds")
    a = ap.parse_args(argv)
    if a.bound_only:
        summary = json.loads(a.out.read_text())
        runs = {m: [{**r, "stages": {int(k): v for k, v in r["stages"].items()}} for r in summary["runs"][m]]
                for m in summary["runs"]}
        layer = record_layer_share(runs, summary["samples_per_s"]["unsealed"], summary["micro_batch"],
                                   summary["stages"], summary["runtime"])
        summary.update(record_layer=layer, record_layer_bound=max((v["share"] or 0) for v in layer.values()))
        a.out.write_text(json.dumps(summary, indent=1) + "\n")
        print(f"the record layer's bound on the throughput cost: {summary['record_layer_bound'] * 100:.3f}% ({a.out})")
        return 0

    from transformers import AutoTokenizer

    from bench.kotlin_phone import one_run
    from zl_common.data import encode_examples, load_examples, make_microbatches

    program = a.program or tiny_export(a.work)
    manifest = json.loads((program / "manifest.json").read_text())
    n, ex = len(manifest["chunks"]), manifest["export"]
    tok = AutoTokenizer.from_pretrained(program / "tokenizer")
    mbs = make_microbatches(encode_examples(load_examples(None), tok, ex["seq_len"]), ex["micro_batch"],
                            ex["seq_len"], tok.pad_token_id)[: a.windows * a.window]
    runs = {"sealed": [], "unsealed": []}
    for r in range(a.rounds):
        order = ("sealed", "unsealed") if r % 2 == 0 else ("unsealed", "sealed")  # neither always goes first
        for mode in order:
            if mode == "unsealed":
                os.environ[BENCH_ENV] = "1"
            else:
                os.environ.pop(BENCH_ENV, None)
            try:
                res = one_run(program, mbs, a.windows, a.window, a.runtime, n,
                              a.work / f"{mode}-{r}-{int(time.time())}", None)
            finally:
                os.environ.pop(BENCH_ENV, None)
            runs[mode].append(res)
            print(f"round {r} {mode}: {res['samples_per_s'] or 0:.3f} samples/s, steps "
                  + ", ".join(f"{s['step_s'] * 1e3:.1f}" for s in res["stages"].values()) + " ms", flush=True)
    tp = {m: statistics.median([x["samples_per_s"] for x in runs[m] if x["samples_per_s"]] or [0]) for m in runs}
    steps = {m: {k: statistics.median([x["stages"][k]["step_s"] for x in runs[m] if x["stages"][k]["step_s"]])
                 for k in range(n)} for m in runs}
    cost = 1 - tp["sealed"] / tp["unsealed"] if tp["unsealed"] else None
    layer = record_layer_share(runs, tp["unsealed"], ex["micro_batch"], n, a.runtime)
    bound = max((v["share"] or 0) for v in layer.values())
    summary = {"program": str(program), "runtime": a.runtime, "stages": n, "micro_batch": ex["micro_batch"],
               "seq_len": ex["seq_len"], "rounds": a.rounds, "windows": a.windows, "window": a.window,
               "samples_per_s": tp, "step_s": steps, "throughput_cost": cost,
               "record_layer": layer, "record_layer_bound": bound, "runs": runs}
    print(f"samples/s: sealed {tp['sealed']:.3f}, unsealed {tp['unsealed']:.3f}; cost {cost * 100:+.2f}% (target <= 2%)")
    for k, v in layer.items():
        print(f"stage {k}: record layer {v['bytes_per_micro_batch'] / 1024:.0f} KiB per micro-batch, seal + open "
              f"{v['seal_open_s'] * 1e3:.3f} ms CPU = {v['share'] * 100:.3f}% of the pipeline's time per micro-batch")
    print(f"the record layer's bound on the throughput cost: {bound * 100:.3f}% (target <= 2%)")
    for k in range(n):
        print(f"stage {k}: step sealed {steps['sealed'][k] * 1e3:.1f} ms, unsealed {steps['unsealed'][k] * 1e3:.1f} ms")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Kotlin phone vs Python phone on the same chunks (issue 30): the same export, data, settings and
pipeline, once with every phone running zl-phone (Python, ExecuTorch's pybindings) and once with
every phone running the Kotlin core on the JVM (ExecuTorch's C++ runtime through kotlin_app/jni),
interleaved for --rounds rounds.

Per stage and runtime: the step time (median and minimum of phase1 + phase2 of a micro-batch, the
first window left out: loading and first touches; the minimum is what a loaded machine disturbs
least), peak PSS (each phone process's /proc/PID/smaps_rollup, sampled from this process every
50 ms: not the telemetry's `rss_peak_bytes`, since RSS counts the .ptd's pages once per mapping and
ExecuTorch maps each method's weights on its own, 1.2 GiB twice over at TinyLlama shape), peak RSS
as the phone reports it, the runtime's own PSS before the program loaded (`pss_runtime_bytes`: the
JVM, or the interpreter with torch imported) and the peak PSS over that floor (the program's
weights, arenas and activations: the figure that carries over to a phone), and the pipeline's
throughput (samples/s over the windows after the first).

Usage:
  python bench/kotlin_phone.py --program EXPORT [--data FILE.jsonl] [--windows 4] [--window 2]
        [--rounds 2] [--cpu-share F] [--mem-limit SIZE] [--out bench/results/kotlin_phone.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import bench.common  # noqa: E402,F401  (quiet libraries, SIGTERM unwinds)

MiB = 1 << 20


def one_run(program: Path, mbs, windows: int, window: int, runtime: str, n: int, root: Path, shares,
            mem_limit: str | None = None) -> dict:
    from host.phones.emulate import start_phones
    from host.run.coordinator import Coordinator
    from host.run.settings import RunSettings
    from zl_mobile.telemetry import read_pss_bytes

    phones = start_phones(n, root / "phones", prefix=f"{runtime[0]}", runtimes=[runtime] * n, cpu_shares=shares,
                          extra_args=["--mem-limit", mem_limit] if mem_limit else None)
    peak_pss, done = {p.name: 0 for p in phones}, threading.Event()

    def sample():  # from outside: a thread in a Python phone would wait for ExecuTorch's calls
        while not done.wait(0.05):
            for p in phones:
                peak_pss[p.name] = max(peak_pss[p.name], read_pss_bytes(p.pid) or 0)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        settings = RunSettings(windows=windows, window_size=window, lr=2e-3, inflight_depth=2)
        settings.max_seconds = 1800
        Coordinator(program, [p.handle() for p in phones], mbs, settings, root / "run", run_id="bench").run()
    finally:
        done.set()
        sampler.join()
        for p in phones:
            p.stop()
    records = [json.loads(x) for x in (root / "run" / "metrics.jsonl").read_text().splitlines()]
    tel = [r for r in records if r["type"] == "TELEMETRY"]
    mb = [r for r in tel if r.get("kind", "micro_batch") == "micro_batch"]
    win = [r for r in tel if r.get("kind") == "window"]
    out = {"stages": {}}
    for k in range(n):
        mine = [r for r in mb if r["stage"] == k]
        steady = [r for r in mine if r["window"] >= 1] or mine
        steps = [(r["phase1_end"] - r["phase1_start"]) + (r["phase2_end"] - r["phase2_start"])
                 for r in steady if "phase2_end" in r]
        peak_rss = max(r.get("rss_peak_bytes") or 0 for r in mine)
        floor = [r["pss_runtime_bytes"] for r in win if r["stage"] == k and r.get("pss_runtime_bytes")]
        peak = peak_pss[mine[0]["device"]]
        out["stages"][k] = {"step_s": statistics.median(steps) if steps else None, "step_min_s": min(steps) if steps else None,
                            "peak_pss_mib": peak / MiB, "peak_rss_mib": peak_rss / MiB,
                            "runtime_pss_mib": floor[0] / MiB if floor else None,
                            "over_floor_mib": (peak - floor[0]) / MiB if floor else None,
                            # what the stage moved on its links (in + out, framed), per micro-batch
                            "link_bytes_per_micro_batch": max((r.get("bytes_in") or 0) + (r.get("bytes_out") or 0)
                                                              for r in mine) / len(mine)}
    # the first window's losses come before any update: the same numbers on both runtimes (parity)
    out["first_window_losses"] = {k: [r["loss"] for r in sorted((r for r in mb if r["stage"] == k and r["window"] == 0),
                                                                 key=lambda r: r["micro_batch"])] for k in range(n)}
    last = [r for r in mb if r["stage"] == n - 1]
    t0 = min(r["phase1_start"] for r in last if r["window"] == 1) if any(r["window"] == 1 for r in last) else None
    t1 = max(r.get("phase2_end", r["phase1_end"]) for r in last)
    done = sum(1 for r in last if r["window"] >= 1)
    micro = len(mbs[0]["input_ids"]) if mbs and "input_ids" in mbs[0] else 1
    out["samples_per_s"] = done * micro / (t1 - t0) if t0 is not None and t1 > t0 else None
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--program", required=True, type=Path, help="a zl-export output dir")
    ap.add_argument("--data", default=None, help="JSONL prompt/completion (default: the synthetic set)")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--window", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cpu-share", type=float, default=None, help="hold every phone to this share of one core")
    ap.add_argument("--mem-limit", default=None, help="every phone's memory limit (zl-phone --mem-limit), e.g. 1.25G")
    ap.add_argument("--out", type=Path, default=Path("bench/results/kotlin_phone.json"))
    ap.add_argument("--work", type=Path, default=Path("/tmp/zl-bench-kotlin"))
    a = ap.parse_args(argv)

    from transformers import AutoTokenizer

    from host.phones.kotlin_phone import classpath
    from zl_common.data import encode_examples, load_examples, make_microbatches

    classpath()
    manifest = json.loads((a.program / "manifest.json").read_text())
    n = len(manifest["chunks"])
    ex = manifest["export"]
    tok = AutoTokenizer.from_pretrained(a.program / "tokenizer")
    examples = load_examples(a.data)
    mbs = make_microbatches(encode_examples(examples, tok, ex["seq_len"]), ex["micro_batch"], ex["seq_len"],
                            tok.pad_token_id)[: a.windows * a.window]
    shares = [a.cpu_share] * n if a.cpu_share else None
    runs = {"python": [], "kotlin": []}
    for r in range(a.rounds):
        for runtime in ("python", "kotlin"):
            t = time.time()
            res = one_run(a.program, mbs, a.windows, a.window, runtime, n, a.work / f"{runtime}-{r}-{int(t)}", shares,
                          a.mem_limit)
            runs[runtime].append(res)
            print(f"round {r} {runtime}: " + ", ".join(
                f"stage {k} step {s['step_s'] * 1e3:.1f} ms peak {s['peak_pss_mib']:.0f} MiB"
                f" (floor {s['runtime_pss_mib'] or 0:.0f})" for k, s in res["stages"].items())
                + f", {res['samples_per_s'] or 0:.2f} samples/s", flush=True)

    def med(rt, k, key):
        vals = [x["stages"][k][key] for x in runs[rt] if x["stages"][k][key] is not None]
        return statistics.median(vals) if vals else None

    summary = {"program": str(a.program), "stages": n, "micro_batch": ex["micro_batch"], "seq_len": ex["seq_len"],
               "rounds": a.rounds, "cpu_share": a.cpu_share, "mem_limit": a.mem_limit, "per_stage": {}, "runs": runs}
    print(f"\n{'stage':>5} {'step py ms':>10} {'step kt ms':>10} {'ratio':>6} {'min ratio':>9} {'peak py':>8} {'peak kt':>8} "
          f"{'floor py':>8} {'floor kt':>8} {'over py':>8} {'over kt':>8} {'ratio':>6}")
    for k in range(n):
        row = {f"{key}_{rt}": med(rt, k, key) for rt in runs
               for key in ("step_s", "step_min_s", "peak_pss_mib", "peak_rss_mib", "runtime_pss_mib", "over_floor_mib")}
        row["step_ratio"] = row["step_s_kotlin"] / row["step_s_python"]
        row["step_min_ratio"] = row["step_min_s_kotlin"] / row["step_min_s_python"]
        row["over_floor_ratio"] = (row["over_floor_mib_kotlin"] / row["over_floor_mib_python"]
                                   if row["over_floor_mib_kotlin"] and row["over_floor_mib_python"] else None)
        summary["per_stage"][k] = row
        print(f"{k:>5} {row['step_s_python'] * 1e3:>10.1f} {row['step_s_kotlin'] * 1e3:>10.1f} "
              f"{row['step_ratio']:>6.2f} {row['step_min_ratio']:>9.2f} "
              f"{row['peak_pss_mib_python']:>8.0f} {row['peak_pss_mib_kotlin']:>8.0f} {row['runtime_pss_mib_python'] or 0:>8.0f} "
              f"{row['runtime_pss_mib_kotlin'] or 0:>8.0f} {row['over_floor_mib_python'] or 0:>8.0f} "
              f"{row['over_floor_mib_kotlin'] or 0:>8.0f} {row['over_floor_ratio'] or 0:>6.2f}")
    tp = {rt: statistics.median([x["samples_per_s"] for x in runs[rt] if x["samples_per_s"]] or [0]) for rt in runs}
    summary["samples_per_s"] = tp
    print(f"pipeline throughput: python {tp['python']:.2f} samples/s, kotlin {tp['kotlin']:.2f} samples/s "
          f"({tp['kotlin'] / tp['python'] if tp['python'] else 0:.2f}x)")
    first = {rt: runs[rt][0]["first_window_losses"] for rt in runs}
    rel = max(abs(x - y) / max(abs(y), 1e-12) for k in range(n)
              for x, y in zip(first["kotlin"][k], first["python"][k], strict=True))
    summary["first_window_losses"], summary["first_window_max_rel_diff"] = first, rel
    print("first window's losses per stage (python | kotlin): " + "; ".join(
        f"stage {k} " + " ".join(f"{x:.6f}" for x in first["python"][k])
        + " | " + " ".join(f"{x:.6f}" for x in first["kotlin"][k])
        for k in range(n)) + f"; largest relative difference {rel:.1e}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(summary, indent=1))
    print(f"written {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

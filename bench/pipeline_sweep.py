"""b/m sweep: ZeroLock vs GPipe, 1F1B and PipeDream over micro-batch size and micro-batches per
step, and the largest b each method fits under a memory cap (issue 7).

b = samples per optimizer step = micro-batch size x m (micro-batches per step, the window). The
micro-batch size is fixed when a program is exported, so each size gets its own export of the
pipeline benchmark's model (bench/recovery.py: make_export, ZeroLock + BP programs; cached in
--export-root). Every (micro-batch, m, method) runs once on the same emulated phones, runtime and
links as bench/pipeline.py (its run_once/analyse), one phone pinned per core, or at 3 and 4 stages
every phone held to its CPU share (--cpu-share, as bench/pipeline.py).

Per configuration: peak PSS (max over stages), activation memory, throughput, and ZeroLock's
ratios to each baseline. "Fits under the cap" = the configuration's peak PSS (max over stages)
<= --mem-cap; the largest b that fits is the largest measured b among those (measured, not
extrapolated).

  python bench/pipeline_sweep.py                                  # micro-batch 1,2,4 x m 2,4,8
  python bench/pipeline_sweep.py --micro-batches 2 --window-sizes 4,8 --mem-cap 380
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, MiB, bench_micro_batches, cpu_shares, machine, now_iso  # noqa: E402
from pipeline import analyse, chunk_spec, run_once, save_figure  # noqa: E402

METHODS = ("zerolock", "gpipe", "1f1b", "pipedream")


def export_for(root: Path, micro_batch: int, stages: int) -> Path:
    """The benchmark export with this micro-batch size (made once, then reused)."""
    from recovery import make_export

    out = root / f"mb{micro_batch}_{stages}st"
    if not (out / "manifest.json").exists():
        spec, layers = chunk_spec(stages)
        make_export(out, spec, micro_batch=micro_batch, modes=("zerolock", "bp"), eager_weights=False,
                    num_layers=layers)
    return out


def largest_fit(rows: list[dict], cap_bytes: float) -> dict:
    """method -> the largest measured b whose peak PSS (max over stages) is within the cap."""
    out = {}
    for m in METHODS:
        fits = [r["b"] for r in rows if r["method"] == m and r["pss_peak_max"] <= cap_bytes]
        out[m] = max(fits) if fits else None
    return out


def plot(rows: list[dict], cap_bytes: float, path: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    for m in METHODS:
        pts = sorted((r["b"], r["micro_batch"], r) for r in rows if r["method"] == m)
        if not pts:
            continue
        bs = [f"{b} ({mb}x{r['m']})" for b, mb, r in pts]
        ax1.plot(bs, [r["pss_peak_max"] / MiB for *_, r in pts], marker="o", label=m)
        ax2.plot(bs, [r["throughput_sps"] or 0 for *_, r in pts], marker="o", label=m)
    ax1.axhline(cap_bytes / MiB, color="red", linestyle=":", label="memory cap")
    ax1.set(title="peak PSS (max over stages)", xlabel="b (micro-batch x m)", ylabel="MiB")
    ax2.set(title="throughput", xlabel="b (micro-batch x m)", ylabel="samples/s")
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", rotation=45)
        ax.legend(fontsize=8)
    return save_figure(fig, path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--export-root", type=Path, default=Path("/tmp/zl-bench-sweep"),
                    help="where the per-micro-batch exports are made and reused")
    ap.add_argument("--micro-batches", default="1,2,4", help="micro-batch sizes (one export each)")
    ap.add_argument("--window-sizes", default="2,4,8", help="m values: micro-batches per optimizer step")
    ap.add_argument("--windows", type=int, default=3, help="windows per run (throughput: all after the first)")
    ap.add_argument("--stages", type=int, choices=[2, 3, 4], default=2)
    ap.add_argument("--cpu-share", default="auto",
                    help="as bench/pipeline.py: every phone held to a share of one core (F, F1,..., none, or auto: "
                         "1.8 / stages at 3 and 4 stages, none at 2)")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--mem-cap", type=float, default=360.0, help="memory cap per stage, MiB of peak PSS")
    ap.add_argument("--max-seconds", type=float, default=240.0)
    ap.add_argument("--work", type=Path, default=Path("/tmp/zl-bench-sweep-runs"))
    ap.add_argument("--out", type=Path, default=REPO / "bench/results/pipeline_sweep.json")
    a = ap.parse_args(argv)
    if a.windows < 2:
        ap.error("--windows must be at least 2: throughput is measured over the windows after the first")

    from exporter.manifest import load_manifest
    from host.run.settings import RunSettings

    methods = a.methods.split(",")
    unknown = set(methods) - set(METHODS)
    if unknown:
        ap.error(f"unknown method(s) {sorted(unknown)}: use {', '.join(METHODS)}")
    try:
        shares = cpu_shares(a.cpu_share, a.stages)
    except ValueError as e:
        ap.error(str(e))
    rows = []
    t0 = time.time()
    for mb in (int(x) for x in a.micro_batches.split(",")):
        export = export_for(a.export_root, mb, a.stages)
        man = load_manifest(export)
        chunks, seq = man["chunks"], man["export"]["seq_len"]
        for m in (int(x) for x in a.window_sizes.split(",")):
            mbs = bench_micro_batches(export, a.windows * m, mb, seq)
            for method in methods:
                settings = RunSettings(windows=a.windows, window_size=m, inflight_depth=max(4, a.stages),
                                       lr=2e-3, schedule=method)
                try:
                    res, recs = run_once(export, a.work / f"{time.time_ns()}-{method}", settings, mbs, len(chunks),
                                         None, watchdog_s=a.max_seconds, shares=shares)
                except Exception as e:
                    print(f"[{method} micro-batch {mb} m={m}] FAILED: {e}", flush=True)
                    continue
                s = analyse(res, recs, chunks, method, m, mb, a.windows)
                s.update(method=method, micro_batch=mb, m=m, b=mb * m)
                rows.append(s)
                print(f"{time.time() - t0:7.1f}s [{method} b={mb * m} = {mb} x {m}] peak PSS max "
                      f"{s['pss_peak_max'] / MiB:.0f} MiB, activations max {s['act_max'] / MiB:.1f} MiB, "
                      f"{s['throughput_sps']:.2f} samples/s", flush=True)
    if not rows:
        print("no run finished: see the FAILED lines above")
        return 1

    print("\n| b (micro-batch x m) | method | peak PSS max | activations max | samples/s | "
          "ZeroLock / it: PSS max, PSS mean, PSS less the runtime mean, throughput |")
    print("|---|---|---|---|---|---|")
    ratios = []
    for mb, m in sorted({(r["micro_batch"], r["m"]) for r in rows}, key=lambda x: (x[0] * x[1], x[0])):
        cfg = [r for r in rows if (r["micro_batch"], r["m"]) == (mb, m)]
        z = next((r for r in cfg if r["method"] == "zerolock"), None)
        for r in cfg:
            rat = ""
            if z and r["method"] != "zerolock":
                q = {"b": mb * m, "micro_batch": mb, "m": m, "vs": r["method"],
                     "pss_peak_max": z["pss_peak_max"] / r["pss_peak_max"],
                     "pss_peak_mean": z["pss_peak_mean"] / r["pss_peak_mean"],
                     "train_peak_mean": (z["train_peak_mean"] / r["train_peak_mean"]
                                         if z.get("train_peak_mean") and r.get("train_peak_mean") else None),
                     "throughput": (z["throughput_sps"] / r["throughput_sps"]) if r["throughput_sps"] else None}
                ratios.append(q)
                rat = (f"{q['pss_peak_max']:.2f}, {q['pss_peak_mean']:.2f}, "
                       + (f"{q['train_peak_mean']:.2f}, " if q["train_peak_mean"] else "-, ")
                       + (f"{q['throughput']:.2f}" if q["throughput"] else "-"))
            print(f"| {mb * m} ({mb} x {m}) | {r['method']} | {r['pss_peak_max'] / MiB:.0f} MiB | "
                  f"{r['act_max'] / MiB:.1f} MiB | {r['throughput_sps']:.2f} | {rat} |")
    cap = a.mem_cap * MiB
    fit = largest_fit(rows, cap)
    print(f"\nlargest b whose peak PSS (max over stages) stays within {a.mem_cap:.0f} MiB (measured b values only):")
    for m in methods:
        print(f"  {m}: {fit[m] if fit[m] is not None else 'none of those measured'}")

    a.out.parent.mkdir(parents=True, exist_ok=True)
    pic = plot(rows, cap, a.out.with_suffix(".png"))
    a.out.write_text(json.dumps({"date": now_iso(), "machine": machine(), "stages": a.stages, "windows": a.windows,
                                 "cpu_shares": shares, "mem_cap_mib": a.mem_cap, "largest_b_within_cap": fit, "rows": rows,
                                 "ratios_zerolock_over_baseline": ratios, "plot": pic}, indent=1, default=str))
    print(f"wrote {a.out} and {pic}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

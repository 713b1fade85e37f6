"""fp32 against int8 and / or int4 base weights on one chunk, side by side (not a test).

Exports of the same model and chunks with --base-weights fp32, int8, int4. For each,
a fresh process loads chunk K's ZeroLock program (ExecuTorch, XNNPACK) and runs phase 1 + phase 2
on the same micro-batches; the parent samples its PSS from outside (bench.common.run_sampled).
Runs alternate fp32 / int8 / int4 `--reps` times, so machine drift hits both alike. Prints, in one run:
step time (median over steps after the first), peak PSS, the PSS of the mapped weights (.ptd),
and the ratios to fp32; the local loss of each export on the same batch (how far the quantized
base moves it). Results: bench/results/base_weights.json; docs/BENCHMARKS.md, "Base weights".

  python bench/base_weights.py --fp32 /tmp/tl_export --int8 /tmp/tl_export_int8 --int4 /tmp/tl_export_int4 --chunk 1"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import REPO, machine, mib, now_iso, run_sampled  # noqa: E402

RESULTS = REPO / "bench" / "results"


def worker(export: Path, chunk: int, steps: int, out: Path) -> None:
    """Run `steps` phase 1 + phase 2 of one chunk and write the timings and losses to `out`."""
    from bench.export_tinyllama import _batch  # the sample micro-batch that bench times its steps on
    from exporter.manifest import load_manifest
    from exporter.verify import sample_lora
    from zl_common.program import ChunkProgram
    from zl_mobile.telemetry import read_pss_by_backing

    manifest = load_manifest(export, check_files=False)
    entry = manifest["chunks"][chunk]
    prog = ChunkProgram(export, entry)
    _, batch = _batch(manifest, entry)
    lora = sample_lora(entry, seed=0)
    times, losses = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        _, saved = prog.phase1(lora, batch)
        res = prog.phase2(lora, saved, batch)
        times.append(time.perf_counter() - t0)
        losses.append(res.loss)
    # int8: XNNPACK packs the quantized GEMMs' weights at load, out of the .pte, into its heap
    # (anonymous); so the split, not only the .ptd, says where the weights live
    pss = read_pss_by_backing()
    out.write_text(json.dumps({"step_s": times, "loss": losses, "weights_pss": pss["weights"], "pss_by_backing": pss}))


def profile(export: Path, chunk: int, out: Path) -> None:
    """One warm step with ETDump on: ms per operator and method (XNNPACK delegate calls vs
    portable kernels), written to `out` as JSON."""
    from executorch.devtools import Inspector

    from bench.export_tinyllama import _batch
    from exporter.manifest import load_manifest
    from exporter.verify import sample_lora
    from zl_common.program import ChunkProgram

    manifest = load_manifest(export, check_files=False)
    entry = manifest["chunks"][chunk]
    prog = ChunkProgram(export, entry, in_place=True, etdump=True)
    _, batch = _batch(manifest, entry)
    lora = sample_lora(entry, seed=0)
    for _ in range(2):  # the first step packs XNNPACK's weights; the second is the one reported
        _, saved = prog.phase1(lora, batch)
        prog.phase2(lora, saved, batch)
    etdump = out.with_suffix(".etdump")
    prog.write_etdump(etdump)
    rows = {}
    execs = [b for b in Inspector(etdump_path=str(etdump)).event_blocks if b.name == "Execute"]
    for method, block in zip(("phase1", "phase2"), execs):
        for ev in block.events:
            if ev.perf_data and ev.perf_data.raw and ev.name not in ("OPERATOR_CALL", "DELEGATE_CALL"):
                key = f"{method} {ev.name}"
                calls, ms = rows.get(key, (0, 0.0))
                rows[key] = (calls + 1, ms + ev.perf_data.raw[-1])
    out.write_text(json.dumps(sorted(([k, c, ms] for k, (c, ms) in rows.items()), key=lambda r: -r[2])))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fp32", type=Path, required=True, help="export with --base-weights fp32")
    ap.add_argument("--int8", type=Path, help="the same export with --base-weights int8")
    ap.add_argument("--int4", type=Path, help="the same export with --base-weights int4")
    ap.add_argument("--chunk", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4, help="steps per process (the first is not timed)")
    ap.add_argument("--reps", type=int, default=2, help="fresh processes per variant, alternated")
    ap.add_argument("--out", type=Path, default=RESULTS / "base_weights.json")
    ap.add_argument("--profile", action="store_true", help="also one ETDump-profiled step per variant (ms per operator)")
    ap.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    ap.add_argument("--profile-worker", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.profile_worker:
        export, chunk, out = a.profile_worker
        profile(Path(export), int(chunk), Path(out))
        return 0
    if a.worker:
        export, chunk, steps, out = a.worker
        worker(Path(export), int(chunk), int(steps), Path(out))
        return 0
    exports = {"fp32": a.fp32, **{v: e for v, e in (("int8", a.int8), ("int4", a.int4)) if e}}
    if len(exports) < 2:
        ap.error("give --int8 and/or --int4 to compare with --fp32")
    import tempfile

    runs = {v: [] for v in exports}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(a.reps):
            for variant, export in exports.items():
                res = Path(tmp) / f"{variant}_{rep}.json"
                cmd = [sys.executable, __file__, "--fp32", str(a.fp32),
                       "--worker", str(export), str(a.chunk), str(a.steps), str(res)]
                rc, err, samples = run_sampled(cmd, 0.01)
                if rc != 0:
                    print(f"{variant} worker failed ({rc}):\n{err}", file=sys.stderr)
                    return 1
                r = json.loads(res.read_text())
                r["peak_pss"] = max(p for _, p in samples)
                runs[variant].append(r)
                b = r["pss_by_backing"]
                print(f"rep {rep} {variant}: step {statistics.median(r['step_s'][1:]):.2f} s, "
                      f"peak PSS {mib(r['peak_pss'])}, weights PSS {mib(r['weights_pss'])} (.ptd; .pte "
                      f"{mib(b['program'])}, anonymous {mib(b['anonymous'])}), loss {r['loss'][-1]:.4f}",
                      flush=True)

        profiles = {}
        for variant, export in exports.items() if a.profile else ():
            res = Path(tmp) / f"{variant}_profile.json"
            cmd = [sys.executable, __file__, "--fp32", str(a.fp32), "--profile-worker", str(export), str(a.chunk), str(res)]
            rc, err, _ = run_sampled(cmd, 0.5)
            if rc != 0:
                print(f"{variant} profile failed ({rc}):\n{err}", file=sys.stderr)
                return 1
            profiles[variant] = json.loads(res.read_text())
            print(f"{variant}: ms per operator, one warm step (method, op, calls, ms):")
            for name, calls, ms in profiles[variant][:12]:
                print(f"  {name:60s} {calls:4d} {ms:9.1f}")

    def summary(v):
        rs = runs[v]
        return {"step_s": statistics.median(t for r in rs for t in r["step_s"][1:]),
                "peak_pss": statistics.median(r["peak_pss"] for r in rs),
                "weights_pss": statistics.median(r["weights_pss"] for r in rs),
                "program_pss": statistics.median(r["pss_by_backing"]["program"] for r in rs),
                "anonymous_pss": statistics.median(r["pss_by_backing"]["anonymous"] for r in rs),
                "loss": rs[0]["loss"][0]}

    s = {v: summary(v) for v in runs}
    ratios = {}
    for v in runs:
        if v == "fp32":
            continue
        r = ratios[v] = {k: s[v][k] / s["fp32"][k] for k in ("step_s", "peak_pss", "weights_pss")}
        # the weights wherever they live: .ptd + .pte + what the heap holds beyond fp32's (QD8: packed
        # weights; the shipped int8 / int4: the decoded weight and its decode steps in the arena)
        packed = max(0, s[v]["anonymous_pss"] - s["fp32"]["anonymous_pss"])
        r["all_weights_pss"] = ((s[v]["weights_pss"] + s[v]["program_pss"] + packed)
                                / (s["fp32"]["weights_pss"] + s["fp32"]["program_pss"]))
        print(f"chunk {a.chunk}: {v} / fp32  step time {r['step_s']:.2f}x  peak PSS {r['peak_pss']:.2f}x "
              f"({mib(s[v]['peak_pss'])} vs {mib(s['fp32']['peak_pss'])})  weights PSS {r['weights_pss']:.2f}x (.ptd), "
              f"{r['all_weights_pss']:.2f}x (.ptd + .pte + heap growth)  loss {s[v]['loss']:.4f} vs {s['fp32']['loss']:.4f}")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"when": now_iso(), "machine": machine(), "chunk": a.chunk, "steps": a.steps,
                                 "exports": {v: str(e) for v, e in exports.items()}, "summary": s,
                                 "ratios": ratios, "runs": runs, "profiles": profiles}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

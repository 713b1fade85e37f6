"""One stage's memory over time, at TinyLlama-1.1B shape (not a test).

A fresh process runs the real stage runtime (`zl_mobile.stage.Stage`: ExecuTorch program, inbound
link, AdamW, checkpoints) on one chunk, fed over loopback TCP by the same kind of link the host
uses. Micro-batches arrive with a pause between them, so the stage rests between steps. The
parent process samples the stage process's PSS (/proc/PID/smaps_rollup) every few milliseconds:
from outside, because ExecuTorch's Python binding holds the GIL while it computes, so a thread
inside the stage could not sample during a phase. It prints, in one run:

  * floor  = frozen weights (.ptd: the chunk's layers + the readout) + one micro-batch of saved
             activations (manifest) + h_k;
  * peak PSS (sampled) and peak RSS (VmHWM) against the floor;
  * the resting PSS between micro-batches, and the PSS read right after each phase 2
    (saved activations freed): after / rest should be close to 1.

Results: bench/results/stage_memory.json and .png; docs/BENCHMARKS.md, section "Stage memory".
The export is made by bench/export_tinyllama.py (reused from --export when present)."""
from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import REPO, machine, memory_snapshot, mib, now_iso, replace_md_section, run_sampled  # noqa: E402
from zl_mobile.telemetry import read_pss_by_backing  # noqa: E402

RESULTS = REPO / "bench" / "results"
DEFAULT_EXPORT = Path("/tmp/zl_bench_tinyllama/tinyllama_xnnpack_lp128")
TARGET = 1.25  # peak at most 1.25x the floor (same target as the export benchmark)


def feed_inputs(entry: dict, manifest: dict, n: int, seed: int = 0):
    """n micro-batches shaped like the chunk's phase-1 inputs: h_{k-1} (or token ids), every
    position a target."""
    import numpy as np

    rng = np.random.default_rng(seed)
    spec = {i["name"]: i for i in entry["methods"]["phase1"]["inputs"]}
    first = spec[entry["first_input"]]
    B, S = spec["attention_mask"]["shape"]
    vocab = manifest["model"]["config"]["vocab_size"]
    for _ in range(n):
        if first["dtype"] == "int64":
            h = rng.integers(0, vocab, size=first["shape"], dtype=np.int64)
        else:
            h = rng.standard_normal(first["shape"], dtype=np.float32)
        yield {"h": h, "attention_mask": np.ones((B, S), np.int64),
               "position_ids": np.tile(np.arange(S, dtype=np.int64), (B, 1)),
               "labels": rng.integers(0, vocab, size=(B, S), dtype=np.int64)}


def worker(export_dir: Path, chunk: int, micro_batches: int, window: int, gap_s: float, threads: int) -> dict:
    """The measuring process: a stage, a feeder link and a PSS sampler, nothing else."""
    from zl_mobile.backends import Backend

    Backend.from_args("executorch").set_threads(threads)  # torch's and ExecuTorch's threads, as a phone sets them
    from zl_mobile.links import OutboundLink
    from zl_mobile.protocol import Message, MsgType
    from zl_mobile.stage import Stage, StageConfig

    manifest = json.loads((export_dir / "manifest.json").read_text())
    entry = next(c for c in manifest["chunks"] if c["index"] == chunk)
    marks = {"after_import": memory_snapshot()}
    events: list[Message] = []
    done = threading.Condition()

    def to_host(msg: Message) -> None:
        with done:
            events.append(msg)
            done.notify_all()

    def count(kind: str) -> int:
        return sum(1 for m in events if m.type == MsgType.TELEMETRY and m.get("kind") == kind)

    token = secrets.token_hex(32)  # a link token, as the host would make one
    cfg = StageConfig(run_id="bench", stage=chunk, num_stages=len(manifest["chunks"]), upstream_token=token,
                      window_size=window, inflight_depth=1, total_micro_batches=micro_batches)
    with tempfile.TemporaryDirectory(prefix="zl-stage-mem-") as work:
        t_load = time.time()
        stage = Stage(export_dir, entry, manifest["export"], cfg, Path(work), to_host, bind="127.0.0.1")
        marks["after_load"] = memory_snapshot()
        marks["load_s"] = time.time() - t_load
        marks["t_loaded"] = time.time()
        time.sleep(gap_s)  # resting after load, before any input
        marks["rest_after_load"] = memory_snapshot()
        feed = OutboundLink("bench-feed", token, window_size=window, replay_horizon=10**9, prune_on_commit=False)
        feed.set_address(f"127.0.0.1:{stage.data_port}")
        fed_at = []
        for mb, t in enumerate(feed_inputs(entry, manifest, micro_batches)):
            fed_at.append(time.time())
            feed.publish(Message(MsgType.HIDDEN_STATE, {"micro_batch": mb, "window": mb // window}, t))
            ends_window = (mb + 1) % window == 0  # then also wait for the AdamW step and the checkpoint

            def finished(mb=mb, ends_window=ends_window) -> bool:
                return count("window") > mb // window if ends_window else count("micro_batch") > mb

            with done:  # one micro-batch at a time, then a pause, so the stage rests between steps
                if not done.wait_for(finished, timeout=600):
                    raise RuntimeError(f"stage {chunk} did not finish micro-batch {mb} within 600 s")
            time.sleep(gap_s)
        marks["end"] = memory_snapshot()
        marks["pss_by_mapping"] = pss_by_mapping()  # resting, after the last pause
        feed.close()
        stage.stop()
    tel = [dict(m.meta) for m in events if m.type == MsgType.TELEMETRY]
    errors = [m.meta for m in events if m.type == MsgType.ERROR]
    return {"marks": marks, "telemetry": tel, "errors": errors, "fed_at": fed_at}


def pss_by_mapping() -> dict:
    """This process's PSS by what backs it (zl_mobile.telemetry.read_pss_by_backing), named for the report."""
    names = {"weights": "weights (.ptd)", "program": "program (.pte)", "libraries": "libraries and other files",
             "anonymous": "anonymous (heap)"}
    return {names[k]: v for k, v in (read_pss_by_backing() or {}).items()}


def analyse(run: dict, manifest: dict, entry: dict, export_dir: Path) -> dict:
    tel = [t for t in run["telemetry"] if t.get("kind") == "micro_batch"]
    samples = run["samples"]
    h_bytes = 4 * entry["methods"]["phase1"]["outputs"][0]["shape"][0] * entry["methods"]["phase1"]["outputs"][0]["shape"][1] \
        * entry["methods"]["phase1"]["outputs"][0]["shape"][2]
    weights = (export_dir / entry["weights"]).stat().st_size
    floor = weights + entry["saved_activation_bytes"] + h_bytes
    # resting: samples in the pauses after each micro-batch's record (its step and checkpoint done),
    # before the next input was fed; the first micro-batch is left out (warm-up allocations)
    rest = []
    ends = [t["phase2_end"] for t in tel]
    for i, t_end in enumerate(ends[1:], start=1):
        nxt = run["fed_at"][i + 1] if i + 1 < len(run["fed_at"]) else float("inf")
        rest += [p for ts, p in samples if t_end + 0.3 < ts < nxt]
    rest_pss = statistics.median(rest) if rest else None
    peak_pss = max(p for _, p in samples)
    after = [t["pss_bytes"] for t in tel[1:]]
    in_step = [(t["phase1_start"], t["phase2_end"]) for t in tel]
    step_peaks = [max((p for ts, p in samples if a <= ts <= b), default=0) for a, b in in_step]
    return {
        "chunk": entry["index"], "layers": entry["layers"], "micro_batches": len(tel),
        "weights_bytes": weights, "saved_activation_bytes": entry["saved_activation_bytes"], "h_bytes": h_bytes,
        "floor_bytes": floor, "baseline_pss": run["marks"]["after_import"]["pss"],
        "pss_after_load": run["marks"]["after_load"]["pss"], "pss_rest_after_load": run["marks"]["rest_after_load"]["pss"],
        "pss_rest": rest_pss, "pss_peak": peak_pss, "rss_peak": run["marks"]["end"]["hwm"],
        "pss_after_phase2_median": statistics.median(after) if after else None,
        "step_peak_pss_median": statistics.median(step_peaks[1:]) if len(step_peaks) > 1 else None,
        "peak_over_floor": peak_pss / floor, "rss_peak_over_floor": run["marks"]["end"]["hwm"] / floor,
        "after_phase2_over_rest": (statistics.median(after) / rest_pss) if after and rest_pss else None,
        "rest_over_floor": rest_pss / floor if rest_pss else None,
        "peak_minus_rest": peak_pss - rest_pss if rest_pss else None,
        "phase1_s": statistics.median(t["phase1_end"] - t["phase1_start"] for t in tel),
        "phase2_s": statistics.median(t["phase2_end"] - t["phase2_start"] for t in tel),
        "samples": len(samples),
        "pss_by_mapping_at_rest": run["marks"].get("pss_by_mapping", {}),
    }


def plot(run: dict, row: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = run["samples"][0][0]
    fig, ax = plt.subplots(figsize=(11, 4))
    ax.plot([t - t0 for t, _ in run["samples"]], [p / 2**20 for _, p in run["samples"]], lw=1, color="k", label="PSS")
    for i, t in enumerate(x for x in run["telemetry"] if x.get("kind") == "micro_batch"):
        ax.axvspan(t["phase1_start"] - t0, t["phase1_end"] - t0, color="tab:blue", alpha=0.25, lw=0,
                   label="phase 1" if i == 0 else None)
        ax.axvspan(t["phase2_start"] - t0, t["phase2_end"] - t0, color="tab:orange", alpha=0.25, lw=0,
                   label="phase 2" if i == 0 else None)
    ax.axhline(row["floor_bytes"] / 2**20, color="tab:red", ls="--", label="floor (weights + saved acts + h)")
    ax.axhline(TARGET * row["floor_bytes"] / 2**20, color="tab:red", ls=":", label=f"target {TARGET}x floor")
    if row["pss_rest"]:
        ax.axhline(row["pss_rest"] / 2**20, color="tab:green", ls="--", label="resting PSS")
    ax.set(xlabel="time (s)", ylabel="MiB", title=f"one stage (chunk {row['chunk']}, layers {row['layers'][0]}-"
                                                    f"{row['layers'][1]}) at TinyLlama-1.1B shape: PSS over time")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(row: dict, meta: dict) -> str:
    ok = "met" if row["peak_over_floor"] <= TARGET else "**missed**"
    back = row["after_phase2_over_rest"]
    return "\n".join([
        "Script: `python bench/stage_memory.py` (options: `--chunk K`, `--micro-batches`, `--window`, `--gap`, "
        "`--interval`, `--export DIR`); raw figures and every PSS sample: `bench/results/stage_memory.json`; plot: "
        "`bench/results/stage_memory.png`.",
        "",
        f"- What runs: a fresh process with the real stage runtime (`zl_mobile.stage.Stage`: ExecuTorch program with "
        f"XNNPACK, inbound link, AdamW, checkpoint per window) on chunk {row['chunk']} (layers {row['layers'][0]}-"
        f"{row['layers'][1]}) of the TinyLlama-1.1B-shaped export (B=1, S=128, every position read out), fed over "
        f"loopback TCP by the host's link; {row['micro_batches']} micro-batches, window {meta['window']}, a "
        f"{meta['gap_s']:.1f} s pause after each; PSS sampled every {meta['interval_s'] * 1000:.0f} ms "
        f"({row['samples']} samples).",
        f"- Machine: {meta['machine']['cpu']}, {meta['machine']['cores']} cores; {meta['threads']} threads. "
        f"Run: {meta['when']}, commit {meta['commit']}.",
        "- Floor = frozen weights (.ptd: the chunk's layers + final norm + lm_head) + one micro-batch of saved "
        "activations (manifest) + h_k.",
        "",
        "| floor | baseline PSS (imports) | PSS after load | resting PSS | peak PSS (sampled) | peak RSS | "
        "peak PSS / floor | PSS after phase 2 (median) | after phase 2 / rest | phase 1 | phase 2 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
        f"| {mib(row['floor_bytes'])} | {mib(row['baseline_pss'])} | {mib(row['pss_after_load'])} | "
        f"{mib(row['pss_rest'])} | {mib(row['pss_peak'])} | {mib(row['rss_peak'])} | "
        f"{row['peak_over_floor']:.2f}x ({ok}, target {TARGET}x) | {mib(row['pss_after_phase2_median'])} | "
        f"{back:.3f} | {row['phase1_s'] * 1000:,.0f} ms | {row['phase2_s'] * 1000:,.0f} ms |",
        "",
        "Where the resting PSS goes (from `/proc/self/smaps` after the last pause): "
        + ", ".join(f"{k} {mib(v)}" for k, v in row["pss_by_mapping_at_rest"].items()) + ".",
        "",
        "![stage memory](../bench/results/stage_memory.png)",
        "",
    ])


def ensure_export(export_dir: Path, chunk: int) -> None:
    man = export_dir / "manifest.json"
    if man.is_file() and any(c["index"] == chunk for c in json.loads(man.read_text())["chunks"]):
        return
    print(f"no export of chunk {chunk} in {export_dir}: exporting it with bench/export_tinyllama.py (a few minutes)")
    subprocess.run([sys.executable, str(REPO / "bench" / "export_tinyllama.py"), "--only-chunk", str(chunk),
                    "--no-eager", "--no-doc", "--steps", "1", "--mem-steps", "1", "--out", str(export_dir.parent),
                    "--results", str(Path(tempfile.gettempdir()) / "zl_export_for_stage_memory.json")], check=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--export", type=Path, default=DEFAULT_EXPORT, help="TinyLlama-shaped export (default %(default)s)")
    p.add_argument("--chunk", type=int, default=1)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--window", type=int, default=4)
    p.add_argument("--gap", type=float, default=1.5, help="pause after each micro-batch, seconds")
    p.add_argument("--interval", type=float, default=0.01, help="PSS sampling interval, seconds")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--no-doc", action="store_true")
    p.add_argument("--worker-result", help=argparse.SUPPRESS)
    a = p.parse_args(argv)

    if a.worker_result:
        res = worker(a.export, a.chunk, a.micro_batches, a.window, a.gap, a.threads)
        Path(a.worker_result).write_text(json.dumps(res))
        return 0

    ensure_export(a.export, a.chunk)
    manifest = json.loads((a.export / "manifest.json").read_text())
    entry = next(c for c in manifest["chunks"] if c["index"] == a.chunk)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        print(f"running chunk {a.chunk} in a fresh process: {a.micro_batches} micro-batches, {a.gap} s pauses ...")
        rc, err, samples = run_sampled([sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]),
                                        "--worker-result", str(out)], a.interval)
        if rc != 0:
            raise SystemExit(f"the measuring process failed (exit code {rc}):\n{err}")
        run = json.loads(out.read_text())
        run["samples"] = [s for s in samples if s[0] >= run["marks"]["t_loaded"] - run["marks"]["load_s"]]
    if run["errors"]:
        print(f"the stage reported errors: {run['errors']}")
        return 1
    row = analyse(run, manifest, entry, a.export)
    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    meta = {"when": now_iso(), "commit": commit, "machine": machine(), "threads": a.threads, "window": a.window,
            "gap_s": a.gap, "interval_s": a.interval, "export": str(a.export)}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "stage_memory.json").write_text(json.dumps({"meta": meta, "result": row, "samples": run["samples"],
                                                            "telemetry": run["telemetry"]}))
    plot(run, row, RESULTS / "stage_memory.png")
    for k in ("floor_bytes", "pss_rest", "pss_peak", "rss_peak", "pss_after_phase2_median"):
        print(f"{k:>26}: {mib(row[k])}")
    print(f"{'peak PSS / floor':>26}: {row['peak_over_floor']:.2f}x (target {TARGET}x)")
    print(f"{'peak RSS / floor':>26}: {row['rss_peak_over_floor']:.2f}x")
    print(f"{'after phase 2 / rest':>26}: {row['after_phase2_over_rest']:.3f}")
    for k, v in row["pss_by_mapping_at_rest"].items():
        print(f"{'PSS at rest, ' + k:>40}: {mib(v)}")
    if not a.no_doc:
        replace_md_section(REPO / "docs" / "BENCHMARKS.md", "## Stage memory (zl_mobile)", markdown(row, meta),
                           "ZeroLock benchmarks", keep_from="### Findings")
    return 0


if __name__ == "__main__":
    sys.exit(main())

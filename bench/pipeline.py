"""Pipeline benchmark: ZeroLock vs the back-propagation baselines GPipe, 1F1B and PipeDream, on the
same export, the same stage runtime and links, and the same data (issue 7).

Per stage: peak PSS (max of `pss_peak_bytes` over the stage's telemetry; PSS is sampled after
every micro-batch step, so a transient peak inside a step is not seen), activation memory
(peak number of micro-batches whose saved activations are held x the manifest's
`saved_activation_bytes` of the program the schedule runs), throughput (samples/s, steady state:
windows after the first) and active fraction (compute time / (compute + wait) over the steady state).
Memory breakdown: each stage reports its runtime's PSS (before its program was loaded) and its
mapped weights' PSS; the peak less the runtime is the seed's measure (model + state, weight cache,
activations: what a GPU allocator counts), reported beside the raw peak PSS and plotted stacked.

Interpretation of the paper's b and m: b = samples per optimizer step, m = micro-batches per step,
so b=8, m=4 is micro_batch 2 x window_size 4.

Default: two stages (a 2-chunk export with BP programs: zl-export --mode both), one emulated phone
per core (--cpus i --threads 1), then a link sweep (Local = no limit, Wi-Fi 300, Mobile 100,
Constrained 50 Mbit/s per phone and direction, with 0 / 2 / 20 / 50 ms of one-way latency: each
phone sees every frame arriving on its stage links (hidden states, gradients, credits) that much later, zl-phone
--link-delay-ms, since not every kernel has netem to add it in the network). `--links netns` (the default where the machine
allows it: root, iproute2, tbf) runs every phone in its own network namespace behind a veth pair on
a bridge, both directions shaped by the kernel (host/phones/netns.py); `--links limiter` shapes each
phone's outgoing frames with the transport's token bucket (zl-phone --rate-mbit) on loopback.
All methods run side by side per link setting, in one script run, and ratios ZeroLock / baseline
are printed.

Stages and backends: `--stages 3|4` exports (with --make-export) and runs 3 or 4 chunks of two
layers each (the model gets 2 x stages layers; 2 stages keep the 6-layer model split 0-2,3-5).
`--backend eager` runs every phone's chunk in eager PyTorch instead of ExecuTorch (zl-phone
--backend eager; the export must hold the eager weights, which --make-export always writes), for
a machine whose torch cannot load ExecuTorch 1.5.1; `--torch-device cuda` puts every stage on the
GPU. `--cores-per-stage C` pins stage i to its own C cores (--cpus, --threads C). Activation memory
is the ExecuTorch programs' `saved_activation_bytes` with either backend, and PSS does not see
GPU memory.

CPU budgets (issue 18): `--cpu-share auto|none|F|F1,...` holds every phone to a share of one core
(zl-phone --cpu-share: a cgroup each, zl_mobile/cpu_budget.py) instead of pinning it to a core, so
three and four stages fit on a 2-core machine as slower, separate computers. `auto` (the default):
1.8 / stages at 3 and 4 stages (0.6 / 0.45 of a core each, 1.8 cores in all, the host and links
keep the rest), none at 2 stages (one pinned core each, as the figures in docs/BENCHMARKS.md).
`--reps N` repeats every (method, link) N times, interleaved (rep 1 of everything, then rep 2);
the ratios ZeroLock / baseline are also taken within each repetition, and their median, min and
max (the spread) are printed and written (`ratio_spread`). `--layers-per-stage L` with
--make-export sets the chunk depth (default 3 at 2 stages, 2 at 3 and 4), so a 2-stage run can
match the per-stage work of a deeper one for bench/schedule_model.py --measured.

Usage:
  python bench/pipeline.py --export DIR --make-export   # export the benchmark model first (~2 min)
  python bench/pipeline.py --export DIR [--windows 4] [--methods zerolock,gpipe,1f1b,pipedream]
        [--sweep-methods zerolock,1f1b,pipedream] [--rates none,300,100,50]
        [--stages 2|3|4] [--backend executorch|eager] [--torch-device cpu|cuda] [--cores-per-stage C]
        [--cpu-share auto|none|F|F1,...] [--reps N] [--layers-per-stage L]
  three stages, all four methods on every link, budgeted phones, 3 interleaved repetitions:
  python bench/pipeline.py --export DIR3 --make-export --stages 3 --reps 3 \
        --sweep-methods zerolock,gpipe,1f1b,pipedream --out bench/results/pipeline_3stages.json
Results: bench/results/pipeline.json; plots bench/results/pipeline_pss.png, pipeline_link.png,
pipeline_timeline.png (each stage's phases per method, Local link; named after --out).
The b/m sweep and the largest b under a memory cap: bench/pipeline_sweep.py.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, MiB, bench_micro_batches, cpu_shares, machine, now_iso, run_on_phones  # noqa: E402

from zl_common.manifest import ChunkEntry  # noqa: E402

warnings.filterwarnings("ignore")

LINKS = {None: "Local", 300.0: "Wi-Fi", 100.0: "Mobile", 50.0: "Constrained"}
LATENCY_MS = {None: 0.0, 300.0: 2.0, 100.0: 20.0, 50.0: 50.0}  # each named link's one-way latency


def chunk_spec(stages: int, per_stage: int | None = None) -> tuple[str, int]:
    """(chunk spec, model layers) of the benchmark export for this many stages (`per_stage` layers
    each; default 3 at 2 stages, the setting docs/BENCHMARKS.md reports, else 2)."""
    per_stage = per_stage or (3 if stages == 2 else 2)
    return ",".join(f"{per_stage * i}-{per_stage * i + per_stage - 1}" for i in range(stages)), per_stage * stages


def stage_cores(i: int, per_stage: int, cores: list[int]) -> list[int]:
    """Stage i's own cores: the i-th group of `per_stage` (round robin when there are too few)."""
    return [cores[(i * per_stage + j) % len(cores)] for j in range(per_stage)]


def run_once(export_dir: Path, root: Path, settings, mbs, n_phones: int, rate, watchdog_s: float = 180.0,
             phone_args=(), cores_per_stage: int = 1, links: str = "limiter", delay_ms: float = 0.0,
             shares: list[float] | None = None, coordinator_base=None, harvest=None):
    """One run (`coordinator_base`: a Coordinator subclass to run; `harvest(root)`: called on the
    phones' files before they are removed). PipeDream's schedule (no flush) runs the next window's warm-up forwards before the
    last backwards of a window, so on the run's last window stage k waits for num_stages-1-k
    inputs that the coordinator never feeds (it feeds windows x window_size) and the run hangs.
    For pipedream the host therefore feeds num_stages-1 extra micro-batches past the end; they are
    forwarded but never stepped, and are left out of every figure (window >= windows)."""
    from host.run.coordinator import Coordinator

    class BenchCoordinator(coordinator_base or Coordinator):
        def setup(self):
            super().setup()
            if self.settings.schedule == "pipedream":
                n = self.settings.micro_batches
                for mb in range(n, n + len(self.stages) - 1):
                    self.feeder.publish(self._input_frame(mb))

    cores = sorted(os.sched_getaffinity(0))

    def args(i):
        if shares:  # a budget of its own instead of cores of its own (host/phones/emulate.py: budget_args)
            from host.phones.emulate import budget_args
            a = [*budget_args(shares[i]), *phone_args]
        else:
            mine = stage_cores(i, cores_per_stage, cores)
            a = ["--cpus", ",".join(map(str, mine)), "--threads", str(len(mine)), *phone_args]
        return (a + (["--rate-mbit", str(rate)] if rate and links == "limiter" else [])
                + (["--link-delay-ms", f"{delay_ms:g}"] if delay_ms else []))

    def run(network=None):
        return run_on_phones(export_dir, root, settings, mbs, n_phones, prefix="pb", per_phone_args=args,
                             coordinator_cls=BenchCoordinator, max_seconds=watchdog_s, network=network)

    if links == "limiter":
        out = run()
    else:
        from host.phones.netns import ShapedNetwork
        with ShapedNetwork(n_phones, rate) as network:  # Local too, so only the rate differs across the sweep
            out = run(network)
    if harvest is not None:
        harvest(root)
    # every phone holds a copy of the export (GBs at TinyLlama shape); a failed run's stay, for its logs
    shutil.rmtree(root, ignore_errors=True)
    return out


def analyse(result, records, chunks, schedule, window_size, micro_batch, windows) -> dict:
    tel = [r for r in records if r["type"] == "TELEMETRY" and r["kind"] == "micro_batch" and r["window"] < windows]
    win = [r for r in records if r["type"] == "TELEMETRY" and r["kind"] == "window"]
    stages = sorted({r["stage"] for r in tel})
    per = []
    for k in stages:
        runtime = next((r["pss_runtime_bytes"] for r in win if r["stage"] == k and r.get("pss_runtime_bytes")), None)
        weights = max((r.get("pss_weights_bytes") or 0 for r in win if r["stage"] == k), default=0) or None
        rs = sorted((r for r in tel if r["stage"] == k), key=lambda r: r["phase2_end"])
        chunk = chunks[k]
        saved = ChunkEntry.from_json(chunk).for_schedule(schedule).saved_activation_bytes
        held = max(r.get("in_flight", 0) for r in rs) + 1  # telemetry is sent after the step popped its own
        steady = [r for r in rs if r["window"] >= 1]
        a0 = next((r for r in rs if r["window"] == 0 and r["micro_batch"] == window_size - 1), rs[0])
        a1 = rs[-1]
        act = a1["active_s"] - a0["active_s"]
        wait = a1["wait_s"] - a0["wait_s"]
        pss_peak = max(r.get("pss_bytes") or 0 for r in rs)  # read after each step
        per.append({"stage": k, "pss_peak_bytes": pss_peak,
                    "rss_peak_bytes": max(r.get("rss_peak_bytes") or 0 for r in rs),  # kernel's VmHWM, inside steps too
                    "pss_median_bytes": sorted(r.get("pss_bytes") or 0 for r in rs)[len(rs) // 2],
                    "held_micro_batches": held, "saved_activation_bytes_per_mb": saved,
                    "activation_bytes": held * saved, "active_fraction": act / (act + wait) if act + wait else None,
                    "active_fraction_whole_run": a1["active_s"] / (a1["active_s"] + a1["wait_s"]),
                    "steady_micro_batches": len(steady), "pss_runtime_bytes": runtime, "pss_weights_bytes": weights,
                    "training_peak_bytes": pss_peak - runtime if runtime else None})
    # steady-state throughput: samples of windows >= 1 over the time between the end of window 0
    # and the end of the last window (last micro-batch's phase-2 end, over all stages)
    ends = {}
    for r in tel:
        ends[r["window"]] = max(ends.get(r["window"], 0), r["phase2_end"])
    last = max(ends)
    n_samples = (last) * window_size * micro_batch
    steady_s = ends[last] - ends[0]
    losses = [r["loss"] for r in tel if r["stage"] == stages[-1] and r.get("loss") is not None]
    pss = [p["pss_peak_bytes"] for p in per]
    acts = [p["activation_bytes"] for p in per]
    fr = [p["active_fraction"] for p in per if p["active_fraction"] is not None]
    return {"per_stage": per, "throughput_sps": n_samples / steady_s if steady_s > 0 else None, "steady_s": steady_s,
            "run_seconds": result["seconds"], "link_bytes": result["link_bytes"],
            "pss_peak_mean": sum(pss) / len(pss), "pss_peak_max": max(pss), **training_peaks(per),
            "act_mean": sum(acts) / len(acts), "act_max": max(acts),
            "active_fraction_mean": sum(fr) / len(fr) if fr else None,
            "last_loss": losses[-1] if losses else None, "errors": result["errors"],
            "timeline": [{"stage": r["stage"], "spans": r.get("spans", [])} for r in tel]}


def training_peaks(per: list) -> dict:
    """Mean and max over stages of the peak PSS less the runtime's own PSS (what the seed's Fig. 4
    counts: model + state, weight cache, activations; a GPU allocator's view leaves out the process
    and its libraries the same way). None where a stage did not report its runtime PSS."""
    t = [p.get("training_peak_bytes") for p in per]
    if not t or None in t:
        return {"train_peak_mean": None, "train_peak_max": None}
    return {"train_peak_mean": sum(t) / len(t), "train_peak_max": max(t)}


def merge(reps: list) -> dict:
    """Medians over repeats (peak PSS: the max); per-stage rows from the repeats merged the same way."""
    import statistics

    if len(reps) == 1:
        return {**reps[0], "reps": 1}
    out = dict(reps[0])
    for key in ("throughput_sps", "active_fraction_mean", "steady_s", "run_seconds", "link_bytes"):
        out[key] = statistics.median(r[key] for r in reps)
    out["throughput_sps_all"] = [r["throughput_sps"] for r in reps]
    out["throughput_sps_min"], out["throughput_sps_max"] = min(out["throughput_sps_all"]), max(out["throughput_sps_all"])
    out["pss_peak_mean"] = statistics.median(r["pss_peak_mean"] for r in reps)
    out["pss_peak_max"] = max(r["pss_peak_max"] for r in reps)
    per = []
    for j, p in enumerate(reps[0]["per_stage"]):
        q = dict(p)
        q["pss_peak_bytes"] = max(r["per_stage"][j]["pss_peak_bytes"] for r in reps)
        if all(r["per_stage"][j].get("training_peak_bytes") is not None for r in reps):
            q["training_peak_bytes"] = max(r["per_stage"][j]["training_peak_bytes"] for r in reps)
            q["pss_runtime_bytes"] = statistics.median(r["per_stage"][j]["pss_runtime_bytes"] for r in reps)
        q["held_micro_batches"] = max(r["per_stage"][j]["held_micro_batches"] for r in reps)
        q["activation_bytes"] = q["held_micro_batches"] * q["saved_activation_bytes_per_mb"]
        q["active_fraction"] = statistics.median(r["per_stage"][j]["active_fraction"] for r in reps)
        per.append(q)
    out["per_stage"] = per
    if all(r.get("train_peak_mean") is not None for r in reps):  # as the PSS figures: median of means, max of maxes
        out["train_peak_mean"] = statistics.median(r["train_peak_mean"] for r in reps)
        out["train_peak_max"] = max(r["train_peak_max"] for r in reps)
    out["act_mean"] = sum(p["activation_bytes"] for p in per) / len(per)
    out["act_max"] = max(p["activation_bytes"] for p in per)
    out["reps"] = len(reps)
    return out


def ratio_spread(raw_runs: list, baselines, rates) -> dict:
    """ZeroLock / baseline throughput within each repetition (the two runs of one rep are
    neighbours in the interleaved order), per baseline and link: median, min, max, every value."""
    import statistics

    out = {}
    for m in baselines:
        for rate in rates:
            vals = []
            for rep in sorted({r["rep"] for r in raw_runs}):
                z = next((r for r in raw_runs if (r["method"], r["rate_mbit"], r["rep"]) == ("zerolock", rate, rep)), None)
                b = next((r for r in raw_runs if (r["method"], r["rate_mbit"], r["rep"]) == (m, rate, rep)), None)
                if z and b and z["throughput_sps"] and b["throughput_sps"]:
                    vals.append(z["throughput_sps"] / b["throughput_sps"])
            if vals:
                out.setdefault(m, {})[str(rate)] = {"median": statistics.median(vals), "min": min(vals),
                                                    "max": max(vals), "n": len(vals), "all": vals}
    return out


BREAKDOWN = (("runtime (process before loading)", "tab:gray"), ("weights (mapped .ptd)", "tab:blue"),
             ("held activations", "tab:red"), ("other (arenas, LoRA + AdamW, buffers)", "tab:olive"))


def breakdown(p: dict) -> list[float]:
    """A stage's peak PSS in the parts of BREAKDOWN (bytes); `other` is what remains of the peak."""
    runtime, weights, acts = p.get("pss_runtime_bytes") or 0, p.get("pss_weights_bytes") or 0, p["activation_bytes"]
    return [runtime, weights, acts, max(p["pss_peak_bytes"] - runtime - weights - acts, 0)]


def memory_breakdown_plot(plt, base: list, path: Path) -> str:
    """Left: each stage's peak PSS stacked by what holds it (the seed's Fig. 4); right: the peak
    less the runtime, per stage, with each method's mean over stages."""
    fig, ax = plt.subplots(1, 2, figsize=(12, 5.2))
    n_st = len(base[0]["per_stage"])
    z = next((r for r in base if r["method"] == "zerolock"), None)
    width = 0.8 / n_st
    for i, r in enumerate(base):
        for j, p in enumerate(r["per_stage"]):
            x, bottom = i + j * width, 0.0
            for (name, color), v in zip(BREAKDOWN, breakdown(p)):
                ax[0].bar(x, v / MiB, width * 0.95, bottom=bottom, color=color, label=name if i == j == 0 else None)
                bottom += v / MiB
            if p.get("training_peak_bytes") is not None:
                ax[1].bar(x, p["training_peak_bytes"] / MiB, width * 0.95, color=f"C{j}", label=f"stage {j}" if i == 0 else None)
        if r.get("train_peak_mean") is not None:
            ax[1].hlines(r["train_peak_mean"] / MiB, i - width / 2, i + width * (n_st - 0.5), color="k", lw=1.5,
                         label="mean over stages" if i == 0 else None)
            if z and z is not r and z.get("train_peak_mean"):
                ax[1].annotate(f"ZeroLock / it: {z['train_peak_mean'] / r['train_peak_mean']:.2f}",
                               (i + width * (n_st - 1) / 2, r["train_peak_mean"] / MiB), textcoords="offset points",
                               xytext=(0, 4), ha="center", fontsize=8)
    for a, title in ((ax[0], "peak PSS per stage, by what holds it (MiB)"),
                     (ax[1], "peak PSS less the runtime, per stage (MiB)")):
        a.set_xticks([i + width * (n_st - 1) / 2 for i in range(len(base))])
        a.set_xticklabels([f"{r['method']}\n(stages 0..{n_st - 1})" for r in base])
        a.set_title(title, fontsize=10)
        a.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    return save_figure(fig, path)


def link_plot(plt, runs: list, sweep_methods, rates, path: Path) -> str:
    fig, ax = plt.subplots(figsize=(6, 3.8))
    def label(r):
        d = next((x.get("delay_ms") for x in runs if x["rate_mbit"] == r), 0)
        return (LINKS.get(r) or f"{r:g}") + (f"\n{r:g} Mbit/s" if r else "") + (f", {d:g} ms" if d else "")

    labels = [label(r) for r in rates]
    for m in sweep_methods:
        ys = [next((x["throughput_sps"] for x in runs if x["method"] == m and x["rate_mbit"] == r), None) for r in rates]
        ax.plot(labels, ys, marker="o", label=m)
    ax.set_ylabel("samples/s (steady state)")
    ax.set_xlabel("link (rate per phone and direction, one-way latency)")
    ax.set_title("throughput vs link")
    ax.legend()
    return save_figure(fig, path)


def plots(out_dir: Path, runs: list, methods, sweep_methods, rates, stem: str = "pipeline", ref=None) -> list[str]:
    """`ref`: the link the memory and timeline plots show (None: Local)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    base = [r for r in runs if r["rate_mbit"] == ref]
    paths.append(memory_breakdown_plot(plt, base, out_dir / f"{stem}_pss.png"))
    if len(rates) > 1:  # one link has no curve to draw
        paths.append(link_plot(plt, runs, sweep_methods, rates, out_dir / f"{stem}_link.png"))

    from host.run.report import draw_timeline

    n_st = len(base[0]["per_stage"])
    fig, axes = plt.subplots(len(base), 1, figsize=(11, 0.2 + (0.9 + 0.4 * n_st) * len(base)), squeeze=False)
    for ax, r in zip(axes[:, 0], base):
        draw_timeline(ax, r["timeline"], f"{r['method']} ({LINKS.get(ref, f'{ref} Mbit/s')} link)")
    paths.append(save_figure(fig, out_dir / f"{stem}_timeline.png"))
    return paths


def save_figure(fig, path: Path) -> str:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--export", type=Path, required=True, help="export dir with BP programs (--mode both)")
    ap.add_argument("--make-export", action="store_true", help="first export the benchmark model into --export (~2 min)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/zl-bench-pipeline"))
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--window-size", type=int, default=4, help="m: micro-batches per optimizer step")
    ap.add_argument("--inflight-depth", type=int, default=4)
    ap.add_argument("--methods", default="zerolock,gpipe,1f1b,pipedream")
    ap.add_argument("--sweep-methods", default="zerolock,1f1b,pipedream")
    ap.add_argument("--rates", default="none,300,100,50", help="Mbit/s per phone; 'none' = no limit")
    ap.add_argument("--delays-ms", default=None,
                    help="one-way latency per --rates entry (zl-phone --link-delay-ms), same order; default: "
                         "0 / 2 / 20 / 50 ms for none / 300 / 100 / 50, 0 for any other rate")
    ap.add_argument("--links", choices=["auto", "netns", "limiter"], default="auto",
                    help="how links are shaped: netns (kernel, own namespaces), limiter (the transport's token "
                         "bucket), auto (netns where the machine allows it)")
    ap.add_argument("--reps", type=int, default=1, help="repeat everything (interleaved); medians are reported")
    ap.add_argument("--stages", type=int, choices=[2, 3, 4], default=None,
                    help="pipeline stages (= chunks of the export; default: the export's); --make-export "
                         "exports that many (default 2)")
    ap.add_argument("--backend", choices=["executorch", "eager"], default="executorch",
                    help="what every phone runs its chunk on (zl-phone --backend)")
    ap.add_argument("--torch-device", default=None, help="with --backend eager: cpu (default) or cuda")
    ap.add_argument("--cores-per-stage", type=int, default=1, help="CPU cores pinned to each stage (its threads)")
    ap.add_argument("--cpu-share", default="auto",
                    help="hold every phone to a share of one core (zl-phone --cpu-share) instead of pinning it: "
                         "F (each), F1,... (one per stage), none, or auto (1.8 / stages at 3 and 4 stages, none at 2)")
    ap.add_argument("--layers-per-stage", type=int, default=None,
                    help="with --make-export: layers per chunk (default 3 at 2 stages, 2 at 3 and 4)")
    ap.add_argument("--max-seconds", type=float, default=180.0, help="give up on a run after this long")
    ap.add_argument("--out", type=Path, default=REPO / "bench/results/pipeline.json")
    a = ap.parse_args(argv)
    if a.torch_device and a.backend != "eager":
        ap.error("--torch-device applies to --backend eager only")
    if a.cores_per_stage < 1:
        ap.error("--cores-per-stage must be at least 1")
    if a.windows < 2:
        ap.error("--windows must be at least 2: throughput is measured over the windows after the first")
    from zl_mobile.backends import Backend, BackendError
    try:  # the check every phone makes at start, made once here
        Backend.from_args(a.backend, a.torch_device).check_runtime()
    except BackendError as e:
        ap.error(str(e))

    from exporter.manifest import load_manifest
    from host.phones import netns
    from host.run.settings import RunSettings

    why_not = netns.unavailable() if a.links != "limiter" else None
    if a.links == "netns" and why_not:
        ap.error(f"--links netns: {why_not}; use --links limiter")
    links = "limiter" if a.links == "limiter" or why_not else "netns"
    if a.links == "auto" and why_not:
        print(f"links: the transport's rate limiter ({why_not})", flush=True)

    if a.make_export:
        from recovery import make_export
        spec, layers = chunk_spec(a.stages or 2, a.layers_per_stage)
        make_export(a.export, spec, micro_batch=2, modes=("zerolock", "bp"), eager_weights=True, num_layers=layers)
    man = load_manifest(a.export)
    ecfg = man["export"]
    mb_size, seq = ecfg["micro_batch"], ecfg["seq_len"]
    chunks = man["chunks"]
    if a.stages is not None and a.stages != len(chunks):
        ap.error(f"--stages {a.stages}, but {a.export} has {len(chunks)} chunks: export {a.stages} "
                 f"(--make-export --stages {a.stages}) or leave --stages out")
    if a.backend == "eager" and not all("eager_weights" in c for c in chunks):
        ap.error(f"--backend eager: {a.export} has no eager weights: re-export with --make-export "
                 "(or zl-export --eager-weights)")
    phone_args = ["--backend", a.backend] + (["--torch-device", a.torch_device] if a.torch_device else [])
    n_cores = len(os.sched_getaffinity(0))
    try:
        shares = cpu_shares(a.cpu_share, len(chunks))
    except ValueError as e:
        ap.error(str(e))
    if shares and a.cores_per_stage != 1:
        ap.error("--cores-per-stage pins phones; with --cpu-share a phone's budget is what it gets: give one of them")
    if shares and sum(shares) > n_cores - 0.2 + 1e-9:
        print(f"warning: the CPU shares add up to {sum(shares):g} of {n_cores} cores: the host and the links have "
              "less than 0.2 of a core", flush=True)
    if not shares and len(chunks) * a.cores_per_stage > n_cores:
        print(f"warning: {len(chunks)} stages x {a.cores_per_stage} cores > {n_cores} cores here: stages share cores",
              flush=True)
    methods = a.methods.split(",")
    sweep = a.sweep_methods.split(",")
    rates = [None if r == "none" else float(r) for r in a.rates.split(",")]
    delays = ([float(d) for d in a.delays_ms.split(",")] if a.delays_ms is not None
              else [LATENCY_MS.get(r, 0.0) for r in rates])
    if len(delays) != len(rates):
        ap.error(f"--delays-ms has {len(delays)} values for {len(rates)} --rates: give one per rate")
    delay_of = dict(zip(rates, delays))
    mbs = bench_micro_batches(a.export, a.windows * a.window_size, mb_size, seq)
    stamp = time.strftime("%H%M%S")
    placement = (f"CPU budgets {', '.join(f'{x:g}' for x in shares)} of a core (unpinned)" if shares
                 else f"{a.cores_per_stage} core(s) per stage")
    print(f"{len(chunks)} stages, backend {a.backend}{' on ' + a.torch_device if a.torch_device else ''}, "
          f"{placement}, links shaped by {links}", flush=True)
    runs = []
    for rep, rate, m in [(i, r, m) for i in range(a.reps) for r in rates
                         for m in (methods if r is None else [x for x in methods if x in sweep])]:
        if True:
            settings = RunSettings(windows=a.windows, window_size=a.window_size, inflight_depth=a.inflight_depth,
                                   lr=2e-3, schedule=m)
            t = time.time()
            try:
                res, recs = run_once(a.export, a.work / f"{stamp}-{time.time_ns()}-{m}-{rate}", settings, mbs,
                                     len(chunks), rate, phone_args=phone_args, cores_per_stage=a.cores_per_stage,
                                     watchdog_s=a.max_seconds, links=links, delay_ms=delay_of[rate], shares=shares)
            except Exception as e:
                print(f"[{m} @ {rate}] FAILED: {e}", flush=True)
                continue
            s = analyse(res, recs, chunks, m, a.window_size, mb_size, a.windows)
            s.update(method=m, rate_mbit=rate, delay_ms=delay_of[rate], link=LINKS.get(rate, f"{rate} Mbit/s"), rep=rep)
            runs.append(s)
            print(f"[{m} @ {s['link']}, rep {rep + 1}/{a.reps}] {time.time() - t:.1f} s: {s['throughput_sps']:.2f} samples/s, "
                  f"PSS peak mean/max {s['pss_peak_mean'] / MiB:.0f}/{s['pss_peak_max'] / MiB:.0f} MiB, "
                  f"acts mean/max {s['act_mean'] / MiB:.1f}/{s['act_max'] / MiB:.1f} MiB, "
                  f"active {s['active_fraction_mean']:.2f}, held {[p['held_micro_batches'] for p in s['per_stage']]}",
                  flush=True)

    if not runs:
        print("no run finished: see the FAILED lines above", flush=True)
        return 1
    raw_runs = runs
    runs = [merge([r for r in raw_runs if r["method"] == m and r["rate_mbit"] == rate])
            for rate in rates for m in methods if any(r["method"] == m and r["rate_mbit"] == rate for r in raw_runs)]

    def get(m, rate):
        return next((r for r in runs if r["method"] == m and r["rate_mbit"] == rate), None)

    # the tables compare methods on one link: Local where it was run, else the first of --rates
    ref = None if None in rates else rates[0]
    ref_name = LINKS.get(ref, f"{ref} Mbit/s")
    failed = [m for m in methods if get(m, ref) is None]
    if "zerolock" in failed:
        print(f"ZeroLock's {ref_name} run failed: nothing to compare against (see the FAILED lines above)", flush=True)
        return 1
    if failed:
        print(f"left out of the tables (their runs failed, see above): {', '.join(failed)}", flush=True)
        methods = [m for m in methods if m not in failed]
        sweep = [m for m in sweep if m not in failed]

    print("\n| method | peak PSS mean / max over stages | activation memory mean / max | throughput | active fraction | "
          "per stage: peak PSS, held mbs x saved |")
    print("|---|---|---|---|---|---|")
    print(f"(link: {ref_name})")
    for m in methods:
        r = get(m, ref)
        st = "; ".join(f"s{p['stage']}: {p['pss_peak_bytes'] / MiB:.0f} MiB, {p['held_micro_batches']} x "
                       f"{p['saved_activation_bytes_per_mb'] / MiB:.1f} MiB" for p in r["per_stage"])
        if r.get("train_peak_mean") is not None:
            rt = ", ".join(f"{p['pss_runtime_bytes'] / MiB:.0f}" for p in r["per_stage"])
            st += (f"; less the runtime ({rt} MiB): "
                   f"mean {r['train_peak_mean'] / MiB:.0f} / max {r['train_peak_max'] / MiB:.0f} MiB")
        print(f"| {m} | {r['pss_peak_mean'] / MiB:,.0f} / {r['pss_peak_max'] / MiB:,.0f} MiB | "
              f"{r['act_mean'] / MiB:,.1f} / {r['act_max'] / MiB:,.1f} MiB | {r['throughput_sps']:.2f} samples/s | "
              f"{r['active_fraction_mean']:.2f} | {st} |")
    z = get("zerolock", ref)
    ratios = {}
    print(f"\nratios ZeroLock / baseline ({ref_name} link): ")
    for m in methods:
        if m == "zerolock":
            continue
        r = get(m, ref)
        if z.get("train_peak_mean") and r.get("train_peak_mean"):
            ratios.setdefault(m, {}).update(train_peak_mean=z["train_peak_mean"] / r["train_peak_mean"],
                                            train_peak_max=z["train_peak_max"] / r["train_peak_max"])
        ratios[m] = {**ratios.get(m, {}), "pss_peak_mean": z["pss_peak_mean"] / r["pss_peak_mean"],
                     "pss_peak_max": z["pss_peak_max"] / r["pss_peak_max"],
                     "act_max": z["act_max"] / r["act_max"], "throughput": z["throughput_sps"] / r["throughput_sps"],
                     "active_fraction": z["active_fraction_mean"] / r["active_fraction_mean"]}
        print(f"  vs {m}: PSS mean {ratios[m]['pss_peak_mean']:.3f}, PSS max {ratios[m]['pss_peak_max']:.3f}, "
              f"activations max {ratios[m]['act_max']:.3f}, throughput {ratios[m]['throughput']:.3f}, "
              f"active fraction {ratios[m]['active_fraction']:.3f}"
              + (f"; peak PSS less the runtime: mean {ratios[m]['train_peak_mean']:.3f}, max {ratios[m]['train_peak_max']:.3f}"
                 if "train_peak_mean" in ratios[m] else ""))
    print("\nthroughput (samples/s) vs link:")
    print("| method | " + " | ".join(LINKS.get(r, str(r)) + (f" ({r:g} Mbit/s" if r else " (")
                                     + (f", {delay_of[r]:g} ms)" if delay_of[r] else ")" if r else "no limit)")
                                     for r in rates) + " |")
    print("|---|" + "---|" * len(rates))
    sweep_tab = {}
    for m in sweep:
        row = [get(m, r) for r in rates]
        sweep_tab[m] = [x["throughput_sps"] if x else None for x in row]
        print(f"| {m} | " + " | ".join(f"{x['throughput_sps']:.2f}" if x else "-" for x in row) + " |")
    for m in sweep:
        if m != "zerolock":
            print(f"| ZeroLock / {m} | " + " | ".join(
                f"{get('zerolock', r)['throughput_sps'] / get(m, r)['throughput_sps']:.2f}x"
                if get("zerolock", r) and get(m, r) else "-" for r in rates) + " |")

    spread = ratio_spread(raw_runs, [m for m in sweep if m != "zerolock"] + [m for m in methods if m not in sweep],
                          rates)
    if a.reps > 1:
        print("\nZeroLock / baseline throughput within each repetition: median (min-max over reps):")
        for m, by_rate in spread.items():
            print(f"  vs {m}: " + ", ".join(f"{LINKS.get(r, str(r))} {v['median']:.2f}x ({v['min']:.2f}-{v['max']:.2f}, "
                                           f"{v['n']} reps)" for r, v in ((r, by_rate.get(str(r))) for r in rates) if v))

    out = {"date": now_iso(), "machine": machine(), "export": str(a.export), "export_config": ecfg,
           "model": man.get("model", {}).get("config"), "chunks": [c.get("layers") for c in chunks],
           "saved_activation_bytes": {"zerolock": [c["saved_activation_bytes"] for c in chunks],
                                      "bp": [c["bp"]["saved_activation_bytes"] for c in chunks if "bp" in c]},
           "settings": {"windows": a.windows, "window_size": a.window_size, "micro_batch": mb_size, "seq_len": seq,
                        "b_samples_per_step": a.window_size * mb_size, "m_micro_batches_per_step": a.window_size,
                        "inflight_depth": a.inflight_depth, "stages": len(chunks), "backend": a.backend,
                        "torch_device": a.torch_device, "cores_per_stage": None if shares else a.cores_per_stage,
                        "links": links, "delays_ms": delays, "cpu_shares": shares,
                        "phones": ("unpinned, each held to its CPU share (zl-phone --cpu-share), --threads 1"
                                   if shares else f"one per {a.cores_per_stage} core(s), --threads {a.cores_per_stage}")},
           "reps": a.reps, "runs": runs, "raw_runs": raw_runs, "ratios_zerolock_over_baseline_local": ratios,
           "ratios_link": ref_name,
           "ratio_spread": spread, "throughput_vs_link": sweep_tab,
           "rates_mbit": rates, "plots": []}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=1, default=str))  # before the plots: a plotting error loses no run
    out["plots"] = plots(a.out.parent, runs, methods, sweep, rates, a.out.stem, ref)
    a.out.write_text(json.dumps(out, indent=1, default=str))
    print(f"wrote {a.out} and {', '.join(out['plots'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

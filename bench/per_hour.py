"""Issue 32, part 3: held-out accuracy per hour of phone time. ZeroLock against the back-propagation
pipelines (GPipe, 1F1B) on three budgeted emulated phones, on the quality study's task.

Every method trains the same SmolLM2 export (`zl-export --mode both`: ZeroLock's programs and the
BP stages), on the same phones (real processes on ExecuTorch's runtime, each held to a share of one
core: bench/pipeline.py's budgets), links, training rows in the same order, LoRA and AdamW, each at
the rate the quality study's sweep chose for it (bench/quality_study.py: BP 1e-3, ZeroLock's
default zl-last1-lens 3e-3 with alpha 0.5 / 0.5 / 1). Each stage keeps every window's checkpoint
(RunSettings.keep_checkpoints); the adapter as it stood when all three stages had committed window
w is evaluated afterwards on held-out rows of the test split (evaluation is not phone time), so
each run gives accuracy against samples and against wall-clock time from the end of setup.

Reported per link: final accuracy, samples/s, and the time each method took to reach 95% of BP's
final accuracy (the mean of GPipe's and 1F1B's, which compute the same gradients): the first
snapshot at or above it, so the figure is as coarse as --snapshot-every.

Usage:
  python bench/per_hour.py --export DIR --make-export          # the export first (~10 min on 2 cores)
  python bench/per_hour.py --export DIR [--budget 512] [--links none,50] [--methods zerolock,gpipe,1f1b]
        [--snapshot-every 8] [--eval-rows 200] [--cpu-share 0.6]
  python bench/per_hour.py --render        # only the plots and the docs section, from the results kept
Training runs are kept under --work (a rerun skips finished ones; --retrain runs them again).
Results: one file per budget and seed, bench/results/per_hour_n{budget}_s{seed}.json and .png;
docs/BENCHMARKS.md's section shows every run kept there, by budget then seed (a rerun replaces its own).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import machine, now_iso, replace_md_section  # noqa: E402
from bench.pipeline import LATENCY_MS, LINKS, run_once  # noqa: E402

RESULTS = ROOT / "bench" / "results"
DOC = ROOT / "docs" / "BENCHMARKS.md"
KEEP = "### Findings"  # written by hand below the generated part, kept on re-render
HEADING = "## Per hour of phone time: ZeroLock vs GPipe and 1F1B on three phones (bench/per_hour.py, issue 32)"
CHUNKS = "0-9,10-19,20-29"
BP = ("gpipe", "1f1b")


def check_export(export: Path, a) -> dict:
    m = json.loads((export / "manifest.json").read_text())
    e = m["export"]
    if [f"{c['layers'][0]}-{c['layers'][1]}" for c in m["chunks"]] != CHUNKS.split(",") or \
            (e["seq_len"], e["micro_batch"]) != (a.seq_len, a.micro_batch):
        sys.exit(f"bench/per_hour.py: {export} is not SmolLM2 split {CHUNKS} at seq len {a.seq_len}, micro-batch "
                 f"{a.micro_batch}; rerun with --make-export")
    if not all("bp" in c for c in m["chunks"]):
        sys.exit(f"bench/per_hour.py: {export} has no BP programs; rerun with --make-export (zl-export --mode both)")
    return m


def make_export(export: Path, a) -> None:
    cmd = ["zl-export", "--model", "smollm2", "--chunks", CHUNKS, "--seq-len", str(a.seq_len), "--micro-batch",
           str(a.micro_batch), "--loss-positions", "16", "--mode", "both", "--out", str(export)]
    print(" ".join(cmd), flush=True)
    subprocess.run([sys.executable, "-m", "exporter.cli", *cmd[1:]], check=True, cwd=ROOT)


def training_rows(export: Path, manifest: dict, a, work: Path):
    """The study's training rows (its first --budget, in seed --seed's order) as zl-host run reads
    them, and the task's held-out rows for evaluation."""
    from transformers import AutoTokenizer

    from bench.quality_tasks import load_task
    from host.run.data import prepare_data

    tok = AutoTokenizer.from_pretrained(export / "tokenizer")
    data, label_ids = load_task(a.task, tok, a.budget, 0, a.eval_rows, a.seq_len, a.data_seed)
    order = np.random.default_rng(a.seed).permutation(a.budget).tolist()
    rows = work / "train.jsonl"
    rows.write_text("".join(json.dumps(data["train_rows"][i]) + "\n" for i in order))
    return prepare_data(export, manifest, str(rows)), data, label_ids, tok


def stamped_coordinator():
    from host.run.coordinator import Coordinator

    class Stamped(Coordinator):
        """Training time starts when every phone holds its program and its assignment."""

        def setup(self):
            super().setup()
            self.train_started = time.time()

        def finish(self):
            return {**super().finish(), "train_started": self.train_started, "setup_s": self.train_started - self.started}

    return Stamped


def train(export, mbs, method, rate, a, out: Path) -> dict:
    """One run on three budgeted phones; keeps every --snapshot-every'th window's adapter in `out`."""
    from safetensors.torch import save_file

    from host.run.settings import RunSettings
    from zl_mobile.checkpoint import checkpoint_name, read_lora

    windows = len(mbs) // a.window
    keep = sorted({*range(a.snapshot_every - 1, windows, a.snapshot_every), windows - 1})
    zl = method == "zerolock"
    settings = RunSettings(windows=windows, window_size=a.window, lr=a.lr_zerolock if zl else a.lr_bp,
                           alpha=[float(x) for x in a.alpha.split(",")] if zl else None, schedule=method,
                           keep_checkpoints=windows)

    def harvest(root: Path):  # the adapter after window w: the three stages' LoRA of their checkpoint w
        out.mkdir(parents=True, exist_ok=True)
        for w in keep:
            lora = {}
            for f in Path(root).glob(f"phones/*/stages/bench/stage_*/{checkpoint_name(w)}"):
                lora.update(read_lora(f))
            save_file(lora, str(out / f"window-{w:06d}.safetensors"))

    t = time.time()
    res, recs = run_once(export, Path(a.work) / "phones" / f"{method}-{rate}-{time.time_ns()}", settings, mbs, 3, rate,
                         watchdog_s=a.max_seconds, links=a.link_kind, delay_ms=LATENCY_MS.get(rate, 0.0),
                         shares=a.shares, coordinator_base=stamped_coordinator(), harvest=harvest)
    commits = {}
    for r in recs:
        if r["type"] == "CHECKPOINT_COMMITTED":
            commits.setdefault(r["window"], []).append(r["t"])
    at = {w: max(ts) - res["train_started"] for w, ts in commits.items() if len(ts) == 3}
    samples = a.window * a.micro_batch
    run = {"method": method, "rate_mbit": rate, "link": LINKS.get(rate, f"{rate} Mbit/s"), "delay_ms": LATENCY_MS.get(rate, 0.0),
           "lr": settings.lr, "alpha": settings.alpha, "windows": windows, "setup_s": res["setup_s"],
           "train_s": at[windows - 1], "samples_per_s": windows * samples / at[windows - 1],
           "snapshots": [{"window": w, "samples": (w + 1) * samples, "seconds": at[w]} for w in keep],
           "link_bytes": res["link_bytes"]}
    (out / "run.json").write_text(json.dumps(run, indent=1))
    print(f"[{method} @ {run['link']}] {run['train_s']:.0f} s of training ({time.time() - t:.0f} s in all), "
          f"{run['samples_per_s']:.2f} samples/s", flush=True)
    return run


def evaluate_runs(runs, export, manifest, data, label_ids, tok, a, work: Path) -> dict:
    """Held-out accuracy of every snapshot (score_snapshots) and of the base (0 samples, 0 s)."""
    from peft import PeftModel
    from safetensors.numpy import load_file

    from bench import quality as Q
    from host.outputs.adapter import write_peft_adapter

    base, _ = Q.load_base(Path(a.cache))
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    mbs = Q.batches(data["test"], range(len(data["test"])), a.micro_batch, a.seq_len, pad)

    def score(model):
        f = Q.final(Q.evaluate(model, mbs, label_ids))
        return {"choice_accuracy": f["choice_accuracy"], "answer_nll": f["answer_nll"]}

    def score_adapter(f: Path) -> dict:
        d = work / "adapters" / "tmp"
        write_peft_adapter(load_file(str(f)), manifest, d, None)
        pm = PeftModel.from_pretrained(base, str(d)).eval()
        try:
            return score(pm)
        finally:
            pm.unload()

    zero = score(base)
    print(f"base, no adapter: {zero['choice_accuracy']:.3f} choice accuracy", flush=True)
    score_snapshots(runs, work / f"n{a.budget}-s{a.seed}" / f"scores_rows{a.eval_rows}.json", score_adapter)
    return zero


def score_snapshots(runs, kept: Path, score_adapter) -> None:
    """Each snapshot gets score_adapter(its adapter file)'s figures, once per distinct adapter: scores
    are kept in `kept` by the file's sha256, since GPipe and 1F1B, and one method on either link,
    train bitwise the same adapters, and a rerun scores only what is new."""
    from zl_common.hashing import sha256_file

    scores = json.loads(kept.read_text()) if kept.exists() else {}
    for run in runs:
        for s in run["snapshots"]:
            if "choice_accuracy" in s:
                continue
            f = Path(run["dir"]) / f"window-{s['window']:06d}.safetensors"
            key = sha256_file(f)
            if key not in scores:
                scores[key] = score_adapter(f)
                kept.parent.mkdir(parents=True, exist_ok=True)
                kept.write_text(json.dumps(scores, indent=1))
            s.update(scores[key])
            print(f"[{run['method']} @ {run['link']}] window {s['window']}: {s['samples']} samples, {s['seconds']:.0f} s: "
                  f"{s['choice_accuracy']:.3f}", flush=True)


def time_to(run, target) -> dict | None:
    hit = next((s for s in run["snapshots"] if s["choice_accuracy"] >= target), None)
    return None if hit is None else {"seconds": hit["seconds"], "samples": hit["samples"]}


def summarise(res) -> None:
    for link in sorted({r["link"] for r in res["runs"]}, key=list(LINKS.values()).index):
        mine = [r for r in res["runs"] if r["link"] == link]
        bp = [r["snapshots"][-1]["choice_accuracy"] for r in mine if r["method"] in BP]
        if not bp:
            continue
        target = 0.95 * float(np.mean(bp))
        for r in mine:
            r["bp_final"], r["target"], r["reached"] = float(np.mean(bp)), target, time_to(r, target)


def plot(res, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = [x for x in LINKS.values() if any(r["link"] == x for r in res["runs"])]
    fig, axes = plt.subplots(len(links), 2, figsize=(11, 3.6 * len(links)), squeeze=False)
    for row, link in zip(axes, links):
        for r in [r for r in res["runs"] if r["link"] == link]:
            xs = [(0, 0)] + [(s["seconds"] / 60, s["samples"]) for s in r["snapshots"]]
            ys = [res["zero_shot"]["choice_accuracy"]] + [s["choice_accuracy"] for s in r["snapshots"]]
            for ax, i in zip(row, (0, 1)):
                ax.plot([x[i] for x in xs], ys, marker="o", ms=3, label=r["method"])
        for ax, xl in zip(row, ("wall-clock minutes of training", "training samples")):
            target = next((r.get("target") for r in res["runs"] if r["link"] == link and r.get("target")), None)
            if target:
                ax.axhline(target, color="grey", ls="--", lw=1, label="95% of BP's final")
            ax.set_xlabel(xl)
            ax.set_ylabel("held-out choice accuracy")
            ax.set_title(f"{link} link")
            ax.grid(alpha=0.3)
        row[0].legend(loc="lower right")
    fig.suptitle(f"SmolLM2-135M, WordNet, {res['settings']['budget']} samples, 3 phones at "
                 f"{res['settings']['cpu_shares'][0]:g} of a core")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(res, png: Path) -> str:
    s = res["settings"]
    mach = res["machine"]
    where = f"{mach['cpu']}, {mach['cores']} cores" if isinstance(mach, dict) else mach
    lines = [f"### {s['budget']:,} training samples, seed {s['seed']}", "",
             f"Run {res['date']} on {where}: `{res['command']}`. SmolLM2-135M (`zl-export --mode both`, "
             f"chunks {CHUNKS}), WordNet classification, {s['budget']} training samples (micro-batch {s['micro_batch']} "
             f"x window {s['window']}), seed {s['seed']}, "
             f"three emulated phones at {', '.join(f'{x:g}' for x in s['cpu_shares'])} "
             f"of a core each, links shaped by {s['link_kind']}; held-out accuracy on {s['eval_rows']} test rows after "
             f"every {s['snapshot_every']} windows. Base without adapter: {res['zero_shot']['choice_accuracy']:.3f}.",
             "", "| link | method | LR | final accuracy | training time | samples/s | time to 95% of BP's final | samples then |",
             "|---|---|---|---|---|---|---|---|"]
    for r in res["runs"]:
        hit = r.get("reached")
        when = "not reached" if hit is None else f"{hit['seconds'] / 60:.1f} min"
        lines.append(f"| {r['link']} | {r['method']} | {r['lr']:g} | {r['snapshots'][-1]['choice_accuracy']:.3f} | "
                     f"{r['train_s'] / 60:.1f} min | {r['samples_per_s']:.2f} | {when} | "
                     f"{'-' if hit is None else hit['samples']} |")
    lines += ["", f"![accuracy against time and samples, {s['budget']:,} samples](../bench/results/{png.name})", ""]
    return "\n".join(lines)


def render(results: Path, doc: Path = DOC) -> None:
    """Each run's results file (per_hour_n{budget}_s{seed}.json) gets its plot beside it and a sub-section
    in the docs, by budget then seed, above the hand-written findings."""
    runs = sorted(((json.loads(f.read_text()), f) for f in results.glob("per_hour_n*.json")),
                  key=lambda rf: (rf[0]["settings"]["budget"], rf[0]["settings"]["seed"]))
    if not runs:
        sys.exit(f"bench/per_hour.py: no per_hour_n*.json in {results}; run the benchmark first")
    for res, f in runs:
        plot(res, f.with_suffix(".png"))
    body = "\n".join(markdown(res, f.with_suffix(".png")) for res, f in runs)
    replace_md_section(doc, HEADING, body, "ZeroLock benchmarks", keep_from=KEEP)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--export", default="/tmp/zl_per_hour_export", help="zl-export --mode both of SmolLM2")
    p.add_argument("--make-export", action="store_true")
    p.add_argument("--task", default="wordnet", choices=["wordnet"], help="the classification task")
    p.add_argument("--budget", type=int, default=512, help="training samples")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--methods", default="zerolock,gpipe,1f1b")
    p.add_argument("--links", default="none,50", help="Mbit/s per phone and direction (none: Local); "
                                                      "bench/pipeline.py's latency for each named rate")
    p.add_argument("--lr-zerolock", type=float, default=3e-3, help="the study's choice for zl-last1-lens")
    p.add_argument("--lr-bp", type=float, default=1e-3, help="the study's choice for BP")
    p.add_argument("--alpha", default="0.5,0.5,1", help="ZeroLock's per-stage alpha (zl-last1-lens)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--window", type=int, default=2)
    p.add_argument("--cpu-share", default="0.6")
    p.add_argument("--snapshot-every", type=int, default=8, help="windows between evaluated adapters")
    p.add_argument("--eval-rows", type=int, default=200)
    p.add_argument("--max-seconds", type=float, default=7200)
    p.add_argument("--work", default="/tmp/zl_per_hour")
    p.add_argument("--retrain", action="store_true")
    p.add_argument("--cache", default="/tmp/zl_smollm2_fp32", help="bench/quality.py's fp32 SmolLM2 (built if missing)")
    p.add_argument("--out", default=str(RESULTS), help="folder for per_hour_n{budget}_s{seed}.json and its plot")
    p.add_argument("--render", action="store_true", help="only the plots and the docs section, from --out's results")
    a = p.parse_args(argv)
    if a.render:
        render(Path(a.out))
        return 0

    from bench.common import cpu_shares
    from host.phones import netns

    export, work = Path(a.export), Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    if a.make_export and not (export / "manifest.json").exists():
        make_export(export, a)
    manifest = check_export(export, a)
    try:
        a.shares = cpu_shares(a.cpu_share, 3)
    except ValueError as e:
        p.error(str(e))
    why_not = netns.unavailable()
    a.link_kind = "limiter" if why_not else "netns"
    mbs, data, label_ids, tok = training_rows(export, manifest, a, work)
    rates = [None if r == "none" else float(r) for r in a.links.split(",")]
    runs = []
    for rate in rates:
        for m in a.methods.split(","):
            d = work / f"n{a.budget}-s{a.seed}" / f"{m}-{rate or 'local'}"
            if (d / "run.json").exists() and not a.retrain:
                run = json.loads((d / "run.json").read_text())
                print(f"[{m} @ {run['link']}] kept from {d}", flush=True)
            else:
                run = train(export, mbs, m, rate, a, d)
            runs.append({**run, "dir": str(d)})
    zero = evaluate_runs(runs, export, manifest, data, label_ids, tok, a, work)
    out = Path(a.out) / f"per_hour_n{a.budget}_s{a.seed}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    res = {"date": now_iso(), "machine": machine(), "command": "python bench/per_hour.py " + " ".join(argv or sys.argv[1:]),
           "settings": {"budget": a.budget, "seed": a.seed, "micro_batch": a.micro_batch, "window": a.window,
                        "cpu_shares": a.shares, "link_kind": a.link_kind, "eval_rows": a.eval_rows,
                        "snapshot_every": a.snapshot_every, "alpha": a.alpha},
           "zero_shot": zero, "runs": runs}
    summarise(res)
    out.write_text(json.dumps(res, indent=1))
    render(out.parent)
    for r in runs:
        hit = r.get("reached")
        when = "not reached" if hit is None else f"after {hit['seconds'] / 60:.1f} min ({hit['samples']} samples)"
        print(f"{r['link']:>11} {r['method']:>8}: final {r['snapshots'][-1]['choice_accuracy']:.3f}, "
              f"{r['samples_per_s']:.2f} samples/s, 95% of BP's final {when}")
    print(f"results: {out}, plot: {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

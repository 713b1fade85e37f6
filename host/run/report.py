"""The run report: loss per stage, PSS and temperature per device, active/wait timelines
(the seed's Fig. 7 and Fig. 8 for this run), as PNG plots plus a Markdown summary."""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path


def load_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_report(run_dir: Path, summary: dict) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    recs = load_metrics(run_dir)
    tel = [r for r in recs if r["type"] == "TELEMETRY" and r.get("kind") == "micro_batch"]
    stages = sorted({r["stage"] for r in tel})
    t0 = min((r["phase1_start"] for r in tel), default=0.0)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for k in stages:
        rs = [r for r in tel if r["stage"] == k]
        axes[0].plot([r["micro_batch"] for r in rs if "task_loss" in r], [r["task_loss"] for r in rs if "task_loss" in r],
                     label=f"stage {k}")
        axes[1].plot([r["micro_batch"] for r in rs if "consis_loss" in r],
                     [r["consis_loss"] for r in rs if "consis_loss" in r], label=f"stage {k}")
    axes[0].set(title="task loss (CE) per stage", xlabel="micro-batch", ylabel="loss")
    axes[1].set(title="consistency loss (KL to previous chunk)", xlabel="micro-batch")
    for ax in axes:
        ax.legend()
    fig.tight_layout()
    fig.savefig(run_dir / "loss.png", dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for k in stages:
        rs = [r for r in tel if r["stage"] == k]
        dev = rs[0]["device"] if rs else "?"
        axes[0].plot([r["phase2_end"] - t0 for r in rs], [r.get("pss_bytes", 0) / 2**20 for r in rs], label=f"{dev} (stage {k})")
        temps = [(r["phase2_end"] - t0, r["temperature_c"]) for r in rs if "temperature_c" in r]
        if temps:
            axes[1].plot(*zip(*temps), label=f"{dev} (stage {k})")
    axes[0].set(title="PSS per device", xlabel="time (s)", ylabel="MiB")
    axes[1].set(title="temperature per device" + ("" if any("temperature_c" in r for r in tel) else " (unavailable)"),
                xlabel="time (s)", ylabel="°C")
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.tight_layout()
    fig.savefig(run_dir / "memory.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(11, 1 + 0.6 * max(len(stages), 1)))
    draw_timeline(ax, tel, "stage activity timeline")
    fig.tight_layout()
    fig.savefig(run_dir / "timeline.png", dpi=110)
    plt.close(fig)

    rows = []
    hello = {r["stage"]: r for r in recs if r["type"] == "HELLO"}  # what each stage's device said at the start
    last = defaultdict(dict)
    for r in tel:
        last[r["stage"]] = r
    for k in stages:
        r = last[k]
        first = next(x for x in tel if x["stage"] == k)
        busy = r["active_s"] + r["wait_s"]
        f = _num
        share = hello.get(k, {}).get("cpu_share")
        rows.append(f"| {k} | {r['device']} | {'-' if share is None else f'{share:g}'} | {f(first.get('loss'))} | "
                    f"{f(r.get('loss'))} | {f(r.get('task_loss'))} | "
                    f"{f(r.get('consis_loss'))} | {r.get('pss_bytes', 0) / 2**20:.0f} | "
                    f"{r.get('temperature_c', 'n/a')} | {100 * r['active_s'] / busy if busy else 0:.0f}% |")
    win = [r for r in recs if r["type"] == "TELEMETRY" and r.get("kind") == "window"]
    win_rows = [f"| {r['stage']} | {r['window']} | {r['micro_batches']} | {_num(r.get('task_loss'))} | "
                f"{_num(r.get('consis_loss'))} | {r.get('rss_peak_bytes', 0) / 2**20:.0f} | {r['seconds']:.2f} | "
                f"{100 * r['active_s'] / max(r['active_s'] + r['wait_s'], 1e-9):.0f}% | {r['bytes_out'] / 2**10:.0f} |"
                for r in sorted(win, key=lambda r: (r["stage"], r["window"]))]
    # from the settings where the host has them, else from the stages' window records (zl-dist)
    forward_only = summary.get("forward_only_stages") or sorted({r["stage"] for r in win if r.get("forward_only")})
    md = [f"# ZeroLock run {summary.get('run_id', '')}", "",
          f"- program: `{summary.get('program')}`", f"- data: {summary.get('data')}",
          f"- micro-batches: {summary.get('micro_batches')}, window {summary.get('window_size')}, "
          f"steps {summary.get('windows')}, lr {summary.get('lr')}",
          f"- wall time: {summary.get('seconds', 0):.1f} s, throughput {summary.get('samples_per_s', 0):.2f} samples/s",
          f"- recoveries: {summary.get('recoveries', 0)}",
          *(["- forward-only stages (LR 0: phase 1 only, their LoRA left at the init): "
             + ", ".join(map(str, forward_only))] if forward_only else []),
          *(["- CPU budgets (share of one core, zl-phone --cpu-share): "
             + ", ".join(f"stage {k} {hello[k]['cpu_share']:g}" for k in sorted(hello) if "cpu_share" in hello[k])]
            if any("cpu_share" in h for h in hello.values()) else []), "",
          "| stage | device | CPU share | first loss | last loss | task | consistency | PSS MiB | temp °C | active |",
          "|---|---|---|---|---|---|---|---|---|---|", *rows, "",
          "![loss](loss.png)", "", "![memory](memory.png)", "", "![timeline](timeline.png)", "",
          "## Per update window", "",
          "| stage | window | micro-batches | mean task | mean consistency | peak RSS MiB | seconds | active | KiB out |",
          "|---|---|---|---|---|---|---|---|---|", *win_rows, ""]
    (run_dir / "report.md").write_text("\n".join(md))
    return run_dir / "report.md"


TIMELINE_COLORS = {"phase1": "tab:blue", "phase2": "tab:orange", "step": "tab:green",
                   # backpressure: held back until the downstream commits (waiting, not compute)
                   "wait_downstream": "lightgray"}


def draw_timeline(ax, tel: list[dict], title: str) -> None:
    """Each stage's activity spans (phase 1, phase 2, optimizer step, and in grey the waits for
    the downstream to commit) from micro-batch telemetry records ({"stage", "spans": [(kind,
    start, end)]}) on one axis; gaps are waiting for input."""
    stages = sorted({r["stage"] for r in tel})
    t0 = min((a for r in tel for kind, a, _ in r.get("spans", []) if kind in TIMELINE_COLORS), default=0.0)
    for r in tel:
        for kind, a, b in r.get("spans", []):
            if kind in TIMELINE_COLORS:
                ax.barh(r["stage"], b - a, left=a - t0, color=TIMELINE_COLORS[kind], height=0.6)
    for kind, c in TIMELINE_COLORS.items():
        ax.barh(-10, 0, color=c, label=kind)
    ax.set(ylim=(-0.5, len(stages) - 0.5), yticks=stages, yticklabels=[f"stage {k}" for k in stages],
           xlabel="time (s); grey: waiting for the downstream to commit; gaps: waiting for input", title=title)
    ax.legend(loc="upper right", ncol=3, fontsize=8)


def _num(v) -> str:
    return "-" if v is None else f"{v:.4f}"

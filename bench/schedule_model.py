"""Three and four stages from two: the schedules replayed on measured phase times (issue 7).

Throughput with three and four stages needs each stage on its own cores, which this 2-core
machine does not have. This script takes a measured 2-stage run of bench/pipeline.py (every
method's stage timelines on the Local link), derives each stage's phase durations from them, and
replays the same schedules (host/pipeline_model.py: zl_mobile/schedules.py's action streams, the
links' rate, delay and credits) for 2, 3 and 4 stages on every link of the run.

First it checks itself: the 2-stage predictions against the run's measured throughput on every
link (the durations come from the same runs, so what is checked is the schedules' waits and the
links' rate, delay and credits, not the durations). Then it
predicts 3 and 4 stages: stage 0 and the last stage keep their measured times; a middle stage gets
ZeroLock's last stage's times (it reads out and has a KL term like a middle one), and the BP
baselines' stage 0 times (a middle BP stage also returns dL/dh_{k-1}, a few % more, so this leans
towards the baselines). Predictions, not measurements: the device machine's run of
bench/pipeline.py --stages 3|4 measures them.

  python bench/schedule_model.py [--from bench/results/pipeline.json] [--stages 2,3,4]
Results: bench/results/schedule_model.json, plot bench/results/schedule_model.png.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import REPO, now_iso  # noqa: E402

from host.pipeline_model import LinkModel, StageTimes, simulate  # noqa: E402

BASELINES = ("gpipe", "1f1b", "pipedream")
TARGETS = {"gpipe": 1.6, "1f1b": 1.6, "pipedream": 1.05}  # issue 7's throughput targets at b=8, m=4


def stage_times(timelines: list[list], n_stages: int) -> list[StageTimes]:
    """Median phase durations per stage over runs' telemetry spans; the time between spans that
    is neither compute nor waiting (telemetry, PSS reads, publishing) goes to phase 2, after which
    the stage spends it."""
    out = []
    for k in range(n_stages):
        dur = {name: [] for name in ("phase1", "phase2", "step")}
        gaps = []
        for timeline in timelines:
            spans = sorted((s for r in timeline if r["stage"] == k for s in r["spans"]), key=lambda s: s[1])
            for name, a, b in spans:
                if name in dur:
                    dur[name].append(b - a)
            n2 = sum(1 for s in spans if s[0] == "phase2")
            gaps.append(sum(max(0.0, spans[j + 1][1] - spans[j][2]) for j in range(len(spans) - 1)) / max(1, n2))
        out.append(StageTimes(forward=statistics.median(dur["phase1"]),
                              phase2=statistics.median(dur["phase2"]) + statistics.median(gaps),
                              step=statistics.median(dur["step"]) if dur["step"] else 0.0))
    return out


def deeper(times: list[StageTimes], method: str, n: int) -> list[StageTimes]:
    """n stages from a measured first and last stage (see the module docstring for the middle)."""
    if n == len(times):
        return times
    middle = times[-1] if method == "zerolock" else times[0]
    return [times[0]] + [middle] * (n - 2) + [times[-1]]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--from", dest="src", type=Path, default=REPO / "bench/results/pipeline.json",
                    help="a bench/pipeline.py result with every method on the Local link")
    ap.add_argument("--stages", default="2,3,4")
    ap.add_argument("--windows", type=int, default=8, help="windows simulated (steady state: after the first)")
    ap.add_argument("--out", type=Path, default=REPO / "bench/results/schedule_model.json")
    a = ap.parse_args(argv)
    try:
        src = json.loads(a.src.read_text())
    except (OSError, json.JSONDecodeError) as e:
        ap.error(f"cannot read {a.src} ({e}): run bench/pipeline.py first")
    st = src["settings"]
    n_meas, m, mb, depth = st["stages"], st["window_size"], st["micro_batch"], st["inflight_depth"]
    local = {r["method"]: r for r in src["runs"] if r["rate_mbit"] is None}
    methods = [x for x in ("zerolock", *BASELINES) if x in local]
    if "zerolock" not in local or len(methods) < 2:
        ap.error(f"{a.src} has no Local-link runs of ZeroLock and a baseline: run bench/pipeline.py with its defaults")
    # phase times per (method, link) over that setting's repetitions: what a link costs a stage's
    # compute (the kernel's side of a transfer runs on the sending phone's core) is in them
    raw = [r for r in src.get("raw_runs") or src["runs"] if r["method"] in methods]
    times = {}
    for key in dict.fromkeys((r["method"], r["rate_mbit"]) for r in raw):
        times[key] = stage_times([r["timeline"] for r in raw if (r["method"], r["rate_mbit"]) == key], n_meas)
    zl = local["zerolock"]
    frame = zl["link_bytes"] // (st["windows"] * m * (n_meas - 1))  # one hidden state with its extras
    links = sorted({(r["rate_mbit"], r.get("delay_ms", 0.0)) for r in src["runs"]},
                   key=lambda x: -(x[0] or 1e9))
    stage_counts = [int(s) for s in a.stages.split(",")]

    def name(rate, delay):
        return "Local" if rate is None else f"{rate:g} Mbit/s, {delay:g} ms"

    rows = []
    for n in stage_counts:
        for rate, delay in links:
            link = LinkModel(rate, (delay or 0.0) / 1e3, frame)
            pred = {x: simulate(x, deeper(times.get((x, rate), times[x, None]), x, n), m, a.windows, link,
                                depth).throughput(mb, m) for x in methods}
            meas = {r["method"]: r["throughput_sps"] for r in src["runs"]
                    if n == n_meas and r["rate_mbit"] == rate}
            rows.append({"stages": n, "rate_mbit": rate, "delay_ms": delay, "predicted_sps": pred,
                         "measured_sps": meas or None,
                         "predicted_ratio": {x: pred["zerolock"] / pred[x] for x in methods if x != "zerolock"},
                         "measured_ratio": {x: meas["zerolock"] / meas[x] for x in meas if x != "zerolock"}
                         if "zerolock" in meas else None})

    print(f"phase times from {a.src} ({src['date']}, {n_meas} stages, b={m * mb}, m={m}), ms per stage "
          "(F / phase 2 with bookkeeping / STEP):")
    for (x, rate), ts in times.items():
        print(f"  {x:9s} {name(rate, dict(links)[rate]):22s} "
              + "  ".join(f"s{k}: {t.forward * 1e3:.0f} / {t.phase2 * 1e3:.0f} / {t.step * 1e3:.0f}"
                          for k, t in enumerate(ts)))
    print(f"hidden state frame {frame} bytes, inflight depth {depth}")
    print("\nZeroLock / baseline throughput, predicted (measured):")
    for r in rows:
        cells = []
        for x in methods[1:]:
            p = r["predicted_ratio"][x]
            q = (r["measured_ratio"] or {}).get(x)
            cells.append(f"{x} {p:.2f}" + (f" ({q:.2f})" if q else ""))
        print(f"  {r['stages']} stages, {name(r['rate_mbit'], r['delay_ms']):22s} " + ", ".join(cells))
    # each measured run against the model fed with its own phase times: only the waits are predicted
    check = []
    for r in raw:
        link = LinkModel(r["rate_mbit"], (r.get("delay_ms") or 0.0) / 1e3, frame)
        pred = simulate(r["method"], stage_times([r["timeline"]], n_meas), m, a.windows, link, depth).throughput(mb, m)
        check.append({"method": r["method"], "rate_mbit": r["rate_mbit"], "predicted_sps": pred,
                      "measured_sps": r["throughput_sps"], "error": pred / r["throughput_sps"] - 1})
    errs = [abs(c["error"]) for c in check]
    print(f"\n{n_meas}-stage check, each run against the model on its own phase times ({len(errs)} runs): "
          f"median error {statistics.median(errs) * 100:.0f}%, max {max(errs) * 100:.0f}%")

    result = {"date": now_iso(), "source": str(a.src), "source_date": src["date"], "settings": st,
              "frame_bytes": frame, "windows_simulated": a.windows, "check": check,
              "stage_times_s": [{"method": x, "rate_mbit": rate, "stages": [t.__dict__ for t in ts]}
                                for (x, rate), ts in times.items()], "rows": rows,
              "plot": plot(rows, methods, stage_counts, a.out.with_suffix(".png"), name)}
    a.out.write_text(json.dumps(result, indent=2))
    print(f"results: {a.out}")
    return 0


def plot(rows, methods, stage_counts, path: Path, name) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from pipeline import save_figure

    links = list(dict.fromkeys((r["rate_mbit"], r["delay_ms"]) for r in rows))
    fig, axes = plt.subplots(1, len(methods) - 1, figsize=(4 * (len(methods) - 1), 3.6), squeeze=False, sharey=True)
    for ax, x in zip(axes[0], methods[1:]):
        for rate, delay in links:
            ys = [next(r["predicted_ratio"][x] for r in rows if r["stages"] == n and r["rate_mbit"] == rate)
                  for n in stage_counts]
            line, = ax.plot(stage_counts, ys, marker="o", label=name(rate, delay))
            for n in stage_counts:
                q = next(((r["measured_ratio"] or {}).get(x) for r in rows
                          if r["stages"] == n and r["rate_mbit"] == rate), None)
                if q:
                    ax.plot([n], [q], marker="x", color=line.get_color(), markersize=9)
        ax.axhline(TARGETS[x], ls="--", color="gray", lw=1)
        ax.text(stage_counts[0], TARGETS[x], f" target {TARGETS[x]:g}x", va="bottom", fontsize=7, color="gray")
        ax.set_title(f"ZeroLock / {x}")
        ax.set_xlabel("stages")
        ax.set_xticks(stage_counts)
    axes[0][0].set_ylabel("throughput ratio (o predicted, x measured)")
    axes[0][0].legend(fontsize=7)
    return save_figure(fig, path)


if __name__ == "__main__":
    raise SystemExit(main())

"""Three and four stages from two: the schedules replayed on measured phase times (issue 7).

Throughput with three and four stages needs each stage on its own cores, which this 2-core
machine does not have. This script takes a measured 2-stage run of bench/pipeline.py (every
method's stage timelines on the Local link), derives each stage's phase durations from them, and
replays the same schedules (host/planning/schedule_simulator.py: zl_mobile/schedules.py's action streams, the
links' rate, delay and credits) for 2, 3 and 4 stages on every link of the run.

First it checks itself: the 2-stage predictions against the run's measured throughput on every
link (the durations come from the same runs, so what is checked is the schedules' waits and the
links' rate, delay and credits, not the durations). Then it
predicts 3 and 4 stages: stage 0 and the last stage keep their measured times; a middle stage gets
ZeroLock's last stage's times (it reads out and has a KL term like a middle one), and the BP
baselines' stage 0 times (a middle BP stage also returns dL/dh_{k-1}, a few % more, so this leans
towards the baselines). Predictions, not measurements: the device machine's run of
bench/pipeline.py --stages 3|4 measures them.

With `--measured` (bench/pipeline.py results at three and four stages, issue 18) the predictions
are checked against measurements: predicted vs measured throughput per method, stage count and
link, a flag where they differ by more than 10%, and each measured run against the model fed its
own phase times (so a miss can be put down to the phase times or to the schedule and links). The
2-stage run's phase times are scaled by the CPU shares of the two runs (a budgeted phase takes
1/share of its unbudgeted time; a pinned, unbudgeted phone counts as a share of 1.0), so a 2-stage
run whose phones are budgeted like the deeper one's, on chunks of the same depth
(bench/pipeline.py --layers-per-stage), is the right source.

  python bench/schedule_model.py [--from bench/results/pipeline.json] [--stages 2,3,4]
        [--measured bench/results/pipeline_3stages.json,bench/results/pipeline_4stages.json]
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

from host.planning.schedule_simulator import LinkModel, StageTimes, simulate  # noqa: E402

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


def shares_of(settings: dict, n: int) -> list[float]:
    """Each stage's CPU share in a bench/pipeline.py run (1.0: pinned to a core of its own)."""
    return list(settings.get("cpu_shares") or [1.0] * n)


def scaled(times: list[StageTimes], src_share: float, shares: list[float]) -> list[StageTimes]:
    """Phase times measured at `src_share` of a core, as they would be at each stage's share."""
    return [StageTimes(t.forward * src_share / q, t.phase2 * src_share / q, t.step * src_share / q)
            for t, q in zip(times, shares)]


def self_check(run_list: list, n: int, m: int, mb: int, depth: int, frame: int, windows: int) -> list[dict]:
    """Each measured run against the model fed its own phase times: only the waits are predicted."""
    out = []
    for r in run_list:
        link = LinkModel(r["rate_mbit"], (r.get("delay_ms") or 0.0) / 1e3, frame)
        pred = simulate(r["method"], stage_times([r["timeline"]], n), m, windows, link, depth).throughput(mb, m)
        out.append({"method": r["method"], "stages": n, "rate_mbit": r["rate_mbit"], "rep": r.get("rep"),
                    "predicted_sps": pred, "measured_sps": r["throughput_sps"], "error": pred / r["throughput_sps"] - 1})
    return out


def frame_bytes(src: dict) -> int:
    """One hidden state with its extras, from ZeroLock's Local run's link bytes."""
    st = src["settings"]
    zl = next(r for r in src["runs"] if r["method"] == "zerolock" and r["rate_mbit"] is None)
    return zl["link_bytes"] // (st["windows"] * st["window_size"] * (st["stages"] - 1))


def check_measured(path: Path, times: dict, src_share: float, frame: int, windows: int, name) -> dict:
    """Predictions for the stage count of a measured bench/pipeline.py result, against it."""
    meas = json.loads(path.read_text())
    st = meas["settings"]
    n, m, mb, depth = st["stages"], st["window_size"], st["micro_batch"], st["inflight_depth"]
    shares = shares_of(st, n)
    rows = []
    for r in meas["runs"]:
        x, rate = r["method"], r["rate_mbit"]
        base = times.get((x, rate)) or times.get((x, None))
        if base is None:
            continue
        link = LinkModel(rate, (r.get("delay_ms") or 0.0) / 1e3, frame)
        pred = simulate(x, scaled(deeper(base, x, n), src_share, shares), m, windows, link, depth).throughput(mb, m)
        got = r["throughput_sps"]
        rows.append({"method": x, "stages": n, "rate_mbit": rate, "delay_ms": r.get("delay_ms"), "predicted_sps": pred,
                     "measured_sps": got, "measured_min": r.get("throughput_sps_min", got),
                     "measured_max": r.get("throughput_sps_max", got), "reps": r.get("reps", 1),
                     "error": pred / got - 1, "over_10pct": abs(pred / got - 1) > 0.10})
    for row in rows:  # ratios ZeroLock / baseline, predicted and measured
        z = next((q for q in rows if q["method"] == "zerolock" and q["rate_mbit"] == row["rate_mbit"]), None)
        if z and row["method"] != "zerolock":
            row["predicted_ratio"] = z["predicted_sps"] / row["predicted_sps"]
            row["measured_ratio"] = z["measured_sps"] / row["measured_sps"]
    raw = meas.get("raw_runs") or meas["runs"]
    check = self_check(raw, n, m, mb, depth, frame_bytes(meas), windows)
    print(f"\n{n} stages measured in {path} ({meas['date']}, CPU shares {shares}): predicted vs measured samples/s")
    print("| method | link | predicted | measured (min-max) | error | ratio predicted / measured |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        ratio = (f"{row['predicted_ratio']:.2f} / {row['measured_ratio']:.2f}" if "predicted_ratio" in row else "-")
        print(f"| {row['method']} | {name(row['rate_mbit'], row['delay_ms'])} | {row['predicted_sps']:.2f} | "
              f"{row['measured_sps']:.2f} ({row['measured_min']:.2f}-{row['measured_max']:.2f}) | "
              f"{row['error'] * 100:+.0f}%{' **>10%**' if row['over_10pct'] else ''} | {ratio} |")
    errs = [abs(c["error"]) for c in check]
    print(f"  the same runs on their own phase times ({len(errs)} runs): median error "
          f"{statistics.median(errs) * 100:.0f}%, max {max(errs) * 100:.0f}%: where this is small and the row above is "
          "not, the miss is in the phase times carried over (depth, share, middle stages), not in the schedule or links")
    return {"source": str(path), "date": meas["date"], "stages": n, "cpu_shares": shares, "rows": rows,
            "own_phase_times_check": check}


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
    ap.add_argument("--measured", default=None,
                    help="bench/pipeline.py results at 3 and/or 4 stages (comma-separated) to check the predictions against")
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
    frame = frame_bytes(src)  # one hidden state with its extras
    src_shares = shares_of(st, n_meas)
    src_share = statistics.mean(src_shares)
    links = sorted({(r["rate_mbit"], r.get("delay_ms", 0.0)) for r in src["runs"]},
                   key=lambda x: -(x[0] or 1e9))
    stage_counts = [int(s) for s in a.stages.split(",")]

    def name(rate, delay):
        return "Local" if rate is None else f"{rate:g} Mbit/s, {delay:g} ms"

    # a stage count that was measured is predicted at that run's CPU shares, any other at the source's
    at_shares = {}
    for path in (a.measured.split(",") if a.measured else []):
        try:
            mst = json.loads(Path(path).read_text())["settings"]
            at_shares[mst["stages"]] = shares_of(mst, mst["stages"])
        except (OSError, json.JSONDecodeError, KeyError) as e:
            ap.error(f"--measured {path}: cannot read it as a bench/pipeline.py result ({type(e).__name__}: {e})")
    rows = []
    for n in stage_counts:
        for rate, delay in links:
            link = LinkModel(rate, (delay or 0.0) / 1e3, frame)
            pred = {x: simulate(x, scaled(deeper(times.get((x, rate), times[x, None]), x, n), src_share,
                                          at_shares.get(n, [src_share] * n)), m, a.windows, link,
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
    check = self_check(raw, n_meas, m, mb, depth, frame, a.windows)
    errs = [abs(c["error"]) for c in check]
    print(f"\n{n_meas}-stage check, each run against the model on its own phase times ({len(errs)} runs): "
          f"median error {statistics.median(errs) * 100:.0f}%, max {max(errs) * 100:.0f}%")

    measured = []
    for path in (a.measured.split(",") if a.measured else []):
        try:
            measured.append(check_measured(Path(path), times, src_share, frame, a.windows, name))
        except (OSError, json.JSONDecodeError, KeyError) as e:
            ap.error(f"--measured {path}: cannot read it as a bench/pipeline.py result ({type(e).__name__}: {e})")
        for row in measured[-1]["rows"]:  # the measured ratios go beside the predicted ones (plot, rows)
            for r in rows:
                if r["stages"] == row["stages"] and r["rate_mbit"] == row["rate_mbit"] and "measured_ratio" in row:
                    r["measured_ratio"] = {**(r["measured_ratio"] or {}), row["method"]: row["measured_ratio"]}

    result = {"date": now_iso(), "source": str(a.src), "source_date": src["date"], "settings": st,
              "source_cpu_shares": src_shares, "measured": measured,
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

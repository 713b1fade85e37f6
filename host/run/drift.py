"""Is the run still the one that was planned? Stage times from telemetry against the plan.

A phone that heats up and throttles, or gets busy with something else, slows its stage, and the
pipeline with it. After every update window each stage reports its phase times; the watch takes a
stage's time per micro-batch (phase 1 + phase 2 + its share of the window's step), and when the
slowest stage's measured time is more than `margin` off the plan's bottleneck (or another stage
has become the slowest by that much) it says so, and what a re-plan would gain: the profiles
rescaled by each phone's measured / predicted ratio, planned again."""
from __future__ import annotations

from typing import Callable


class DriftWatch:
    def __init__(self, plan: dict, replan: Callable[[dict], object] | None, margin: float = 0.15,
                 report: Callable[[dict], None] | None = None, skip_windows: int = 1):
        """`plan`: a plan file's contents (zl-host plan); `replan(scales)`: the plan for phone ->
        slowdown factor (host.cli.plan.make_plan's plan), or None to skip that part."""
        self.plan = plan
        self.replan = replan
        self.margin = margin
        self.report = report or (lambda rec: None)
        self.skip = skip_windows  # the first window warms the runtime up
        self.predicted = [s["time_s"] for s in plan["stages"]]
        self.devices = plan["devices"]
        self.measured: dict[int, dict[int, float]] = {}  # window -> stage -> seconds per micro-batch
        self.reports: list[dict] = []
        self._reported_at: float | None = None

    def on_event(self, kind: str, data: dict) -> None:
        if kind != "telemetry" or data.get("kind") != "window" or data.get("window", 0) < self.skip:
            return
        n = data.get("micro_batches") or 1
        if "seconds" in data and "wait_s" in data:  # busy time (wall less waits), as host.planning.profile measures it
            per_mb = (data["seconds"] - data["wait_s"]) / n
        else:
            per_mb = (data.get("phase1_s", 0.0) + data.get("phase2_s", 0.0) + data.get("step_s", 0.0)) / n
        w = data["window"]
        self.measured.setdefault(w, {})[data["stage"]] = per_mb
        if len(self.measured[w]) == len(self.predicted):
            self.check(w, self.measured.pop(w))

    def check(self, window: int, stages: dict[int, float]) -> dict | None:
        measured = [stages[k] for k in range(len(self.predicted))]
        k_meas = max(range(len(measured)), key=measured.__getitem__)
        k_plan = self.plan["bottleneck_stage"]
        planned = self.plan["bottleneck_s"]
        drift = measured[k_meas] / planned - 1
        if abs(drift) <= self.margin:
            self._reported_at = None
            return None
        if self._reported_at is not None and abs(drift - self._reported_at) <= self.margin:
            return None  # said already; say it again only when it moved by another margin
        self._reported_at = drift
        rec = {"window": window, "planned_bottleneck_s": planned, "planned_stage": k_plan,
               "measured_bottleneck_s": measured[k_meas], "measured_stage": k_meas, "drift": drift,
               "measured_s": measured, "predicted_s": self.predicted}
        if self.replan is not None:
            scales = {self.devices[k]: measured[k] / self.predicted[k] for k in range(len(measured))
                      if self.predicted[k] > 0}
            try:
                new = self.replan(scales)
            except Exception as e:  # an infeasible re-plan is a finding, not a crash
                rec["replan_error"] = str(e)
            else:
                rec.update(replan_chunks=new.chunks, replan_devices=new.devices, replan_bottleneck_s=new.bottleneck_s,
                           replan_gain=measured[k_meas] / new.bottleneck_s)
        self.reports.append(rec)
        self.report(rec)
        return rec


def describe(rec: dict) -> str:
    """One line for the console."""
    line = (f"drift: window {rec['window']}: stage {rec['measured_stage']} takes {rec['measured_bottleneck_s'] * 1e3:.1f} ms "
            f"per micro-batch, the plan's bottleneck (stage {rec['planned_stage']}) was "
            f"{rec['planned_bottleneck_s'] * 1e3:.1f} ms ({rec['drift']:+.0%})")
    if "replan_gain" in rec:
        line += (f"; a re-plan ({rec['replan_chunks']} on {','.join(rec['replan_devices'])}) would take "
                 f"{rec['replan_bottleneck_s'] * 1e3:.1f} ms: {rec['replan_gain']:.2f}x the throughput "
                 "(zl-host profile again, then zl-host plan)")
    elif "replan_error" in rec:
        line += f"; no re-plan fits: {rec['replan_error']}"
    return line

"""Live progress of a run (rich): per stage window, step, losses, PSS, temperature, activity."""
from __future__ import annotations

import time

from rich.table import Table


class LiveView:
    def __init__(self, num_stages: int, total_micro_batches: int, micro_batch_rows: int):
        self.total = total_micro_batches
        self.rows = micro_batch_rows
        self.stages = {k: {} for k in range(num_stages)}
        self.notes: list[str] = []
        self.t0 = time.time()

    def on_event(self, kind: str, data: dict) -> None:
        if kind == "telemetry" and data.get("kind") == "micro_batch":
            self.stages[data["stage"]] = data
        elif kind in ("failure", "rejoined", "caught_up", "error", "waiting"):
            self.notes.append(f"{time.strftime('%H:%M:%S')} {kind}: " + ", ".join(
                f"{k}={v}" for k, v in data.items()
                if k in ("stage", "device", "why", "message", "resumed_after_window")))
            self.notes = self.notes[-4:]

    def __rich__(self):
        done = min((s.get("micro_batch", -1) + 1 for s in self.stages.values()), default=0)
        elapsed = time.time() - self.t0
        rate = done * self.rows / elapsed if elapsed > 0 else 0.0
        left = (self.total - done) * self.rows / rate if rate > 0 else float("nan")
        t = Table(title=f"ZeroLock: {done}/{self.total} micro-batches through every stage, {rate:.2f} samples/s, "
                        f"{elapsed:.0f} s elapsed, ~{left:.0f} s left", caption="\n".join(self.notes) or None)
        for col in ("stage", "device", "window", "step", "task loss", "consis loss", "PSS MiB", "temp °C", "active"):
            t.add_column(col, justify="right")
        for k, s in sorted(self.stages.items()):
            if not s:
                t.add_row(str(k), "-", "-", "-", "-", "-", "-", "-", "-")
                continue
            busy = s["active_s"] + s["wait_s"]
            t.add_row(str(k), s["device"], str(s["window"]), str(s["step"]), _fmt(s.get('task_loss')),
                      _fmt(s.get('consis_loss')), f"{s.get('pss_bytes', 0) / 2**20:.0f}",
                      f"{s['temperature_c']:.1f}" if "temperature_c" in s else "n/a",
                      f"{100 * s['active_s'] / busy:.0f}%" if busy else "-")
        return t


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.4f}"

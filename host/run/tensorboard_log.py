"""TensorBoard event files in the run directory, written as the run goes, so `tensorboard
--logdir runs` shows a running pipeline's curves live (each run directory is a TensorBoard run).

Fed the records the coordinator writes to metrics.jsonl (its on_event), one scalar series per
metric and stage, grouped by metric so the stages share a chart:
  per micro-batch (step: micro-batch): loss, task_loss, consistency_loss, pss_mib, temperature_c,
      link_mib_out (the stage's link bytes so far), link_mib_in, active_fraction (active / (active
      + waiting) so far)
  per update window (step: window): samples_per_s, active_s, wait_s, link_kib_out
  zl-host eval (step: the run's micro-batches): eval/nll, eval/accuracy, and the base model's."""
from __future__ import annotations

from pathlib import Path

# the writer's own flush period (s): short, so a watching TensorBoard sees the curves move
FLUSH_SECS = 5


def _writer(log_dir: Path):
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=str(log_dir), flush_secs=FLUSH_SECS)


class RunEvents:
    """on_event(kind, record) -> scalars; close() at the end."""

    def __init__(self, run_dir: Path, micro_batch_rows: int):
        self.rows = micro_batch_rows
        self.w = _writer(Path(run_dir))

    def on_event(self, kind: str, rec: dict) -> None:
        if kind != "telemetry" or "stage" not in rec:
            return
        k, what = rec["stage"], rec.get("kind", "micro_batch")
        if what == "micro_batch" and "micro_batch" in rec:
            self._micro_batch(f"stage{k}", rec)
        elif what == "window" and "window" in rec:
            self._window(f"stage{k}", rec)
        elif what == "adb_dumpsys":  # sampled over adb, on the host's clock
            step = int(rec.get("time_ms", 0) // 1000)
            self._some(f"stage{k}", step, rec)

    def _some(self, s: str, step: int, rec: dict) -> None:
        if rec.get("pss_bytes"):
            self.w.add_scalar(f"pss_mib/{s}", rec["pss_bytes"] / 2**20, step)
        if rec.get("temperature_c") is not None:
            self.w.add_scalar(f"temperature_c/{s}", float(rec["temperature_c"]), step)

    def _micro_batch(self, s: str, rec: dict) -> None:
        step = int(rec["micro_batch"])
        for key, tag in (("loss", "loss"), ("task_loss", "task_loss"), ("consis_loss", "consistency_loss")):
            if rec.get(key) is not None:
                self.w.add_scalar(f"{tag}/{s}", float(rec[key]), step)
        self._some(s, step, rec)
        if "bytes_out" in rec:
            self.w.add_scalar(f"link_mib_out/{s}", rec["bytes_out"] / 2**20, step)
        if "bytes_in" in rec:
            self.w.add_scalar(f"link_mib_in/{s}", rec["bytes_in"] / 2**20, step)
        busy = rec.get("active_s", 0.0) + rec.get("wait_s", 0.0)
        if busy > 0:
            self.w.add_scalar(f"active_fraction/{s}", rec["active_s"] / busy, step)

    def _window(self, s: str, rec: dict) -> None:
        step = int(rec["window"])
        if rec.get("seconds"):
            self.w.add_scalar(f"samples_per_s/{s}", rec.get("micro_batches", 0) * self.rows / rec["seconds"], step)
        for key in ("active_s", "wait_s"):
            if key in rec:
                self.w.add_scalar(f"{key}/{s}", float(rec[key]), step)
        if "bytes_out" in rec:
            self.w.add_scalar(f"link_kib_out/{s}", rec["bytes_out"] / 2**10, step)

    def close(self) -> None:
        self.w.close()


def write_eval(run_dir: Path, before: dict, after: dict, step: int) -> None:
    """zl-host eval's held-out metrics into the run's TensorBoard (next to its training curves)."""
    w = _writer(Path(run_dir))
    try:
        for name, m in (("adapter", after), ("base", before)):
            w.add_scalar(f"eval/nll_{name}", m["nll"], step)
            w.add_scalar(f"eval/accuracy_{name}", m["accuracy"], step)
    finally:
        w.close()


def eval_run_dir(adapter: Path) -> Path | None:
    """The run directory an adapter was trained in (adapter/ of a zl-host run), or None."""
    run = Path(adapter).absolute().parent
    return run if (run / "run.json").is_file() else None

"""What `zl-host run` is asked to do, as one object: built from the command line (`from_args`) or
in code (benches, tests) with the same names and defaults, and checked before anything starts.
The run itself (host/run_job.py) takes only this object, as peft's models take their configs."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields

from .cli_error import CliError

HELD_OUT = 0.2  # the default share of the data kept out of training (the last micro-batches)


@dataclass
class RunConfig:
    program: str | None = None        # zl-export output dir (None only with resume)
    data: str | None = None           # AG News CSV, JSONL, wordnet[:split]; None: the tiny model's synthetic set
    devices: str = "auto"             # auto | emulated:N | NAME,... | SERIAL,...
    steps: int = 8                    # optimizer steps (update windows) ...
    epochs: float | None = None       # ... or passes over the training data ...
    micro_batches: int | None = None  # ... or total micro-batches
    window: int = 4                   # micro-batches per update window
    held_out: float = HELD_OUT
    inflight: int = 2
    replay_horizon: int | None = None
    lr: float | list = 2e-3  # one value or one per stage
    alpha: float | list | None = None  # override of the export's alpha: one value or one per stage
    out: str | None = None             # run dir (default runs/TIMESTAMP)
    resume: str | None = None          # continue the run in this dir (its run.json wins over the rest)
    tokens: str | None = None          # JSON file NAME -> pairing token
    wait: float = 30.0
    mdns: str = "loopback"
    adb_data_port: int = 47475
    adb_staging: str = "/data/local/tmp/zerolock"
    link_mbit: float | None = None     # emulated phones: link rate per direction ...
    link_delay_ms: float = 0.0         # ... and one-way latency
    cpu_share: str | None = None       # emulated phones: F or F1,...,FN of one core
    mem_limit: str | None = None       # emulated phones: one limit or one per phone
    runtime: str | None = None         # emulated phones: python | kotlin, or one per phone (host/kotlin_phone.py)
    heartbeat_timeout: float = 5.0
    recovery: str = "local"            # or global-rollback (the BP baseline's)
    inject_failure: list[str] = field(default_factory=list)
    plan: str | None = None            # a zl-host plan file
    drift_margin: float = 0.15

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> "RunConfig":
        """The options `zl-host run` parsed; anything the parser lacks keeps its default."""
        given = {f.name: getattr(a, f.name) for f in fields(cls) if getattr(a, f.name, None) is not None}
        return cls(**given)

    def windows_for(self, train_micro_batches: int) -> int:
        """Update windows to run: --steps, or as many as --micro-batches or --epochs take."""
        if self.micro_batches:
            return max(1, self.micro_batches // self.window)
        if self.epochs:
            return max(1, round(self.epochs * train_micro_batches / self.window))
        return self.steps

    def emulated_count(self) -> int | None:
        """N of --devices emulated:N (None for other devices), refused unless a whole number >= 1."""
        if not self.devices.startswith("emulated:"):
            return None
        return emulated_count(self.devices)

    def failures(self) -> list[dict]:
        return parse_failures(self.inject_failure)


def emulated_count(spec: str) -> int:
    """N of --devices emulated:N: a whole number of phones, at least 1."""
    text = spec.split(":", 1)[1].strip()
    if not (text.isascii() and text.isdigit()) or int(text) < 1:
        raise CliError(f"--devices {spec!r}: N in emulated:N must be a whole number of phones (at least 1), "
                       "e.g. --devices emulated:3")
    return int(text)


def parse_failures(specs: list[str] | None) -> list[dict]:
    """--inject-failure specs -> the coordinator's failure records, each checked."""
    from zl_mobile.assign_rules import FAILURE_DETECTS, FAILURE_MODES
    from zl_mobile.stage import FAILURE_POINTS, SLOW_POINT

    out = []
    for spec in specs or []:
        try:
            d = dict(part.split("=", 1) for part in spec.split(","))
            point = d.get("point", "after-phase1")
            if point == SLOW_POINT:  # not a failure: a slower phone (every phase 1 takes `seconds` more)
                f = {"stage": int(d["stage"]), "point": point, "seconds": float(d["seconds"])}
                if "window" in d:
                    f["window"] = int(d["window"])
            else:
                f = {"stage": int(d["stage"]), "window": int(d["window"]), "point": point,
                     **{k: d[k] for k in ("mode", "detect") if k in d}}
        except (KeyError, ValueError):
            raise CliError(f"--inject-failure {spec!r}: expected stage=K,window=W[,point=...][,mode=process|app]"
                           f"[,detect=connection|heartbeat] (or stage=K,point={SLOW_POINT},seconds=S[,window=W])") from None
        if f["point"] not in (*FAILURE_POINTS, SLOW_POINT):
            raise CliError(f"--inject-failure point {f['point']!r}: use one of {', '.join((*FAILURE_POINTS, SLOW_POINT))}")
        for key, allowed in (("mode", FAILURE_MODES), ("detect", FAILURE_DETECTS)):
            if f.get(key, allowed[0]) not in allowed:
                raise CliError(f"--inject-failure {key} {f[key]!r}: use one of {', '.join(allowed)}")
        if f.get("detect", "connection") != "connection" and f.get("mode") != "app":
            raise CliError(f"--inject-failure {spec!r}: detect=heartbeat needs mode=app (a killed process always "
                           "drops its connection)")
        out.append(f)
    return out

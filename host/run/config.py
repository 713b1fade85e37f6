"""What `zl-host run` is asked to do, as one object: built from the command line (`from_args`) or
in code (benches, tests) with the same names and defaults, and checked before anything starts.
The run itself (host/run/job.py) takes only this object, as peft's models take their configs.

Each field is the one definition of its option: default, value parser and help text; the parser
of `zl-host run` is made from them (`add_run_options`), and `zl-host finetune` takes the ones it
shares. The training settings the coordinator also needs (steps, window, LR, ...) take their
defaults from host/run/settings.py's RunSettings, so the command line and code agree."""
from __future__ import annotations

import argparse
from dataclasses import MISSING, dataclass, field, fields

from ..cli.error import CliError
from ..cli.option_types import alphas, fraction, lrs, non_negative, positive
from .settings import RECOVERIES, RunSettings

HELD_OUT = 0.2  # the default share of the data kept out of training (the last micro-batches)


def option(default, help: str | None = None, *, type=None, metavar: str | None = None, choices=None,
           append: bool = False):
    """A RunConfig field that is also `--name` on the command line (underscores become dashes)."""
    meta = {"help": help, "type": type, "metavar": metavar, "choices": choices, "append": append}
    if append:  # repeatable: the parser collects a list (None when never given)
        return field(default_factory=list, metadata=meta)
    return field(default=default, metadata=meta)


_EMULATED = "with --devices emulated:N: "


@dataclass
class RunConfig:
    program: str | None = option(None, "zl-export output dir")  # None only with resume
    data: str | None = option(None, "AG News CSV, JSONL, Parquet, or wordnet[:validation|test] "
                                    "(WordNet noun glosses by category); omit for the tiny model's synthetic set")
    devices: str = option("auto", "auto | emulated:N | NAME,NAME,...")  # or SERIAL,...
    steps: int = option(RunSettings.windows, "optimizer steps (update windows)", type=int)
    epochs: float | None = option(None, "instead of --steps: passes over the training data", type=float)
    micro_batches: int | None = option(None, "instead of --steps: total micro-batches", type=int)
    window: int = option(RunSettings.window_size, "micro-batches per update window", type=int)
    held_out: float = option(HELD_OUT, "fraction of the micro-batches kept out of training, the last ones (default "
                                       "%(default)s; 0: train on all, for data split beforehand)", type=fraction)
    inflight: int = option(RunSettings.inflight_depth, "hidden states in flight between neighbours", type=int)
    replay_horizon: int | None = option(
        RunSettings.replay_horizon, "most hidden states a stage holds for its downstream's replay; when full it waits "
        "for the downstream to commit (default 2 x window + in-flight depth; at least one window)", type=int)
    lr: float | list = option(RunSettings.lr, "AdamW's learning rate: one value, or one per stage (3e-4,3e-4,3e-3: the "
                                              "early stages slower; 0,0,3e-3: stages 0 and 1 forward-only, phase 1 only, "
                                              "their LoRA left at the init)", type=lrs)
    alpha: float | list | None = option(
        RunSettings.alpha, "override the export's task/consistency blend: one value, or one per stage (0.5,0.75,1: more "
        "task weight deeper down, which measured best on SmolLM2; docs/BENCHMARKS.md, Quality)", type=alphas)
    out: str | None = option(None, "run dir (default runs/TIMESTAMP)")
    resume: str | None = option(None, "continue the run in RUN_DIR")  # its run.json wins over the rest
    tokens: str | None = option(None, "JSON file NAME -> pairing token")
    wait: float = option(30.0, "seconds to wait for enough devices", type=float)
    mdns: str = option("loopback", "interfaces to browse: loopback, all, or an IPv4 address")
    adb_data_port: int = option(47475, "port an adb phone's stage listens on for its upstream link (forwarded by the "
                                       "host; 0: the phone picks one and reports it)", type=int)
    adb_staging: str = option("/data/local/tmp/zerolock", "phone dir adb pushes into before run-as copies into the "
                                                          "app's files")
    link_mbit: float | None = option(None, _EMULATED + "each phone's link rate per direction (its own network namespace "
                                     "where the machine allows it, else the transport's rate limiter)", type=positive)
    link_delay_ms: float = option(0.0, _EMULATED + "one-way latency of each phone's link", type=non_negative)
    cpu_share: str | None = option(None, _EMULATED + "hold each phone to this share of one CPU core (one value, or one "
                                   "per phone), in a cgroup of its own (needs root and the cgroup cpu controller)",
                                   metavar="F|F1,F2,...")
    heartbeat_timeout: float = option(RunSettings.heartbeat_timeout, type=float)
    recovery: str = option(RunSettings.recovery, "local replay (ZeroLock) or the global rollback a BP pipeline needs "
                                                 "(baseline)", choices=list(RECOVERIES))
    inject_failure: list[str] = option(
        None, "stage=K,window=W[,point=after-phase1|before-commit|mid-checkpoint][,mode=process|app]"
        "[,detect=connection|heartbeat]: kill the phone process, or fail the stage inside the running phone (which "
        "then drops the session or goes silent); or stage=K,point=slow-phase1,seconds=S: a slower phone (tests, "
        "benchmarks)", append=True)
    plan: str | None = option(None, "a zl-host plan file: its chunks (the export must match) on its phones, and a "
                                    "report when the stage times drift from it")
    drift_margin: float = option(0.15, "with --plan: report when the slowest stage is this far off the plan (0.15: "
                                       "15%%)", type=positive)
    runtime: str | None = option(None, _EMULATED + "what the phones run, python (zl-phone, default) or kotlin (the app's "
                                 "core on the JVM, on ExecuTorch's C++ runtime); one for all or one per phone",
                                 metavar="python|kotlin|R1,R2,...")
    mem_limit: str | None = option(None, _EMULATED + "each phone's memory limit (zl-phone --mem-limit), one for all "
                                                     "or A,B,...")

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> "RunConfig":
        """The options `zl-host run` parsed; anything the parser lacks keeps its default."""
        given = {f.name: getattr(a, f.name) for f in fields(cls) if getattr(a, f.name, None) is not None}
        return cls(**given)

    def settings(self, train_micro_batches: int) -> RunSettings:
        """The coordinator's settings of a new run over `train_micro_batches` micro-batches."""
        return RunSettings(windows=self.windows_for(train_micro_batches), window_size=self.window, lr=self.lr,
                           alpha=self.alpha, inflight_depth=self.inflight, heartbeat_timeout=self.heartbeat_timeout,
                           inject_failure=self.failures(), recovery=self.recovery, replay_horizon=self.replay_horizon)

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


def add_run_options(parser: argparse.ArgumentParser, names: list[str] | None = None,
                    help: dict[str, str] | None = None) -> None:
    """`--name` for each RunConfig field (all, or `names` in that order), from its definition;
    `help` rewords an option for another command (zl-host finetune's --held-out)."""
    by_name = {f.name: f for f in fields(RunConfig)}
    for name in names or list(by_name):
        f = by_name[name]
        m = f.metadata
        kw = {"help": (help or {}).get(name, m["help"])}
        if m["append"]:
            kw["action"] = "append"
        else:
            kw["default"] = None if f.default is MISSING else f.default
            kw.update({k: m[k] for k in ("type", "metavar", "choices") if m[k] is not None})
        parser.add_argument("--" + name.replace("_", "-"), **kw)


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

"""Which device runs which chunk, and the settings of a run."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from zl_common.manifest import ChunkEntry


class PlanError(Exception):
    pass


RECOVERIES = ("local", "global-rollback")  # local replay (ZeroLock) or the BP baseline's global rollback


@dataclass
class RunSettings:
    windows: int = 8              # optimizer steps (update windows)
    window_size: int = 4          # micro-batches per window
    inflight_depth: int = 2       # hidden states in flight between neighbours
    replay_horizon: int | None = None  # most hidden states an upstream holds for replay (default: default_horizon)
    lr: float | list = 2e-3       # one for every stage, or one per stage
    weight_decay: float = 0.0
    alpha: float | list | None = None  # override of the export's alpha: one for every stage, or one per stage
    heartbeat_timeout: float = 5.0
    compute_timeout: float = 600.0  # a single runtime call (phase 1 or 2) may keep a stage silent this long
    rejoin_timeout: float = 60.0  # how long to wait for a failed real phone to come back
    inject_failure: list | None = None  # [{"stage": K, "window": W, "point": ...}, ...]
    recovery: str = RECOVERIES[0]  # or "global-rollback"
    schedule: str = "zerolock"    # or a BP baseline: gpipe, 1f1b, pipedream
    max_seconds: float | None = None  # give up (with a clear error) if the run takes longer
    # no stage progressed this long: stop, saying where each stands (default 3x compute_timeout)
    stall_timeout: float | None = None
    # window checkpoints each stage keeps (default 2; a study of the adapter over time keeps all)
    keep_checkpoints: int | None = None

    def alpha_for(self, stage: int) -> float | None:
        return self.alpha[stage] if isinstance(self.alpha, list) else self.alpha

    def lr_for(self, stage: int) -> float:
        return self.lr[stage] if isinstance(self.lr, list) else self.lr

    def checked_per_stage(self, num_stages: int) -> None:
        """--alpha and --lr lists name one value per stage."""
        for opt, v in (("--alpha", self.alpha), ("--lr", self.lr)):
            if isinstance(v, list) and len(v) != num_stages:
                raise PlanError(f"{opt} gives {len(v)} values for {num_stages} stages; give one for every "
                                f"stage, or one per stage")
        if self.forward_only_stages(num_stages) and self.schedule != "zerolock":
            raise PlanError(f"--lr 0 (a forward-only stage) is a ZeroLock option; --schedule {self.schedule} "
                            f"back-propagates through every stage")

    def forward_only_stages(self, num_stages: int) -> list[int]:
        """Stages whose LR is 0: phase 1 only, their LoRA left at the export's init."""
        return [k for k in range(num_stages) if self.lr_for(k) == 0]

    @property
    def horizon(self) -> int:
        return self.replay_horizon or (2 * self.window_size + self.inflight_depth)

    def default_horizon(self, num_stages: int) -> int:
        """One window more than the least that works, plus the in-flight depth: the upstream may
        run a window ahead and the downstream's credits stay busy while it commits. 2W + depth for
        ZeroLock, GPipe and 1F1B."""
        return min_replay_horizon(self.schedule, self.window_size, num_stages) + self.window_size + self.inflight_depth

    def checked_horizon(self, num_stages: int) -> int:
        """The replay horizon this run uses; a value that could not cover a failure is refused."""
        need = min_replay_horizon(self.schedule, self.window_size, num_stages)
        default = self.default_horizon(num_stages)
        h = self.replay_horizon if self.replay_horizon is not None else default
        if h < need:
            ahead = need - self.window_size
            why = (f"a whole window ({self.window_size})" if not ahead else
                   f"a whole window ({self.window_size}) plus the {ahead} micro-batch(es) the {self.schedule} "
                   "schedule forwards past it before the step")
            raise PlanError(f"replay horizon {h} is too small: an upstream stage holds every hidden state until its "
                            f"downstream commits the window that used it, and that commit needs {why}, so the "
                            f"upstream would wait forever; use --replay-horizon {need} or more (the default, {default}, "
                            "adds a window and the in-flight depth so the upstream may run ahead)")
        return h

    @property
    def stall_after(self) -> float:
        return self.stall_timeout if self.stall_timeout is not None else 3 * self.compute_timeout + self.heartbeat_timeout

    @property
    def micro_batches(self) -> int:
        return self.windows * self.window_size

    def to_json(self) -> dict:
        return asdict(self)


def min_replay_horizon(schedule: str, window_size: int, num_stages: int) -> int:
    """The fewest hidden states an upstream must be able to hold for its downstream to reach its
    next commit: one window, plus what the downstream's schedule forwards past the window's end
    before the window's step (PipeDream's warm-up; none for ZeroLock, GPipe and 1F1B). With
    backpressure nothing uncommitted is dropped, so this also covers a failure at any point."""
    from zl_mobile.schedules import schedule as actions

    ahead = 0
    for k in range(1, num_stages):
        top = -1
        for a in actions(schedule, k, num_stages, window_size, total=3 * window_size):
            if a.op == "F":
                top = max(top, a.mb)
            elif a.op == "STEP":
                ahead = max(ahead, top - ((a.mb + 1) * window_size - 1))
                if a.mb >= 2:  # some schedules run on until the stage is stopped
                    break
    return window_size + ahead


def assign_by_memory(chunks: list[ChunkEntry], devices: list, file_sizes: dict) -> list:
    """Chunk k -> device, the biggest chunk (weights + saved activations of the entry it runs,
    ChunkEntry.for_schedule's) on the device with the most memory. Returns the devices reordered
    so that result[k] runs chunk k."""
    if len(devices) < len(chunks):
        raise PlanError(f"{len(devices)} device(s) for {len(chunks)} chunks: start or connect "
                        f"{len(chunks) - len(devices)} more (zl-host emulate N, or phones with the app open)")
    need = sorted(range(len(chunks)), key=lambda k: -(file_sizes[chunks[k].weights] + chunks[k].saved_activation_bytes))
    by_mem = sorted(devices, key=lambda d: -d.memory_bytes)
    out = [None] * len(chunks)
    for k, dev in zip(need, by_mem):
        out[k] = dev
    return out

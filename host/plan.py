"""Which device runs which chunk, and the settings of a run."""
from __future__ import annotations

from dataclasses import asdict, dataclass


class PlanError(Exception):
    pass


@dataclass
class RunSettings:
    windows: int = 8              # optimizer steps (update windows)
    window_size: int = 4          # micro-batches per window
    inflight_depth: int = 2       # hidden states in flight between neighbours
    replay_horizon: int | None = None  # hidden states an upstream keeps for replay (default 2W + depth)
    lr: float = 2e-3
    weight_decay: float = 0.0
    alpha: float | None = None    # override of the export's alpha
    heartbeat_timeout: float = 5.0
    compute_timeout: float = 600.0  # a single runtime call (phase 1 or 2) may keep a stage silent this long
    rejoin_timeout: float = 60.0  # how long to wait for a failed real phone to come back
    inject_failure: list | None = None  # [{"stage": K, "window": W, "point": ...}, ...]
    recovery: str = "local"       # or "global-rollback"
    schedule: str = "zerolock"    # or a BP baseline: gpipe, 1f1b, pipedream
    max_seconds: float | None = None  # give up (with a clear error) if the run takes longer

    @property
    def horizon(self) -> int:
        return self.replay_horizon or (2 * self.window_size + self.inflight_depth)

    @property
    def micro_batches(self) -> int:
        return self.windows * self.window_size

    def to_json(self) -> dict:
        return asdict(self)


def assign_by_memory(chunks: list[dict], devices: list, file_sizes: dict) -> list:
    """Chunk k -> device, the biggest chunk (weights + saved activations) on the device with the
    most memory. Returns the devices reordered so that result[k] runs chunk k."""
    if len(devices) < len(chunks):
        raise PlanError(f"{len(devices)} device(s) for {len(chunks)} chunks: start or connect "
                        f"{len(chunks) - len(devices)} more (zl-host emulate N, or phones with the app open)")
    need = sorted(range(len(chunks)), key=lambda k: -(file_sizes[chunks[k]["weights"]] + chunks[k]["saved_activation_bytes"]))
    by_mem = sorted(devices, key=lambda d: -d.memory_bytes)
    out = [None] * len(chunks)
    for k, dev in zip(need, by_mem):
        out[k] = dev
    return out

"""A stage's own checkpoint: LoRA + AdamW state + progress, committed atomically.

Commit protocol: write ckpt-W.safetensors.tmp, fsync, rename to ckpt-W.safetensors, fsync the
directory, then atomically replace COMMITTED (a small JSON naming the file and its sha256).
Only COMMITTED says what exists: a crash at any point leaves the previous commit in force, so a
window is never lost (it is redone from the previous commit) and never applied twice."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

POINTER = "COMMITTED"
LORA, OPT = "lora/", "opt/"  # key prefixes of a checkpoint file's two groups of tensors


class CheckpointError(Exception):
    pass


@dataclass
class Checkpoint:
    window: int           # last committed update window (-1: none)
    step: int             # optimizer steps applied
    lora: dict[str, torch.Tensor]
    optimizer: dict[str, torch.Tensor]
    meta: dict


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


from zl_common.hashing import sha256_file as _sha256  # noqa: E402


def _group(tensors: dict, prefix: str) -> dict:
    return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}


def checkpoint_name(window: int) -> str:
    return f"ckpt-{window:08d}.safetensors"  # zero-padded: names sort by window


CHECKPOINT_FILES = "ckpt-*.safetensors"  # checkpoint_name's, as a glob


def read_lora(path: Path) -> dict[str, torch.Tensor]:
    """The LoRA of one checkpoint file, by parameter name (for tools that read kept windows)."""
    return _group(load_file(str(path)), LORA)


class CheckpointStore:
    def __init__(self, directory: Path, keep: int = 2):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.keep = keep
        self.fail_hook = None  # test/benchmark fault injection: called with a point name

    def _hook(self, point: str) -> None:
        if self.fail_hook:
            self.fail_hook(point)

    def tear_pending(self) -> None:
        """Fault injection: cut the checkpoint being written in half, as a crash mid-write leaves it."""
        tmp = next(self.dir.glob("*.tmp"), None)
        if tmp is not None:
            with open(tmp, "r+b") as f:
                f.truncate(max(1, tmp.stat().st_size // 2))

    def commit(self, ckpt: Checkpoint) -> str:
        """Durably write `ckpt` and record it as committed; returns its sha256."""
        name = checkpoint_name(ckpt.window)
        final, tmp = self.dir / name, self.dir / (name + ".tmp")
        tensors = {f"{LORA}{k}": v.contiguous() for k, v in ckpt.lora.items()}
        tensors.update({f"{OPT}{k}": v.contiguous() for k, v in ckpt.optimizer.items()})
        meta = {"window": str(ckpt.window), "step": str(ckpt.step), "meta": json.dumps(ckpt.meta)}
        save_file(tensors, str(tmp), metadata=meta)
        self._hook("mid-checkpoint")
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final)
        _fsync_dir(self.dir)
        digest = _sha256(final)
        self._point_to(ckpt.window, ckpt.step, name, digest)
        self._prune(keep_name=name)
        return digest

    def _point_to(self, window: int, step: int, name: str, digest: str) -> None:
        """Atomically make `name` the committed checkpoint (the pointer's write, fsync, rename)."""
        tmp = self.dir / (POINTER + ".tmp")
        tmp.write_text(json.dumps({"window": window, "step": step, "file": name, "sha256": digest}))
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, self.dir / POINTER)
        _fsync_dir(self.dir)

    def _files(self) -> list[Path]:
        """The checkpoint files here, oldest window first (names sort by window)."""
        return sorted(self.dir.glob(CHECKPOINT_FILES))

    def _prune(self, keep_name: str) -> None:
        files = self._files()
        for f in files[:-self.keep]:
            if f.name != keep_name:
                f.unlink(missing_ok=True)
        for f in self.dir.glob("*.tmp"):
            f.unlink(missing_ok=True)

    def pointer(self) -> dict | None:
        p = self.dir / POINTER
        if not p.exists():
            return None
        try:
            return json.loads(p.read_text())
        except json.JSONDecodeError:
            raise CheckpointError(f"{p} is not valid JSON: the stage's checkpoint record is corrupt; "
                                  "delete the stage work dir to restart this stage from scratch") from None

    def rollback(self, window: int) -> None:
        """Make the checkpoint of `window` the committed one again (-1: none, start fresh); later
        checkpoints are deleted. Used by the global-rollback baseline, which a BP pipeline needs."""
        if window < 0:
            (self.dir / POINTER).unlink(missing_ok=True)
            _fsync_dir(self.dir)
            later = self._files()
        else:
            name = checkpoint_name(window)
            path = self.dir / name
            if not path.exists():
                raise CheckpointError(f"no checkpoint of window {window} is kept here (keep={self.keep}): "
                                      "raise keep_checkpoints to cover the rollback horizon")
            self._point_to(window, int(self._meta_of(path)["step"]), name, _sha256(path))
            later = [f for f in self._files() if f.name > name]
        for f in later:
            f.unlink(missing_ok=True)

    @staticmethod
    def _meta_of(path: Path) -> dict:
        from safetensors import safe_open
        with safe_open(str(path), "pt") as f:
            return f.metadata()

    def load(self) -> Checkpoint | None:
        """The last committed checkpoint, or None. Uncommitted files are ignored."""
        ptr = self.pointer()
        if ptr is None:
            return None
        path = self.dir / ptr["file"]
        if not path.exists() or _sha256(path) != ptr["sha256"]:
            raise CheckpointError(f"committed checkpoint {path} is missing or does not match its sha256: "
                                  "storage is corrupt; delete the stage work dir to restart the stage")
        tensors = load_file(str(path))
        meta = self._meta_of(path)
        return Checkpoint(window=int(meta["window"]), step=int(meta["step"]),
                          lora=_group(tensors, LORA), optimizer=_group(tensors, OPT),
                          meta=json.loads(meta["meta"]))


def restore_training_state(init_path: Path, lora_names, store: "CheckpointStore", adamw_cfg):
    """A stage's LoRA (from its export's initialisation), its AdamW, and the last committed window
    (-1: none), restored from `store`'s checkpoint where there is one: (lora, optimizer, committed,
    checkpoint or None). Phones (stage.py) and torch.distributed ranks (host/dist/ranks.py) start the same way."""
    from .adamw import AdamW

    init = load_file(str(init_path))
    lora = {n: init[n].clone() for n in lora_names}
    opt = AdamW(lora, adamw_cfg)
    ckpt = store.load()
    committed = -1
    if ckpt is not None:
        for n, t in ckpt.lora.items():
            lora[n].copy_(t)
        opt.load_state_tensors(ckpt.optimizer, ckpt.step)
        committed = ckpt.window
    return lora, opt, committed, ckpt

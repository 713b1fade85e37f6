"""The on-disk copy of a stage's replay buffer: every hidden state the stage sent downstream and
the downstream has not committed yet, one encoded HIDDEN_STATE frame per file.

Why on disk: a fast upstream stage can have committed windows its downstream has not used yet.
If that upstream dies, its restarted process cannot recompute those hidden states (its LoRA has
moved on and its own upstream has dropped the inputs once it committed them), so it reloads
them from here. The stage fsyncs the files before it commits a checkpoint, so every hidden state
of a committed window outlives a crash or a power cut; files of uncommitted windows are dropped
at load (the restarted stage computes them again, bit for bit)."""
from __future__ import annotations

import os
import threading
from pathlib import Path

from .protocol import Message, ProtocolError
from .protocol.frames import decode_message, encode_message


class ReplayStore:
    def __init__(self, directory: Path):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._unsynced: set[int] = set()
        self._lock = threading.Lock()  # the stage's thread writes, the link's reader drops

    def _path(self, mb: int) -> Path:
        return self.dir / f"mb-{mb:012d}.zlf"

    def ids(self) -> list[int]:
        out = []
        for p in self.dir.glob("mb-*.zlf"):
            try:
                out.append(int(p.stem[3:]))
            except ValueError:
                continue
        return sorted(out)

    def put(self, msg: Message) -> None:
        mb = msg["micro_batch"]
        tmp = self.dir / f"mb-{mb:012d}.tmp"
        tmp.write_bytes(encode_message(msg))
        with self._lock:
            tmp.replace(self._path(mb))
            self._unsynced.add(mb)

    def sync(self) -> None:
        """Make every file written so far durable (before a checkpoint commit covers them)."""
        with self._lock:
            todo, self._unsynced = sorted(self._unsynced), set()
        for mb in todo:
            try:
                fd = os.open(self._path(mb), os.O_RDONLY)
            except FileNotFoundError:  # already dropped: the downstream committed it meanwhile
                continue
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def drop_below(self, end: int) -> None:
        """The downstream committed every micro-batch below `end`: they are not needed any more."""
        with self._lock:
            for mb in self.ids():
                if mb >= end:
                    break
                self._path(mb).unlink(missing_ok=True)
                self._unsynced.discard(mb)

    def load(self, below: int) -> list[Message]:
        """What a restarted stage can replay: the unbroken run of stored hidden states that ends
        at `below - 1` (its resume point less one). Anything at or past `below` belongs to a window
        the stage had not committed and is dropped; so is anything cut off by a gap, which could
        not be sent in order anyway."""
        for p in self.dir.glob("mb-*.tmp"):
            p.unlink(missing_ok=True)  # a write the crash interrupted
        ids = self.ids()
        for mb in [m for m in ids if m >= below]:
            self._path(mb).unlink(missing_ok=True)
        run: list[int] = []
        for mb in reversed([m for m in ids if m < below]):
            if mb != (run[-1] - 1 if run else below - 1):
                break
            run.append(mb)
        keep = set(run)
        for mb in ids:
            if mb < below and mb not in keep:
                self._path(mb).unlink(missing_ok=True)
        out = []
        for mb in reversed(run):
            try:
                out.append(decode_message(self._path(mb).read_bytes()))
            except (OSError, ProtocolError):  # a damaged file: what came before it cannot be sent in order either
                out.clear()
        return out

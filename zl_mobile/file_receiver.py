"""FILE_BEGIN / FILE_CHUNK / FILE_END for one host session (docs/PROTOCOL.md 5.2).

A phone runs for days and a host may start transfers it never finishes, so every open transfer
is owned by its session and closed, with its part file removed, when the session ends, when a
new FILE_BEGIN names the same file or reuses the transfer id, or when it has seen no chunk for
`stale_after` seconds. Part files live in their own directory under short names of their own
(a 255-byte file name plus a suffix would pass NAME_MAX, and two uploads to one name must never
share a part file); the finished file is renamed into `files/` on the same file system."""
from __future__ import annotations

import hashlib
import logging
import os
import secrets
import shutil
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np

from .protocol import ErrorCode, Message, MsgType, ProtocolError
from .protocol.quoting import quote

log = logging.getLogger("zl_mobile.files")
MAX_OPEN = 8            # transfers open at once in one session; a host pushes them one by one
STALE_AFTER_S = 120.0   # an open transfer with no chunk for this long is abandoned


def clear_incoming(incoming: Path) -> None:
    """Part files left by a previous process (a crash, a kill) are never finished: remove them."""
    shutil.rmtree(incoming, ignore_errors=True)
    incoming.mkdir(parents=True, exist_ok=True)


class FileReceiver:
    def __init__(self, files: Path, incoming: Path, *, max_open: int = MAX_OPEN,
                 stale_after: float = STALE_AFTER_S, device_name: str = "device", clock=time.monotonic):
        self.files, self.incoming = files, incoming
        self.max_open, self.stale_after = max_open, stale_after
        self.name, self._clock = device_name, clock
        self._open: dict[int, dict] = {}
        self._gone: OrderedDict[int, str] = OrderedDict()  # abandoned transfer id -> why (for its FILE_END)

    # ---- messages
    def begin(self, msg: Message) -> Message | None:
        tid, name = msg["transfer_id"], msg["name"]
        if tid in self._open:
            self._abandon(tid, f"transfer {tid} was restarted by a new FILE_BEGIN with the same id")
        for other, tr in list(self._open.items()):
            if tr["meta"]["name"] == name:
                self._abandon(other, f"{quote(name)}: superseded by transfer {tid} to the same name; only the last "
                                     "FILE_BEGIN for a name is kept")
        self.sweep()
        if len(self._open) >= self.max_open:
            return self._refuse(tid, f"{self.max_open} transfers are already open on this device; "
                                     "finish (FILE_END) one before starting another")
        part = self.incoming / f"{tid}-{secrets.token_hex(6)}.part"
        try:
            fh = open(part, "wb")
        except OSError as e:
            return self._refuse(tid, f"{quote(name)}: cannot store it on the device ({e.strerror or e}); "
                                     f"make room in {self.files} and push it again")
        self._gone.pop(tid, None)
        self._open[tid] = {"meta": dict(msg.meta), "path": part, "fh": fh, "size": 0, "sha": hashlib.sha256(),
                           "ok": True, "why": "", "seen": self._clock()}
        return None

    def chunk(self, msg: Message) -> None:
        tid = msg["transfer_id"]
        tr = self._open.get(tid)
        if tr is None:
            if tid in self._gone:
                return None  # abandoned: its FILE_END says why
            raise ProtocolError(ErrorCode.UNEXPECTED, f"FILE_CHUNK for unknown transfer {tid}; send FILE_BEGIN first")
        tr["seen"] = self._clock()
        if not tr["ok"]:
            return None  # FILE_END reports the first failure, not the chunks after it
        data = np.asarray(msg.tensors["data"]).tobytes()
        if msg["offset"] != tr["size"] or tr["size"] + len(data) > tr["meta"]["size"]:
            tr["ok"], tr["why"] = False, f"chunk at offset {msg['offset']} does not follow {tr['size']} bytes received"
            return None
        try:
            tr["fh"].write(data)
        except OSError as e:  # a full disk: say so, not the offset mismatch every later chunk would cause
            tr["ok"], tr["why"] = False, self._write_failed(tr, e)
            return None
        tr["sha"].update(data)
        tr["size"] += len(data)
        return None

    def end(self, msg: Message) -> Message:
        tid = msg["transfer_id"]
        tr = self._open.pop(tid, None)
        if tr is None:
            if tid in self._gone:
                return self._result(tid, False, 0, None, self._gone.pop(tid) + "; push it again")
            raise ProtocolError(ErrorCode.UNEXPECTED, f"FILE_END for unknown transfer {tid}")
        try:
            tr["fh"].flush()
            os.fsync(tr["fh"].fileno())
        except OSError as e:
            if tr["ok"]:
                tr["ok"], tr["why"] = False, self._write_failed(tr, e)
        finally:
            try:
                tr["fh"].close()
            except OSError:
                pass  # the failed flush already said why
        meta, digest = tr["meta"], tr["sha"].hexdigest()
        ok = tr["ok"] and tr["size"] == meta["size"] and digest == meta["sha256"]
        why = ""
        if ok:
            try:
                os.replace(tr["path"], self.files / meta["name"])
                log.info("%s: stored %s (%d bytes)", self.name, quote(meta["name"]), tr["size"])
            except OSError as e:
                ok, why = False, f"{quote(meta['name'])}: storing it failed on the device ({e.strerror or e}); push it again"
        else:
            why = tr["why"] or (f"{quote(meta['name'])}: received {tr['size']} bytes with sha256 {digest[:12]}..., expected "
                                f"{meta['size']} bytes with {meta['sha256'][:12]}...; the file was discarded, push it again")
        if not ok:
            tr["path"].unlink(missing_ok=True)
            log.warning("%s: rejected file: %s", self.name, why)
        return self._result(tid, ok, tr["size"], digest, why)

    # ---- abandoning
    def sweep(self) -> None:
        """Abandon transfers that have seen no chunk for stale_after seconds."""
        now = self._clock()
        for tid, tr in list(self._open.items()):
            if now - tr["seen"] > self.stale_after:
                self._abandon(tid, f"{quote(tr['meta']['name'])}: no chunk for {self.stale_after:g} s, the transfer was dropped")

    def close(self) -> None:
        """The session ended: every open transfer is abandoned."""
        for tid in list(self._open):
            self._abandon(tid, "the session ended")
        self._gone.clear()

    @property
    def open_count(self) -> int:
        return len(self._open)

    def _refuse(self, tid: int, why: str) -> Message:
        """FILE_RESULT ok=false at once; the host's chunks already on their way are dropped and its
        FILE_END answered with the same reason (unknown, they would end the session: 5.1)."""
        self._forget(tid, why)
        log.warning("%s: refused transfer %d: %s", self.name, tid, why)
        return self._result(tid, False, 0, None, why)

    def _forget(self, tid: int, why: str) -> None:
        self._gone[tid] = why
        while len(self._gone) > 64:
            self._gone.popitem(last=False)

    def _abandon(self, tid: int, why: str) -> None:
        tr = self._open.pop(tid)
        try:
            tr["fh"].close()
        except OSError:
            pass
        tr["path"].unlink(missing_ok=True)
        self._forget(tid, why)
        log.info("%s: abandoned transfer %d: %s", self.name, tid, why)

    def _write_failed(self, tr: dict, e: OSError) -> str:
        return (f"{quote(tr['meta']['name'])}: writing it failed on the device after {tr['size']} bytes "
                f"({e.strerror or e}); make room in {self.files} and push it again")

    @staticmethod
    def _result(tid: int, ok: bool, size: int, digest: str | None, why: str) -> Message:
        reply = {"transfer_id": tid, "ok": ok, "size": size, "sha256": digest}
        if why:
            reply["message"] = why
        return Message(MsgType.FILE_RESULT, reply)

"""The device side of a host session: what a phone does with each control message.

Files it is sent are kept in its work dir (as a phone keeps them in its storage), checked
against their sha256; STAGE_ASSIGN starts (or rewires) the stage runtime for one chunk."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import threading
from pathlib import Path

import numpy as np

from . import __version__
from .backends import Backend
from .connection import Connection
from .program import ProgramError
from .protocol import (ConnectionClosed, DeviceAuth, ErrorCode, Message, MsgType, ProtocolError,
                       device_handshake)
from .stage import Stage, StageConfig
from .telemetry import total_memory_bytes

log = logging.getLogger("zl_mobile.device")


from .hashing import sha256_file  # noqa: E402


class Device:
    """State that outlives host sessions: stored files and the running stage."""

    def __init__(self, name: str, workdir: Path, token: str, limiter=None, bind: str = "0.0.0.0",
                 backend: Backend | None = None, link_delay=None, cpu_share: float | None = None,
                 memory_limit=None):
        self.name = name
        self.cpu_share = cpu_share  # the share of one core this process is held to (zl-phone --cpu-share)
        self.memory_limit = memory_limit  # zl_mobile.memlimit.MemoryLimit (zl-phone --mem-limit) or None
        self.backend = backend or Backend()  # the runtime the chunk runs on (zl-phone --backend)
        self.bind = bind  # the stage's data port listens here too
        self.workdir = Path(workdir)
        self.files = self.workdir / "files"
        self.files.mkdir(parents=True, exist_ok=True)
        self.auth = DeviceAuth(token, name)
        self.limiter = limiter        # shapes the stage's outgoing frames (--rate-mbit)
        self.link_delay = link_delay  # delays its incoming ones (--link-delay-ms): links.DelayLine
        self.stage: Stage | None = None
        self.stage_meta: dict | None = None
        self._host: Connection | None = None
        self._lock = threading.Lock()
        self._transfers: dict[int, dict] = {}
        self._heartbeat_seq = 0

    # ---- identity
    def hello(self) -> Message:
        from .memlimit import budget_bytes

        stored = {}
        for p in sorted(self.files.iterdir()):
            if p.is_file() and not p.name.endswith(".part"):
                stored[p.name] = self._cached_sha(p)
        return Message(MsgType.HELLO, {
            "name": self.name, "protocol_version": 1, "runtime_version": f"zl_mobile {__version__} ({self.backend.label})",
            "memory_bytes": total_memory_bytes(), "capabilities": self.backend.capabilities, "os": "linux-emulated",
            "cores": len(os.sched_getaffinity(0)), "files": stored,
            **({"cpu_share": self.cpu_share} if self.cpu_share is not None else {}),
            **({"memory_budget_bytes": b} if (b := budget_bytes(self.memory_limit)) else {})})

    def _cached_sha(self, p: Path) -> str:
        cache = p.with_name(p.name + ".sha256")
        if p.suffix == ".sha256":
            return ""
        if cache.exists() and cache.stat().st_mtime >= p.stat().st_mtime:
            return cache.read_text().strip()
        digest = sha256_file(p)
        cache.write_text(digest)
        return digest

    # ---- session
    def serve_connection(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            hs = device_handshake(sock, self.auth, self.hello())
        except (ProtocolError, OSError, ConnectionClosed) as e:
            log.warning("%s: refused a connection: %s", self.name, e)
            sock.close()
            return
        conn = Connection(sock)
        with self._lock:
            self._host = conn
        log.info("%s: host %s connected", self.name, hs.host_name)
        threading.Thread(target=self._heartbeats, args=(conn,), daemon=True).start()
        try:
            while True:
                msg = conn.recv()
                try:
                    reply = self.handle(msg)
                except ProtocolError as e:
                    log.warning("%s: %s", self.name, e)
                    conn.try_send(e.to_message(msg.get("request_id") if isinstance(msg.get("request_id"), int) else None))
                    continue
                except Exception as e:  # a failure on this side: report it (INTERNAL), keep the session
                    err = ProtocolError(ErrorCode.INTERNAL, f"{msg.type.name} failed on the device: "
                                                            f"{type(e).__name__}: {e}")
                    log.error("%s: %s", self.name, err)
                    log.debug("%s: %s failed", self.name, msg.type.name, exc_info=True)
                    conn.try_send(err.to_message(msg.get("request_id") if isinstance(msg.get("request_id"), int) else None))
                    continue
                if reply is not None:
                    conn.send(reply)
                if msg.type == MsgType.SHUTDOWN:
                    break
        except ProtocolError as e:  # a bad frame: tell the host, drop the session, keep serving
            log.warning("%s: dropping the host session: %s", self.name, e)
            conn.try_send(e.to_message())
        except (ConnectionClosed, OSError):
            log.info("%s: host disconnected", self.name)
        finally:
            with self._lock:
                if self._host is conn:
                    self._host = None
            hs.close()
            conn.close()

    def _heartbeats(self, conn: Connection, period: float = 0.5) -> None:
        import time
        seq = 0
        while not conn.closed and conn.try_send(Message(MsgType.HEARTBEAT, {"seq": seq, "time_ms": int(time.monotonic() * 1000)})):
            seq += 1
            time.sleep(period)

    def send_to_host(self, msg: Message) -> None:
        conn = self._host
        if conn is not None:
            conn.try_send(msg)

    def handle(self, msg: Message) -> Message | None:
        t = msg.type
        if t == MsgType.HEARTBEAT:
            return Message(MsgType.HEARTBEAT, {"seq": msg["seq"]})
        if t == MsgType.FILE_BEGIN:
            return self._file_begin(msg)
        if t == MsgType.FILE_CHUNK:
            return self._file_chunk(msg)
        if t == MsgType.FILE_END:
            return self._file_end(msg)
        if t == MsgType.STAGE_ASSIGN:
            return self._assign(msg)
        if t == MsgType.STATE_GET:
            return self._state_get(msg)
        if t == MsgType.SHUTDOWN:
            self.stop_stage()
            return None
        raise ProtocolError(ErrorCode.UNEXPECTED, f"{t.name} is not something a host sends to a device")

    # ---- files
    def _file_begin(self, msg: Message) -> None:
        tid = msg["transfer_id"]
        part = self.files / (msg["name"] + ".part")
        self._transfers[tid] = {"meta": msg.meta, "path": part, "fh": open(part, "wb"), "size": 0,
                                "sha": hashlib.sha256(), "ok": True, "why": ""}
        return None

    def _file_chunk(self, msg: Message) -> None:
        tr = self._transfers.get(msg["transfer_id"])
        if tr is None:
            raise ProtocolError(ErrorCode.UNEXPECTED, f"FILE_CHUNK for unknown transfer {msg['transfer_id']}; send FILE_BEGIN first")
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

    def _write_failed(self, tr: dict, e: OSError) -> str:
        return (f"{tr['meta']['name']}: writing it failed on the device after {tr['size']} bytes "
                f"({e.strerror or e}); make room in {self.files} and push it again")

    def _file_end(self, msg: Message) -> Message:
        tid = msg["transfer_id"]
        tr = self._transfers.pop(tid, None)
        if tr is None:
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
        if ok:
            os.replace(tr["path"], self.files / meta["name"])
            log.info("%s: stored %s (%d bytes)", self.name, meta["name"], tr["size"])
            why = ""
        else:
            tr["path"].unlink(missing_ok=True)
            why = tr["why"] or (f"{meta['name']}: received {tr['size']} bytes with sha256 {digest[:12]}..., expected "
                                f"{meta['size']} bytes with {meta['sha256'][:12]}...; the file was discarded, push it again")
            log.warning("%s: rejected file: %s", self.name, why)
        reply = {"transfer_id": tid, "ok": ok, "size": tr["size"], "sha256": digest}
        if why:
            reply["message"] = why
        return Message(MsgType.FILE_RESULT, reply)

    # ---- stage
    def _reject(self, msg: Message, why: str) -> ProtocolError:
        return ProtocolError(ErrorCode.REJECTED, why)

    def _assign(self, msg: Message) -> Message:
        meta = msg.meta
        manifest_path = self.files / "manifest.json"
        if not manifest_path.exists():
            raise self._reject(msg, "no manifest.json on this device: push the export's manifest before STAGE_ASSIGN")
        manifest = json.loads(manifest_path.read_text())
        chunks = manifest["chunks"]
        k = meta["stage"]
        if meta["num_stages"] != len(chunks) or k >= len(chunks):
            raise self._reject(msg, f"stage {k} of {meta['num_stages']} does not fit the program: the export has "
                                    f"{len(chunks)} chunks; assign one stage per chunk")
        chunk = chunks[k]
        if meta.get("schedule", "zerolock") != "zerolock":  # BP baselines run the chunk's BP program
            if "bp" not in chunk:
                raise self._reject(msg, f"schedule {meta['schedule']} needs the chunk's BP program: export with --mode both")
            chunk = {**chunk, **chunk["bp"]}
        sizes = {f["path"]: f for f in manifest["files"]}
        try:
            needed = self.backend.chunk_files(chunk)
        except ProgramError as e:
            raise self._reject(msg, str(e)) from None
        for key in needed:
            entry = sizes[chunk[key]]
            p = self.files / chunk[key]
            if not p.exists():
                raise self._reject(msg, f"{chunk[key]} is not on this device: push it before assigning stage {k}")
            if self._cached_sha(p) != entry["sha256"]:
                raise self._reject(msg, f"{chunk[key]} on this device does not match the manifest's sha256: push it again")
        if sizes[chunk["program"]]["sha256"] != meta["program_sha256"]:
            raise self._reject(msg, f"program_sha256 in STAGE_ASSIGN is not chunk {k}'s program "
                                    f"({chunk['program']}): assign the stage that matches the program")
        if "upstream_token" not in meta:
            raise self._reject(msg, f"STAGE_ASSIGN for stage {k} lacks upstream_token: the stage needs the pairing "
                                    "token of its upstream link (section 6) to accept it")
        cfg = StageConfig.from_assign(meta)
        same = (self.stage is not None and self.stage_meta is not None and not (meta.get("config") or {}).get("restart")
                and self.stage_meta.get("run_id") == meta.get("run_id") and self.stage_meta["stage"] == k)
        if same:  # a rewire after a neighbour restarted: keep the running stage
            self.stage.rewire(cfg.downstream)
        else:
            self.stop_stage()
            try:
                self.stage = Stage(self.files, chunk, manifest["export"], cfg, self.workdir,
                                   to_host=self.send_to_host, limiter=self.limiter,
                                   data_port=meta.get("listen_port", 0), bind=self.bind,
                                   load_program=self.backend.load, link_delay=self.link_delay)
            except ProgramError as e:
                raise self._reject(msg, str(e)) from None
        self.stage_meta = dict(meta)
        return Message(MsgType.ACK, {"request_id": meta["request_id"], "ok": True, "data_port": self.stage.data_port,
                                     "committed_window": self.stage.committed, "next_micro_batch": self.stage.next_mb})

    def stop_stage(self) -> None:
        if self.stage is not None:
            self.stage.stop()
            self.stage = None
            self.stage_meta = None

    def _state_get(self, msg: Message) -> Message:
        if self.stage is None:
            raise ProtocolError(ErrorCode.UNEXPECTED, "no stage is assigned on this device: send STAGE_ASSIGN first")
        if msg["kind"] == "lora":
            tensors = self.stage.lora_state()
        else:
            tensors = {k: v.clone() for k, v in self.stage.opt.state_tensors().items()}
        return Message(MsgType.STATE_PUT, {"request_id": msg["request_id"], "kind": msg["kind"],
                                           "window": max(self.stage.committed, 0), "step": self.stage.opt.step_count,
                                           "committed_window": self.stage.committed},
                       {k: v.numpy() for k, v in tensors.items()})


def serve(device: Device, port: int, bind: str = "0.0.0.0", ready=None) -> None:
    """Accept connections forever; each gets its own thread (the handshake allows one host)."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((bind, port))
    srv.listen(8)
    if ready is not None:
        ready(srv.getsockname()[1])
    while True:
        sock, _ = srv.accept()
        threading.Thread(target=device.serve_connection, args=(sock,), daemon=True).start()

"""The device side of a host session: what a phone does with each control message.

Files it is sent are kept in its work dir (as a phone keeps them in its storage), checked
against their sha256; STAGE_ASSIGN starts (or rewires) the stage runtime for one chunk."""
from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from zl_common.manifest import Manifest, ManifestError
from zl_common.program import ProgramError

from . import __version__
from .assign_rules import validate_assign
from .backends import Backend
from .connection import Connection
from .file_receiver import FileReceiver, clear_incoming
from .links import bind_listener
from .protocol import (
    PROTOCOL_VERSION,
    ConnectionClosed,
    DeviceAuth,
    ErrorCode,
    Message,
    MsgType,
    ProtocolError,
    device_handshake,
    error_reply,
)
from .protocol.quoting import quote, quote_any
from .stage import Stage, StageConfig
from .telemetry import total_memory_bytes

log = logging.getLogger("zl_mobile.device")


from zl_common.hashing import sha256_file  # noqa: E402


@dataclass(frozen=True)
class Limits:
    """How long and how many, against peers that connect and then stall (docs/PROTOCOL.md 6)."""
    handshake_s: float = 10.0   # the whole handshake, however slowly its bytes trickle in
    io_s: float = 10.0          # no byte inside a started frame for this long: TIMEOUT
    max_connections: int = 64   # open at once, authenticated or not
    # the largest frame of the host session (PROTOCOL.md 2.1): 1 MiB FILE_CHUNKs and metadata fit
    # many times over; a frame the device could never need is OVERSIZED from its header alone
    session_max_frame: int = 64 << 20
    transfer_s: float = 120.0   # an open transfer with no chunk for this long is dropped (PROTOCOL.md 5.2)


class Device:
    """State that outlives host sessions: stored files and the running stage."""

    def __init__(self, name: str, workdir: Path, token: str, limiter=None, bind: str = "0.0.0.0",
                 backend: Backend | None = None, link_delay=None, cpu_share: float | None = None,
                 memory_limit=None, limits: Limits | None = None):
        self.name = name
        self.cpu_share = cpu_share  # the share of one core this process is held to (zl-phone --cpu-share)
        self.memory_limit = memory_limit  # zl_mobile.memlimit.MemoryLimit (zl-phone --mem-limit) or None
        self.limits = limits or Limits()
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
        self._silent: Connection | None = None  # a session whose stage failed in-app without a word
        self._lock = threading.Lock()
        # connections not yet authenticated, oldest first: at the connection cap the oldest gives
        # way, so sockets opened and left idle cannot keep the real host out (serve)
        self._unauthenticated: collections.OrderedDict[int, socket.socket] = collections.OrderedDict()
        self.incoming = self.workdir / "incoming"  # part files of transfers in progress (file_receiver.py)
        clear_incoming(self.incoming)
        self.sha_cache = self.workdir / "sha256"  # digests of stored files, by a hash of their name
        self.sha_cache.mkdir(exist_ok=True)
        self.receiver = self._new_receiver()
        self._heartbeat_seq = 0

    def _new_receiver(self) -> FileReceiver:
        return FileReceiver(self.files, self.incoming, device_name=self.name, stale_after=self.limits.transfer_s)

    # ---- identity
    def hello(self) -> Message:
        from .memlimit import budget_bytes

        stored = {}
        for p in sorted(self.files.iterdir()):
            if p.is_file():
                stored[p.name] = self._cached_sha(p)
        return Message(MsgType.HELLO, {
            "name": self.name, "protocol_version": PROTOCOL_VERSION,
            "runtime_version": f"zl_mobile {__version__} ({self.backend.label})",
            "memory_bytes": total_memory_bytes(), "capabilities": self.backend.capabilities, "os": "linux-emulated",
            "cores": len(os.sched_getaffinity(0)), "files": stored,
            **({"cpu_share": self.cpu_share} if self.cpu_share is not None else {}),
            **({"memory_budget_bytes": b} if (b := budget_bytes(self.memory_limit)) else {})})

    def _cached_sha(self, p: Path) -> str:
        # beside the file a 255-byte name plus ".sha256" would pass NAME_MAX: keyed by a hash instead
        cache = self.sha_cache / hashlib.sha256(p.name.encode()).hexdigest()
        if cache.exists() and cache.stat().st_mtime >= p.stat().st_mtime:
            return cache.read_text().strip()
        digest = sha256_file(p)
        cache.write_text(digest)
        return digest

    # ---- session
    def serve_connection(self, sock: socket.socket) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # a host that vanished without a FIN (phone off the Wi-Fi) is found by the kernel, not by a read
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        with self._lock:
            self._unauthenticated[id(sock)] = sock
        try:
            hs = device_handshake(sock, self.auth, self.hello(), timeout=self.limits.handshake_s)
        except (ProtocolError, OSError, ConnectionClosed) as e:
            log.warning("%s: refused a connection: %s", self.name, e)
            sock.close()
            return
        finally:
            with self._lock:
                self._unauthenticated.pop(id(sock), None)
        # between frames a host may stay quiet (it only listens while a run trains); inside a frame
        # no byte for io_s seconds is a stall (TIMEOUT); each quiet period drops stale transfers
        sock.settimeout(None)
        conn = Connection(sock, stall_s=self.limits.io_s, max_frame=self.limits.session_max_frame)
        receiver = self.receiver = self._new_receiver()  # transfers belong to this session
        with self._lock:
            self._host = conn
        log.info("%s: host %s connected", self.name, quote(hs.host_name))
        threading.Thread(target=self._heartbeats, args=(conn,), daemon=True).start()
        try:
            while True:
                try:
                    msg = conn.recv()
                except socket.timeout:
                    receiver.sweep()
                    continue
                receiver.sweep()  # counted from each transfer's last chunk, heartbeats or not
                if msg.type == MsgType.ERROR:
                    log.warning("%s: host error %s: %s", self.name, quote(msg["code"]), quote(msg["message"]))
                    if msg.get("request_id") is None:  # about the session, not a request: it ends (5.1)
                        break
                    continue
                rid = msg.get("request_id") if isinstance(msg.get("request_id"), int) else None
                try:
                    reply = self.handle(msg)
                except ProtocolError as e:
                    log.warning("%s: %s", self.name, e)
                    conn.try_send(error_reply(e, rid))
                    if rid is None:  # an ERROR about no one request is about the session: its sender closes (5.1)
                        break
                    continue
                except Exception as e:  # a failure on this side: report it (INTERNAL)
                    err = ProtocolError(ErrorCode.INTERNAL, f"{msg.type.name} failed on the device: "
                                                            f"{type(e).__name__}: {e}")
                    log.error("%s: %s", self.name, err)
                    log.debug("%s: %s failed", self.name, msg.type.name, exc_info=True)
                    conn.try_send(error_reply(err, rid))
                    if rid is None:  # as above: only an answer to one request keeps the session
                        break
                    continue
                if reply is not None and conn is not self._silent:
                    conn.send(reply)
                if msg.type == MsgType.SHUTDOWN:
                    break
        except ProtocolError as e:  # a bad frame: tell the host, drop the session, keep serving
            log.warning("%s: dropping the host session: %s", self.name, e)
            conn.try_send(error_reply(e))
        except (ConnectionClosed, OSError):
            log.info("%s: host disconnected", self.name)
        finally:
            receiver.close()  # abandoned transfers: descriptors closed, part files removed
            with self._lock:
                if self._host is conn:
                    self._host = None
            hs.close()
            conn.close()

    def _heartbeats(self, conn: Connection, period: float = 0.5) -> None:
        seq = 0
        while not conn.closed and conn is not self._silent \
                and conn.try_send(Message(MsgType.HEARTBEAT, {"seq": seq, "time_ms": int(time.monotonic() * 1000)})):
            seq += 1
            time.sleep(period)

    def send_to_host(self, msg: Message) -> None:
        conn = self._host
        if conn is not None and conn is not self._silent:
            conn.try_send(msg)

    def _stage_failed(self, stage: Stage, detect: str) -> None:
        """Fault injection, mode "app" (zl_mobile.stage): the stage dropped its state inside this
        running phone. The host learns of it as it would of an app whose training crashed: the
        session drops (`connection`), or the phone stops answering until the host's heartbeat
        timeout gives up on the session (`heartbeat`). The phone itself serves on."""
        with self._lock:
            if self.stage is stage:
                self.stage, self.stage_meta = None, None
            conn = self._host
        if conn is None:
            return
        if detect == "heartbeat":
            self._silent = conn
        else:
            conn.close()

    def handle(self, msg: Message) -> Message | None:
        t = msg.type
        if t == MsgType.HEARTBEAT:
            return Message(MsgType.HEARTBEAT, {"seq": msg["seq"]})
        if t == MsgType.FILE_BEGIN:
            return self.receiver.begin(msg)
        if t == MsgType.FILE_CHUNK:
            return self.receiver.chunk(msg)
        if t == MsgType.FILE_END:
            return self.receiver.end(msg)
        if t == MsgType.STAGE_ASSIGN:
            return self._assign(msg)
        if t == MsgType.STATE_GET:
            return self._state_get(msg)
        if t == MsgType.SHUTDOWN:
            self.stop_stage()
            return None
        if t == MsgType.STATE_PUT:  # answered with ACK (PROTOCOL.md 5.6), as the Kotlin core does
            return Message(MsgType.ACK, {"request_id": msg["request_id"], "ok": False,
                                         "message": "this device does not load state from the host; its stage "
                                                    "restores from its own checkpoints"})
        raise ProtocolError(ErrorCode.UNEXPECTED, f"{t.name} is not something a host sends to a device")

    # ---- stage
    def _reject(self, msg: Message, why: str) -> ProtocolError:
        return ProtocolError(ErrorCode.REJECTED, why)

    def _assign(self, msg: Message) -> Message:
        meta = msg.meta
        validate_assign(meta)  # every field, before anything is read, created or started
        manifest_path = self.files / "manifest.json"
        if not manifest_path.exists():
            raise self._reject(msg, "no manifest.json on this device: push the export's manifest before STAGE_ASSIGN")
        try:  # text that is not JSON stays a failure on this side (INTERNAL); records of the wrong shape are refused
            manifest = Manifest.from_json(json.loads(manifest_path.read_text()))
        except ManifestError as e:
            raise self._reject(msg, f"{e}; push the export's own manifest.json") from None
        chunks = manifest.chunks
        k = meta["stage"]
        if meta["num_stages"] != len(chunks) or k >= len(chunks):
            raise self._reject(msg, f"stage {k} of {meta['num_stages']} does not fit the program: the export has "
                                    f"{len(chunks)} chunks; assign one stage per chunk")
        schedule = meta.get("schedule", "zerolock")
        try:
            chunk = chunks[k].for_schedule(schedule)  # BP baselines run the chunk's BP program
            needed = self.backend.chunk_files(chunk)
        except ManifestError as e:
            raise self._reject(msg, f"schedule {schedule}: {e}") from None
        except ProgramError as e:
            raise self._reject(msg, str(e)) from None
        sizes = manifest.files
        for key in needed:  # names first: nothing outside the phone's storage is looked at, even to say so
            name = getattr(chunk, key)
            if not plain_file_name(name) or name not in sizes:
                raise self._reject(msg, f"manifest.json names {quote_any(name)} as chunk {k}'s {key}, which is not a "
                                        "plain file name listed in its files (no '/', '\\', '..'; files live in the "
                                        "phone's storage): push the export's own manifest.json")
        for key in needed:
            name = getattr(chunk, key)
            p = self.files / name
            if not p.exists():
                raise self._reject(msg, f"{quote(name)} is not on this device: push it before assigning stage {k}")
            if self._cached_sha(p) != sizes[name].sha256:
                raise self._reject(msg, f"{quote(name)} on this device does not match the manifest's sha256: push it again")
        if chunk.program not in sizes or sizes[chunk.program].sha256 != meta["program_sha256"]:
            raise self._reject(msg, f"program_sha256 in STAGE_ASSIGN is not chunk {k}'s program "
                                    f"({quote_any(chunk.program)}): assign the stage that matches the program")
        if "upstream_token" not in meta:
            raise self._reject(msg, f"STAGE_ASSIGN for stage {k} lacks upstream_token: the stage needs the pairing "
                                    "token of its upstream link (section 6) to accept it")
        cfg = StageConfig.from_assign(meta)
        same = (self.stage is not None and self.stage_meta is not None and not cfg.restart
                and self.stage_meta.get("run_id") == meta.get("run_id") and self.stage_meta["stage"] == k)
        if same:  # a rewire after a neighbour restarted: keep the running stage
            self.stage.rewire(cfg.downstream)
        else:
            listener = self._listener(msg, cfg.listen_port)  # before anything is stopped or created
            self.stop_stage()
            try:
                self.stage = Stage(self.files, chunks[k], manifest.export, cfg, self.workdir,
                                   to_host=self.send_to_host, limiter=self.limiter,
                                   data_port=cfg.listen_port, bind=self.bind,
                                   load_program=self.backend.load, link_delay=self.link_delay,
                                   on_failure=self._stage_failed, listener=listener, io_s=self.limits.io_s)
            except ProgramError as e:
                if listener is not None:
                    listener.close()
                raise self._reject(msg, str(e)) from None
            except BaseException:
                if listener is not None:
                    listener.close()
                raise
        self.stage_meta = dict(meta)
        return Message(MsgType.ACK, {"request_id": meta["request_id"], "ok": True, "data_port": self.stage.data_port,
                                     "committed_window": self.stage.committed, "next_micro_batch": self.stage.next_mb})

    def _listener(self, msg: Message, port: int):
        """The new stage's data port, bound now so a port that cannot be had is refused before the
        running stage is stopped. None: any port (0), or the port the running stage holds (its
        socket is closed with it and the new stage binds it again)."""
        if not port or (self.stage is not None and self.stage.data_port == port):
            return None
        try:
            return bind_listener(self.bind, port)
        except OSError as e:
            raise self._reject(msg, f"STAGE_ASSIGN listen_port: cannot listen on {self.bind}:{port} "
                                    f"({e.strerror or e}); free the port or assign another") from None

    def evict_unauthenticated(self) -> bool:
        """Close the oldest connection that has not authenticated (its handshake then fails and
        its slot frees); False when there is none."""
        with self._lock:
            if not self._unauthenticated:
                return False
            _, sock = self._unauthenticated.popitem(last=False)
        try:
            sock.shutdown(socket.SHUT_RDWR)  # wakes its handshake's read; the thread closes it
        except OSError:
            pass
        return True

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
    """Accept connections forever, one thread each (the handshake allows one host). At most
    device.limits.max_connections at once: the rest are closed at accept. A failing accept
    (EMFILE: out of descriptors) is logged and retried, never the end of the phone."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((bind, port))
    srv.listen(64)
    if ready is not None:
        ready(srv.getsockname()[1])
    slots = threading.BoundedSemaphore(device.limits.max_connections)
    warned = Throttle(5.0)

    def run(sock: socket.socket) -> None:
        try:
            device.serve_connection(sock)
        finally:
            slots.release()

    # accept wakes up now and then: a signal (SIGTERM, Ctrl-C) that the kernel hands to another
    # thread only sets Python's flag, and its handler runs when the main thread returns to Python
    srv.settimeout(0.5)
    while True:
        try:
            sock, peer = srv.accept()
        except socket.timeout:
            continue
        except OSError as e:  # EMFILE/ENFILE/ENOMEM, ECONNABORTED: the listener itself is fine
            if warned():
                log.warning("%s: accept failed (%s); retrying", device.name, e.strerror or e)
            time.sleep(0.05)  # the pending connection stays queued: do not spin on it
            continue
        if not slots.acquire(blocking=False):
            # the oldest unauthenticated connection gives way, so a host that authenticates always
            # finds room; with none to spare (cannot happen with one host session) the new one goes
            evicted = device.evict_unauthenticated()
            if warned():
                log.warning("%s: %d connections open already; closing %s", device.name,
                            device.limits.max_connections,
                            "the oldest unauthenticated one" if evicted else f"the one from {peer[0]}")
            if not (evicted and slots.acquire(timeout=2.0)):
                sock.close()
                continue
        try:
            threading.Thread(target=run, args=(sock,), daemon=True).start()
        except RuntimeError as e:  # no thread to be had
            slots.release()
            sock.close()
            if warned():
                log.warning("%s: cannot serve a connection (%s)", device.name, e)


def plain_file_name(name) -> bool:
    """A name a manifest may give a file: what FILE_BEGIN accepts (PROTOCOL.md 5.2), so it always
    names a file in the phone's storage."""
    return (isinstance(name, str) and 1 <= len(name.encode("utf-8", "surrogatepass")) <= 255
            and name not in (".", "..") and not any(c in name for c in "/\\\0"))


class Throttle:
    """True at most once per `period` seconds: one log line for a flood, not one per connection."""

    def __init__(self, period: float):
        self.period, self._last = period, -period

    def __call__(self) -> bool:
        now = time.monotonic()
        if now - self._last < self.period:
            return False
        self._last = now
        return True

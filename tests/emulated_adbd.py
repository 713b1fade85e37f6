"""EMULATED adbd, for tests only: the device end of the ADB transport protocol, so the real adb
server (``adb connect 127.0.0.1:PORT``) and adbutils can drive an emulated phone (zl-phone) the
way they drive a phone on USB. It is not an Android device and fakes no Android behaviour
beyond what the host uses; everything it does is done for real on this machine:

- transport: CNXN / OPEN / OKAY / WRTE / CLSE (protocol version 0x01000001, no AUTH, no TLS),
  one OKAY per WRTE both ways (no delayed-ack feature); as in adbd, a failing stream (its local
  socket reset or closed, a file error) closes that stream only (CLSE), never the connection;
- ``shell:<cmd>``: run by /bin/sh in the sandbox dir (stdout and stderr merged, like shell v1);
  ``sandbox/bin`` comes first on PATH, where tests put thin stand-ins for Android commands
  (``run-as``, ``dumpsys``) that this machine lacks;
- ``sync:``: STAT, SEND (DATA/DONE), RECV, QUIT; paths must lie under ``fs_root`` (default: the
  sandbox dir);
- ``tcp:<port>``: connect to 127.0.0.1:<port> (what ``adb forward`` opens); ``ports`` maps a
  device port to the host port of the process behind it (the app's 47474 -> a zl-phone's port),
  since several emulated devices share this machine's ports;
- ``reverse:forward:[norebind:]tcp:P;tcp:Q``, ``reverse:killforward:tcp:P``,
  ``reverse:killforward-all``, ``reverse:list-forward``: listen on 127.0.0.1:P (P = 0 picks a
  port and reports it) and open ``tcp:Q`` towards the adb server for each connection, as adbd
  does for ``adb reverse``; like adbd's, a reverse belongs to the connection that made it and
  is dropped when that connection drops.

:meth:`EmulatedAdbd.drop_connection` does what a USB glitch does to a phone: the connection to the
adb server drops, the server reconnects, and the device is listed 'offline' until it answers.

Run ``python -m tests.emulated_adbd --sandbox DIR`` to try it by hand: it prints the port to
``adb connect`` to.
"""
from __future__ import annotations

import argparse
import os
import socket
import struct
import subprocess
import threading
import time
from pathlib import Path

A_SYNC, A_CNXN, A_OPEN, A_OKAY = 0x434E5953, 0x4E584E43, 0x4E45504F, 0x59414B4F
A_CLSE, A_WRTE, A_AUTH, A_STLS = 0x45534C43, 0x45545257, 0x48545541, 0x534C5453
VERSION = 0x01000001
MAX_PAYLOAD = 256 * 1024
_HEADER = struct.Struct("<6I")


def _packet(cmd: int, arg0: int, arg1: int, data: bytes = b"") -> bytes:
    return _HEADER.pack(cmd, arg0, arg1, len(data), sum(data) & 0xFFFFFFFF, cmd ^ 0xFFFFFFFF) + data


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            raise ConnectionError("peer closed")
        buf += part
    return bytes(buf)


class Stream:
    """One ADB stream: our id, the server's id, and one-WRTE-in-flight flow control."""

    def __init__(self, transport: "Transport", local_id: int, remote_id: int, service: str = ""):
        self.t, self.local_id, self.remote_id, self.service = transport, local_id, remote_id, service
        self._okay = threading.Event()
        self._okay.set()
        self.closed = False
        self.on_data = lambda data: None
        self.on_close = lambda: None
        self.started = lambda: None
        self.opened: threading.Event | None = None  # set for streams we OPEN (reverse forwards)

    def write(self, data: bytes) -> bool:
        for i in range(0, len(data), self.t.max_payload):
            while not self._okay.wait(0.5):
                if self.closed:
                    return False
            if self.closed:
                return False
            self._okay.clear()
            self.t.send(A_WRTE, self.local_id, self.remote_id, data[i:i + self.t.max_payload])
        return True

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._okay.set()
            self.t.send(A_CLSE, self.local_id, self.remote_id)
            self.t.streams.pop(self.local_id, None)
            self.t.guard(self, self.on_close)

    def gone(self) -> None:
        """The server closed this stream (CLSE), or the connection dropped: no CLSE back."""
        self.closed = True
        self._okay.set()
        if self.opened is not None:
            self.opened.set()
        self.t.guard(self, self.on_close)


class Transport:
    """One connection from the adb server."""

    def __init__(self, daemon: "EmulatedAdbd", sock: socket.socket):
        self.d, self.sock = daemon, sock
        self.max_payload = 4096
        self.streams: dict[int, Stream] = {}
        self._wlock = threading.Lock()
        self._ids = iter(range(1, 1 << 31))
        self._idlock = threading.Lock()

    def send(self, cmd, arg0, arg1, data=b"") -> None:
        try:
            with self._wlock:
                self.sock.sendall(_packet(cmd, arg0, arg1, data))
        except OSError:
            pass

    def new_id(self) -> int:
        with self._idlock:
            return next(self._ids)

    def guard(self, stream: Stream, handler, *args) -> None:
        """Run one stream's handler. If it fails (its local socket was reset or closed under it,
        a file error), that stream is closed and the failure recorded in ``errors``; the
        connection and its other streams go on, as in adbd, where a failing local socket sends
        CLSE for its stream only. (Letting the error end :meth:`run` would drop the whole device
        off the adb server: 'offline' until the server reconnects.)"""
        try:
            handler(*args)
        except Exception as e:  # noqa: BLE001 - any failure of one stream stays in that stream
            self.d.errors.append(f"{stream.service or 'stream'} {stream.local_id}: {e!r}")
            if not stream.closed:
                stream.close()

    def run(self) -> None:
        try:
            while True:
                cmd, arg0, arg1, n, _check, magic = _HEADER.unpack(_recv_exact(self.sock, 24))
                if magic != cmd ^ 0xFFFFFFFF:
                    raise ConnectionError(f"bad magic on command {cmd:#x}")
                data = _recv_exact(self.sock, n) if n else b""
                self._dispatch(cmd, arg0, arg1, data)
        except (ConnectionError, OSError):
            pass
        finally:
            self.d.connection_closed(self)
            for s in list(self.streams.values()):
                s.gone()
            self.streams.clear()
            self.sock.close()

    def _dispatch(self, cmd, arg0, arg1, data) -> None:
        if cmd == A_CNXN:
            self.max_payload = min(arg1, MAX_PAYLOAD)
            self.d.stay_offline()
            self.send(A_CNXN, VERSION, self.max_payload, self.d.banner())
        elif cmd == A_OPEN:
            service = data.rstrip(b"\0").decode(errors="replace")
            stream = Stream(self, self.new_id(), arg0, service)
            self.streams[stream.local_id] = stream
            try:
                ok = self.d.open_service(service, stream)
            except Exception as e:  # noqa: BLE001 - a service that cannot start fails its OPEN only
                self.d.errors.append(f"{service}: {e!r}")
                ok = False
            if ok:
                self.send(A_OKAY, stream.local_id, arg0)
                self.guard(stream, stream.started)
            else:
                self.streams.pop(stream.local_id, None)
                self.send(A_CLSE, 0, arg0)
        elif cmd == A_OKAY:
            s = self.streams.get(arg1)
            if s is not None:
                if s.remote_id == 0:  # the answer to an OPEN we sent (reverse forward)
                    s.remote_id = arg0
                    s.opened.set()
                s._okay.set()
        elif cmd == A_WRTE:
            s = self.streams.get(arg1)
            if s is None:
                self.send(A_CLSE, 0, arg0)
                return
            self.send(A_OKAY, s.local_id, s.remote_id)
            self.guard(s, s.on_data, data)
        elif cmd == A_CLSE:
            s = self.streams.pop(arg1, None)
            if s is not None:
                s.gone()
        elif cmd in (A_AUTH, A_STLS, A_SYNC):
            raise ConnectionError(f"command {cmd:#x} is not supported by the emulated adbd")


# ---------------------------------------------------------------- services

def _pump_socket(stream: Stream, sock: socket.socket) -> None:
    """tcp socket <-> ADB stream, both ways, until either side closes."""
    stream.on_data = lambda data: sock.sendall(data)

    def closed():
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        sock.close()

    stream.on_close = closed

    def reader():
        try:
            while True:
                data = sock.recv(65536)
                if not data or not stream.write(data):
                    break
        except OSError:
            pass
        stream.close()

    stream.started = lambda: threading.Thread(target=reader, daemon=True).start()


class _Sync:
    """The sync: service (file push/pull/stat) confined to the sandbox dir."""

    def __init__(self, daemon: "EmulatedAdbd", stream: Stream):
        self.d, self.s = daemon, stream
        self.buf = bytearray()
        self.send_file = None  # (fh, tmp path, final path, mode) while a SEND runs

    def _path(self, raw: bytes) -> Path | None:
        p = Path(os.path.normpath(raw.decode()))
        root = self.d.fs_root
        return p if p.is_absolute() and (p == root or root in p.parents) else None

    def feed(self, data: bytes) -> None:
        self.buf += data
        while len(self.buf) >= 8:
            cmd, n = bytes(self.buf[:4]), struct.unpack("<I", self.buf[4:8])[0]
            if self.send_file is not None and cmd == b"DONE":
                del self.buf[:8]
                self._done(n)
                continue
            if len(self.buf) < 8 + n:
                return
            arg = bytes(self.buf[8:8 + n])
            del self.buf[:8 + n]
            self._command(cmd, arg)

    def _fail(self, message: str) -> None:
        data = message.encode()
        self.s.write(b"FAIL" + struct.pack("<I", len(data)) + data)

    def _command(self, cmd: bytes, arg: bytes) -> None:
        if cmd == b"STAT":
            p = self._path(arg)
            try:
                st = os.stat(p) if p else None
            except OSError:
                st = None
            fields = (st.st_mode, st.st_size, int(st.st_mtime)) if st else (0, 0, 0)
            self.s.write(b"STAT" + struct.pack("<3I", *fields))
        elif cmd == b"SEND":
            raw, _, mode = arg.rpartition(b",")
            p = self._path(raw)
            if p is None:
                self._fail(f"remote couldn't create file: {raw.decode()} is outside this emulated device")
                self.send_file = (None, None, None, 0)
                return
            p.parent.mkdir(parents=True, exist_ok=True)
            tmp = p.with_name(p.name + ".adbtmp")
            self.send_file = (open(tmp, "wb"), tmp, p, int(mode) & 0o777)
            self.d.pushed.append(str(p))
        elif cmd == b"DATA" and self.send_file is not None:
            if self.send_file[0] is not None:
                self.send_file[0].write(arg)
        elif cmd == b"RECV":
            p = self._path(arg)
            try:
                with open(p, "rb") as f:
                    while block := f.read(64 * 1024):
                        self.s.write(b"DATA" + struct.pack("<I", len(block)) + block)
                self.s.write(b"DONE" + struct.pack("<I", 0))
            except (OSError, TypeError):
                self._fail(f"remote object '{arg.decode()}' does not exist")
        elif cmd == b"QUIT":
            self.s.close()
        else:
            self._fail(f"unknown sync command {cmd!r} (emulated adbd)")

    def _done(self, mtime: int) -> None:
        fh, tmp, final, mode = self.send_file
        self.send_file = None
        if fh is None:
            return
        fh.close()
        os.chmod(tmp, mode or 0o644)
        os.replace(tmp, final)
        os.utime(final, (mtime, mtime))
        self.s.write(b"OKAY" + struct.pack("<I", 0))


class EmulatedAdbd:
    """Listens on 127.0.0.1:port for the adb server; ``sandbox`` is the emulated device's disk."""

    def __init__(self, sandbox: Path, model: str = "ZeroLock_Emulated", port: int = 0,
                 ports: dict[int, int] | None = None, fs_root: Path | None = None):
        self.sandbox = Path(sandbox).resolve()
        self.fs_root = Path(fs_root).resolve() if fs_root else self.sandbox
        self.ports = dict(ports or {})
        (self.sandbox / "bin").mkdir(parents=True, exist_ok=True)
        self.model = model
        self.srv = socket.socket()
        self.srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.srv.bind(("127.0.0.1", port))
        self.srv.listen(4)
        self.port = self.srv.getsockname()[1]
        self.reverses: dict[int, tuple[socket.socket, str, Transport]] = {}
        self.shell_log: list[str] = []   # every shell command, for tests to inspect
        self.services: list[str] = []    # every service the adb server opened
        self.pushed: list[str] = []      # every file written through sync SEND
        self.errors: list[str] = []      # every stream that failed (and was closed alone)
        self.connections = 0             # connections the adb server made (1 unless it reconnected)
        self.offline_until = 0.0         # time.monotonic() before which a new CNXN is not answered
        self._transports: set[Transport] = set()
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def serial(self) -> str:
        return f"127.0.0.1:{self.port}"

    def banner(self) -> bytes:
        props = f"ro.product.name=zlemu;ro.product.model={self.model};ro.product.device=zlemu;"
        return f"device::{props}features=cmd\0".encode()

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, _ = self.srv.accept()
            except OSError:
                return
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            transport = Transport(self, sock)
            with self._lock:
                self.connections += 1
                self._transports.add(transport)
            threading.Thread(target=transport.run, daemon=True).start()

    def connection_closed(self, transport: Transport) -> None:
        """adbd's listener_disconnect: the reverses made over a connection go with it."""
        with self._lock:
            self._transports.discard(transport)
            for port, (lsock, _, t) in list(self.reverses.items()):
                if t is transport:
                    lsock.close()
                    del self.reverses[port]

    def drop_connection(self, offline_for: float = 0.0) -> None:
        """What a USB glitch does: the connection(s) to the adb server drop (taking their reverses
        with them); the server reconnects at once, and the device stays 'offline' there until
        it answers the new CNXN, ``offline_for`` seconds from now."""
        self.offline_until = time.monotonic() + offline_for
        with self._lock:
            transports = list(self._transports)
        for t in transports:
            try:
                t.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def stay_offline(self) -> None:
        """Hold back the answer to a CNXN until ``offline_until`` (or close())."""
        self._closing.wait(max(0.0, self.offline_until - time.monotonic()))

    def close(self) -> None:
        self._closed = True
        self._closing.set()
        self.srv.close()
        with self._lock:
            for lsock, _, _ in list(self.reverses.values()):
                lsock.close()
            self.reverses.clear()

    # ---- services
    def open_service(self, service: str, stream: Stream) -> bool:
        self.services.append(service)
        if service.startswith("shell:"):
            return self._shell(service[len("shell:"):], stream)
        if service == "sync:":
            sync = _Sync(self, stream)
            stream.on_data = sync.feed
            return True
        if service.startswith("tcp:"):
            try:
                port = int(service[4:])
                sock = socket.create_connection(("127.0.0.1", self.ports.get(port, port)), timeout=5)
            except (OSError, ValueError):
                return False
            sock.settimeout(None)
            _pump_socket(stream, sock)
            return True
        if service.startswith("reverse:"):
            reply = self._reverse(service[len("reverse:"):], stream.t)
            stream.started = lambda: (stream.write(reply), stream.close())
            return True
        return False

    def _shell(self, cmd: str, stream: Stream) -> bool:
        self.shell_log.append(cmd)
        env = dict(os.environ, PATH=f"{self.sandbox / 'bin'}:{os.environ.get('PATH', '/usr/bin:/bin')}",
                   ZL_EMU_SANDBOX=str(self.sandbox))
        proc = subprocess.Popen(["/bin/sh", "-c", cmd], cwd=self.sandbox, env=env, stdin=subprocess.DEVNULL,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

        def run():
            for block in iter(lambda: proc.stdout.read1(65536), b""):
                if not stream.write(block):
                    break
            proc.stdout.close()
            proc.wait()
            stream.close()

        stream.on_close = lambda: proc.poll() is None and proc.kill()
        stream.started = lambda: threading.Thread(target=run, daemon=True).start()
        return True

    def _reverse(self, request: str, transport: Transport) -> bytes:
        with self._lock:  # connection_closed (another thread) drops reverses too
            return self._reverse_locked(request, transport)

    def _reverse_locked(self, request: str, transport: Transport) -> bytes:
        def okay(text: str | None = None) -> bytes:
            return b"OKAY" + (f"{len(text):04x}{text}".encode() if text is not None else b"")

        def fail(text: str) -> bytes:
            return b"FAIL" + f"{len(text):04x}{text}".encode()

        if request == "list-forward":
            lines = "".join(f"host tcp:{p} {target}\n" for p, (_, target, _) in self.reverses.items())
            return okay(lines)[4:]  # adbd sends the list without an OKAY of its own
        if request == "killforward-all":
            for lsock, _, _ in self.reverses.values():
                lsock.close()
            self.reverses.clear()
            return okay()
        if request.startswith("killforward:"):
            spec = request[len("killforward:"):]
            entry = self.reverses.pop(int(spec[4:]), None) if spec.startswith("tcp:") else None
            if entry is None:
                return fail(f"listener '{spec}' not found")
            entry[0].close()
            return okay()
        if request.startswith("forward:"):
            spec = request[len("forward:"):]
            norebind = spec.startswith("norebind:")
            spec = spec[len("norebind:"):] if norebind else spec
            local, _, target = spec.partition(";")
            if not (local.startswith("tcp:") and target.startswith("tcp:")):
                return fail(f"the emulated adbd only reverses tcp: to tcp:, not {spec}")
            port = int(local[4:])
            if port in self.reverses:
                if norebind:
                    return fail(f"cannot rebind existing socket {local}")
                old = self.reverses.pop(port)
                old[0].close()
            lsock = socket.socket()
            try:
                lsock.bind(("127.0.0.1", port))
            except OSError as e:
                lsock.close()
                return fail(f"cannot bind listener: {e}")
            lsock.listen(8)
            port = lsock.getsockname()[1]
            self.reverses[port] = (lsock, target, transport)
            threading.Thread(target=self._reverse_accept, args=(lsock, target, transport), daemon=True).start()
            return okay() + (okay(str(port))[4:] if local == "tcp:0" else b"")
        return fail(f"unsupported reverse request {request}")

    def _reverse_accept(self, lsock: socket.socket, target: str, transport: Transport) -> None:
        while True:
            try:
                sock, _ = lsock.accept()
            except OSError:
                return
            stream = Stream(transport, transport.new_id(), 0, target)
            stream.opened = threading.Event()
            transport.streams[stream.local_id] = stream
            _pump_socket(stream, sock)
            transport.send(A_OPEN, stream.local_id, 0, target.encode() + b"\0")
            if not stream.opened.wait(10) or stream.closed:
                sock.close()
                continue
            stream.started()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sandbox", type=Path, required=True)
    p.add_argument("--port", type=int, default=0)
    a = p.parse_args(argv)
    d = EmulatedAdbd(a.sandbox, port=a.port)
    print(f"emulated adbd on 127.0.0.1:{d.port}; adb connect 127.0.0.1:{d.port}", flush=True)
    threading.Event().wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


# ---------------------------------------------------------------- an emulated phone on "USB"

RUN_AS = """#!/bin/sh
# EMULATED run-as (tests/emulated_adbd.py): runs the command in the app's data dir, as run-as does
# for a debuggable app; no uid switch.
pkg="$1"; shift
cd "$ZL_EMU_SANDBOX/data/data/$pkg" 2>/dev/null || { echo "run-as: unknown package: $pkg" >&2; exit 1; }
exec "$@"
"""

DUMPSYS = """#!/bin/sh
# EMULATED dumpsys (tests/emulated_adbd.py): prints captured outputs from real phones
# (tests/data/dumpsys), not this machine's state.
case "$1" in
  meminfo) cat '{meminfo}' ;;
  battery) cat '{battery}' ;;
  *) echo "Can't find service: $1"; exit 1 ;;
esac
"""


def usb_phone_sandbox(sandbox: Path, phone_files: Path, package: str, *, run_as: bool = True,
                      meminfo: Path | None = None, battery: Path | None = None) -> Path:
    """Lay out an emulated device's disk for the app: data/data/<package>/files/programs is the
    zl-phone's files dir; bin/ holds run-as (unless ``run_as`` is False: a phone whose app is not
    debuggable) and dumpsys stand-ins."""
    app = sandbox / "data" / "data" / package / "files"
    app.mkdir(parents=True, exist_ok=True)
    link = app / "programs"
    if not link.exists():
        link.symlink_to(Path(phone_files).resolve(), target_is_directory=True)
    bin_dir = sandbox / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    scripts = {}
    if run_as:
        scripts["run-as"] = RUN_AS
    if meminfo is not None and battery is not None:
        scripts["dumpsys"] = DUMPSYS.format(meminfo=Path(meminfo).resolve(), battery=Path(battery).resolve())
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    return sandbox

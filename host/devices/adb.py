"""Phones on adb: discovery, push, port forwarding, PSS and battery temperature.

Thin wrappers over adbutils (which talks to the adb server's socket) plus pure parsers for
``dumpsys meminfo <package>`` and ``dumpsys battery``. :func:`adb_status` tells apart "no adb
anywhere", "adb server would not start", "server running, no phone attached" and "phones".
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 5037
_INSTALL_HINT = ("install Android platform-tools (Debian/Ubuntu: apt-get install adb) or set "
                 "ZL_ADB=/path/to/adb")


class AdbUnavailable(RuntimeError):
    """No adb server could be reached or started; ``kind`` is "adb-missing",
    "server-failed" or "no-server"."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class DumpsysParseError(ValueError):
    """``dumpsys`` output did not hold the expected value."""


@dataclass(frozen=True)
class AdbPhone:
    serial: str
    model: str   # "" when adb does not report it (e.g. unauthorized)
    state: str   # "device" (ready), "unauthorized", "offline", "recovery", ...

    @property
    def ready(self) -> bool:
        return self.state == "device"


@dataclass(frozen=True)
class AdbStatus:
    kind: str                  # "adb-missing" | "server-failed" | "no-server" | "no-device" | "ok"
    message: str               # one line for people
    phones: list[AdbPhone] = field(default_factory=list)
    adb_path: str | None = None
    server: str = ""           # "host:port"


# ------------------------------------------------------------------ server and binary

def _port(port: int | None) -> int:
    if port is not None:
        return int(port)
    return int(os.environ.get("ANDROID_ADB_SERVER_PORT") or DEFAULT_PORT)


def _bundled_adb() -> str | None:
    """The adb binary shipped inside the adbutils wheel, if this platform's wheel has one."""
    try:
        import adbutils.binaries as binaries
    except ImportError:
        return None
    exe = os.path.join(os.path.dirname(binaries.__file__), "adb.exe" if os.name == "nt" else "adb")
    return exe if os.path.isfile(exe) and os.access(exe, os.X_OK) else None


def find_adb(*, bundled: bool = True) -> str | None:
    """The adb to start a server with: $ZL_ADB, $ADBUTILS_ADB_PATH, adb on PATH, then (if
    ``bundled``) the binary in the adbutils wheel. None if there is none."""
    for var in ("ZL_ADB", "ADBUTILS_ADB_PATH"):
        exe = os.environ.get(var)
        if exe:
            return exe if os.path.isfile(exe) and os.access(exe, os.X_OK) else None
    exe = shutil.which("adb")
    if exe:
        return exe
    return _bundled_adb() if bundled else None


def _server_up(host: str, port: int, timeout: float = 1.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _client(host: str, port: int | None):
    import adbutils
    return adbutils.AdbClient(host=host, port=_port(port), socket_timeout=10)


def _ensure_server(host: str, port: int, start_server: bool, bundled: bool) -> str | None:
    """Make sure a server answers on host:port; return the adb path used (None if one ran)."""
    server = f"{host}:{port}"
    if _server_up(host, port):
        return None
    adb = find_adb(bundled=bundled)
    if adb is None:
        raise AdbUnavailable("adb-missing", f"no adb server on {server} and no adb binary "
                             f"found (ZL_ADB, ADBUTILS_ADB_PATH, PATH"
                             f"{', adbutils wheel' if bundled else ''}); {_INSTALL_HINT}")
    if not start_server or host not in ("127.0.0.1", "localhost", "::1"):
        raise AdbUnavailable("no-server", f"no adb server on {server}; start one with "
                             f"'{adb} -P {port} start-server'")
    try:
        proc = subprocess.run([adb, "-P", str(port), "start-server"], capture_output=True,
                              text=True, timeout=30)
        detail = (proc.stderr or proc.stdout).strip().splitlines()
    except (OSError, subprocess.TimeoutExpired) as e:
        detail = [str(e)]
    if not _server_up(host, port, timeout=3.0):
        raise AdbUnavailable("server-failed", f"'{adb} -P {port} start-server' did not bring "
                             f"up a server on {server}: {detail[-1] if detail else 'no output'}")
    return adb


def list_adb_devices(*, host: str = DEFAULT_HOST, port: int | None = None,
                     start_server: bool = True, bundled: bool = True) -> list[AdbPhone]:
    """Phones the adb server knows, in any state (check ``.ready``); [] when none is attached.

    Starts a local server if none runs (``start_server``). Raises :class:`AdbUnavailable`
    when there is no server and no adb binary to start one, or it would not start.
    """
    port = _port(port)
    _ensure_server(host, port, start_server, bundled)
    phones = []
    for info in _client(host, port).list(extended=True):
        model = info.tags.get("model", "").replace("_", " ")
        phones.append(AdbPhone(serial=info.serial, model=model, state=info.state))
    return phones


def adb_status(*, host: str = DEFAULT_HOST, port: int | None = None,
               start_server: bool = True, bundled: bool = True) -> AdbStatus:
    """Like :func:`list_adb_devices`, but never raises for the expected cases."""
    port = _port(port)
    server = f"{host}:{port}"
    try:
        started_with = _ensure_server(host, port, start_server, bundled)
        phones = list_adb_devices(host=host, port=port, start_server=False)
    except AdbUnavailable as e:
        return AdbStatus(e.kind, str(e), adb_path=find_adb(bundled=bundled), server=server)
    how = f"started with {started_with}" if started_with else "running"
    if not phones:
        return AdbStatus("no-device", f"adb server {how} on {server}, no device attached; "
                         f"connect a phone by USB with USB debugging on (or 'adb connect "
                         f"<ip>:<port>')", [], started_with, server)
    waiting = [p for p in phones if not p.ready]
    msg = f"adb server {how} on {server}: {len(phones) - len(waiting)} ready of {len(phones)}"
    if waiting:
        msg += "; " + ", ".join(f"{p.serial} is {p.state}" for p in waiting)
        if any(p.state == "unauthorized" for p in waiting):
            msg += " (accept the USB debugging prompt on the phone)"
    return AdbStatus("ok", msg, phones, started_with, server)


# ------------------------------------------------------------------ device commands

class AdbCommandError(RuntimeError):
    """An adb request to one phone failed (one line: what failed, on which phone, what to do)."""


_PACKAGE = re.compile(r"^[A-Za-z0-9_.:]+$")
_SHA256 = re.compile(r"^([0-9a-f]{64})\s", re.M)


def _device(serial: str, host: str, port: int | None):
    return _client(host, port).device(serial)


def _adb_call(serial: str, what: str, fn, *args, **kwargs):
    """Run one adbutils call; its errors become AdbCommandError naming the phone and the step."""
    import adbutils

    try:
        return fn(*args, **kwargs)
    except (adbutils.AdbError, OSError) as e:
        detail = " ".join(str(e).split()) or type(e).__name__
        raise AdbCommandError(f"adb {what} on {serial} failed: {detail}; check 'adb devices' "
                              f"lists {serial} as 'device'") from None


def push(serial: str, local: str, remote: str, *, host: str = DEFAULT_HOST,
         port: int | None = None) -> int:
    """Copy a local file to ``remote`` (a file path) on the phone (adb push); returns the bytes
    sent."""
    if not os.path.isfile(local):
        raise FileNotFoundError(f"push: local file not found: {local}")
    dev = _device(serial, host, port)
    return _adb_call(serial, f"push {os.path.basename(local)} to {remote}", dev.sync.push,
                     local, remote, 0o644, True)


def forward(serial: str, local_port: int, remote_port: int, *, host: str = DEFAULT_HOST,
            port: int | None = None) -> int:
    """Forward host tcp:local_port to the phone's tcp:remote_port (``adb forward``); 0 picks a
    free local port. Returns the local port. Always a new forward: one the user made stays."""
    dev = _device(serial, host, port)
    if local_port == 0:
        local_port = _free_local_port()
    _adb_call(serial, f"forward tcp:{local_port} tcp:{remote_port}", dev.forward,
              f"tcp:{local_port}", f"tcp:{remote_port}")
    return local_port


def forward_remove(serial: str, local_port: int, *, host: str = DEFAULT_HOST,
                   port: int | None = None) -> None:
    dev = _device(serial, host, port)
    _adb_call(serial, f"forward --remove tcp:{local_port}", dev.forward_remove,
              f"tcp:{local_port}", raise_non_found=False)


def forward_list(serial: str, *, host: str = DEFAULT_HOST, port: int | None = None) -> list[tuple[str, str]]:
    """(local, remote) of the host-side forwards to this phone, e.g. ("tcp:40001", "tcp:47474")."""
    items = _adb_call(serial, "forward --list", _client(host, port).forward_list)
    return [(f.local, f.remote) for f in items if f.serial == serial]


def reverse(serial: str, device_port: int, host_port: int, *, host: str = DEFAULT_HOST,
            port: int | None = None) -> int:
    """``adb reverse tcp:device_port tcp:host_port``: connections to 127.0.0.1:device_port on
    the phone reach 127.0.0.1:host_port on this machine. device_port 0 lets adbd pick one.
    Returns the phone-side port."""
    dev = _device(serial, host, port)

    def request() -> int:
        with dev.open_transport() as c:
            c.send_command(f"reverse:forward:tcp:{device_port};tcp:{host_port}")
            c.check_okay()           # the adb server reached the phone
            c.check_okay()           # adbd installed the listener
            return int(c.read_string_block()) if device_port == 0 else device_port

    return _adb_call(serial, f"reverse tcp:{device_port} tcp:{host_port}", request)


def reverse_remove(serial: str, device_port: int, *, host: str = DEFAULT_HOST,
                   port: int | None = None) -> None:
    dev = _device(serial, host, port)
    _adb_call(serial, f"reverse --remove tcp:{device_port}", dev.reverse_remove, f"tcp:{device_port}")


def reverse_list(serial: str, *, host: str = DEFAULT_HOST, port: int | None = None) -> list[tuple[str, str]]:
    """(phone side, host side) of the phone's reverse forwards."""
    dev = _device(serial, host, port)
    return [(r.remote, r.local) for r in _adb_call(serial, "reverse --list", dev.reverse_list)]


def wait_ready(serial: str, timeout: float, *, host: str = DEFAULT_HOST, port: int | None = None,
               poll: float = 0.2) -> bool:
    """Wait up to ``timeout`` s until the adb server lists ``serial`` as 'device' (ready); True
    if it does. A phone can drop off adb for a moment (a USB glitch or re-enumeration, adbd
    restarting; the server reconnects an 'adb connect' device by itself) and is listed 'offline'
    or not at all meanwhile."""
    import adbutils

    deadline = time.monotonic() + max(0.0, timeout)
    while True:
        try:
            if any(d.serial == serial and d.state == "device" for d in _client(host, port).list()):
                return True
        except (adbutils.AdbError, OSError):
            pass
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        time.sleep(min(poll, left))


def _free_local_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shell(serial: str, args: list[str] | str, *, host: str = DEFAULT_HOST, port: int | None = None,
          timeout: float = 30) -> str:
    dev = _device(serial, host, port)
    return _adb_call(serial, "shell", dev.shell, args, timeout=timeout)


def shell_rc(serial: str, args: list[str] | str, *, host: str = DEFAULT_HOST,
             port: int | None = None, timeout: float = 30) -> tuple[int, str]:
    """Run a shell command; (exit status, stdout+stderr). Works on adbd without shell v2."""
    command = " ".join(shlex.quote(a) for a in args) if isinstance(args, (list, tuple)) else args
    dev = _device(serial, host, port)  # a subshell, so that an 'exit' in it still reports its status
    r = _adb_call(serial, "shell", dev.shell2, f"({command})", timeout=timeout)
    return r.returncode, r.output


def parse_sha256sum(text: str) -> str | None:
    """The digest from ``sha256sum FILE`` output; None when the file is absent."""
    m = _SHA256.search(text + " ")
    return m.group(1) if m else None


def read_mem_total_bytes(serial: str, **kw) -> int:
    """The phone's RAM (MemTotal of /proc/meminfo); 0 if unreadable."""
    m = re.search(r"^MemTotal:\s+(\d+)\s*kB", shell(serial, ["cat", "/proc/meminfo"], **kw), re.M)
    return int(m.group(1)) * 1024 if m else 0


def read_pss_kib(serial: str, package: str, **kw) -> int:
    """Total PSS (KiB) of ``package``'s process(es), from ``dumpsys meminfo <package>``."""
    if not _PACKAGE.match(package):
        raise ValueError(f"not a package/process name: {package!r}")
    return parse_meminfo_pss_kib(shell(serial, ["dumpsys", "meminfo", package], **kw))


def read_battery_temp_c(serial: str, **kw) -> float:
    """Battery temperature in degrees C, from ``dumpsys battery``."""
    return parse_battery_temp_c(shell(serial, ["dumpsys", "battery"], **kw))


# ------------------------------------------------------------------ parsers

_MEMINFO_BLOCK = re.compile(r"^\*\* MEMINFO in pid \d+ \[[^\]]*\] \*\*", re.M)
_TOTAL_PSS_LINE = re.compile(r"^\s*TOTAL PSS:\s+(\d+)", re.M)         # Android 11+
_TOTAL_SUMMARY = re.compile(r"^\s*TOTAL:\s+(\d+)", re.M)               # Android 7-10 summary
_TOTAL_ROW = re.compile(r"^\s*TOTAL\s+(\d+)\s+\d+", re.M)              # table row, any version
_NO_PROCESS = re.compile(r"^No process found for: (.*)$", re.M)


def _first_line(text: str) -> str:
    for line in text.splitlines():
        if line.strip():
            return line.strip()[:80]
    return "(empty)"


def _block_pss(block: str) -> int | None:
    for pattern in (_TOTAL_PSS_LINE, _TOTAL_SUMMARY, _TOTAL_ROW):
        m = pattern.search(block)
        if m:
            return int(m.group(1))
    return None


def parse_meminfo_pss_kib(text: str) -> int:
    """Total PSS in KiB from ``dumpsys meminfo <package>`` output.

    Reads the App Summary's ``TOTAL PSS:`` (Android 11+) or ``TOTAL:`` (older), else the
    first number of the table's ``TOTAL`` row. With several ``** MEMINFO in pid`` blocks (a
    package with more than one process) the totals are summed.
    """
    if not isinstance(text, str):
        raise DumpsysParseError(f"dumpsys meminfo output must be text, got {type(text).__name__}")
    m = _NO_PROCESS.search(text)
    if m and not _MEMINFO_BLOCK.search(text):
        raise DumpsysParseError(f"{m.group(1).strip()} is not running ('{m.group(0).strip()}'"
                                f" from dumpsys meminfo); start the app on the phone first")
    starts = [b.start() for b in _MEMINFO_BLOCK.finditer(text)]
    blocks = [text[a:b] for a, b in zip(starts, starts[1:] + [len(text)])] or [text]
    totals = [_block_pss(b) for b in blocks]
    if any(t is None for t in totals):
        raise DumpsysParseError("no 'TOTAL PSS:', 'TOTAL:' or TOTAL row in dumpsys meminfo "
                                f"output (first line: {_first_line(text)!r}); expected "
                                "'dumpsys meminfo <package>' of a running app")
    return sum(totals)


_TEMPERATURE = re.compile(r"^\s*temperature:\s*(-?\d+)\s*$", re.M)


def parse_battery_temp_c(text: str) -> float:
    """Battery temperature in degrees C from ``dumpsys battery`` (``temperature: 312`` is
    tenths of a degree: 31.2)."""
    if not isinstance(text, str):
        raise DumpsysParseError(f"dumpsys battery output must be text, got {type(text).__name__}")
    m = _TEMPERATURE.search(text)
    if m is None:
        raise DumpsysParseError("no 'temperature: <tenths of C>' line in dumpsys battery "
                                f"output (first line: {_first_line(text)!r}); expected "
                                "'Current Battery Service state:' output")
    return int(m.group(1)) / 10.0

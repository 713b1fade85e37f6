"""How a run reaches phones that are only on USB (adb), and how their stages reach each other.

The decisions are pure functions (:func:`peer_of`, :func:`plan_route`); :class:`AdbLinks`
carries them out with the thin wrappers in :mod:`host.devices.adb` and undoes them at the end of a run.

- control: ``adb forward tcp:L tcp:APP_PORT`` gives the host 127.0.0.1:L for the app's port;
- data port of a USB-only stage: ``adb forward tcp:H tcp:D`` (D: the stage's inbound link port,
  which the host asks the app to listen on with STAGE_ASSIGN ``listen_port``);
- a USB-only upstream phone reaches its neighbour through ``adb reverse tcp:P tcp:H`` on itself
  (P picked by adbd): 127.0.0.1:P on the phone is H on the host, which is the neighbour's data
  port (forwarded, or an emulated phone's port on this host). The bytes go phone -> USB -> adb
  server -> USB -> phone; no relay code on the host.
- files: ``adb push`` into a staging dir, then ``run-as <package> cp`` into the app's files dir
  (a debuggable app), checked with ``sha256sum`` on the phone before (skip an unchanged file)
  and after. Where that is not possible (no run-as, no sha256sum) the caller falls back to the
  protocol's FILE_* transfer.
"""
from __future__ import annotations

import functools
import ipaddress
import re
import shlex
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from . import adb

APP_PACKAGE = "org.zerolock.app"
APP_PORT = 47474              # the app's control port (kotlin_app TrainingService.DEFAULT_PORT)
DATA_PORT = 47475             # the inbound link port the host asks an adb phone's stage to use
STAGING_DIR = "/data/local/tmp/zerolock"   # adb shell can write here; the app's run-as can read it
APP_FILES_DIR = "files/programs"           # relative to the app's data dir (run-as's working dir)
CLEANUP_WAIT_S = 10.0   # how long cleanup waits, in all, for phones that dropped off adb for a moment
_LISTENER_GONE = re.compile(r"listener '[^']*' not found")   # adbd: no such reverse (any more)


class WiringError(Exception):
    """Two stages cannot be connected with the reachability they have (one line, with a fix)."""


class AdbPushUnavailable(Exception):
    """adb cannot place files in the app's storage on this phone; use the protocol's FILE_*."""


@dataclass(frozen=True)
class Peer:
    """One end of a link. kind: "host" (the host's feed into stage 0), "local" (a process on
    this host: an emulated phone on loopback), "lan" (a phone with a network address) or "adb"
    (a phone reached only through adb)."""
    name: str
    kind: str
    ip: str | None = None
    serial: str | None = None


HOST = Peer("host", "host")


def _is_loopback(ip: str) -> bool:
    if ip == "localhost":
        return True
    try:
        return ipaddress.ip_address(ip).is_loopback
    except ValueError:
        return False


def peer_of(handle) -> Peer:
    """The Peer of a DeviceHandle: adb when it has a serial, else by its endpoint's address."""
    if getattr(handle, "serial", None):
        return Peer(handle.name, "adb", serial=handle.serial)
    ip = handle.endpoint.rpartition(":")[0].strip("[]")
    return Peer(handle.name, "local" if _is_loopback(ip) else "lan", ip=ip)


@dataclass(frozen=True)
class Route:
    """How ``up`` connects to ``down``'s data port: forward (host forwards down's port over adb),
    reverse (up reaches a host port through adb reverse), else up connects to ``direct_ip``."""
    forward: bool
    reverse: bool
    direct_ip: str | None = None


def plan_route(up: Peer, down: Peer) -> Route:
    """The wiring decision for the link up -> down (pure; raises WiringError when impossible)."""
    if up.kind not in ("host", "local", "lan", "adb") or down.kind not in ("local", "lan", "adb"):
        raise ValueError(f"unknown peer kinds {up.kind} -> {down.kind}")
    if down.kind == "lan":   # a phone on the network; a USB phone reaches it over its own Wi-Fi
        return Route(forward=False, reverse=False, direct_ip=down.ip)
    if down.kind == "local":
        if up.kind == "lan":
            raise WiringError(f"{up.name} (on the network) cannot reach {down.name}, which listens on this "
                              f"host's loopback: start {down.name} with --bind 0.0.0.0, or put {up.name} after it")
        if up.kind == "adb":
            return Route(forward=False, reverse=True)
        return Route(forward=False, reverse=False, direct_ip=down.ip)
    # down is on USB only: its data port is reachable on this host through adb forward
    if up.kind == "lan":
        raise WiringError(f"{up.name} (on the network) cannot reach {down.name}, which is only on USB: "
                          f"connect {up.name} by USB too, or put {down.name} first in --devices order")
    return Route(forward=True, reverse=up.kind == "adb")


class AdbLinks:
    """Carries out the wiring for one run and remembers every forward and reverse it made, so
    :meth:`close` removes exactly those."""

    def __init__(self, *, host: str = adb.DEFAULT_HOST, port: int | None = None,
                 package: str = APP_PACKAGE, app_port: int = APP_PORT, data_port: int = DATA_PORT,
                 staging_dir: str = STAGING_DIR, files_dir: str = APP_FILES_DIR, on_event=None,
                 cleanup_wait: float = CLEANUP_WAIT_S):
        self.kw = {"host": host, "port": port}
        self.cleanup_wait = cleanup_wait
        self.package, self.app_port, self.data_port = package, app_port, data_port
        self.staging_dir, self.files_dir = staging_dir.rstrip("/"), files_dir.rstrip("/")
        self.on_event = on_event or (lambda kind, data: None)
        self._forwards: dict[tuple[str, int], int] = {}   # (serial, phone port) -> host port
        self._reverses: dict[tuple[str, int], int] = {}   # (serial, host port) -> phone port
        self._no_adb_push: dict[str, str] = {}            # serial -> why adb push is not possible
        self._lock = threading.Lock()

    # ---- ports
    def forward(self, serial: str, phone_port: int) -> int:
        """A host port forwarded to ``phone_port`` on the phone (made once per run)."""
        local, new = self._once(self._forwards, (serial, phone_port), lambda: adb.forward(serial, 0, phone_port, **self.kw))
        if new:
            self.on_event("adb_forward", {"serial": serial, "host_port": local, "phone_port": phone_port})
        return local

    def reverse(self, serial: str, host_port: int) -> int:
        """A phone port reversed to ``host_port`` on this machine (made once per run)."""
        phone, new = self._once(self._reverses, (serial, host_port), lambda: adb.reverse(serial, 0, host_port, **self.kw))
        if new:
            self.on_event("adb_reverse", {"serial": serial, "phone_port": phone, "host_port": host_port})
        return phone

    def _once(self, made: dict, key: tuple, make) -> tuple[int, bool]:
        """(port, whether it was made now): ``make()`` runs only for a key not yet in ``made``."""
        with self._lock:
            if key not in made:
                made[key] = make()
                return made[key], True
            return made[key], False

    def control_endpoint(self, serial: str) -> str:
        """127.0.0.1:L, forwarded to the app's control port on the phone."""
        return f"127.0.0.1:{self.forward(serial, self.app_port)}"

    def listen_port(self, handle) -> int | None:
        """The data port to ask for in STAGE_ASSIGN (``listen_port``): fixed for adb phones, since
        the host forwards it; None (the phone picks) otherwise, and when data_port is 0."""
        return self.data_port if getattr(handle, "serial", None) and self.data_port else None

    def address(self, up_handle, down_handle, down_ip: str, data_port: int) -> str:
        """The address the upstream (None: the host's feed) connects to for down's data port."""
        up = HOST if up_handle is None else peer_of(up_handle)
        down = peer_of(down_handle)
        route = plan_route(up, down)
        ip, port = route.direct_ip or down_ip, data_port
        if route.forward:
            ip, port = "127.0.0.1", self.forward(down.serial, data_port)
        if route.reverse:
            ip, port = "127.0.0.1", self.reverse(up.serial, port)
        self.on_event("link", {"up": up.name, "up_kind": up.kind, "down": down.name, "down_kind": down.kind,
                               "forward": route.forward, "reverse": route.reverse, "address": f"{ip}:{port}"})
        return f"{ip}:{port}"

    # ---- files
    def _run_as(self, command: str) -> str:
        return f"run-as {shlex.quote(self.package)} sh -c {shlex.quote(command)}"

    def device_sha256(self, serial: str, name: str) -> str | None:
        """sha256 of the app's copy of ``name`` on the phone; None when it holds none. Raises
        AdbPushUnavailable when run-as or sha256sum do not work there."""
        path = f"{self.files_dir}/{name}"
        rc, out = adb.shell_rc(serial, self._run_as(f"if [ -f {shlex.quote(path)} ]; then sha256sum "
                                                    f"{shlex.quote(path)}; else echo absent; fi"), **self.kw)
        digest = adb.parse_sha256sum(out)
        if rc == 0 and (digest or out.strip() == "absent"):
            return digest
        raise AdbPushUnavailable(f"cannot read {self.package}'s files over adb on {serial} "
                                 f"({' '.join(out.split())[:120] or f'exit status {rc}'}): needs a debuggable "
                                 "app (run-as) and sha256sum")

    def push(self, serial: str, local: Path, sha256: str) -> bool:
        """Put ``local`` into the app's files dir unless it holds the same sha256 already;
        True if sent. AdbPushUnavailable: use FILE_* instead (the reason is remembered)."""
        if serial in self._no_adb_push:
            raise AdbPushUnavailable(self._no_adb_push[serial])
        local = Path(local)
        try:
            if self.device_sha256(serial, local.name) == sha256:
                return False
            staged = f"{self.staging_dir}/{local.name}"
            adb.shell_rc(serial, f"mkdir -p {shlex.quote(self.staging_dir)}", **self.kw)
            adb.push(serial, str(local), staged, **self.kw)
            final = f"{self.files_dir}/{local.name}"
            part = final + ".adb-part"
            rc, out = adb.shell_rc(serial, self._run_as(
                f"mkdir -p {shlex.quote(self.files_dir)} && cp {shlex.quote(staged)} {shlex.quote(part)} && "
                f"mv -f {shlex.quote(part)} {shlex.quote(final)}"), **self.kw)
            adb.shell_rc(serial, f"rm -f {shlex.quote(staged)}", **self.kw)
            if rc != 0:
                raise AdbPushUnavailable(f"run-as {self.package} could not copy {local.name} into its files on "
                                         f"{serial}: {' '.join(out.split())[:120]}")
            got = self.device_sha256(serial, local.name)
            if got != sha256:
                raise adb.AdbCommandError(f"{local.name} on {serial} has sha256 {str(got)[:12]}... after adb push, "
                                          f"expected {sha256[:12]}...: check the phone's storage, then run again")
            return True
        except AdbPushUnavailable as e:
            self._no_adb_push[serial] = str(e)
            raise

    # ---- PSS and temperature
    def sample(self, serial: str) -> dict:
        """PSS (bytes) of the app and battery temperature (C), each only if readable."""
        out = {}
        try:
            out["pss_bytes"] = adb.read_pss_kib(serial, self.package, **self.kw) * 1024
        except (adb.DumpsysParseError, adb.AdbCommandError):
            pass
        try:
            out["temperature_c"] = adb.read_battery_temp_c(serial, **self.kw)
        except (adb.DumpsysParseError, adb.AdbCommandError):
            pass
        return out

    # ---- the end
    def close(self) -> list[str]:
        """Remove every forward and reverse this run made; returns what could not be removed
        (one line each).

        A phone that is off adb at that moment (listed 'offline' or not at all: a USB glitch, the
        adb server reconnecting it) is waited for, up to ``cleanup_wait`` s for the whole
        cleanup, and asked again. A reverse the phone no longer has counts as removed: adbd
        drops the reverses of a connection that drops (and the adb server its forwards)."""
        left = []
        with self._lock:
            forwards, reverses = dict(self._forwards), dict(self._reverses)
            self._forwards.clear()
            self._reverses.clear()
        deadline = time.monotonic() + self.cleanup_wait
        for (serial, _), local in forwards.items():
            left += self._undo(serial, functools.partial(adb.forward_remove, serial, local, **self.kw), deadline)
        for (serial, _), phone in reverses.items():
            left += self._undo(serial, functools.partial(adb.reverse_remove, serial, phone, **self.kw), deadline)
        return left

    def _undo(self, serial: str, remove, deadline: float, attempts: int = 3) -> list[str]:
        """Run ``remove`` until it succeeds; between tries wait (until ``deadline``) for the
        phone to be ready again. [] when done, else the last error."""
        for _ in range(attempts):
            try:
                remove()
                return []
            except adb.AdbCommandError as e:
                if _LISTENER_GONE.search(str(e)):
                    return []
                problem = str(e)
            if not adb.wait_ready(serial, deadline - time.monotonic(), **self.kw):
                break
        return [problem]


class AdbSampler:
    """Reads PSS and battery temperature of the adb phones every ``period`` s, for the metrics.

    :meth:`start` takes the first sample of every phone (at once, up to ``first_wait`` s) before
    it returns, so that each phone has a sample before training starts, however short the run:
    a first pass in the background could still be running when a short run ends, and what it
    emits after the run's last event is never written."""

    def __init__(self, links: AdbLinks, serials: dict[str, str], emit, period: float = 5.0,
                 first_wait: float = 10.0):
        self.links, self.serials, self.emit, self.period = links, serials, emit, period
        self.first_wait = first_wait
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="adb-sampler", daemon=True)

    def start(self) -> "AdbSampler":
        if self.serials:
            first = [threading.Thread(target=self._sample, args=item, name=f"adb-sample-{item[0]}", daemon=True)
                     for item in self.serials.items()]
            for t in first:
                t.start()
            deadline = time.monotonic() + self.first_wait
            for t in first:
                t.join(max(0.0, deadline - time.monotonic()))
            self._thread.start()
        return self

    def _sample(self, name: str, serial: str) -> None:
        rec = self.links.sample(serial)
        if rec:
            self.emit(name, {"kind": "adb_dumpsys", "serial": serial, "time_ms": int(time.time() * 1000), **rec})

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            for name, serial in self.serials.items():
                if self._stop.is_set():
                    return
                self._sample(name, serial)

    def stop(self) -> None:
        self._stop.set()

"""Emulated phones: real zl-phone processes on this machine, started and restarted by the host."""
from __future__ import annotations

import os
import secrets
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .cli_error import CliError

if TYPE_CHECKING:
    from .netns import PhoneNet, ShapedNetwork


class EmulatorError(Exception):
    pass


@dataclass
class EmulatedPhone:
    name: str
    workdir: Path
    token: str
    extra_args: list = field(default_factory=list)
    port: int = 0
    proc: subprocess.Popen | None = None
    log_path: Path | None = None
    adopted_pid: int | None = None  # a phone a previous host started, still running (resume)
    net: "PhoneNet | None" = None  # its own network namespace (host/netns.py); None: loopback

    @property
    def address(self) -> str:
        return self.net.address if self.net else "127.0.0.1"

    @property
    def endpoint(self) -> str:
        return f"{self.address}:{self.port}"

    runtime = "python"  # the phone's runtime (host/kotlin_phone.py: "kotlin")
    advertises = True   # ready once it says it is advertised over mDNS (unless --mdns none)

    def command(self) -> list[str]:
        cmd = [*(self.net.prefix if self.net else []), sys.executable, "-m", "zl_mobile.phone", "--name", self.name,
               "--workdir", str(self.workdir), "--token", self.token, "--port", str(self.port),
               *(["--bind", self.net.address] if self.net else []), *self.extra_args]
        if "--cpu-share" in self.extra_args:  # budgeted from the start; a launcher, as `ip netns exec` hides the cgroups
            cmd = [sys.executable, "-m", "zl_mobile.cpu_budget",
                   self.extra_args[self.extra_args.index("--cpu-share") + 1], "--", *cmd]
        return cmd

    def start(self, timeout: float = 60.0) -> "EmulatedPhone":
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.workdir / "phone.log"
        cmd = self.command()
        log = open(self.log_path, "ab")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log, env=env,
                                     start_new_session=True)
        deadline = time.time() + timeout
        port = None
        while time.time() < deadline:
            line = self.proc.stdout.readline().decode()
            if not line:
                break
            if "listening on" in line:
                port = int(line.split("listening on ")[1].split(",")[0].rpartition(":")[2])
            if line.startswith("advertised") or (("--mdns" in self.extra_args or not self.advertises) and port):
                break
        if port is None:
            self.stop()
            raise EmulatorError(f"emulated phone {self.name} did not start within {timeout:.0f} s; see {self.log_path}")
        self.port = port
        threading.Thread(target=self._drain, daemon=True).start()
        return self

    def _drain(self) -> None:
        proc = self.proc
        for _ in iter(proc.stdout.readline, b""):
            pass

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else self.adopted_pid

    def adopt_or_start(self, pid: int | None) -> "EmulatedPhone":
        """On resume: keep the phone a previous host started if it still answers, else start it."""
        from zl_mobile.processes import pid_alive, wait_gone

        if pid and pid_alive(pid) and self._answers():
            self.adopted_pid = pid
            return self
        if pid:  # a phone killed a moment ago may still hold its port while it dies
            wait_gone(pid, 5.0)
        return self.start()

    def _answers(self) -> bool:
        """The phone answers the opening of a handshake (with its challenge). Accepting alone
        proves nothing: the kernel completes a connection in the listener's backlog for a process
        that is being killed, which then resets it."""
        import socket

        from zl_mobile.protocol import send_message
        from zl_mobile.protocol.handshake import HostHandshake

        try:
            with socket.create_connection((self.address, self.port), timeout=2) as s:
                s.settimeout(2)
                send_message(s, HostHandshake(self.token, "zl-host").start())
                return len(s.recv(1)) == 1
        except (OSError, ValueError):
            return False

    def alive(self) -> bool:
        if self.adopted_pid is not None:
            from zl_mobile.processes import pid_alive

            return pid_alive(self.adopted_pid)
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        if self.adopted_pid is not None:
            self._signal(9)
        elif self.alive():
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._release_budget()

    def _release_budget(self) -> None:
        """A phone killed outright cannot remove its CPU budget's cgroup (zl-phone --cpu-share): once it
        is gone, its parent does."""
        pid = self.proc.pid if self.proc is not None else None
        if pid is not None and self.proc.poll() is not None:
            from zl_mobile.cpu_budget import release

            release(pid)

    def _signal(self, sig: int) -> None:
        pid, self.adopted_pid = self.adopted_pid, None
        try:
            os.kill(pid, sig)
            for _ in range(100):
                os.kill(pid, 0)
                time.sleep(0.05)
        except OSError:
            from zl_mobile.cpu_budget import release

            release(pid)  # gone: its CPU budget's cgroup too (a no-op if it had none or removed it)

    def stop(self) -> None:
        if self.adopted_pid is not None:
            self._signal(15)
        elif self.alive():
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._release_budget()

    def restart(self) -> str:
        """Kill (if still running) and start again with the same work dir, token and port."""
        self.kill()
        return self.start().endpoint

    def handle(self):
        from .coordinator import DeviceHandle

        return DeviceHandle(self.name, self.endpoint, self.token, _memory_bytes(), restart=self.restart,
                            alive=self.alive)


def _memory_bytes() -> int:
    from zl_mobile.telemetry import total_memory_bytes

    return total_memory_bytes()


@dataclass
class EmulatedLinks:
    """How zl-host's emulated phones are linked (zl-host run --link-mbit / --link-delay-ms): rate per
    phone and direction (None: unshaped) and one-way latency. Kept in run.json for --resume."""
    mbit: float | None = None
    delay_ms: float = 0.0
    netns_tag: str | None = None  # the phones' namespaces, once made

    def open(self, n: int) -> tuple["ShapedNetwork | None", list[str], str]:
        """(the phones' network or None, zl-phone arguments, how the links are shaped, in words).
        A rate puts every phone in its own shaped namespace where the machine allows it, else on
        loopback behind the transport's rate limiter; on resume the same namespaces are taken over."""
        from . import netns

        args = ["--link-delay-ms", f"{self.delay_ms:g}"] if self.delay_ms else []
        latency = f", {self.delay_ms:g} ms one-way latency" if self.delay_ms else ""
        if not self.mbit:
            return None, args, "loopback, unshaped" + latency
        why = netns.unavailable()
        if why is not None:
            return None, args + ["--rate-mbit", f"{self.mbit:g}"], \
                f"loopback, the transport's rate limiter at {self.mbit:g} Mbit/s ({why})" + latency
        if self.netns_tag:
            network = netns.ShapedNetwork(n, self.mbit, tag=self.netns_tag).reopen()
        else:
            network = netns.ShapedNetwork(n, self.mbit).open()
        self.netns_tag = network.tag
        return network, args, f"own network namespaces, {self.mbit:g} Mbit/s per phone and direction" + latency


def budget_args(share: float) -> list[str]:
    """zl-phone arguments of a phone held to `share` of one core: not pinned (the shares of several
    phones need not add up to whole cores); the phone picks its threads from the share."""
    return ["--cpu-share", f"{share:g}"]


def phone_class(runtime: str):
    """The emulated phone of a runtime: zl-phone ("python") or the Kotlin core on the JVM ("kotlin")."""
    if runtime == "kotlin":
        from .kotlin_phone import KotlinPhone

        return KotlinPhone
    return EmulatedPhone


def start_phones(n: int, root: Path, prefix: str = "emu", extra_args=None, per_phone_args=None,
                 network: "ShapedNetwork | None" = None, cpu_shares: list[float] | None = None,
                 runtimes: list[str] | None = None) -> list[EmulatedPhone]:
    """Start n phones; with 2+ cores each phone is pinned to its own core (round robin), or, with
    `cpu_shares`, phone i is held to cpu_shares[i] of one core (zl-phone --cpu-share) instead.
    With `network` (an open host.netns.ShapedNetwork of n phones) phone i runs in its namespace.
    `runtimes[i]` ("python" or "kotlin", host/kotlin_phone.py) says what phone i runs."""
    phones = []
    cores = sorted(os.sched_getaffinity(0))
    try:
        for i in range(n):
            args = list(extra_args or [])
            if per_phone_args:
                args += per_phone_args(i)
            elif cpu_shares:
                args += budget_args(cpu_shares[i])
            elif len(cores) > 1:
                args += ["--cpus", str(cores[i % len(cores)]), "--threads", "1"]
            net = network.phones[i] if network else None
            cls = phone_class(runtimes[i] if runtimes else "python")
            phones.append(cls(f"{prefix}{i}", Path(root) / f"{prefix}{i}", secrets.token_hex(32), args,
                              net=net).start())
    except BaseException:
        for p in phones:
            p.stop()
        raise
    return phones


def cpu_shares(text: str | None, n: int) -> list[float] | None:
    """--cpu-share F|F1,...,Fn for n emulated phones (None: unbudgeted); checked before anything starts."""
    if text is None:
        return None
    from zl_mobile.cpu_budget import CpuBudgetError, parse_shares, unavailable

    try:
        shares = parse_shares(text, n)
    except CpuBudgetError as e:
        raise CliError(str(e)) from None
    why = unavailable()
    if why is not None:
        raise CliError(f"--cpu-share: {why}")
    return shares

"""One emulated phone: a real zl-phone process on this machine, started, adopted and restarted by
the host (host/phones/kotlin_phone.py's Kotlin phone is one too; host/phones/emulate.py starts several)."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .netns import PhoneNet


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
    net: "PhoneNet | None" = None  # its own network namespace (host/phones/netns.py); None: loopback

    @property
    def address(self) -> str:
        return self.net.address if self.net else "127.0.0.1"

    @property
    def endpoint(self) -> str:
        return f"{self.address}:{self.port}"

    runtime = "python"  # the phone's runtime (host/phones/kotlin_phone.py: "kotlin")
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
        from ..run.coordinator import DeviceHandle

        return DeviceHandle(self.name, self.endpoint, self.token, _memory_bytes(), restart=self.restart,
                            alive=self.alive)


def _memory_bytes() -> int:
    from zl_mobile.telemetry import total_memory_bytes

    return total_memory_bytes()

"""CPU budgets for emulated phones: one process, one cgroup, a fixed share of one core.

`zl-phone --cpu-share F` puts its own process into a cgroup of its own, `zerolock/phone-PID` under
the cpu controller's mount, limited to F of one core: cgroup v2 `cpu.max` ("QUOTA PERIOD") where v2
has the cpu controller, else v1's `cpu.cfs_quota_us` / `cpu.cfs_period_us`. The period is short
(10 ms), so a phase of a few tens of milliseconds is throttled evenly rather than run at full speed
and then stopped for a coarse slice.

The cgroup goes when the phone does: on a normal exit and on SIGTERM / Ctrl-C the phone moves itself
back to the cgroup it came from and removes its own (`CpuBudget.close`); a phone killed outright
(SIGKILL) cannot, so whoever started it calls `release(pid)` after wait() (host/phones/emulate.py does),
and every budgeted start also removes the empty cgroups of phones that are gone (`sweep`).

Needs root (or a delegated, writable cgroup tree) and a mounted cpu controller; `unavailable()`
says in one line why not, before anything is started."""
from __future__ import annotations

import errno
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

from .processes import pid_alive

PERIOD_US = 10_000          # 10 ms: v1's cfs quota has a 1 ms floor, so shares go down to 0.1
MIN_SHARE = 0.1
WEIGHT_V1, WEIGHT_V2 = 262144, 10000  # the phones' group's cpu.shares / cpu.weight: the largest allowed
GROUP = "zerolock"          # the parent of every phone's cgroup
PREFIX = "phone-"           # phone-PID


def threads_for_share(share: float) -> int:
    """Compute threads for a process held to `share` of one core: as many as whole cores it may
    use. More would burn the quota in parallel bursts and stall together at its end (XNNPACK's
    workers wait on each other), so short phases would cost what the throttling decides."""
    return max(1, math.ceil(share - 1e-9))


class CpuBudgetError(Exception):
    """One line: what is wrong and what to do."""


@dataclass(frozen=True)
class Controller:
    """Where the cpu controller is: its mount point and the cgroup version."""
    mount: Path
    version: int  # 1 or 2

    @property
    def group(self) -> Path:
        return self.mount / GROUP

    def path_for(self, pid: int) -> Path:
        return self.group / f"{PREFIX}{pid}"


def _mounts() -> list[tuple[str, str, list[str]]]:
    """(mount point, fs type, super options) of the cgroup mounts, from /proc/self/mountinfo."""
    out = []
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, rest = left.split(), right.split()
        if len(fields) >= 5 and len(rest) >= 3 and rest[0] in ("cgroup", "cgroup2"):
            out.append((fields[4].replace("\\040", " "), rest[0], rest[2].split(",")))
    return out


def find_controller() -> Controller | None:
    """The cpu controller: cgroup v2 where its root lists `cpu`, else a v1 hierarchy with `cpu`."""
    mounts = _mounts()
    for point, fstype, _ in mounts:
        if fstype == "cgroup2":
            try:
                if "cpu" in Path(point, "cgroup.controllers").read_text().split():
                    return Controller(Path(point), 2)
            except OSError:
                pass
    for point, fstype, opts in mounts:
        if fstype == "cgroup" and "cpu" in opts:
            return Controller(Path(point), 1)
    return None


def unavailable() -> str | None:
    """Why CPU budgets cannot be set here (one line), or None."""
    if os.geteuid() != 0:
        return ("CPU budgets need root (a cgroup per phone): run as root, or leave --cpu-share out "
                "to run the phones unbudgeted")
    c = find_controller()
    if c is None:
        return ("no cgroup cpu controller is mounted (neither cgroup v2 with 'cpu' in cgroup.controllers nor a v1 "
                "'cpu' hierarchy): mount one, or leave --cpu-share out")
    if not os.access(c.mount, os.W_OK):
        return f"the cgroup cpu controller at {c.mount} is read-only here: remount it rw, or leave --cpu-share out"
    return None


def check_share(value: float, what: str = "--cpu-share") -> float:
    """A valid share of one core: MIN_SHARE .. number of cores (CpuBudgetError otherwise)."""
    cores = os.cpu_count() or 1
    if not (isinstance(value, (int, float)) and math.isfinite(value)) or not MIN_SHARE <= value <= cores:
        raise CpuBudgetError(f"{what} {value!r}: a share of one core must be between {MIN_SHARE:g} and {cores} "
                             f"(this machine's cores), e.g. 0.5")
    return float(value)


def parse_shares(text: str, n: int, what: str = "--cpu-share") -> list[float]:
    """'F' (every one of n phones) or 'F1,...,Fn' (one per phone) -> n shares."""
    parts = [p.strip() for p in str(text).split(",")]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise CpuBudgetError(f"{what} {text!r}: expected a number (every phone) or {n} comma-separated "
                             "numbers (one per phone), e.g. 0.6 or 0.6,0.6,0.4") from None
    if len(values) == 1:
        values = values * n
    elif len(values) != n:
        raise CpuBudgetError(f"{what} {text!r} gives {len(values)} shares for {n} phones: give one (every "
                             f"phone) or {n}")
    return [check_share(v, what) for v in values]


def _write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _procs(path: Path) -> list[int]:
    try:
        return [int(x) for x in (path / "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return []



def _rmdir(path: Path, timeout: float = 2.0) -> bool:
    """Remove an empty cgroup; a task that is still exiting keeps it busy for a moment."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.rmdir(path)
            return True
        except FileNotFoundError:
            return True
        except OSError as e:
            if e.errno != errno.EBUSY or time.monotonic() > deadline:
                return False
            time.sleep(0.02)


def sweep(c: Controller | None = None) -> list[Path]:
    """Remove the cgroups of budgeted phones that are gone (killed with SIGKILL and nobody
    released them): empty, and their process does not exist. Returns what was removed."""
    c = c or find_controller()
    removed = []
    if c is None or not c.group.is_dir():
        return removed
    for d in c.group.iterdir():
        if not (d.is_dir() and d.name.startswith(PREFIX) and d.name[len(PREFIX):].isdigit()):
            continue
        if not _procs(d) and not pid_alive(int(d.name[len(PREFIX):])) and _rmdir(d, timeout=0.2):
            removed.append(d)
    return removed


def release(pid: int) -> bool:
    """After the phone with this pid has exited (the parent's wait() returned): remove its cgroup,
    if it has one. True if there is none left."""
    c = find_controller()
    if c is None:
        return True
    path = c.path_for(pid)
    if not path.exists():
        return True
    deadline = time.monotonic() + 2.0
    while _procs(path) and time.monotonic() < deadline:
        time.sleep(0.02)
    return _rmdir(path)


def throttled_fraction(pid: int) -> float | None:
    """Of the periods in which the phone with this pid ran, the fraction that ended with it held back
    at its quota (cpu.stat: nr_throttled / nr_periods): near 1 when the budget, not the machine, is
    what limits it. None if it has no budget cgroup (or the kernel does not say)."""
    c = find_controller()
    if c is None:
        return None
    try:
        stat = dict(line.split() for line in (c.path_for(pid) / "cpu.stat").read_text().splitlines() if line.strip())
        return int(stat["nr_throttled"]) / int(stat["nr_periods"]) if int(stat["nr_periods"]) else None
    except (OSError, KeyError, ValueError):
        return None


class CpuBudget:
    """This process's CPU budget: `CpuBudget.enter(share)` makes the cgroup, sets the limit and
    moves the process (every thread) into it; `close()` moves it back and removes the cgroup."""

    def __init__(self, controller: Controller, share: float, pid: int, origin: Path | None, adopted: bool = False):
        self.controller, self.share, self.pid, self.origin = controller, share, pid, origin
        self.path = controller.path_for(pid)
        self.adopted = adopted  # made by the launcher before this program was exec'd
        self.closed = False

    @classmethod
    def enter(cls, share: float) -> "CpuBudget":
        share = check_share(share)
        pid = os.getpid()
        rel = _own_cgroup_path()
        if rel == f"/{GROUP}/{PREFIX}{pid}":
            # put there by the launcher below (`python -m zl_mobile.cpu_budget`), e.g. in front of `ip netns
            # exec`, under which the cgroup mounts are not visible: keep it; the parent removes it
            c = find_controller() or Controller(Path("/nonexistent"), 1)
            return cls(c, share, pid, None, adopted=True)
        why = unavailable()
        if why is not None:
            raise CpuBudgetError(f"--cpu-share: {why}")
        c = find_controller()
        sweep(c)
        budget = cls(c, share, pid, _own_cgroup(c))
        try:
            c.group.mkdir(exist_ok=True)
            if c.version == 2:  # the cpu controller has to be enabled down to the phone's cgroup
                for parent in (c.mount, c.group):
                    if "cpu" not in (parent / "cgroup.subtree_control").read_text().split():
                        _write(parent / "cgroup.subtree_control", "+cpu")
            budget.path.mkdir(exist_ok=True)
            quota = max(1000, round(share * PERIOD_US))
            # the quota is the limit. The phones' parent group has the largest weight there is, so a busy
            # host does not take a phone's share away (a phone is a computer of its own); the phones'
            # quotas, which add up to less than the cores, keep them from the host and from each other
            if c.version == 2:
                _write(c.group / "cpu.weight", str(WEIGHT_V2))
                _write(budget.path / "cpu.max", f"{quota} {PERIOD_US}")
            else:
                _write(c.group / "cpu.shares", str(WEIGHT_V1))
                _write(budget.path / "cpu.cfs_period_us", str(PERIOD_US))
                _write(budget.path / "cpu.cfs_quota_us", str(quota))
            _write(budget.path / "cgroup.procs", str(pid))
        except OSError as e:
            _rmdir(budget.path, timeout=0.2)
            raise CpuBudgetError(f"cannot set up the cgroup {budget.path}: {e.strerror or e}; check that the "
                                 f"cgroup cpu controller at {c.mount} is writable") from None
        return budget

    def close(self) -> None:
        """Leave the cgroup (back to where the process came from) and remove it. Idempotent."""
        if self.closed:
            return
        self.closed = True
        if not self.controller.mount.is_dir():
            return  # the mounts are not visible here (a launched phone in a network namespace): the parent removes it
        back = self.origin if self.origin is not None and self.origin.is_dir() else self.controller.mount
        try:
            _write(back / "cgroup.procs", str(self.pid))
        except OSError:
            return  # still inside: the parent's release() or the next start's sweep removes it
        _rmdir(self.path)


def _own_cgroup_path(version: int | None = None) -> str | None:
    """This process's cgroup path in the cpu controller's hierarchy (/proc/self/cgroup): v1's `cpu`
    line, else the v2 line (version None: whichever there is)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    v1 = v2 = None
    for line in lines:
        _, controllers, rel = line.split(":", 2)
        if controllers == "":
            v2 = rel
        elif "cpu" in controllers.split(","):
            v1 = rel
    return v1 if version == 1 else v2 if version == 2 else (v1 or v2)


def _own_cgroup(c: Controller) -> Path | None:
    """The cgroup of this process in the controller's hierarchy (where to go back to)."""
    rel = _own_cgroup_path(c.version)
    return None if rel is None else c.mount / rel.lstrip("/")


def main(argv=None) -> int:
    """Launcher: `python -m zl_mobile.cpu_budget SHARE [--] CMD ...` runs CMD in a budget cgroup of its
    own (named after this pid, which CMD keeps: exec). For a phone started where it cannot reach the
    cgroup mounts itself (`ip netns exec` remounts /sys); whoever waits for CMD calls release(pid)."""
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2 or args[0] in ("-h", "--help"):
        print("usage: python -m zl_mobile.cpu_budget SHARE [--] CMD ...", file=sys.stderr)
        return 2
    share, cmd = args[0], args[1:]
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    try:
        CpuBudget.enter(parse_shares(share, 1)[0])
    except CpuBudgetError as e:
        print(f"zl_mobile.cpu_budget: error: {e}", file=sys.stderr)
        return 2
    os.execvp(cmd[0], cmd)
    return 127  # not reached


if __name__ == "__main__":
    raise SystemExit(main())

"""Process liveness, as the phone's CPU budget, the host's network namespaces and tests need it."""
from __future__ import annotations

import os
import time


def pid_alive(pid: int) -> bool:
    """True while `pid` exists and has not exited (also one owned by another user: signal 0 is then
    refused, not failed). A zombie -- exited, not yet reaped by a parent that may never reap it
    (an orphan of a killed host) -- is not alive: it holds no socket and runs nothing."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]  # the name in parentheses may hold spaces
    except (OSError, IndexError):
        return True  # no procfs to ask: signal 0 is all there is
    return state not in ("Z", "X")


def wait_gone(pid: int, timeout: float) -> bool:
    """Wait up to `timeout` seconds for `pid` to be gone (a SIGKILL is delivered, not awaited)."""
    deadline = time.monotonic() + timeout
    while pid_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True

"""Process liveness, as the phone's CPU budget, the host's network namespaces and tests need it."""
from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """True while `pid` exists (also one owned by another user: signal 0 is then refused, not failed)."""
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True

"""STAGE_ASSIGN field rules (docs/PROTOCOL.md 5.3.1), checked before a device starts anything.

An authenticated host is still not trusted with the device's storage or its threads: a run id
becomes a directory name, window_size sizes loops, ports and addresses are dialled. Each bad
field is refused with REJECTED naming it, so the host learns what to fix and the session goes on.
The Kotlin core (StageAssignRules.kt) applies the same rules; tests/vectors/stage_assign_rules.json
holds cases both pass."""
from __future__ import annotations

import ipaddress
import math
import re

from .protocol import ErrorCode, ProtocolError
from .protocol.quoting import quote_any

RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")
HOSTNAME = re.compile(r"(?=.{1,253}\Z)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
                      r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\Z")
MAX_WINDOW = 4096          # micro-batches per update window; a schedule walks a few windows up front
MAX_DEPTH = 4096           # inflight_depth, buffer_capacity
MAX_HORIZON = 1 << 24      # replay_horizon: entries kept, never preallocated
MAX_KEEP = 10_000          # keep_checkpoints
MAX_BUSY_MS = 86_400_000   # one day
SCHEDULES = ("zerolock", "gpipe", "1f1b", "pipedream")
FAILURE_POINTS = ("after-phase1", "before-commit", "mid-checkpoint", "hold-gil-in-phase1", "slow-phase1")
ANY_WINDOW_POINTS = ("slow-phase1",)  # window null: every window (a slower phone)
FAILURE_MODES = ("process", "app")  # the phone process dies / the stage fails inside the running app
FAILURE_DETECTS = ("connection", "heartbeat")  # app mode: the session drops / the stage goes silent


def _reject(field: str, why: str) -> ProtocolError:
    return ProtocolError(ErrorCode.REJECTED, f"STAGE_ASSIGN {field}: {why}")


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v) -> bool:
    return (_int(v) or isinstance(v, float)) and math.isfinite(v)


def _int_in(meta: dict, key: str, lo: int, hi: int, field: str | None = None, nullable: bool = False) -> None:
    if key not in meta or (nullable and meta[key] is None):
        return
    v = meta[key]
    if not _int(v) or not lo <= v <= hi:
        raise _reject(field or key, f"{quote_any(v)} must be an integer from {lo} to {hi}")


def check_address(field: str, v) -> None:
    """`host:port`: an IPv4 address, a bracketed IPv6 one or a DNS name, and a port 1..65535."""
    if not isinstance(v, str):
        raise _reject(field, f"{quote_any(v)} must be a \"host:port\" string")
    host, sep, port = v.rpartition(":")
    if not sep or not port.isdigit() or not port.isascii() or not 1 <= int(port) <= 65535:
        raise _reject(field, f"{quote_any(v)} must be \"host:port\" with a port from 1 to 65535")
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
            return
        except ValueError:
            pass
    elif HOSTNAME.match(host):
        return
    raise _reject(field, f"{quote_any(v)}: {quote_any(host)} is not an IPv4 address, [IPv6] address or host name")


def check_run_id(v) -> None:
    if not isinstance(v, str) or not RUN_ID.match(v):
        raise _reject("run_id", f"{quote_any(v)} must be a name of 1-128 letters, digits, '.', '_' or '-' not starting "
                                "with '.' or '-' (it names a directory under the device's storage; no paths)")


def validate_assign(meta: dict) -> None:
    """Raise REJECTED naming the first bad field; the message schema (types of the top-level
    fields, stage < num_stages) has been checked by the decoder already."""
    if "run_id" in meta:
        check_run_id(meta["run_id"])
    _int_in(meta, "num_stages", 1, 1024)
    if meta.get("downstream") is not None:
        check_address("downstream", meta["downstream"])
    up = meta.get("upstream")
    if up is not None and (len(up) > 300 or any(c in up for c in "\0\n\r")):
        raise _reject("upstream", "must be at most 300 characters on one line (a peer address or \"host\")")
    if meta.get("downstream") is not None and "downstream_token" not in meta:
        raise _reject("downstream_token", "a stage with a downstream needs the pairing token of that link")
    _int_in(meta, "window_size", 1, MAX_WINDOW)
    _int_in(meta, "inflight_depth", 1, MAX_DEPTH)
    _int_in(meta, "buffer_capacity", 1, MAX_DEPTH)
    _int_in(meta, "replay_horizon", 1, MAX_HORIZON)
    _int_in(meta, "listen_port", 0, 65535)
    if "schedule" in meta and meta["schedule"] not in SCHEDULES:
        raise _reject("schedule", f"{quote_any(meta['schedule'])} must be one of {', '.join(SCHEDULES)}")
    _check_config(meta.get("config") or {})


def _check_config(c: dict) -> None:
    if "lr" in c and not (_number(c["lr"]) and 0 <= c["lr"] <= 100):  # 0: a forward-only stage (stage_core.py)
        raise _reject("config.lr", f"{quote_any(c['lr'])} must be a number from 0 (forward-only) to 100")
    if "weight_decay" in c and not (_number(c["weight_decay"]) and 0 <= c["weight_decay"] <= 100):
        raise _reject("config.weight_decay", f"{quote_any(c['weight_decay'])} must be a number from 0 to 100")
    if c.get("alpha") is not None and not (_number(c["alpha"]) and 0 <= c["alpha"] <= 1):
        raise _reject("config.alpha", f"{quote_any(c['alpha'])} must be a number from 0 to 1 (or null: the export's)")
    _int_in(c, "keep_checkpoints", 1, MAX_KEEP, "config.keep_checkpoints")
    _int_in(c, "total_micro_batches", 1, 1 << 53, "config.total_micro_batches", nullable=True)
    _int_in(c, "rollback_to_window", -1, 1 << 53, "config.rollback_to_window", nullable=True)
    _int_in(c, "busy_ms", 0, MAX_BUSY_MS, "config.busy_ms")
    if "restart" in c and not isinstance(c["restart"], bool):
        raise _reject("config.restart", f"{quote_any(c['restart'])} must be true or false")
    inject = c.get("inject_failure")
    if inject is None:
        return
    if not isinstance(inject, list) or len(inject) > 64:
        raise _reject("config.inject_failure", "must be a list of at most 64 {window, point} objects")
    for sp in inject:
        any_window = isinstance(sp, dict) and sp.get("window") is None and sp.get("point") in ANY_WINDOW_POINTS
        if not isinstance(sp, dict) or not (any_window or (_int(sp.get("window")) and sp["window"] >= 0)) \
                or sp.get("point", "after-phase1") not in FAILURE_POINTS \
                or ("seconds" in sp and not (_number(sp["seconds"]) and 0 <= sp["seconds"] <= 3600)) \
                or sp.get("mode", "process") not in FAILURE_MODES or sp.get("detect", "connection") not in FAILURE_DETECTS:
            raise _reject("config.inject_failure", f"{quote_any(sp)} must be {{window: uint (null for slow-phase1), "
                                                   f"point: one of {', '.join(FAILURE_POINTS)}, seconds: 0..3600, mode: "
                                                   f"{' or '.join(FAILURE_MODES)}, detect: {' or '.join(FAILURE_DETECTS)}}}")

"""Message types, the Message value, and per-type metadata/tensor schemas (PROTOCOL.md section 5)."""
from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from .errors import ErrorCode, ProtocolError
from .quoting import quote, quote_any
from .tensors import as_wire_array


class MsgType(enum.IntEnum):
    AUTH_REQUEST = 0x01
    AUTH_CHALLENGE = 0x02
    AUTH_RESPONSE = 0x03
    AUTH_OK = 0x04
    HELLO = 0x05
    HEARTBEAT = 0x06
    ACK = 0x07
    ERROR = 0x08
    SHUTDOWN = 0x09
    FILE_BEGIN = 0x10
    FILE_CHUNK = 0x11
    FILE_END = 0x12
    FILE_RESULT = 0x13
    STAGE_ASSIGN = 0x20
    HIDDEN_STATE = 0x30
    GRADIENT = 0x31
    CREDIT = 0x32
    REPLAY_REQUEST = 0x33
    TELEMETRY = 0x40
    CHECKPOINT_COMMITTED = 0x41
    STATE_GET = 0x50
    STATE_PUT = 0x51


@dataclass(eq=False)
class Message:
    """One protocol message: type, JSON metadata object, named tensors (numpy arrays; torch
    tensors are accepted when encoding)."""

    type: MsgType
    meta: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        self.type = MsgType(self.type)

    def __getitem__(self, key: str) -> Any:
        return self.meta[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.meta.get(key, default)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Message):
            return NotImplemented
        if self.type != other.type or self.meta != other.meta or self.tensors.keys() != other.tensors.keys():
            return False
        for k, a in self.tensors.items():
            (da, wa), (db, wb) = as_wire_array(a), as_wire_array(other.tensors[k])
            if da != db or wa.shape != wb.shape or wa.tobytes() != wb.tobytes():
                return False
        return True

    def __repr__(self) -> str:
        ts = ", ".join(f"{k}:{getattr(v, 'dtype', '?')}{list(getattr(v, 'shape', []))}"
                       for k, v in self.tensors.items())
        return f"Message({self.type.name}, {self.meta!r}, tensors=[{ts}])"


# ---- schema --------------------------------------------------------------------------------

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
_HEX64 = re.compile(r"[0-9a-f]{64}\Z")


def error_reply(err: ProtocolError, request_id: int | None = None) -> Message:
    """The ERROR message that tells the peer about `err` (errors.py knows no messages: it sits
    below them)."""
    meta = {"code": err.code.value, "message": err.message}
    if request_id is not None:
        meta["request_id"] = request_id
    return Message(MsgType.ERROR, meta)


def _is_int(v):
    return type(v) is int and INT64_MIN <= v <= INT64_MAX


_KINDS: dict[str, Callable[[Any], bool]] = {
    "uint": lambda v: _is_int(v) and v >= 0,
    "int": _is_int,
    "str": lambda v: type(v) is str,
    "bool": lambda v: type(v) is bool,
    "hex64": lambda v: type(v) is str and bool(_HEX64.match(v)),
    "object": lambda v: type(v) is dict,
    "number": lambda v: (_is_int(v) or type(v) is float),
    "list[str]": lambda v: type(v) is list and all(type(x) is str for x in v),
}


def _kind_ok(kind: str, v: Any) -> bool:
    if kind.endswith("|null"):
        return v is None or _KINDS[kind[:-5]](v)
    return _KINDS[kind](v)


# (required fields, optional fields, tensor rule, extra check)
# tensor rule: "none" | "any" | "some" (>=1) | "h" (must contain h) | "data" (exactly one uint8 1-D "data")
_SCHEMA: dict[MsgType, tuple[dict[str, str], dict[str, str], str]] = {
    # host_share / device_share: the X25519 shares of version 2 (6.1); optional in the schema so
    # that a version-1 AUTH_REQUEST still decodes and gets its BAD_VERSION answer
    MsgType.AUTH_REQUEST: ({"protocol_version": "uint", "host_nonce": "hex64", "host_name": "str"},
                           {"host_share": "hex64"}, "none"),
    MsgType.AUTH_CHALLENGE: ({"device_nonce": "hex64", "device_name": "str"}, {"device_share": "hex64"}, "none"),
    MsgType.AUTH_RESPONSE: ({"host_proof": "hex64"}, {}, "none"),
    MsgType.AUTH_OK: ({"device_proof": "hex64"}, {}, "none"),
    MsgType.HELLO: ({"name": "str", "protocol_version": "uint", "runtime_version": "str",
                     "memory_bytes": "uint", "capabilities": "list[str]"},
                    {"model": "str", "os": "str", "abi": "str", "cores": "uint", "memory_budget_bytes": "uint",
                     "cpu_share": "number"}, "none"),
    MsgType.HEARTBEAT: ({"seq": "uint"}, {"time_ms": "uint", "busy_ms": "uint"}, "none"),
    MsgType.ACK: ({"request_id": "uint", "ok": "bool"}, {"message": "str"}, "none"),
    MsgType.ERROR: ({"code": "str", "message": "str"}, {"request_id": "uint"}, "none"),
    MsgType.SHUTDOWN: ({}, {"reason": "str"}, "none"),
    MsgType.FILE_BEGIN: ({"transfer_id": "uint", "name": "str", "kind": "str", "size": "uint",
                          "sha256": "hex64"}, {}, "none"),
    MsgType.FILE_CHUNK: ({"transfer_id": "uint", "offset": "uint"}, {}, "data"),
    MsgType.FILE_END: ({"transfer_id": "uint"}, {}, "none"),
    MsgType.FILE_RESULT: ({"transfer_id": "uint", "ok": "bool", "size": "uint", "sha256": "hex64|null"},
                          {"message": "str"}, "none"),
    MsgType.STAGE_ASSIGN: ({"request_id": "uint", "stage": "uint", "num_stages": "uint",
                            "upstream": "str|null", "downstream": "str|null", "program_sha256": "hex64"},
                           {"weights_sha256": "hex64", "window_size": "uint", "buffer_capacity": "uint",
                            "inflight_depth": "uint", "replay_horizon": "uint", "schedule": "str",
                            "run_id": "str", "listen_port": "uint", "upstream_token": "hex64",
                            "downstream_token": "hex64", "config": "object"}, "none"),
    MsgType.HIDDEN_STATE: ({"micro_batch": "uint", "window": "uint"}, {}, "h"),
    MsgType.GRADIENT: ({"micro_batch": "uint"}, {"window": "uint"}, "some"),
    MsgType.CREDIT: ({"credits": "uint"}, {"micro_batch": "uint"}, "none"),
    MsgType.REPLAY_REQUEST: ({"from_micro_batch": "uint", "to_micro_batch": "uint"}, {"window": "uint"}, "none"),
    MsgType.TELEMETRY: ({}, {"kind": "str", "stage": "uint", "step": "uint", "window": "uint", "micro_batch": "uint",
                             "loss": "number", "task_loss": "number", "consis_loss": "number", "pss_bytes": "uint",
                             "rss_peak_bytes": "uint", "temperature_c": "number", "active_s": "number",
                             "wait_s": "number", "wait_downstream_s": "number", "replay_held": "uint",
                             "replay_held_peak": "uint", "bytes_in": "uint", "bytes_out": "uint", "cpu_s": "number",
                             "time_ms": "uint", "nonfinite": "list[str]"}, "none"),
    MsgType.CHECKPOINT_COMMITTED: ({"window": "uint", "step": "uint", "sha256": "hex64"}, {}, "none"),
    MsgType.STATE_GET: ({"request_id": "uint", "kind": "str"}, {}, "none"),
    MsgType.STATE_PUT: ({"request_id": "uint", "kind": "str"}, {"window": "uint", "step": "uint"}, "any"),
}

FILE_KINDS = ("program", "weights", "manifest", "other")
STATE_KINDS = ("lora", "optimizer")


def _bad(t: MsgType, why: str) -> ProtocolError:
    return ProtocolError(ErrorCode.MALFORMED, f"{t.name} {why}")


def _check_extra(msg: MsgType, meta: dict) -> None:
    if msg == MsgType.FILE_BEGIN:
        name = meta["name"]
        nb = len(name.encode("utf-8", "surrogatepass"))
        if not 1 <= nb <= 255 or name in (".", "..") or any(c in name for c in "/\\\0"):
            raise _bad(msg, f"file name {quote(name)} must be a plain file name (1..255 bytes, no '/', '\\', NUL, "
                            "not '.' or '..')")
        if meta["kind"] not in FILE_KINDS:
            raise _bad(msg, f"kind {quote_any(meta['kind'])} must be one of {', '.join(FILE_KINDS)}")
    elif msg == MsgType.STAGE_ASSIGN:
        if meta["stage"] >= meta["num_stages"]:
            raise _bad(msg, f"stage {meta['stage']} is not below num_stages {meta['num_stages']}")
    elif msg == MsgType.CREDIT:
        if meta["credits"] < 1:
            raise _bad(msg, "credits must be >= 1")
    elif msg == MsgType.REPLAY_REQUEST:
        if meta["from_micro_batch"] > meta["to_micro_batch"]:
            raise _bad(msg, f"from_micro_batch {meta['from_micro_batch']} > to_micro_batch {meta['to_micro_batch']}")
    elif msg in (MsgType.STATE_GET, MsgType.STATE_PUT):
        if meta["kind"] not in STATE_KINDS:
            raise _bad(msg, f"kind {quote_any(meta['kind'])} must be one of {', '.join(STATE_KINDS)}")


def validate(msg_type: MsgType, meta: dict, tensors: dict[str, np.ndarray]) -> None:
    """Check metadata fields and tensor names against the schema of `msg_type`; MALFORMED if not."""
    if type(meta) is not dict:
        raise _bad(msg_type, "metadata must be a JSON object")
    required, optional, rule = _SCHEMA[msg_type]
    for key, kind in required.items():
        if key not in meta:
            raise _bad(msg_type, f"lacks required field {key!r} ({kind})")
        if not _kind_ok(kind, meta[key]):
            raise _bad(msg_type, f"field {key!r} must be {kind}, got {quote_any(meta[key])}")
    for key, kind in optional.items():
        if key in meta and not _kind_ok(kind, meta[key]):
            raise _bad(msg_type, f"field {key!r} must be {kind}, got {quote_any(meta[key])}")
    n = len(tensors)
    if rule == "none" and n:
        raise _bad(msg_type, f"carries {n} tensors; it carries none")
    if rule == "some" and not n:
        raise _bad(msg_type, "carries no tensor; it needs at least one")
    if rule == "h" and "h" not in tensors:
        raise _bad(msg_type, "lacks the hidden-state tensor 'h'")
    if rule == "data":
        data = tensors.get("data")
        if n != 1 or data is None:
            raise _bad(msg_type, "must carry exactly one tensor named 'data'")
        if getattr(data, "dtype", None) != np.uint8 or getattr(data, "ndim", None) != 1:
            raise _bad(msg_type, "tensor 'data' must be 1-D uint8")
    _check_extra(msg_type, meta)

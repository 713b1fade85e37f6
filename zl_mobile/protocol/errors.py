"""Error codes and the one exception type of the wire protocol (docs/PROTOCOL.md section 7)."""
from __future__ import annotations

import enum


class ErrorCode(str, enum.Enum):
    TRUNCATED = "TRUNCATED"
    OVERSIZED = "OVERSIZED"
    BAD_MAGIC = "BAD_MAGIC"
    BAD_VERSION = "BAD_VERSION"
    BAD_CHECKSUM = "BAD_CHECKSUM"
    UNKNOWN_TYPE = "UNKNOWN_TYPE"
    MALFORMED = "MALFORMED"
    UNAUTHENTICATED = "UNAUTHENTICATED"
    BUSY = "BUSY"
    UNEXPECTED = "UNEXPECTED"
    REJECTED = "REJECTED"
    TIMEOUT = "TIMEOUT"
    INTERNAL = "INTERNAL"

    @classmethod
    def parse(cls, name: str) -> "ErrorCode":
        """Map a received code name to an ErrorCode; unknown names become INTERNAL (spec 5.1)."""
        try:
            return cls(name)
        except ValueError:
            return cls.INTERNAL


class ProtocolError(Exception):
    """A protocol violation or refusal. `code` is an ErrorCode, `message` one line naming the
    problem and the fix."""

    def __init__(self, code: ErrorCode, message: str):
        self.code = ErrorCode(code)
        self.message = " ".join(str(message).split())  # always one line
        super().__init__(f"{self.code.value}: {self.message}")


class ConnectionClosed(ConnectionError):
    """The peer closed the connection cleanly between two frames."""


def human_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"

"""The one way a device quotes a peer-supplied value in a message or a log line (docs/PROTOCOL.md 7).

A peer's text may hold CR, ESC, BEL or 60 KB: shown raw it forges log lines, drives the reader's
terminal and bloats the answer. quote() keeps it to one short printable-ASCII line, and the Kotlin
phone renders it byte for byte the same (tests/vectors/quoting.json).
"""
from __future__ import annotations

import json

QUOTE_MAX_CHARS = 64  # code points of the value shown; the rest is counted, not shown

_SIMPLE = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape_char(ch: str) -> str:
    if ch in _SIMPLE:
        return _SIMPLE[ch]
    cp = ord(ch)
    if 0x20 <= cp <= 0x7E:
        return ch
    if cp < 0x100:
        return f"\\x{cp:02x}"
    if cp < 0x10000:
        return f"\\u{cp:04x}"
    return f"\\U{cp:08x}"


def quote(value: str) -> str:
    """`"escaped first 64 code points"` plus `...(N chars)` when the value is longer."""
    shown = "".join(_escape_char(ch) for ch in value[:QUOTE_MAX_CHARS])
    suffix = f"...({len(value)} chars)" if len(value) > QUOTE_MAX_CHARS else ""
    return f'"{shown}"{suffix}'


def quote_any(value: object) -> str:
    """A string as quote() shows it; any other JSON value as compact ASCII JSON (a number stays
    unquoted, so it does not read as a string), cut after 64 characters as quote() cuts."""
    if isinstance(value, str):
        return quote(value)
    text = json.dumps(value, ensure_ascii=True, separators=(",", ":"), default=repr)
    return text if len(text) <= QUOTE_MAX_CHARS else f"{text[:QUOTE_MAX_CHARS]}...({len(text)} chars)"

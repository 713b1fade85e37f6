"""Peer-supplied text in a real zl-phone's answers and log (issue 51 items 12, 13): a FILE_BEGIN
name 5.2 allows and a 60 KB STAGE_ASSIGN value come back quoted (PROTOCOL.md 7): one short line of
printable ASCII, no raw CR/ESC/BEL for a terminal and no forged log line."""
from __future__ import annotations

import pytest

from tests.test_phone_bad_input import Log, Session, assert_serves
from tests.test_phone_hostile import _assign, _begin, serving_phone
from zl_mobile.protocol import Message, MsgType
from zl_mobile.protocol.quoting import quote

HOSTILE_NAME = "a\nb\r\x1b[2J\x07\n[device] INJECTED"


@pytest.fixture(scope="module")
def phone(tmp_path_factory):
    yield from serving_phone(tmp_path_factory, "quoting")


def _one_printable_line(text: str) -> None:
    assert text.isascii() and text.isprintable(), repr(text[:200])


def _log_is_clean(log: Log) -> None:
    raw = log.new()
    for ch in "\r\x1b\x07":
        assert ch not in raw, f"raw {ch!r} in the phone's log:\n{raw!r}"
    assert not any(line.startswith("[device] INJECTED") for line in raw.splitlines()), raw


def test_a_hostile_file_name_is_quoted_in_file_result_and_the_log(phone):
    log = Log(phone)
    with Session(phone) as s:
        tid = _begin(s, HOSTILE_NAME, 0, "00" * 32)  # zero bytes, wrong sha: refused at FILE_END
        reply = s.request(Message(MsgType.FILE_END, {"transfer_id": tid}))
        assert reply.type == MsgType.FILE_RESULT and reply["ok"] is False, reply
        _one_printable_line(reply["message"])
        assert reply["message"].startswith(quote(HOSTILE_NAME) + ": received 0 bytes"), reply["message"]
    log.wait_line("rejected file:", quote(HOSTILE_NAME))
    _log_is_clean(log)
    assert_serves(phone)


def test_a_60_kb_value_comes_back_as_a_short_quoted_prefix(phone):
    log = Log(phone)
    schedule = "\x1b[2J" + "s" * 60000
    with Session(phone) as s:
        meta = _assign(schedule=schedule)
        reply = s.request(Message(MsgType.STAGE_ASSIGN, meta))
        assert reply.type == MsgType.ERROR and reply["code"] == "REJECTED", reply
        assert reply["request_id"] == meta["request_id"]
        msg = reply["message"]
        _one_printable_line(msg)
        assert msg.startswith("STAGE_ASSIGN schedule: " + quote(schedule)), msg[:200]
        assert f"...({len(schedule)} chars)" in msg and len(msg) < 300, msg[:400]
        s.heartbeat()
    log.wait_line("REJECTED:", "STAGE_ASSIGN schedule:")
    _log_is_clean(log)

"""A host sending what only a device sends (or chunks of no transfer), against one real zl-phone
process: tests/vectors/session_rules/host_sends.json, the rule of PROTOCOL.md 5.1 that an ERROR
without request_id is about the session and its sender closes. The Kotlin phone runs the same file."""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from tests.test_phone_bad_input import Session, assert_serves, wait_free
from tests.test_phone_hostile import serving_phone
from zl_mobile.protocol import ConnectionClosed, Message, MsgType

VECTOR = json.loads((Path(__file__).parent / "vectors" / "session_rules" / "host_sends.json").read_text())


@pytest.fixture(scope="module")
def phone(tmp_path_factory):
    yield from serving_phone(tmp_path_factory, "rules")


def _message(case: dict) -> Message:
    tensors = {name: np.zeros(t["shape"], dtype=t["dtype"]) for name, t in case.get("tensors", {}).items()}
    return Message(MsgType[case["type"]], case["meta"], tensors)


def _closed(s: Session, within: float = 5.0) -> bool:
    """True once the phone has closed the session; False if it still sends its heartbeats after
    `within` seconds (an open session's are periodic, so a read alone would never time out)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            msg = s.conn.recv()
        except (ConnectionClosed, ConnectionResetError):
            return True
        assert msg.type == MsgType.HEARTBEAT, f"the phone sent {msg} where it should have closed the session"
    return False


@pytest.mark.parametrize("case", VECTOR["cases"], ids=lambda c: c["description"][:50])
def test_a_host_message_out_of_place_is_answered_per_5_1(phone, case):
    wait_free(phone)
    with Session(phone) as s:
        s.send(_message(case))
        want = case["reply"]
        if want is not None:
            reply = s.recv()
            assert reply.type == MsgType[want["type"]] and reply["code"] == want["code"], reply
            assert reply.get("request_id") == want["request_id"], reply
            assert reply["message"].isprintable() and reply["message"].isascii(), reply
        if case["closes"]:
            assert _closed(s)
        else:
            s.heartbeat()  # still served, and nothing else was sent before the answer
    assert_serves(phone)

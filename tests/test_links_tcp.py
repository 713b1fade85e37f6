"""The TCP layer of the stage links (zl_mobile/links.py) over loopback: the rules themselves run on
the pure classes (tests/test_link_rules_vectors.py); here one scenario of each side of
tests/vectors/link_rules/link_rules.json goes through the real sockets, so the links apply those
rules, answer a broken one with ERROR UNEXPECTED and drop the connection, and the data port's
connection cap (PROTOCOL.md 6, a rule about sockets) holds.

The test plays the downstream stage of an OutboundLink (accepts it, sends REPLAY_REQUEST / CREDIT /
CHECKPOINT_COMMITTED, reads the HIDDEN_STATE frames), and the upstream of an InboundLink.
"""
from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import numpy as np
import pytest

from zl_mobile.link_rules import NO_END, InboundQueue, unusable_reason
from zl_mobile.links import InboundLink, OutboundLink
from zl_mobile.protocol import (
    ConnectionClosed,
    DeviceAuth,
    ErrorCode,
    Message,
    MsgType,
    ProtocolError,
    device_handshake,
    host_handshake,
    new_token,
    recv_message,
    send_message,
)

VECTORS = json.loads((Path(__file__).parent / "vectors" / "link_rules" / "link_rules.json").read_text())
TIMEOUT = 10.0


def _scenario(side: list[dict], name: str) -> dict:
    return next(s for s in side if s["name"] == name)


# the outbound scenario that reconnects, replays a gap, prunes on commit and refuses a request below
# it; the inbound one that refuses frames beyond the credits and counts them per connection
OUTBOUND = _scenario(VECTORS["outbound"], "prune on commit; a restarted downstream gets exactly its gap; "
                                          "asking below a commit is an error")
OUTBOUND_REFUSED = _scenario(VECTORS["outbound"], "a commit beyond what was sent is refused and prunes nothing")
INBOUND = _scenario(VECTORS["inbound"]["credits"], "a HIDDEN_STATE beyond the credits granted is refused and not kept; "
                                                   "credits are counted per connection")


def _hidden(mb: int, window_size: int) -> Message:
    return Message(MsgType.HIDDEN_STATE, {"micro_batch": mb, "window": mb // window_size},
                   {"h": np.full((1, 2), mb, dtype=np.float32)})


def _wait(what: str, cond) -> None:
    end = time.time() + TIMEOUT
    while not cond():
        if time.time() > end:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.005)


class FakeDownstream:
    """The downstream end of one OutboundLink: a listening socket that plays the device side of
    the link handshake and then speaks the link messages the scenario asks for."""

    def __init__(self, token: str):
        self.auth = DeviceAuth(token, "fake-downstream")
        self.server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.server.bind(("127.0.0.1", 0))
        self.server.listen(4)
        self.server.settimeout(TIMEOUT)
        self.address = f"127.0.0.1:{self.server.getsockname()[1]}"
        self.sock: socket.socket | None = None
        self.hs = None
        self.pending: socket.socket | None = None

    def connect(self) -> None:
        sock = self.pending or self.server.accept()[0]
        self.pending = None
        sock.settimeout(TIMEOUT)
        hello = Message(MsgType.HELLO, {"name": "fake-downstream", "protocol_version": 1, "runtime_version": "test",
                                        "memory_bytes": 0, "capabilities": ["link"]})
        self.hs = device_handshake(sock, self.auth, hello)
        self.sock = sock

    def disconnect(self) -> None:
        """Drop the connection and wait until the link has noticed (it reconnects at once: its
        TCP connect is accepted here, its handshake runs at the next `connect`)."""
        self.quiet()
        self.sock.close()
        self.hs.close()
        self.sock = None
        self.pending = self.server.accept()[0]

    def send(self, msg: Message) -> None:
        send_message(self.sock, msg)

    def read_sent(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            msg = recv_message(self.sock)
            assert msg.type == MsgType.HIDDEN_STATE, msg
            assert float(np.asarray(msg.tensors["h"]).ravel()[0]) == msg["micro_batch"]
            out.append(msg["micro_batch"])
        return out

    def quiet(self) -> None:
        """Nothing more was sent than the scenario expected."""
        self.sock.settimeout(0.2)
        try:
            extra = recv_message(self.sock)
            pytest.fail(f"the link sent more than expected: {extra}")
        except (socket.timeout, TimeoutError):
            pass
        finally:
            self.sock.settimeout(TIMEOUT)

    def close(self) -> None:
        for s in (self.sock, self.pending, self.server):
            if s is not None:
                s.close()


@pytest.mark.parametrize("scenario", [OUTBOUND, OUTBOUND_REFUSED], ids=["replay", "refused"])
def test_outbound_link(scenario):
    token = new_token()
    errors: list[str] = []
    down = FakeDownstream(token)
    W = scenario["window_size"]
    link = OutboundLink(scenario["link"], token, window_size=W, replay_horizon=scenario["replay_horizon"],
                        on_error=errors.append, prune_on_commit=scenario.get("prune_on_commit", True))
    link.set_address(down.address)
    expected_errors = []
    try:
        for i, step in enumerate(scenario["steps"]):
            where = f"{scenario['name']}, step {i} {step}"
            op = step["do"]
            if op == "publish":
                for mb in step["mb"]:
                    link.publish(_hidden(mb, W))
            elif op == "connect":
                down.connect()
            elif op == "disconnect":
                down.disconnect()
            elif op == "replay_request":
                down.send(Message(MsgType.REPLAY_REQUEST, {"from_micro_batch": step["from"], "to_micro_batch": NO_END}))
            elif op == "credit":
                down.send(Message(MsgType.CREDIT, {"credits": step["n"]}))
            elif op == "committed":
                down.send(Message(MsgType.CHECKPOINT_COMMITTED, {"window": step["window"],
                                                                 "step": min(step["window"] + 1, 2**63 - 1),
                                                                 "sha256": "0" * 64}))
            else:
                pytest.fail(f"unknown step in {where}")
            if step.get("sent"):
                assert down.read_sent(len(step["sent"])) == step["sent"], where
            if "refused" in step:  # ERROR UNEXPECTED with the rule's words, then the link drops
                err = recv_message(down.sock)
                assert err.type == MsgType.ERROR and err["code"] == "UNEXPECTED", where
                assert err["message"] == step["refused"], where
                with pytest.raises((ConnectionClosed, ConnectionResetError)):
                    recv_message(down.sock)
                down.sock.close()
                down.hs.close()
                down.sock = None
            if "error" in step:
                expected_errors.append(step["error"])
                _wait(f"the error of {where}", lambda: len(errors) >= len(expected_errors))
                assert errors == expected_errors, where
            if "buffered" in step:
                want = step["buffered"]
                _wait(f"buffered == {want} ({where}; have {link.buffered()})", lambda: link.buffered() == want)
            if "full" in step:
                assert link.full() == step["full"], where
        if down.sock is not None:
            down.quiet()
        assert errors == expected_errors
    finally:
        link.close()
        down.close()


class Upstream:
    """The upstream end of one InboundLink connection: authenticates with the link's token (BUSY
    while the previous connection's slot is still being freed), reads the greeting."""

    def __init__(self, port: int, token: str):
        end = time.time() + TIMEOUT
        while True:
            self.sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT)
            try:
                host_handshake(self.sock, token, "upstream")
                break
            except ProtocolError as e:
                self.sock.close()
                if e.code != ErrorCode.BUSY or time.time() > end:
                    raise
                time.sleep(0.02)
        assert recv_message(self.sock).type == MsgType.REPLAY_REQUEST

    def credit(self) -> int | None:
        """The CREDIT the link sends next (None: it sends nothing)."""
        self.sock.settimeout(0.3)
        try:
            msg = recv_message(self.sock)
        except (socket.timeout, TimeoutError):
            return None
        finally:
            self.sock.settimeout(TIMEOUT)
        assert msg.type == MsgType.CREDIT, msg
        return msg["credits"]


def test_inbound_link_credits():
    """PROTOCOL.md 5.4.1 on the real InboundLink: a HIDDEN_STATE beyond the credits, or one the stage
    cannot use (unusable_reason, what Stage checks), is answered ERROR UNEXPECTED, is not kept, and
    the link closes."""
    scenario = INBOUND
    token = new_token()
    W, depth, total = scenario["window_size"], scenario["inflight_depth"], scenario["total_micro_batches"]
    queue = InboundQueue()
    stage = {"next": (scenario["committed_window"] + 1) * W}  # the micro-batch the stage needs next
    link = InboundLink(scenario["link"], token, queue, inflight_depth=depth, port=0, bind="127.0.0.1",
                       next_needed=lambda: queue.next_after(stage["next"]),
                       unusable=lambda msg: unusable_reason(msg["micro_batch"], msg["window"], stage["next"],
                                                            inflight_depth=depth, window_size=W, total=total))
    up: Upstream | None = None
    try:
        for i, step in enumerate(scenario["steps"]):
            where = f"{scenario['name']}, step {i} {step}"
            op = step["do"]
            if op == "connect":
                if up is not None:
                    up.sock.close()
                up = Upstream(link.port, token)
                assert up.credit() == step["credit"], where
            elif op == "send":
                mb = step["mb"]
                send_message(up.sock, Message(MsgType.HIDDEN_STATE, {"micro_batch": mb, "window": step.get("window", mb // W)},
                                              {"h": np.full((1, 2), mb, dtype=np.float32)}))
                if "refused" in step:
                    err = recv_message(up.sock)
                    assert err.type == MsgType.ERROR and err["code"] == "UNEXPECTED", (where, err)
                    assert err["message"] == step["refused"], where
                    with pytest.raises((ConnectionClosed, ConnectionResetError)):
                        recv_message(up.sock)
                    up.sock.close()
                    up = None
            elif op == "take":
                assert queue.take(step["mb"], timeout=TIMEOUT)["micro_batch"] == step["mb"], where
                stage["next"] = step["mb"] + 1  # as the stage: its next before the credit goes out
                link.grant(1)
                assert up.credit() == step["credit"], where
            else:
                pytest.fail(f"unknown step in {where}")
            if "queued" in step:
                _wait(f"queued == {step['queued']} ({where}; have {queue.ids()})", lambda: queue.ids() == step["queued"])
        if up is not None:  # nothing refused that the scenario did not expect
            assert up.credit() is None
    finally:
        if up is not None:
            up.sock.close()
        link.close()


def _held(socks: list[socket.socket], closed: set[int], want: int) -> int:
    """How many of `socks` the link still holds open, once `want` of them are (or 3 s have passed),
    with 0.3 s more for any late close: a closed one reads EOF (or a reset)."""
    def probe() -> None:
        for i, s in enumerate(socks):
            if i in closed:
                continue
            s.settimeout(0.0)
            try:
                if s.recv(1) == b"":
                    closed.add(i)
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                closed.add(i)
    end = time.time() + 3.0
    while True:
        probe()
        if len(socks) - len(closed) <= want or time.time() > end:
            break
        time.sleep(0.02)
    time.sleep(0.3)
    probe()
    return len(socks) - len(closed)


@pytest.mark.parametrize("scenario", VECTORS["inbound"]["connections"],
                         ids=[s["name"] for s in VECTORS["inbound"]["connections"]])
def test_inbound_link_connection_cap(scenario):
    """PROTOCOL.md 6 on the real InboundLink: its data port holds at most max_connections; at the cap
    the oldest unauthenticated connection gives way, so idle sockets never keep the upstream out."""
    token = new_token()
    queue = InboundQueue()
    link = InboundLink(scenario["link"], token, queue, inflight_depth=2, port=0, bind="127.0.0.1",
                       next_needed=lambda: queue.next_after(0), max_connections=scenario["max_connections"])
    idle: list[socket.socket] = []
    closed: set[int] = set()
    up: Upstream | None = None
    try:
        for i, step in enumerate(scenario["steps"]):
            where = f"{scenario['name']}, step {i} {step}"
            if step["do"] == "idle":
                for _ in range(step["n"]):
                    idle.append(socket.create_connection(("127.0.0.1", link.port), timeout=TIMEOUT))
            elif step["do"] == "connect":
                up = Upstream(link.port, token)
            else:
                pytest.fail(f"unknown step in {where}")
            assert _held(idle, closed, step["held"]) == step["held"], where
        if up is not None:  # the authenticated upstream was never the one to give way
            assert up.credit() == 2
    finally:
        for s in idle:
            s.close()
        if up is not None:
            up.sock.close()
        link.close()

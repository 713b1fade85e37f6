"""The link rules of docs/PROTOCOL.md 5.4.1 on the pure classes of zl_mobile/link_rules.py (no
sockets, no link threads), against the scenarios of tests/vectors/link_rules/link_rules.json. The
Kotlin core runs the same file on its own pure classes (LinkRulesTest.kt), so both sides keep the
same replay buffer, resume point, credits and horizon (backpressure) rules, and refuse the same
hidden states (beyond the credits, or unusable by the stage). The TCP layer around these rules
(zl_mobile/links.py) has its loopback tests in tests/test_links_tcp.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from zl_mobile.link_rules import (
    LINK_MAX_CONNECTIONS,
    NO_END,
    InboundCredits,
    InboundQueue,
    OutboundLinkState,
    initial_credit,
    unusable_message,
    unusable_reason,
)

VECTORS = json.loads((Path(__file__).parent / "vectors" / "link_rules" / "link_rules.json").read_text())


def _hidden(mb: int) -> dict:
    return {"micro_batch": mb, "h": f"h{mb}"}


@pytest.mark.parametrize("scenario", VECTORS["outbound"], ids=[s["name"] for s in VECTORS["outbound"]])
def test_outbound_link_state(scenario):
    link = OutboundLinkState(scenario["link"], window_size=scenario["window_size"], replay_horizon=scenario["replay_horizon"],
                             prune_on_commit=scenario.get("prune_on_commit", True))
    for i, step in enumerate(scenario["steps"]):
        where = f"{scenario['name']}, step {i} {step}"
        op = step["do"]
        error = refused = None
        if op == "publish":
            for mb in step["mb"]:
                link.publish(mb, _hidden(mb))
        elif op == "connect":
            link.connected()
        elif op == "disconnect":
            link.disconnected()
        elif op == "replay_request":
            error = link.on_replay_request(step["from"])
        elif op == "credit":
            link.on_credit(step["n"])
        elif op == "committed":
            refused = link.on_committed(step["window"])
        else:
            pytest.fail(f"unknown step in {where}")
        sent = []  # the link sends whatever the rules allow, as soon as they allow it
        while (taken := link.take_next()) is not None:
            assert taken[1] == _hidden(taken[0]), where
            sent.append(taken[0])
        assert sent == step.get("sent", []), where
        assert error == step.get("error"), where
        assert refused == step.get("refused"), where
        if refused is not None:  # the link answers ERROR and drops the connection
            link.disconnected()
        if "buffered" in step:
            assert link.buffered() == step["buffered"], where
        if "full" in step:
            assert link.full() == step["full"], where


@pytest.mark.parametrize("case", VECTORS["inbound"]["greeting"], ids=[c["name"] for c in VECTORS["inbound"]["greeting"]])
def test_inbound_greeting(case):
    queue = InboundQueue()
    for mb in case["queued"]:
        queue.put(_hidden(mb))
    resume = (case["committed_window"] + 1) * case["window_size"]
    assert queue.next_after(resume) == case["replay_from"]
    assert initial_credit(case["inflight_depth"], len(queue)) == case["initial_credit"]


@pytest.mark.parametrize("scenario", VECTORS["inbound"]["credits"], ids=[s["name"] for s in VECTORS["inbound"]["credits"]])
def test_inbound_credits(scenario):
    """A HIDDEN_STATE beyond the credits of its connection, or one the stage cannot use, is refused
    and not kept, and the connection ends; a new one starts with the greeting's credit."""
    W, depth, total, name = (scenario["window_size"], scenario["inflight_depth"], scenario["total_micro_batches"],
                             scenario["link"])
    queue = InboundQueue()
    next_mb = (scenario["committed_window"] + 1) * W  # the micro-batch the stage needs next
    credits: InboundCredits | None = None  # the current connection's (None: no upstream connected)
    for i, step in enumerate(scenario["steps"]):
        where = f"{scenario['name']}, step {i} {step}"
        op = step["do"]
        if op == "connect":
            credits = InboundCredits(name)
            first = initial_credit(depth, len(queue))
            if first is not None:
                credits.grant(first)
            assert first == step["credit"], where
        elif op == "send":
            mb = step["mb"]
            refused = credits.spend(mb)
            if refused is None:
                why = unusable_reason(mb, step.get("window", mb // W), next_mb, inflight_depth=depth, window_size=W, total=total)
                refused = None if why is None else unusable_message(mb, name, why)
            assert refused == step.get("refused"), where
            if refused is None:
                queue.put(_hidden(mb))
            else:
                credits = None  # the link closes
        elif op == "take":
            mb = step["mb"]
            assert queue.take(mb, timeout=0)["micro_batch"] == mb, where
            next_mb = mb + 1  # as the stage: its next moves before the credit goes out
            sent = None
            if credits is not None:
                credits.grant(1)
                sent = 1
            assert sent == step["credit"], where
        else:
            pytest.fail(f"unknown step in {where}")
        if "queued" in step:
            assert queue.ids() == step["queued"], where


def test_inbound_queue_steps():
    queue = InboundQueue()
    for step in VECTORS["inbound"]["queue"]:
        op, mb = step["do"], step["mb"]
        if op == "put":
            queue.put(_hidden(mb))
        elif op == "take":
            assert queue.take(mb, timeout=0)["micro_batch"] == step["took"], step
            assert len(queue) == step["left"], step
        elif op == "next_after":
            assert queue.next_after(mb) == step["next"], step
        else:
            pytest.fail(f"unknown step {step}")


def test_no_end_is_the_protocols():
    assert NO_END == VECTORS["no_end"] == 2**53


def test_the_data_port_cap_is_the_vectors():
    assert LINK_MAX_CONNECTIONS == VECTORS["max_connections"]


def test_the_host_feed_holds_nothing_and_serves_any_replay():
    """The feed into stage 0 builds each input when it is sent: any replay is served, commits
    prune nothing and are never refused, and it stops at the run's end."""
    feed = OutboundLinkState("host-feed", window_size=2, replay_horizon=4, feed=True, feed_total=5)
    feed.connected()
    assert feed.on_replay_request(3) is None
    feed.on_credit(10)
    assert [feed.take_next() for _ in range(3)] == [(3, None), (4, None), None]
    assert feed.on_committed(40) is None and feed.downstream_committed == 40
    feed.connected()
    assert feed.on_replay_request(0) is None  # a global rollback: from the start again
    assert feed.take_next() is None  # no credit yet on the new connection
    feed.on_credit(1)
    assert feed.take_next() == (0, None)

"""STAGE_ASSIGN field rules (docs/PROTOCOL.md 5.3.1) on the Python reference, against the cases of
tests/vectors/stage_assign/stage_assign_rules.json; the Kotlin core passes the same file
(kotlin_app/core/src/test/kotlin/org/zerolock/core/StageAssignRulesTest.kt)."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from zl_mobile.assign_rules import validate_assign
from zl_mobile.protocol import ErrorCode, ProtocolError

VECTORS = json.loads((Path(__file__).parent / "vectors" / "stage_assign" / "stage_assign_rules.json").read_text())


def build(case: dict) -> dict:
    meta = copy.deepcopy(VECTORS["base"])
    for key, value in case["set"].items():
        head, _, tail = key.partition(".")
        if tail:
            meta.setdefault(head, {})[tail] = value
        else:
            meta[key] = value
    for key in case["drop"]:
        meta.pop(key, None)
    return meta


@pytest.mark.parametrize("case", VECTORS["cases"], ids=[c["description"] for c in VECTORS["cases"]])
def test_stage_assign_rule(case):
    meta = build(case)
    if case["field"] is None:
        validate_assign(meta)
        return
    with pytest.raises(ProtocolError) as e:
        validate_assign(meta)
    assert e.value.code == ErrorCode.REJECTED
    assert e.value.message.startswith(f"STAGE_ASSIGN {case['field']}:"), e.value.message
    assert "\n" not in e.value.message


def test_the_vectors_cover_every_rule():
    """Each field the rules check has at least one refused case (a rule nobody tests can rot)."""
    fields = {c["field"] for c in VECTORS["cases"] if c["field"]}
    assert {"run_id", "downstream", "window_size", "config.lr", "config.keep_checkpoints", "listen_port",
            "inflight_depth", "replay_horizon", "schedule"} <= fields


def test_a_forward_only_lr_is_zero_not_below():
    """LR 0 (a forward-only stage, zl_mobile/stage_core.py) is accepted by the shared vectors; the
    smallest step below it is not."""
    with pytest.raises(ProtocolError):
        validate_assign(build({"set": {"config.lr": -1e-9}, "drop": []}))

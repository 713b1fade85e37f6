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


DEFAULTS = json.loads((Path(__file__).parent / "vectors" / "stage_assign" / "stage_assign_defaults.json").read_text())


def _read(cfg, key: str):
    return getattr(cfg, key.partition(".")[2] or key)


def test_a_key_left_out_takes_the_shared_default():
    """stage_assign_defaults.json: what zl_mobile takes for each key an assignment leaves out; the
    Kotlin core's StageAssignment reads the same file (StageAssignRulesTest.kt)."""
    from zl_mobile.stage import StageConfig

    minimal = copy.deepcopy(DEFAULTS["minimal"])
    validate_assign(minimal)  # the keys both devices require, and no more
    cfg = StageConfig.from_assign(minimal)
    assert {k: _read(cfg, k) for k in DEFAULTS["defaults"]} == DEFAULTS["defaults"]
    assert {k: _read(cfg, k) for k in DEFAULTS["device_own"]} == {k: v["python"] for k, v in DEFAULTS["device_own"].items()}


def test_a_key_given_wins_over_its_default():
    """Each pinned key is read from where the protocol puts it (top level or config), not defaulted."""
    from zl_mobile.stage import StageConfig

    given = {"run_id": "r1", "downstream_token": "2" * 64, "window_size": 8, "inflight_depth": 3, "replay_horizon": 40,
             "schedule": "gpipe", "listen_port": 7071, "config.lr": 0.5, "config.weight_decay": 0.01, "config.alpha": 0.7,
             "config.total_micro_batches": 64, "config.rollback_to_window": 3,
             "config.inject_failure": [{"window": 1, "point": "before-commit"}], "config.busy_ms": 5,
             "config.restart": True, "config.keep_checkpoints": 9}
    assert set(given) == set(DEFAULTS["defaults"]) | set(DEFAULTS["device_own"])
    meta = build({"set": given, "drop": []})
    cfg = StageConfig.from_assign(meta)
    assert {k: _read(cfg, k) for k in given} == given

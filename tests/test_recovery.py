"""Fail one phone, lose nothing: a stage killed at any point restarts from its own checkpoint,
replays the buffered hidden states, and the run ends with the same LoRA as an uninterrupted one."""
import numpy as np
import pytest

from host.plan import RunSettings
from tests.conftest import run_pipeline, small_micro_batches

SETTINGS = dict(windows=4, window_size=2, lr=2e-2, inflight_depth=2)


@pytest.fixture(scope="module")
def baseline(small_export, tmp_path_factory):
    out = small_export[0]
    mbs = small_micro_batches(out, n_examples=8)
    result, records = run_pipeline(out, tmp_path_factory.mktemp("base"), RunSettings(**SETTINGS), mbs)
    return out, mbs, result, records


def _commits(records):
    return sorted((r["stage"], r["window"]) for r in records if r["type"] == "CHECKPOINT_COMMITTED")


@pytest.mark.parametrize("recovery", ["local"])
@pytest.mark.parametrize("failures", [
    [{"stage": 1, "window": 1, "point": "after-phase1"}],
    [{"stage": 1, "window": 1, "point": "before-commit"}],
    [{"stage": 1, "window": 2, "point": "mid-checkpoint"}],
    [{"stage": 0, "window": 1, "point": "after-phase1"}],
    [{"stage": 2, "window": 2, "point": "before-commit"}],
    [{"stage": 1, "window": 1, "point": "after-phase1"}, {"stage": 1, "window": 2, "point": "mid-checkpoint"}],
], ids=["mid-stage-after-phase1", "between-step-and-commit", "mid-checkpoint", "first-stage", "last-stage",
        "two-failures-in-a-row"])
def test_injected_failure_ends_with_the_uninterrupted_lora(baseline, tmp_path, failures, recovery):
    out, mbs, base, base_records = baseline
    events = []
    settings = RunSettings(**SETTINGS, inject_failure=failures, recovery=recovery)
    result, records = run_pipeline(out, tmp_path, settings, mbs, on_event=lambda k, d: events.append((k, d)))
    failed = [d["stage"] for k, d in events if k == "failure"]
    assert failed == [f["stage"] for f in failures]  # each injected failure was detected, once
    assert [d["stage"] for k, d in events if k == "rejoined"] == failed
    diff = max(float(np.abs(result["lora"][n] - base["lora"][n]).max()) for n in base["lora"])
    print(f"largest LoRA difference vs the uninterrupted run: {diff:.3g}")
    assert diff <= 1e-6
    # every window committed exactly once per stage: none lost, none applied twice
    assert _commits(records) == _commits(base_records)
    assert len(result["recoveries"]) == len(failures) and all(r["caught_up"] for r in result["recoveries"])
    # the other stages never rolled back: their commits are strictly increasing in time
    for k in {0, 1, 2} - set(failed):
        ws = [r["window"] for r in records if r["type"] == "CHECKPOINT_COMMITTED" and r["stage"] == k]
        assert ws == sorted(ws)


def test_global_rollback_baseline_also_ends_with_the_uninterrupted_lora(baseline, tmp_path):
    """The BP-pipeline baseline rolls every stage back to the last globally consistent
    checkpoint: correct too, but everyone replays (and re-commits the rolled-back windows)."""
    out, mbs, base, base_records = baseline
    failures = [{"stage": 1, "window": 2, "point": "after-phase1"}]
    settings = RunSettings(**SETTINGS, inject_failure=failures, recovery="global-rollback")
    result, records = run_pipeline(out, tmp_path, settings, mbs)
    diff = max(float(np.abs(result["lora"][n] - base["lora"][n]).max()) for n in base["lora"])
    assert diff <= 1e-6
    (rec,) = result["recoveries"]
    assert rec["kind"] == "global-rollback" and rec["stages"] == [0, 1, 2] and rec["caught_up"]
    commits = _commits(records)
    g = rec["resumed_after_window"]
    # stages other than the failed one committed windows after g twice: they really rolled back
    assert any(commits.count((k, w)) == 2 for k in (0, 2) for w in range(g + 1, 4))


def test_failure_past_the_replay_horizon_is_reported_not_skipped(baseline, tmp_path):
    """If the upstream already dropped hidden states the restarted stage needs, the run stops
    with a message naming the lost micro-batches."""
    from host.coordinator import RunError

    out, mbs, base, base_records = baseline
    settings = RunSettings(**{**SETTINGS, "inflight_depth": 1}, replay_horizon=1,
                           inject_failure=[{"stage": 1, "window": 1, "point": "before-commit"}])
    with pytest.raises(RunError, match=r"replay horizon passed: micro-batches 2-\d+ .* lost"):
        run_pipeline(out, tmp_path, settings, mbs)


def test_a_long_runtime_call_is_not_taken_for_a_dead_phone(baseline, tmp_path):
    """The runtime holds the interpreter while it computes, so a phone's heartbeat thread is
    silent for as long as a phase lasts (seconds per phase at TinyLlama size). The stage says
    so beforehand (HEARTBEAT busy_ms): a phase far longer than the heartbeat timeout is no failure."""
    out, mbs, base, base_records = baseline
    events = []
    stall = {"stage": 1, "window": 1, "point": "hold-gil-in-phase1", "seconds": 4.0}
    settings = RunSettings(**SETTINGS, heartbeat_timeout=1.0, inject_failure=[stall])
    result, records = run_pipeline(out, tmp_path, settings, mbs, on_event=lambda k, d: events.append((k, d)))
    assert [d for k, d in events if k == "failure"] == [] and result["recoveries"] == []
    stalled = [r for r in records if r["type"] == "TELEMETRY" and r["kind"] == "micro_batch"
               and (r["stage"], r["window"]) == (1, 1)]
    assert max(r["phase1_end"] - r["phase1_start"] for r in stalled) >= 4.0  # the stall did happen
    assert _commits(records) == _commits(base_records)
    diff = max(float(np.abs(result["lora"][n] - base["lora"][n]).max()) for n in base["lora"])
    assert diff <= 1e-6

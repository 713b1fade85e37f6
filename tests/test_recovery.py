"""Fail one phone, lose nothing, at the default replay horizon and with a faster upstream: a
stage killed at any point restarts from its own checkpoint, replays, and the run ends with the
same LoRA as an uninterrupted one, every window committed once per stage.

Phones 1 and 2 are slowed, 2 the most (zl_mobile.stage SLOW_POINT: every phase 1 sleeps longer,
as on a slower phone), so stages 0 and 1 run ahead until their replay buffers hold the horizon
and backpressure holds them there; a failure then needs hidden states that a faster upstream
had already sent (and, for a failed upstream, already committed)."""
import shutil

import numpy as np
import pytest

from host.run.settings import RunSettings
from tests.conftest import run_pipeline, small_micro_batches

WINDOWS = 10
SETTINGS = dict(window_size=2, lr=2e-2, inflight_depth=2)  # default replay horizon: 2W + depth = 6
HORIZON = 6
SLOWER = [{"stage": 1, "point": "slow-phase1", "seconds": 0.12}, {"stage": 2, "point": "slow-phase1", "seconds": 0.25}]


@pytest.fixture(scope="module")
def baseline(small_export, tmp_path_factory):
    out = small_export[0]
    mbs = small_micro_batches(out, n_examples=8)
    result, records = run_pipeline(out, tmp_path_factory.mktemp("base"), RunSettings(windows=WINDOWS, **SETTINGS), mbs)
    return out, mbs, result, records


def _commits(records):
    return sorted((r["stage"], r["window"]) for r in records if r["type"] == "CHECKPOINT_COMMITTED")


def lora_diff(result, base) -> float:
    return max(float(np.abs(result["lora"][n] - base["lora"][n]).max()) for n in base["lora"])


def assert_held_within(records, horizon: int, ahead_stages=(0, 1)):
    """No stage ever held more hidden states for replay than the horizon, and backpressure did
    hold one back: an upstream of a slower phone filled its buffer and waited for its downstream.
    (Which of the two fills depends on the machine's load; that one does, does not.)"""
    tel = [r for r in records if r["type"] == "TELEMETRY" and r.get("kind", "micro_batch") == "micro_batch"]
    held_back = []
    for k in ahead_stages:
        mine = [r for r in tel if r["stage"] == k]
        peak = max(r["replay_held_peak"] for r in mine)
        assert peak <= horizon, f"stage {k} held {peak} hidden states, above the horizon {horizon}"
        if peak == horizon and max(r["wait_downstream_s"] for r in mine) > 0:
            held_back.append(k)
    assert held_back, "no stage ran ahead to the horizon and waited for its downstream"
    assert all("replay_held" not in r for r in tel if r["stage"] == 2)  # the last stage sends nothing


def assert_as_uninterrupted(result, records, base, base_records, failures):
    assert lora_diff(result, base) == 0.0  # bitwise: the same windows, applied once, in order
    assert _commits(records) == _commits(base_records)  # every window committed once per stage
    assert len(result["recoveries"]) == len(failures) and all(r["caught_up"] for r in result["recoveries"])


@pytest.mark.parametrize("stage", [0, 1, 2])
@pytest.mark.parametrize("point", ["after-phase1", "before-commit", "mid-checkpoint"])
def test_a_failure_at_each_point_and_stage_ends_with_the_uninterrupted_lora(baseline, tmp_path, stage, point):
    out, mbs, base, base_records = baseline
    events = []
    failures = [{"stage": stage, "window": 4, "point": point}]
    settings = RunSettings(windows=WINDOWS, **SETTINGS, inject_failure=[*failures, *SLOWER])
    result, records = run_pipeline(out, tmp_path, settings, mbs, on_event=lambda k, d: events.append((k, d)))
    assert [d["stage"] for k, d in events if k == "failure"] == [stage]  # detected, once
    assert [d["stage"] for k, d in events if k == "rejoined"] == [stage]
    assert_as_uninterrupted(result, records, base, base_records, failures)
    assert_held_within(records, HORIZON)
    # the other stages never rolled back: their commits are strictly increasing in time
    for k in {0, 1, 2} - {stage}:
        ws = [r["window"] for r in records if r["type"] == "CHECKPOINT_COMMITTED" and r["stage"] == k]
        assert ws == sorted(ws) == list(range(WINDOWS))


@pytest.mark.parametrize("detect,point", [("connection", "after-phase1"), ("heartbeat", "mid-checkpoint")])
def test_a_stage_that_fails_inside_the_running_phone_is_restored_without_a_restart(baseline, tmp_path, detect, point):
    """The app lives on and its stage loses its memory (an app's training service crashing, as
    the seed's E2 fails a worker): the host finds out from the dropped session or from the
    heartbeats stopping, reconnects to the same process, and the stage restores its checkpoint."""
    out, mbs, base, base_records = baseline
    events, phones, pids = [], [], []

    def on_event(kind, data):
        events.append((kind, data))
        if kind in ("failure", "rejoined"):  # the failed stage's phone process, as it fails and as it rejoins
            pids.append(next(p.proc.pid for p in phones if p.name == data["device"]))

    failures = [{"stage": 1, "window": 4, "point": point, "mode": "app", "detect": detect}]
    settings = RunSettings(windows=WINDOWS, **SETTINGS, heartbeat_timeout=2.0, inject_failure=[*failures, *SLOWER])
    result, records = run_pipeline(out, tmp_path, settings, mbs, on_event=on_event, phones_out=phones)
    (failure,) = [d for k, d in events if k == "failure"]
    assert failure["stage"] == 1
    assert ("no heartbeat" in failure["why"]) == (detect == "heartbeat"), failure["why"]
    assert len(pids) == 2 and pids[0] == pids[1]  # the same phone process: reconnected, not restarted
    assert_as_uninterrupted(result, records, base, base_records, failures)


def test_two_failures_in_a_row(baseline, tmp_path):
    """The upstream fails while it is ahead, then its downstream fails before the first has caught up."""
    out, mbs, base, base_records = baseline
    failures = [{"stage": 0, "window": 3, "point": "before-commit"}, {"stage": 1, "window": 3, "point": "after-phase1"}]
    settings = RunSettings(windows=WINDOWS, **SETTINGS, inject_failure=[*failures, *SLOWER])
    result, records = run_pipeline(out, tmp_path, settings, mbs)
    assert_as_uninterrupted(result, records, base, base_records, failures)
    assert_held_within(records, HORIZON)


@pytest.mark.parametrize("stage", [0, 1])
def test_kill_9_of_a_phone_that_ran_ahead(baseline, tmp_path, stage):
    """A real SIGKILL of the phone's process (no injected point) once it has committed window 4."""
    out, mbs, base, base_records = baseline
    phones, killed = [], []

    def on_event(kind, data):
        if kind == "checkpoint_committed" and data["stage"] == stage and data["window"] == 4 and not killed:
            phone = next(p for p in phones if p.name == data["device"])
            phone.kill()
            killed.append(phone.name)

    settings = RunSettings(windows=WINDOWS, **SETTINGS, inject_failure=SLOWER)
    result, records = run_pipeline(out, tmp_path, settings, mbs, on_event=on_event, phones_out=phones)
    assert killed
    assert_as_uninterrupted(result, records, base, base_records, failures=[None])
    assert_held_within(records, HORIZON)


def test_a_replay_the_restarted_stage_cannot_serve_is_an_error_not_a_wait(baseline, tmp_path):
    """Stages 0 and 1 die while 0 is ahead, and stage 0's replay files are lost with it: the
    restarted stage 1 needs hidden states nobody holds any more, and the run stops saying which,
    instead of waiting forever."""
    from host.run.coordinator import RunError

    out, mbs, base, base_records = baseline
    phones, committed, device_of, killed = [], {}, {}, []

    def on_event(kind, data):
        if "stage" in data and "device" in data:
            device_of[data["stage"]] = data["device"]
        if kind != "checkpoint_committed":
            return
        committed[data["stage"]] = data["window"]
        if data["stage"] == 0 and committed.get(1, -1) < data["window"] - 1 and 1 in device_of and not killed:
            by_name = {p.name: p for p in phones}
            for k in (1, 0):
                by_name[device_of[k]].kill()
                killed.append(k)
            shutil.rmtree(by_name[device_of[0]].workdir / "stages" / "test" / "stage_0" / "replay")

    settings = RunSettings(windows=WINDOWS, **SETTINGS, inject_failure=SLOWER)
    with pytest.raises(RunError, match=r"replay unavailable: micro-batches \d+-\d+ needed downstream of stage0-out "
                                       r"are no longer held .*zl-host run --resume"):
        run_pipeline(out, tmp_path, settings, mbs, on_event=on_event, phones_out=phones)
    assert killed == [1, 0]


def test_too_small_a_replay_horizon_is_refused_with_what_would_work(small_export, tmp_path):
    from host.run.coordinator import Coordinator
    from host.run.settings import PlanError

    with pytest.raises(PlanError, match=r"replay horizon 1 is too small: .* use --replay-horizon 2 or more "
                                        r"\(the default, 6,"):
        Coordinator(small_export[0], [], [], RunSettings(windows=2, **SETTINGS, replay_horizon=1), tmp_path)
    assert RunSettings(**SETTINGS).checked_horizon(3) == HORIZON  # the default passes its own check
    assert RunSettings(**SETTINGS, replay_horizon=2).checked_horizon(3) == 2  # one window is enough


def test_global_rollback_baseline_also_ends_with_the_uninterrupted_lora(baseline, tmp_path):
    """The BP-pipeline baseline rolls every stage back to the last globally consistent
    checkpoint: correct too, but everyone replays (and re-commits the rolled-back windows)."""
    out, mbs, base, base_records = baseline
    failures = [{"stage": 1, "window": 2, "point": "after-phase1"}]
    settings = RunSettings(windows=WINDOWS, **SETTINGS, inject_failure=failures, recovery="global-rollback")
    result, records = run_pipeline(out, tmp_path, settings, mbs)
    assert lora_diff(result, base) <= 1e-6
    (rec,) = result["recoveries"]
    assert rec["kind"] == "global-rollback" and rec["stages"] == [0, 1, 2] and rec["caught_up"]
    commits = _commits(records)
    g = rec["resumed_after_window"]
    # stages other than the failed one committed windows after g twice: they really rolled back
    assert any(commits.count((k, w)) == 2 for k in (0, 2) for w in range(g + 1, WINDOWS))


def test_a_long_runtime_call_is_not_taken_for_a_dead_phone(baseline, tmp_path):
    """The runtime holds the interpreter while it computes, so a phone's heartbeat thread is
    silent for as long as a phase lasts (seconds per phase at TinyLlama size). The stage says
    so beforehand (HEARTBEAT busy_ms): a phase far longer than the heartbeat timeout is no failure."""
    out, mbs, base, base_records = baseline
    events = []
    stall = {"stage": 1, "window": 1, "point": "hold-gil-in-phase1", "seconds": 4.0}
    settings = RunSettings(windows=WINDOWS, **SETTINGS, heartbeat_timeout=1.0, inject_failure=[stall])
    result, records = run_pipeline(out, tmp_path, settings, mbs, on_event=lambda k, d: events.append((k, d)))
    assert [d for k, d in events if k == "failure"] == [] and result["recoveries"] == []
    stalled = [r for r in records if r["type"] == "TELEMETRY" and r["kind"] == "micro_batch"
               and (r["stage"], r["window"]) == (1, 1)]
    assert max(r["phase1_end"] - r["phase1_start"] for r in stalled) >= 4.0  # the stall did happen
    assert _commits(records) == _commits(base_records)
    assert lora_diff(result, base) <= 1e-6


def test_keep_checkpoints_keeps_every_window_for_a_study_of_the_adapter_over_time(baseline, tmp_path):
    """RunSettings.keep_checkpoints: each stage keeps that many window checkpoints (bench/per_hour.py
    evaluates the adapter as it stood after every window); the default keeps two."""
    from zl_mobile.checkpoint import checkpoint_name, read_lora

    out, mbs, base, _ = baseline
    result, _ = run_pipeline(out, tmp_path, RunSettings(windows=WINDOWS, **SETTINGS, keep_checkpoints=WINDOWS), mbs)
    assert lora_diff(result, base) == 0.0
    kept = {p.name: sorted(f.name for f in p.glob("ckpt-*.safetensors")) for p in tmp_path.glob("phones/*/stages/test/stage_*")}
    assert sorted(kept) == ["stage_0", "stage_1", "stage_2"]
    assert all(v == [f"ckpt-{w:08d}.safetensors" for w in range(WINDOWS)] for v in kept.values()), kept
    last = {}
    for p in tmp_path.glob(f"phones/*/stages/test/stage_*/{checkpoint_name(WINDOWS - 1)}"):
        last.update(read_lora(p))
    assert sorted(last) == sorted(result["lora"]) and all(np.array_equal(last[k], result["lora"][k]) for k in last)
    default = {p.resolve() for p in tmp_path.parent.glob("base*/phones/*/stages/test/stage_*/ckpt-*.safetensors")}
    assert default and len(default) == 3 * 2  # the baseline run (default settings): the last two windows per stage

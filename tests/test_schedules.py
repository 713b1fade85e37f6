"""Schedules as data, and the BP baselines running on the same stage runtime and links."""
import itertools

import numpy as np
import pytest

from host.run.settings import RunSettings
from tests.conftest import run_pipeline, small_micro_batches
from zl_mobile.schedules import SCHEDULES, forwards_held, schedule


def _take(name, k, n=3, size=4, windows=3):
    acts = list(itertools.islice(schedule(name, k, n, size), 200))
    steps = [i for i, a in enumerate(acts) if a.op == "STEP"]
    return acts[:steps[windows - 1] + 1]


@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize("k", [0, 1, 2])
def test_every_micro_batch_forward_then_backward_once(name, k):
    acts = _take(name, k)
    second = "L" if name == "zerolock" else "B"
    fwd = [a.mb for a in acts if a.op == "F"]
    back = [a.mb for a in acts if a.op == second]
    assert sorted(back) == list(range(12))
    assert len(set(fwd)) == len(fwd) and set(back) <= set(fwd)
    pos = {(a.op, a.mb): i for i, a in enumerate(acts)}
    for mb in back:
        assert pos[("F", mb)] < pos[(second, mb)]
        assert pos[(second, mb)] < pos[("STEP", mb // 4)]  # each window's grads are in before its step


@pytest.mark.parametrize("k,expected", [(0, 3), (1, 2), (2, 1)])
def test_activations_held_per_schedule(k, expected):
    """The memory story in one number: forwards whose activations are still held. 1 is also what
    lets a stage keep phase 1's outputs in place (ZeroLock everywhere, the BP pipelines' last stage)."""
    assert forwards_held("zerolock", k, 3, 4, windows=3) == 1
    assert forwards_held("gpipe", k, 3, 4, windows=3) == 4
    assert forwards_held("1f1b", k, 3, 4, windows=3) == expected
    assert forwards_held("pipedream", k, 3, 4, windows=3) == expected
    assert forwards_held("1f1b", 0, 8, 2) == 2  # the warm-up is capped by the window


def test_pipedream_drains_at_the_end_of_the_run():
    for k in range(3):
        acts = list(schedule("pipedream", k, 3, 4, total=8))
        assert [a.mb for a in acts if a.op == "F"] == list(range(8))
        assert [a.mb for a in acts if a.op == "B"] == list(range(8))
        assert (acts[-1].op, acts[-1].mb) == ("STEP", 1)


def test_unknown_schedule():
    with pytest.raises(ValueError, match="unknown schedule 'x'"):
        schedule("x", 0, 3, 4)


@pytest.fixture(scope="module")
def bp_runs(small_export, tmp_path_factory):
    out = small_export[0]
    mbs = small_micro_batches(out, n_examples=8)
    runs = {}
    for name in ("gpipe", "1f1b", "pipedream"):
        settings = RunSettings(windows=2, window_size=4, lr=1e-2, inflight_depth=4, schedule=name)
        runs[name] = run_pipeline(out, tmp_path_factory.mktemp(name), settings, mbs)
    return runs


def test_bp_baselines_train_on_the_same_runtime(bp_runs):
    for name, (result, records) in bp_runs.items():
        commits = sorted((r["stage"], r["window"]) for r in records if r["type"] == "CHECKPOINT_COMMITTED")
        assert commits == [(k, w) for k in range(3) for w in range(2)], name
        last = [r for r in records if r["type"] == "TELEMETRY" and r["kind"] == "micro_batch" and r["stage"] == 2]
        assert all("loss" in r for r in last) and len(last) == 8
        assert all(r["schedule"] == name for r in records if r["type"] == "TELEMETRY")


def test_flushed_bp_schedules_compute_the_same_update(bp_runs):
    """GPipe and 1F1B differ only in order: with a flush per window, the updates agree."""
    a, b = bp_runs["gpipe"][0]["lora"], bp_runs["1f1b"][0]["lora"]
    assert max(float(np.abs(a[n] - b[n]).max()) for n in a) < 1e-5
    c = bp_runs["pipedream"][0]["lora"]  # asynchronous: its second window's forwards used older weights
    assert max(float(np.abs(a[n] - c[n]).max()) for n in a) > 0


def test_bp_in_flight_activations_follow_the_schedule(bp_runs):
    for name, expect in (("gpipe", 4), ("1f1b", 3)):
        recs = [r for r in bp_runs[name][1] if r["type"] == "TELEMETRY" and r["kind"] == "micro_batch" and r["stage"] == 0]
        # in_flight counts forwards still held after this backward: peak is one less than held before it
        assert max(r["in_flight"] for r in recs) == expect - 1, name


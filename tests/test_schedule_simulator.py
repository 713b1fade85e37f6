"""host/planning/schedule_simulator.py: the schedules replayed on given phase times give the timelines the
pipeline literature derives by hand (bubbles, latency, link rate, credits)."""
import pytest

from host.planning.schedule_simulator import LinkModel, StageTimes, simulate

F, P2, STEP, MB, M = 0.05, 0.08, 0.01, 2, 4  # seconds, samples per micro-batch, micro-batches per window


def window_s(method, stages, link=LinkModel(), depth=4, times=None):
    """Seconds per window in the steady state."""
    tl = simulate(method, times or [StageTimes(F, P2, STEP)] * stages, M, 6, link, depth)
    return M * MB / tl.throughput(MB, M)


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("method", ["gpipe", "1f1b"])
def test_a_flush_costs_the_fill_and_drain_bubble(method, stages):
    # GPipe and 1F1B with a flush: (m + S - 1) slots of F + B per window, then the step
    assert window_s(method, stages) == pytest.approx((M + stages - 1) * (F + P2) + STEP)


@pytest.mark.parametrize("stages", [1, 2, 4])
def test_zerolock_and_pipedream_have_no_bubble(stages):
    assert window_s("zerolock", stages) == pytest.approx(M * (F + P2) + STEP)
    assert window_s("pipedream", stages) == pytest.approx(M * (F + P2) + STEP)


def test_latency_costs_back_propagation_twice_per_window_and_zerolock_nothing():
    d = 0.03
    link = LinkModel(delay_s=d)
    # the window's forwards cross S-1 links before the last stage starts backward, its gradients
    # cross them again before stage 0 can finish
    assert window_s("gpipe", 3, link) == pytest.approx((M + 2) * (F + P2) + STEP + 2 * 2 * d)
    assert window_s("zerolock", 3, link) == pytest.approx(M * (F + P2) + STEP)


def test_a_slow_link_bounds_zerolock_by_its_transfer_time():
    # 1 MB at 40 Mbit/s = 0.2 s per hidden state, more than a stage's F + phase 2 (0.13 s)
    link = LinkModel(rate_mbit=40, frame_bytes=1_000_000)
    assert link.transfer_s() == pytest.approx(0.2)
    assert window_s("zerolock", 2, link) == pytest.approx(M * 0.2, rel=0.02)
    # a fast link leaves it compute-bound
    assert window_s("zerolock", 2, LinkModel(rate_mbit=1000, frame_bytes=1_000_000)) == pytest.approx(M * (F + P2) + STEP)


def test_one_credit_makes_each_hidden_state_wait_a_round_trip():
    # with one credit, h(i) goes when the credit of h(i-1) is back: taken on arrival, one delay back
    d = 0.2
    assert window_s("zerolock", 2, LinkModel(delay_s=d), depth=1) == pytest.approx(M * 2 * d, rel=0.02)
    assert window_s("zerolock", 2, LinkModel(delay_s=d), depth=4) == pytest.approx(M * (F + P2) + STEP)


def test_the_slowest_stage_sets_zerolock_pace_and_a_faster_upstream_runs_ahead():
    times = [StageTimes(F, P2, STEP), StageTimes(2 * F, 2 * P2, STEP)]
    tl = simulate("zerolock", times, M, 6)
    assert M * MB / tl.throughput(MB, M) == pytest.approx(M * 2 * (F + P2) + STEP)
    assert tl.active_fraction(1) > 0.99
    # no gradient to wait for: stage 0 is done long before stage 1 (its hidden states wait in the
    # replay buffer for credits)
    assert tl.spans[0][-1][3] < 0.6 * tl.spans[1][-1][3]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="unknown schedule"):
        simulate("zigzag", [StageTimes(F, P2)], M, 3)
    with pytest.raises(ValueError, match="two windows"):
        simulate("zerolock", [StageTimes(F, P2)], M, 1)

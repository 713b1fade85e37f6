"""The split planner (host/planning/split_planner.py): exact against brute force, memory respected,
an infeasible set refused with how much is missing."""
from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from host.planning.split_planner import InfeasibleError, PhoneModel, evaluate_split, even_chunks, ideal_time, plan_split

MiB = 2**20


def brute_force(L, phones, frame_bytes=0, held=lambda k, n: 1):
    """Every cut into len(phones) chunks x every permutation: (best bottleneck or None)."""
    P = len(phones)
    best = None
    for cuts in itertools.combinations(range(1, L), P - 1):
        bounds = [0, *cuts, L]
        for perm in itertools.permutations(range(P)):
            worst, ok = 0.0, True
            for k in range(P):
                i, j = bounds[k], bounds[k + 1]
                ph = phones[perm[k]]
                if ph.budget_bytes is not None and ph.memory_bytes(j - i, i == 0, held(k, P)) > ph.budget_bytes:
                    ok = False
                    break
                worst = max(worst, ph.stage_s(j - i, i == 0, j == L, frame_bytes))
            if ok and (best is None or worst < best):
                best = worst
    return best


phone_st = st.builds(
    lambda name, layer_ms, fixed_ms, extra_ms, mbit, budget_mib, layer_mib: PhoneModel(
        name=name, layer_s=layer_ms / 1e3, fixed_s=fixed_ms / 1e3, first_extra_s=extra_ms / 1e3,
        link_mbit=mbit, budget_bytes=None if budget_mib is None else budget_mib * MiB,
        runtime_bytes=20 * MiB, readout_bytes=4 * MiB, embed_bytes=6 * MiB, layer_bytes=layer_mib * MiB,
        act_fixed_bytes=MiB, act_layer_bytes=MiB // 2, held_layer_bytes=MiB),
    st.just("p"), st.integers(1, 50), st.integers(0, 30), st.integers(0, 10),
    st.one_of(st.none(), st.integers(5, 500)), st.one_of(st.none(), st.integers(30, 120)), st.integers(1, 8))


@settings(max_examples=150, deadline=None)
@given(L=st.integers(1, 9), phones=st.lists(phone_st, min_size=1, max_size=4), frame_kib=st.integers(0, 512),
       gpipe=st.booleans())
def test_optimum_equals_brute_force(L, phones, frame_kib, gpipe):
    phones = [PhoneModel(**{**p.to_json(), "name": f"p{i}"}) for i, p in enumerate(phones)]
    held = (lambda k, n: 4) if gpipe else (lambda k, n: 1)
    frame = frame_kib * 1024
    if L < len(phones):
        with pytest.raises(ValueError, match="at least one layer"):
            plan_split(L, phones, frame, held=held)
        return
    expected = brute_force(L, phones, frame, held)
    if expected is None:
        with pytest.raises(InfeasibleError):
            plan_split(L, phones, frame, held=held)
        return
    plan = plan_split(L, phones, frame, held=held)
    assert plan.bottleneck_s == pytest.approx(expected, rel=1e-9, abs=1e-12)
    # the plan is what it says: contiguous, covering, one chunk per phone, within every budget
    assert plan.stages[0].first == 0 and plan.stages[-1].last == L - 1
    assert all(a.last + 1 == b.first for a, b in zip(plan.stages, plan.stages[1:]))
    assert sorted(plan.devices) == sorted(p.name for p in phones)
    assert max(s.time_s for s in plan.stages) == pytest.approx(plan.bottleneck_s)
    for s in plan.stages:
        assert s.budget_bytes is None or s.memory_bytes <= s.budget_bytes
    assert plan.ideal_s <= plan.bottleneck_s * (1 + 1e-9)  # whole layers never beat the continuous bound


def test_uneven_phones_get_layers_by_speed():
    # speeds 1 : 2 : 3 (0.3 / 0.6 / 0.9 of a core): 22 layers go about 4 / 7 / 11
    phones = [PhoneModel(f"p{i}", layer_s=0.03 / f, fixed_s=0.01 / f) for i, f in enumerate((0.3, 0.6, 0.9))]
    plan = plan_split(22, phones)
    layers = {s.phone: s.layers for s in plan.stages}
    assert layers["p0"] < layers["p1"] < layers["p2"]
    even = evaluate_split(even_chunks(22, 3), phones)
    assert even.bottleneck_s / plan.bottleneck_s > 1.7
    assert plan.bottleneck_s <= 1.1 * plan.ideal_s
    assert plan.ideal_s == pytest.approx(ideal_time(22, phones))


def test_ideal_is_never_below_a_phone_s_fixed_cost():
    # the slow phone's readout alone outlasts what the continuous split would give every stage
    phones = [PhoneModel("slow", layer_s=0.01, fixed_s=0.1), PhoneModel("fast", layer_s=0.001, fixed_s=0.0)]
    assert ideal_time(10, phones) == pytest.approx(0.1)  # not (10 + 10) / 1100 = 0.018
    plan = plan_split(10, phones)
    assert plan.bottleneck_s == pytest.approx(0.11) and plan.bottleneck_s >= plan.ideal_s


def test_memory_budget_moves_layers_off_a_fast_phone():
    fast = PhoneModel("fast", layer_s=0.01, fixed_s=0.0, budget_bytes=30 * MiB, runtime_bytes=10 * MiB,
                      layer_bytes=4 * MiB)
    slow = PhoneModel("slow", layer_s=0.04, fixed_s=0.0, budget_bytes=None, runtime_bytes=10 * MiB,
                      layer_bytes=4 * MiB)
    free = plan_split(10, [PhoneModel(**{**fast.to_json(), "budget_bytes": None}), slow])
    assert {s.phone: s.layers for s in free.stages}["fast"] == 8
    plan = plan_split(10, [fast, slow])
    mine = next(s for s in plan.stages if s.phone == "fast")
    assert mine.layers == 5 and mine.memory_bytes == 30 * MiB  # 10 + 5 x 4: as many as fit
    assert plan.bottleneck_s == pytest.approx(0.2)  # the slow phone's 5 layers


def test_infeasible_set_is_refused_with_what_is_missing():
    # 10 layers of 4 MiB + 10 MiB runtime per phone: 2 phones of 25 MiB hold 3 + 3 layers at most
    phones = [PhoneModel(f"p{i}", layer_s=0.01, fixed_s=0.0, budget_bytes=25 * MiB, runtime_bytes=10 * MiB,
                         layer_bytes=4 * MiB) for i in range(2)]
    with pytest.raises(InfeasibleError) as e:
        plan_split(10, phones)
    # 2 x 10 + 40 = 60 MiB needed, 50 given: 10 MiB missing, however the layers are cut
    assert e.value.missing_bytes == 10 * MiB
    assert "lacks 10.0 MiB" in str(e.value) and "50.0 MiB in all" in str(e.value)
    assert sum(e.value.short.values()) == 10 * MiB


def test_first_stage_carries_the_embedding():
    a = PhoneModel("a", layer_s=0.01, fixed_s=0.0, embed_bytes=8 * MiB, budget_bytes=20 * MiB, layer_bytes=MiB)
    b = PhoneModel("b", layer_s=0.01, fixed_s=0.0, embed_bytes=8 * MiB, budget_bytes=40 * MiB, layer_bytes=MiB)
    plan = plan_split(24, [a, b])
    assert plan.stages[0].memory_bytes == 8 * MiB + plan.stages[0].layers * MiB
    for s in plan.stages:
        assert s.memory_bytes <= s.budget_bytes


# a 28-layer model's shape (issue 53's numbers): per phone a 60 MiB runtime, the 211 MiB readout and
# 20 MiB of fixed activations; 57 MiB of weights + 3 MiB of activations a layer; the embedding on stage 0
def _phone28(name: str, budget: int, layer_s: float = 0.06) -> PhoneModel:
    return PhoneModel(name, layer_s=layer_s, fixed_s=0.1, budget_bytes=budget, runtime_bytes=60 * MiB,
                      readout_bytes=211 * MiB, embed_bytes=211 * MiB, layer_bytes=57 * MiB, act_fixed_bytes=20 * MiB,
                      act_layer_bytes=3 * MiB, held_layer_bytes=MiB)


@pytest.mark.parametrize("n, budget", [(4, 1280 * MiB), (6, 1024 * MiB)])
def test_a_28_layer_model_on_4_phones_at_1_25_gib_and_6_at_1_gib(n, budget):
    # one phone 6x faster than the rest: unbudgeted it would take more layers than its budget holds
    phones = [_phone28(f"p{i}", budget, layer_s=0.01 if i == 0 else 0.06) for i in range(n)]
    free = plan_split(28, [PhoneModel(**{**p.to_json(), "budget_bytes": None}) for p in phones])
    assert max(s.memory_bytes for s in free.stages) > budget
    plan = plan_split(28, phones)
    assert plan.stages[0].first == 0 and plan.stages[-1].last == 27
    assert all(a.last + 1 == b.first for a, b in zip(plan.stages, plan.stages[1:]))
    assert sorted(plan.devices) == sorted(p.name for p in phones)
    for s in plan.stages:
        assert s.budget_bytes == budget and s.memory_bytes <= budget
    assert plan.bottleneck_s >= free.bottleneck_s


def test_lowering_one_phone_s_budget_moves_layers_off_it():
    phones = [_phone28(f"p{i}", 1280 * MiB, layer_s=0.03 if i == 0 else 0.06) for i in range(4)]
    before = {s.phone: s for s in plan_split(28, phones).stages}
    phones[0] = PhoneModel(**{**phones[0].to_json(), "budget_bytes": 700 * MiB})
    after = {s.phone: s for s in plan_split(28, phones).stages}
    assert after["p0"].layers < before["p0"].layers
    assert after["p0"].memory_bytes <= 700 * MiB < before["p0"].memory_bytes
    assert sum(s.layers for s in after.values()) == 28


def test_a_28_layer_model_too_big_for_the_budgets_says_how_much_is_missing():
    # the model takes 4 x (60 + 211 + 20) + 211 + 28 x 60 = 3055 MiB on 4 phones, whatever the cut
    with pytest.raises(InfeasibleError) as e:
        plan_split(28, [_phone28(f"p{i}", 700 * MiB) for i in range(4)])
    assert e.value.missing_bytes == (3055 - 2800) * MiB
    assert "lacks 255.0 MiB" in str(e.value) and "2800.0 MiB in all" in str(e.value)
    assert "\n" not in str(e.value)
    assert set(e.value.short) == {"p0", "p1", "p2", "p3"} and sum(e.value.short.values()) == 255 * MiB

"""docs/PROTOCOL.md 5.4.2 on the Python side: tests/vectors/window_gradient/window_gradient.json,
which the Kotlin core passes too (kotlin_app/core/src/test/kotlin/org/zerolock/core/WindowGradientVectorsTest.kt).
The file is generated from zl_mobile (tests/vectors/window_gradient/make_vectors.py); these tests
check it is current and that what it holds is the token-level rule, not an artefact of the code."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.vectors.window_gradient import make_vectors
from zl_mobile.accumulate import WindowGradients

VECTORS = json.loads(make_vectors.OUT.read_text())


def test_vectors_are_current():
    assert make_vectors.render() == make_vectors.OUT.read_text(), \
        "stale: run python tests/vectors/window_gradient/make_vectors.py"


@pytest.mark.parametrize("case", VECTORS["readout"], ids=[c["name"] for c in VECTORS["readout"]])
def test_readout_case(case):
    labels = np.array(case["labels"], dtype=np.int64)
    valid = int((labels != -100).sum())
    if "error" in case:  # never cut: the stage fails the micro-batch, naming the count and the fix
        assert valid > case["capacity"]
        with pytest.raises(ValueError) as e:
            make_vectors.stage_batch(labels, case["capacity"], case["micro_batch"])
        assert str(e.value) == case["error"]
        assert f"--loss-positions {valid}" in case["error"]
        return
    b = make_vectors.stage_batch(labels, case["capacity"], case["micro_batch"])
    flat = labels.reshape(-1)
    want = [i for i in range(flat.size) if flat[i] != -100]  # row-major b*S+i
    assert case["valid"] == valid and case["index"][:valid] == want
    assert case["target"][:valid] == flat[want].tolist()
    assert case["weight"] == [1.0] * valid + [0.0] * (case["capacity"] - valid)
    assert case["index"][valid:] == case["target"][valid:] == [0] * (case["capacity"] - valid)
    assert b["loss_index"].tolist() == case["index"] and b["loss_weight"].tolist() == case["weight"]


@pytest.mark.parametrize("case", VECTORS["windows"], ids=[c["name"] for c in VECTORS["windows"]])
def test_window_case(case):
    mbs = case["micro_batches"]
    names = list(case["expected"])
    acc = WindowGradients({n: torch.zeros(len(case["expected"][n])) for n in names})
    for mb in mbs:
        assert mb["n_valid"] == int((np.array(mb["labels"]) != -100).sum())
        acc.add(0, {n: torch.tensor(g, dtype=torch.float32) for n, g in mb["grads"].items()}, mb["n_valid"])
    got = acc.mean(0)
    for n in names:  # bit for bit: the Kotlin side is held to the same file
        assert got[n].tolist() == case["expected"][n], n
    total = sum(mb["n_valid"] for mb in mbs)
    for n in names:
        exp = np.array(case["expected"][n], dtype=np.float64)
        if total == 0:
            assert not exp.any()
            continue
        token = sum(mb["n_valid"] * np.array(mb["grads"][n], dtype=np.float64) for mb in mbs) / total
        np.testing.assert_allclose(exp, token, rtol=1e-5, atol=1e-6)
        counts = {mb["n_valid"] for mb in mbs}
        if len(counts) > 1:  # the old rule (mean of micro-batch means) gives another gradient here
            old = sum(np.array(mb["grads"][n], dtype=np.float64) for mb in mbs) / len(mbs)
            assert np.abs(old - token).max() > 0.05 * np.abs(token).max()


def test_the_vectors_cover_the_rules():
    names = {c["name"] for c in VECTORS["windows"]}
    assert {"one_and_seven", "padding_micro_batch_adds_nothing", "no_valid_position_steps_on_zero"} <= names
    assert [m["n_valid"] for m in next(c for c in VECTORS["windows"] if c["name"] == "one_and_seven")["micro_batches"]] == [1, 7]
    assert sum("error" in c for c in VECTORS["readout"]) >= 2

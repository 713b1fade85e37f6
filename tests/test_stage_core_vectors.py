"""tests/vectors/stage_core/stage_core.json on the Python stage core (zl_mobile/stage_core.py): what a
TELEMETRY record sends (present: unmade readings absent, non-finite ones named in `nonfinite`), the
window record's figures (StageCore's own, from real micro-batches and a real AdamW step and commit),
and how config.inject_failure entries are read and fire (Faults). The Kotlin core runs the same
file (StageCoreVectorsTest.kt), so a Kotlin phone and a Python one report and fail alike."""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from zl_mobile.checkpoint import CheckpointStore
from zl_mobile.stage_core import AppFailure, Faults, StageCore, present

VECTORS = json.loads((Path(__file__).parent / "vectors" / "stage_core" / "stage_core.json").read_text())
LOSSES = ("loss", "task_loss", "consis_loss")


def _num(x):
    """The vectors' stand-ins for the numbers JSON cannot hold."""
    return {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}.get(x, x) if isinstance(x, str) else x


def _record(d: dict) -> dict:
    return {k: _num(v) for k, v in d.items()}


@pytest.mark.parametrize("case", VECTORS["present"], ids=[c["name"] for c in VECTORS["present"]])
def test_present(case):
    assert present(_record(case["record"])) == case["sent"]


@pytest.mark.parametrize("case", VECTORS["window_records"], ids=[c["name"] for c in VECTORS["window_records"]])
def test_window_record(case, tmp_path):
    init = tmp_path / "lora_init.safetensors"
    save_file({"a": torch.tensor([0.5, -0.25])}, str(init))
    core = StageCore(SimpleNamespace(lora_names=["a"]), init, CheckpointStore(tmp_path / "ck"), stage=case["stage"],
                     window_size=len(case["micro_batches"]), lr=0.0 if case["forward_only"] else 1e-2, weight_decay=0.0,
                     schedule=case["schedule"])
    assert core.forward_only == case["forward_only"]
    w = case["window"]
    for mb in case["micro_batches"]:
        now = time.time()
        t = {"phase1_start": now - mb["phase1_s"], "phase1_end": now}
        if "phase2_s" in mb:  # phase 2's end is the core's own clock: its time is kept within a few ms
            t["phase2_start"] = time.time() - mb["phase2_s"]
        losses = {k: _num(mb[k]) for k in LOSSES if mb.get(k) is not None}
        grads = None if case["forward_only"] else {"a": torch.tensor([0.125, 0.25])}
        core.add(w, grads, torch.ones(3), t, losses)
    _, rec = core.end_window(w)
    rec.pop("_rss_peak")  # the transport's: it folds it into rss_peak_bytes
    sent = present(rec)
    for k, want in case["record"].items():
        assert k in sent, (k, sent)
        if k == "phase2_s":
            assert sent[k] == pytest.approx(want, abs=0.05), (k, sent)
        else:
            assert sent[k] == want, (k, sent)
    assert not set(case["absent"]) & set(sent), sent


@pytest.mark.parametrize("case", VECTORS["fault_specs"], ids=[c["name"] for c in VECTORS["fault_specs"]])
def test_fault_spec(case):
    (spec,) = Faults([case["spec"]], marker=lambda point, w: Path("/nonexistent")).specs
    assert dataclasses.asdict(spec) == case["parsed"]


@pytest.mark.parametrize("case", VECTORS["fault_firing"], ids=[c["name"] for c in VECTORS["fault_firing"]])
def test_fault_firing(case, tmp_path, caplog):
    def marker(point: str, w: int) -> Path:  # as zl_mobile.Stage names it
        return tmp_path / f"failure-injected-{case['run_id']}-{case['stage']}-{w}-{point}"

    def start() -> Faults:
        return Faults(case["specs"], marker=marker, stage=case["stage"])

    faults = start()
    caplog.set_level(logging.WARNING, logger="zl_mobile.stage")
    for i, step in enumerate(case["steps"]):
        where = f"{case['name']}, step {i} {step}"
        if step.get("restart"):
            faults = start()
        elif "fail" in step:
            caplog.clear()
            fired = None
            try:
                faults.fail(step["fail"], step["window"])
            except AppFailure as e:
                fired = e.detect
            assert fired == step["fires"], where
            assert [r.getMessage() for r in caplog.records] == ([step["log"]] if "log" in step else []), where
        elif "slow" in step:
            assert faults.slow_seconds(step["slow"]) == step["seconds"], where
        elif "stall" in step:
            assert faults.stall_seconds(step["stall"]) == step["seconds"], where
        else:
            pytest.fail(f"unknown step in {where}")

"""Forward-only stages (`zl-host run --lr 0,0,X`, issue 49): a stage whose LR is 0 runs phase 1
only, still forwarding its hidden states; its LoRA stays the export's init (zl_mobile/stage_core.py)."""
from __future__ import annotations

import argparse

import numpy as np
import pytest
from safetensors.numpy import load_file

from host.run.settings import PlanError, RunSettings
from tests.conftest import run_pipeline, small_micro_batches

W, WINDOWS = 2, 3


def test_lr_zero_is_forward_only_in_the_settings():
    from host.cli.option_types import lrs

    assert lrs("0,0,3e-3") == [0.0, 0.0, 3e-3]
    with pytest.raises(argparse.ArgumentTypeError, match="forward-only"):
        lrs("0,0,0")  # nothing would train
    assert RunSettings(lr=[0.0, 0.0, 3e-3]).forward_only_stages(3) == [0, 1]
    with pytest.raises(PlanError, match="forward-only"):  # BP needs every stage's backward
        RunSettings(lr=[0.0, 0.0, 3e-3], schedule="1f1b").checked_per_stage(3)


def test_three_phones_with_lr_0_0_x_train_the_last_stage_only(small_export, tmp_path):
    from host.run.report import write_report

    out, manifest = small_export[0], small_export[1]
    settings = RunSettings(windows=WINDOWS, window_size=W, lr=[0.0, 0.0, 2e-2], inflight_depth=4)
    result, records = run_pipeline(out, tmp_path, settings, small_micro_batches(out, n_examples=4))
    assert not result["errors"]
    for k, chunk in enumerate(manifest["chunks"]):
        init = load_file(str(out / chunk["lora_init"]))
        same = [np.array_equal(result["lora"][n], v) for n, v in init.items()]
        assert all(same) if k < 2 else not any(same), k  # stages 0 and 1 bit for bit the init; 2 trained
    win = [r for r in records if r["type"] == "TELEMETRY" and r.get("kind") == "window"]
    assert sorted((r["stage"], r["window"]) for r in win) == [(k, w) for k in range(3) for w in range(WINDOWS)]
    for r in win:  # phase 2 ran on stage 2 only: the early stages do less per window
        assert r["micro_batches"] == W
        assert r["phase2_calls"] == (0 if r["stage"] < 2 else W), r
        assert r.get("forward_only", False) == (r["stage"] < 2)
        assert ("loss" in r) == (r["stage"] == 2)
    # the early stages still forwarded every micro-batch's hidden state
    assert {r["micro_batch"] for r in records if r["type"] == "TELEMETRY" and r.get("kind") == "micro_batch"
            and r["stage"] == 2} == set(range(WINDOWS * W))
    report = write_report(tmp_path / "run", {}).read_text()
    assert "forward-only stages (LR 0: phase 1 only, their LoRA left at the init): 0, 1" in report

"""One home for each setting: `zl-host run`'s options are made from RunConfig's fields, whose
training defaults are RunSettings'; the coordinator's STAGE_ASSIGN carries every key, so the
device defaults (tests/vectors/stage_assign/stage_assign_defaults.json) decide nothing in a run."""
from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import pytest

from host.cli.zl_host import build_parser
from host.run.config import RunConfig
from host.run.coordinator import Coordinator, DeviceHandle
from host.run.settings import RunSettings

DEFAULTS = json.loads((Path(__file__).parent / "vectors" / "stage_assign" / "stage_assign_defaults.json").read_text())


def test_every_run_config_field_is_an_option_with_its_default():
    """`zl-host run` with no options is RunConfig() (a field the parser lacked would be missed)."""
    a = build_parser().parse_args(["run"])
    assert {f.name for f in fields(RunConfig)} <= set(vars(a))
    assert RunConfig.from_args(a) == RunConfig()


def test_the_command_lines_defaults_are_the_coordinators():
    """The settings a plain `zl-host run` trains with are RunSettings' own defaults (the windows
    are --steps when neither --epochs nor --micro-batches is given)."""
    assert RunConfig().settings(train_micro_batches=1000) == RunSettings(inject_failure=[])


def test_finetune_and_run_share_their_training_options():
    p = build_parser()
    run = vars(p.parse_args(["run"]))
    fine = vars(p.parse_args(["finetune", "--model", "tiny", "--data", "d.jsonl"]))
    for key in ("steps", "epochs", "window", "lr", "held_out", "alpha", "devices", "out"):
        assert fine[key] == run[key], key
    for cmd in (["run"], ["finetune", "--model", "tiny", "--data", "d.jsonl"]):  # the same value parser
        with pytest.raises(SystemExit):
            p.parse_args([*cmd, "--lr", "0,0"])  # every stage forward-only


def test_the_devices_defaults_are_the_hosts():
    """Where a device default and a host default name the same setting they agree (the stage's LR
    default was 1e-3 where the host's is 2e-3)."""
    s, d = RunSettings(), DEFAULTS["defaults"]
    assert (d["window_size"], d["inflight_depth"], d["schedule"]) == (s.window_size, s.inflight_depth, s.schedule)
    assert (d["config.lr"], d["config.weight_decay"], d["config.alpha"]) == (s.lr, s.weight_decay, s.alpha)
    assert d["config.busy_ms"] == int(s.compute_timeout * 1000)


class _Client:
    address = "127.0.0.1"

    def __init__(self):
        self.sent = []

    def assign(self, meta):
        self.sent.append(meta)
        return {"data_port": 47000, "committed_window": -1}


def _assignments(export_dir: Path, tmp_path: Path, settings: RunSettings) -> list[dict]:
    n = len(json.loads((export_dir / "manifest.json").read_text())["chunks"])
    devices = [DeviceHandle(f"p{k}", f"127.0.0.1:{47100 + k}", "0" * 64, memory_bytes=1 << 30) for k in range(n)]
    coord = Coordinator(export_dir, devices, [], settings, tmp_path, keep_order=True)
    try:
        for st in coord.stages:
            st.client, st.data_port = _Client(), 47000
        for st in reversed(coord.stages):
            coord._assign(st)
        return [st.client.sent[-1] for st in coord.stages]
    finally:
        coord.metrics.close()


def _has(meta: dict, key: str) -> bool:
    head, _, tail = key.partition(".")
    return tail in meta.get(head, {}) if tail else head in meta


def test_stage_assign_sends_every_key_a_device_could_default(small_export, tmp_path):
    """Every key of stage_assign_defaults.json is in each STAGE_ASSIGN (but the last stage's
    downstream_token); keep_checkpoints, each device's own, only when the run needs more."""
    sent = _assignments(small_export[0], tmp_path / "a", RunSettings(windows=2, window_size=2))
    for k, meta in enumerate(sent):
        missing = [key for key in DEFAULTS["defaults"] if not _has(meta, key)
                   and not (key == "downstream_token" and k == len(sent) - 1)]
        assert not missing, f"stage {k}'s STAGE_ASSIGN leaves out {missing}: the device's default would decide them"
        assert not any(_has(meta, key) for key in DEFAULTS["device_own"])
        assert meta["config"]["lr"] == RunSettings.lr and meta["config"]["inject_failure"] == []
    sent = _assignments(small_export[0], tmp_path / "b", RunSettings(windows=2, window_size=2, keep_checkpoints=5))
    assert all(meta["config"]["keep_checkpoints"] == 5 for meta in sent)

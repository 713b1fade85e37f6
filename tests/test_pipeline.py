"""Three emulated phones (real processes, real TCP on loopback) run the exported chunks."""
import numpy as np
import pytest
from safetensors.numpy import load_file

from host.run.settings import RunSettings
from tests.conftest import run_pipeline, small_micro_batches


@pytest.fixture(scope="module")
def trained(small_export, tmp_path_factory):
    out, manifest, artifacts, cfg = small_export
    mbs = small_micro_batches(out, n_examples=4)  # two micro-batches, seen once per window
    settings = RunSettings(windows=4, window_size=2, lr=2e-2, inflight_depth=4)
    result, records = run_pipeline(out, tmp_path_factory.mktemp("pipe"), settings, mbs)
    return out, manifest, result, records


def test_every_stage_local_loss_goes_down(trained):
    out, manifest, result, records = trained
    tel = [r for r in records if r["type"] == "TELEMETRY" and r.get("kind") == "micro_batch"]
    for k in range(3):
        by_window = {}
        for r in tel:
            if r["stage"] == k:
                by_window.setdefault(r["window"], []).append(r["loss"])
        assert sorted(by_window) == [0, 1, 2, 3]
        assert np.mean(by_window[3]) < np.mean(by_window[0]) - 1e-3, (k, by_window)


def test_hidden_state_arrives_before_the_senders_phase2_ends(trained):
    out, manifest, result, records = trained
    tel = {(r["stage"], r["micro_batch"]): r for r in records if r["type"] == "TELEMETRY" and r.get("kind") == "micro_batch"}
    checked, early = 0, {0: 0, 1: 0}
    for (k, mb), r in tel.items():
        if k + 1 < 3:
            nxt = tel[(k + 1, mb)]
            # early forwarding: h_k was on the wire (loopback: in the receiver's socket) before
            # the sender started phase 2; the receiver's own record comes after phase 1 ended.
            # No "forwarded": the receiver had granted no credit yet (a loaded machine), so the
            # link thread sent it after the record
            if "forwarded" in r:
                assert r["phase1_end"] <= r["forwarded"] <= r["published"] < r["phase2_end"], (k, mb)
                early[k] += 1
            assert r["phase1_end"] <= nxt["received"]
            checked += 1
    assert checked == 2 * 8
    assert all(early.values()), early  # each sender forwarded some h_k before its phase 2


def test_each_window_committed_once_and_lora_gathered(trained):
    out, manifest, result, records = trained
    commits = [(r["stage"], r["window"]) for r in records if r["type"] == "CHECKPOINT_COMMITTED"]
    assert sorted(commits) == [(k, w) for k in range(3) for w in range(4)]
    names = {t["name"] for c in manifest["chunks"] for t in c["lora"]}
    assert set(result["lora"]) == names
    init = {}
    for c in manifest["chunks"]:
        init.update(load_file(str(out / c["lora_init"])))
    moved = [n for n in names if "lora_B" in n and np.abs(result["lora"][n]).max() > 0]
    assert moved, "training did not change lora_B"


def test_telemetry_reports_memory_and_time(trained):
    out, manifest, result, records = trained
    tel = [r for r in records if r["type"] == "TELEMETRY" and r["kind"] == "micro_batch"]
    assert all(r["pss_bytes"] > 10 << 20 for r in tel)
    assert all(r["rss_peak_bytes"] >= r["pss_bytes"] for r in tel)  # PSS <= RSS <= the peak RSS
    assert all(isinstance(r.get("temperature_c", 0.0), float) for r in tel)  # absent when unavailable
    assert all(r["phase2_end"] >= r["phase2_start"] >= r["phase1_end"] >= r["phase1_start"] for r in tel)
    assert tel[-1]["active_s"] > 0


def test_window_telemetry_breaks_memory_down(trained):
    """Each stage reports what its runtime costs before any program is loaded and what its mapped
    weights file holds: the parts of the memory breakdown the pipeline bench draws."""
    out, manifest, result, records = trained
    mbs = [r for r in records if r["type"] == "TELEMETRY" and r["kind"] == "micro_batch"]
    windows = [r for r in records if r["type"] == "TELEMETRY" and r["kind"] == "window"]
    for k, chunk in enumerate(manifest["chunks"]):
        mine = [r for r in windows if r["stage"] == k]
        runtime = {r["pss_runtime_bytes"] for r in mine}
        assert len(runtime) == 1, "read once, before the program was loaded"
        peak = max(r["pss_bytes"] for r in mbs if r["stage"] == k)
        assert 10 << 20 < runtime.pop() < peak
        weights = {r["pss_weights_bytes"] for r in mine}
        ptd = (out / chunk["weights"]).stat().st_size
        assert len(weights) == 1 and 0 < weights.pop() <= ptd + 4096, (weights, ptd)


def test_window_telemetry_sums_up_its_micro_batches(trained):
    out, manifest, result, records = trained
    mbs = [r for r in records if r["type"] == "TELEMETRY" and r["kind"] == "micro_batch"]
    windows = [r for r in records if r["type"] == "TELEMETRY" and r["kind"] == "window"]
    assert sorted((r["stage"], r["window"]) for r in windows) == [(k, w) for k in range(3) for w in range(4)]
    for wr in windows:
        mine = [r for r in mbs if (r["stage"], r["window"]) == (wr["stage"], wr["window"])]
        assert wr["micro_batches"] == len(mine) == 2
        for key in ("task_loss", "consis_loss", "loss"):
            assert wr[key] == pytest.approx(np.mean([r[key] for r in mine]), rel=1e-6)
        assert wr["phase1_s"] == pytest.approx(sum(r["phase1_end"] - r["phase1_start"] for r in mine), abs=1e-6)
        assert wr["phase2_s"] == pytest.approx(sum(r["phase2_end"] - r["phase2_start"] for r in mine), abs=1e-3)
        assert wr["rss_peak_bytes"] >= max(r["rss_peak_bytes"] for r in mine) >= max(r["pss_bytes"] for r in mine)
        assert 0 < wr["active_s"] <= wr["seconds"] + 1e-3 and wr["step_s"] > 0
    for k in range(2):  # per-window traffic adds up to the running total the micro-batch records carry
        sent = sum(r["bytes_out"] for r in windows if r["stage"] == k)
        assert sent == max(r["bytes_out"] for r in mbs if r["stage"] == k) > 0

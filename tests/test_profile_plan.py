"""zl-host profile on emulated phones end to end (their own runtime, their --mem-limit as budget),
zl-host plan from those profiles (a plan, a refused set), zl-host run --plan (the plan's phones in
its order, drift reported), the phone's memory limit enforced, and the drift watch."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from host.cli.zl_host import main
from host.run.drift import DriftWatch, describe
from zl_common.data import synthetic_examples

MiB = 2**20
EXPORT = ["--seq-len", "16", "--micro-batch", "2", "--loss-positions", "8", "--backend", "portable"]
# one layer of the small model (hidden 64, intermediate 128, 2 of 4 heads for k/v), fp32
LAYER_BYTES = 4 * (64 * 64 + 64 * 32 + 64 * 32 + 64 * 64 + 3 * 64 * 128 + 2 * 64)


from .conftest import cli_error_line as _error_line  # noqa: E402


@pytest.fixture(scope="module")
def profiled(small_model_dir, tmp_path_factory):
    """Two emulated phones (limits 700 and 900 MiB) profiled with the small model."""
    out = tmp_path_factory.mktemp("profiles")
    rc = main(["profile", "--devices", "emulated:2", "--model", str(small_model_dir), *EXPORT, "--out", str(out),
               "--reps", "2", "--mem-limit", "700M,900M"])
    return rc, out


def test_profile_two_emulated_phones(profiled, capsys):
    rc, out = profiled
    assert rc == 0
    profiles = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
    assert set(profiles) == {"emu0", "emu1"}
    assert profiles["emu0"]["budget_bytes"] == 700 * MiB  # from HELLO memory_budget_bytes = --mem-limit
    assert profiles["emu1"]["budget_bytes"] == 900 * MiB
    for p in profiles.values():
        f = p["fit"]
        assert f["phase1_layer_s"] + f["phase2_layer_s"] > 0 and f["phase2_fixed_s"] >= 0
        assert f["layer_bytes"] == LAYER_BYTES            # from the programs' weight files
        assert f["embed_bytes"] == 512 * 64 * 4
        assert 50 * MiB < f["runtime_bytes"] < f["peak_1_layer_bytes"] < 700 * MiB
        for n in ("1", "3"):  # both calibration stages ran their micro-batches on the phone
            assert p["runs"][n]["phase1_s"] > 0 and p["runs"][n]["phase2_s"] > 0
            assert 0 < p["runs"][n]["cpu_s"] < 10 * p["runs"][n]["busy_s"]  # the phone's CPU time per micro-batch
        assert p["export"]["seq_len"] == 16 and p["export"]["backend"] == "portable"
        assert p["fit"]["calibration_layers"] == [1, 3]
    # both phones were profiled at once (a run keeps them all busy): their calibration stages overlap
    spans = {}
    for d in (out / "runs").iterdir():
        mbs = [r for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines()) if "phase2_end" in r]
        ends = [r["phase2_end"] for r in mbs]
        # each calibration stage sent its hidden states downstream (to the host's sink), as a stage
        # with a next one does in a run: counted where they arrive (the stage's bytes_out is read
        # before its link thread sends, so under load even the last record may read 0)
        sink = json.loads((d / "sink.json").read_text())
        assert 0 < sink["received"] <= sink["micro_batches"], (d, sink)
        assert sorted(r["bytes_out"] for r in mbs) == [r["bytes_out"] for r in mbs], d
        name = d.name.split("-")[0]
        lo, hi = spans.get(name, (min(ends), max(ends)))
        spans[name] = (min(lo, *ends), max(hi, *ends))
    (a0, a1), (b0, b1) = spans["emu0"], spans["emu1"]
    assert a0 < b1 and b0 < a1, spans
    # a pace pass of the 1-layer program, then both programs timed: three stage runs per phone, each
    # its own run (a phone keeps its running stage for a second STAGE_ASSIGN of the same run id)
    for name in ("emu0", "emu1"):
        runs = sorted(d.name.split("-")[1:3] for d in (out / "runs").iterdir() if d.name.startswith(name + "-"))
        assert runs == [["layers_1", "pace"], ["layers_1", "timed"], ["layers_3", "timed"]], runs


def test_calibration_layers_are_far_apart_within_the_model():
    from host.planning.profile import calibration_layers

    assert [calibration_layers(n) for n in (2, 3, 12, 22, 30, 80)] == [(1, 2), (1, 3), (1, 3), (1, 5), (1, 7), (1, 8)]


def test_plan_from_profiles_and_refused_set(profiled, small_model_dir, tmp_path, capsys):
    _, out = profiled
    plan_file = tmp_path / "plan.json"
    capsys.readouterr()
    assert main(["plan", "--devices", "emu0,emu1", "--profiles", str(out), "--model", str(small_model_dir), *EXPORT,
                 "--out", str(plan_file)]) == 0
    printed = capsys.readouterr().out
    assert "bottleneck" in printed and "emu0" in printed and "emu1" in printed
    plan = json.loads(plan_file.read_text())
    assert sorted(plan["devices"]) == ["emu0", "emu1"]
    ranges = [tuple(map(int, r.split("-"))) for r in plan["chunks"].split(",")]
    assert ranges[0][0] == 0 and ranges[-1][1] == 2 and len(ranges) == 2
    for s in plan["stages"]:
        assert s["memory_bytes"] <= s["budget_bytes"]
    assert plan["bottleneck_s"] == max(s["time_s"] for s in plan["stages"])
    # zl-export --chunks reads the plan file
    from exporter.chunk_spec import chunks_from_arg
    assert chunks_from_arg(str(plan_file)) == plan["chunks"]

    # the same phones with budgets below what the runtime alone takes: refused, saying what is missing
    low = tmp_path / "low"
    low.mkdir()
    for p in out.glob("*.json"):
        d = json.loads(p.read_text())
        d["budget_bytes"] = 100 * MiB
        (low / p.name).write_text(json.dumps(d))
    assert main(["plan", "--devices", "emu0,emu1", "--profiles", str(low), "--model", str(small_model_dir), *EXPORT,
                 "--out", str(tmp_path / "never.json")]) == 2
    line = _error_line(capsys)
    assert "cannot hold the 3-layer model" in line and "lacks" in line and "200.0 MiB in all" in line
    assert not (tmp_path / "never.json").exists()

    # profiles measured at another sequence length do not plan this run
    assert main(["plan", "--devices", "emu0,emu1", "--profiles", str(out), "--model", str(small_model_dir),
                 "--seq-len", "32", "--micro-batch", "2", "--backend", "portable"]) == 2
    assert "measured at seq_len 16" in _error_line(capsys)


def _saved_28_layer_profiles(folder, layer_s: dict, budget: int) -> None:
    """Profiles of phones measured on a 28-layer model (calibration 1 and 7 layers) at zl-host plan's
    default settings, fitted and saved as zl-host profile does: 60 MiB runtime, 211 MiB readout and
    embedding, 57 MiB of weights + 3 MiB of activations a layer, 20 MiB fixed; `layer_s` per phone."""
    from host.planning.profile import build_profile, save_profile

    manifest = folder / "calibration"
    manifest.mkdir(parents=True)
    (manifest / "manifest.json").write_text(json.dumps({
        "export": {"seq_len": 128, "micro_batch": 1, "loss_positions": None, "backend": "xnnpack",
                   "base_weights": "fp32"},
        "model": {"config": {"hidden_size": 64, "vocab_size": 512}}}))

    def run(n, per):
        return {"layers": n, "phase1_s": 0.03 + n * per / 3, "phase2_s": 0.07 + n * per * 2 / 3, "step_s": 0.0,
                "busy_s": 0.1 + n * per, "pss_runtime_bytes": 60 * MiB,
                "rss_peak_bytes": (60 + 211 + 211 + 20 + n * 60) * MiB,
                "weights": {"embed": 211 * MiB, "readout": 211 * MiB, "layers": n * 57 * MiB},
                "saved_activation_bytes": n * MiB, "link_mbit": None}

    for name, per in layer_s.items():
        save_profile(build_profile(name, {"memory_budget_bytes": budget}, {1: run(1, per), 7: run(7, per)}, manifest),
                     folder)


def test_plan_with_mem_limits_overrides_the_profiled_budgets(tmp_path, capsys):
    """zl-host plan --mem-limits: the phones' budgets for this plan (the profiles say 8 GiB); the split
    keeps every stage within them, a set too small is refused in one line saying what is missing."""
    from .conftest import write_small_model_dir

    model = str(write_small_model_dir(tmp_path / "model", layers=28))
    profiles = tmp_path / "profiles"
    speeds = {"a": 0.01, "b": 0.06, "c": 0.06, "d": 0.06, "e": 0.06, "f": 0.06}  # a is 6x faster
    _saved_28_layer_profiles(profiles, speeds, 8 << 30)

    def plan(devices, *extra):
        capsys.readouterr()
        out = tmp_path / f"plan-{len(extra)}-{devices}.json"
        rc = main(["plan", "--devices", devices, "--profiles", str(profiles), "--model", model, "--out", str(out),
                   *extra])
        return rc, (json.loads(out.read_text()) if rc == 0 else None)

    rc, free = plan("a,b,c,d")
    assert rc == 0 and "mem_limits" not in free
    layers = {s["phone"]: s["last"] - s["first"] + 1 for s in free["stages"]}
    assert max(s["memory_bytes"] for s in free["stages"]) > 1280 * MiB  # the fast phone's share would not fit
    for devices, limits, budget in (("a,b,c,d", "1.25GiB", 1280 * MiB), ("a,b,c,d,e,f", "1.0GiB", 1024 * MiB)):
        rc, p = plan(devices, "--mem-limits", limits)
        assert rc == 0
        assert "budgets from --mem-limits" in capsys.readouterr().out
        assert p["mem_limits"] == {d: budget for d in devices.split(",")}
        assert p["devices"] and sorted(p["devices"]) == devices.split(",")
        assert p["stages"][0]["first"] == 0 and p["stages"][-1]["last"] == 27
        assert all(x["last"] + 1 == y["first"] for x, y in zip(p["stages"], p["stages"][1:]))
        for s in p["stages"]:
            assert s["budget_bytes"] == budget and s["memory_bytes"] <= budget
    # one budget per phone, in --devices order: a lower one on the fast phone moves layers off it
    rc, p = plan("a,b,c,d", "--mem-limits", "700M,1.25GiB,1.25GiB,1.25GiB")
    assert rc == 0
    mine = next(s for s in p["stages"] if s["phone"] == "a")
    assert mine["budget_bytes"] == 700 * MiB and mine["memory_bytes"] <= 700 * MiB
    assert mine["last"] - mine["first"] + 1 < layers["a"]
    # zl-host run --plan's drift re-plan keeps the plan's budgets, not the profiles'
    from host.cli.plan import drift_watch
    replanned = drift_watch(p, 0.15, 4, tmp_path, print).replan({})
    assert replanned.chunks == p["chunks"] and replanned.stages[0].budget_bytes == p["stages"][0]["budget_bytes"]

    # too little for the model (4 x 291 + 211 + 28 x 60 = 3055 MiB): one line, how much is missing
    assert plan("a,b,c,d", "--mem-limits", "700M")[0] == 2
    line = _error_line(capsys)
    assert "cannot hold the 28-layer model" in line and "lacks 255.0 MiB" in line and "2800.0 MiB in all" in line
    assert "(budgets from --mem-limits 700M)" in line
    # bad values and a wrong count: one line naming the flag and the fix
    assert plan("a,b,c,d", "--mem-limits", "1G,2G")[0] == 2
    assert "give one memory budget for every one of the 4 phones" in _error_line(capsys)
    assert plan("a,b,c,d", "--mem-limits", "lots")[0] == 2
    line = _error_line(capsys)
    assert line.startswith("zl-host: error: --mem-limits: memory size 'lots'") and "e.g. 600M or 1.5G" in line


def test_run_with_plan_uses_its_order_and_reports_drift(profiled, small_export, small_model_dir, tmp_path, capsys):
    """A plan for three phones (the small export's 0-0,1-1,2-2) whose predictions are 20x too
    fast: the run puts stage k on the plan's k-th phone and reports the drift."""
    _, out = profiled
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    base = json.loads((out / "emu0.json").read_text())
    for name in ("emu0", "emu1", "emu2"):
        (profiles / f"{name}.json").write_text(json.dumps({**base, "device": name}))
    from host.cli.plan import make_plan
    plan, _, _ = make_plan(str(small_model_dir), base["export"], [json.loads((profiles / f"emu{i}.json").read_text())
                                                   for i in range(3)], 2)
    plan_json = plan.to_json()
    plan_json["chunks"] = "0-0,1-1,2-2"
    order = ["emu2", "emu0", "emu1"]
    for s, name in zip(plan_json["stages"], order):
        s["phone"], s["time_s"] = name, s["time_s"] / 20
    plan_json.update(devices=order, bottleneck_s=max(s["time_s"] for s in plan_json["stages"]),
                     format="zerolock-plan", model=str(small_model_dir), export=base["export"], schedule="zerolock",
                     profiles=str(profiles))
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(plan_json))
    run = tmp_path / "run"
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(e) + "\n" for e in synthetic_examples(16, seed=3)))
    assert main(["run", "--program", str(small_export[0]), "--data", str(data), "--devices", "emulated:3",
                 "--plan", str(plan_file), "--steps", "3", "--window", "2", "--out", str(run)]) == 0
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    on = {r["stage"]: r["device"] for r in recs if r["type"] == "TELEMETRY"}
    assert on == {0: "emu2", 1: "emu0", 2: "emu1"}
    drift = [json.loads(line) for line in (run / "drift.jsonl").read_text().splitlines()]
    assert drift and drift[0]["drift"] > 1.0  # measured far slower than the 20x too fast plan
    assert drift[0]["replan_gain"] > 0 and drift[0]["replan_chunks"].count(",") == 2
    assert "drift: window" in capsys.readouterr().err
    summary = json.loads((run / "summary.json").read_text())
    assert summary["plan"]["devices"] == order and summary["plan"]["drift_reports"]

    # an export that is not the plan's split is refused before any phone starts
    plan_file.write_text(json.dumps({**plan_json, "chunks": "0-1,2-2"}))
    assert main(["run", "--program", str(small_export[0]), "--data", str(data), "--devices", "emulated:3",
                 "--plan", str(plan_file), "--out", str(tmp_path / "r2")]) == 2
    assert "zl-export --chunks" in _error_line(capsys)


def test_phone_mem_limit_is_enforced_and_checked(tmp_path):
    cmd = [sys.executable, "-m", "zl_mobile.phone", "--name", "tight", "--workdir", str(tmp_path / "w"),
           "--mdns", "none"]
    r = subprocess.run([*cmd, "--mem-limit", "lots"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--mem-limit" in r.stderr and "600M" in r.stderr
    # 40 MiB is less than the runtime itself: the phone is ended as a low-memory killer would
    r = subprocess.run([*cmd, "--mem-limit", "40M"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 137
    assert "passed --mem-limit 40.0 MiB" in r.stderr


def _window(stage, w, seconds, n=2):
    return {"kind": "window", "stage": stage, "window": w, "micro_batches": n, "phase1_s": seconds * n / 2,
            "phase2_s": seconds * n / 2, "step_s": 0.0}


def test_drift_watch_reports_beyond_margin_only():
    plan = {"stages": [{"time_s": 0.10}, {"time_s": 0.09}], "devices": ["a", "b"], "bottleneck_stage": 0,
            "bottleneck_s": 0.10}
    seen = []

    class Replanned:
        chunks, devices, bottleneck_s = "0-9,10-21", ["b", "a"], 0.12

    scales_seen = []
    watch = DriftWatch(plan, lambda scales: scales_seen.append(scales) or Replanned, margin=0.15, report=seen.append)
    for k, s in enumerate((0.11, 0.095)):  # window 0: warm-up, never judged
        watch.on_event("telemetry", _window(k, 0, 5.0 if k else s))
    for k, s in enumerate((0.11, 0.095)):  # within 15%
        watch.on_event("telemetry", _window(k, 1, s))
    assert seen == []
    for k, s in enumerate((0.10, 0.20)):  # stage 1 throttled: twice the plan's bottleneck
        watch.on_event("telemetry", _window(k, 2, s))
    assert len(seen) == 1
    rec = seen[0]
    assert rec["measured_stage"] == 1 and rec["drift"] == pytest.approx(1.0)
    assert scales_seen[0]["b"] == pytest.approx(0.20 / 0.09) and scales_seen[0]["a"] == pytest.approx(1.0)
    assert rec["replan_gain"] == pytest.approx(0.20 / 0.12)
    assert "re-plan (0-9,10-21 on b,a)" in describe(rec)
    for k, s in enumerate((0.10, 0.205)):  # still drifted by about as much: not said again
        watch.on_event("telemetry", _window(k, 3, s))
    assert len(seen) == 1


def test_profile_fit_recovers_per_layer_and_fixed_costs(tmp_path):
    """build_profile on known calibration numbers: t(n) = fixed + n x per-layer, step shared out."""
    from host.planning.profile import build_profile, phone_model

    def run(n):
        return {"layers": n, "phase1_s": 0.002 + n * 0.001, "phase2_s": 0.010 + n * 0.003, "step_s": 0.020 + n * 0.004,
                "rss_peak_bytes": 300 * MiB + n * 2 * MiB, "pss_runtime_bytes": 200 * MiB,
                "weights": {"embed": 128 * 1024, "readout": 96 * 1024, "layers": n * 150_000},
                "saved_activation_bytes": 50_000 + n * 120_000, "link_mbit": 400.0}

    hello = {"memory_bytes": 8 << 30, "memory_budget_bytes": 700 * MiB}
    (tmp_path / "manifest.json").write_text(json.dumps({"export": {"seq_len": 16, "micro_batch": 2},
                                                        "model": {"config": {"hidden_size": 64, "vocab_size": 512}}}))
    prof = build_profile("p", hello, {1: run(1), 3: run(3)}, tmp_path)
    f = prof["fit"]
    assert f["phase1_layer_s"] == pytest.approx(0.001) and f["phase1_fixed_s"] == pytest.approx(0.002)
    assert f["phase2_layer_s"] == pytest.approx(0.003) and f["phase2_fixed_s"] == pytest.approx(0.010)
    assert f["layer_bytes"] == 150_000 and f["held_layer_bytes"] == 120_000
    assert f["act_layer_bytes"] == 2 * MiB - 150_000  # the measured slope beyond the weights
    assert prof["budget_bytes"] == 700 * MiB and prof["link_mbit"] == 400.0
    m = phone_model(prof, window_size=4)
    assert m.layer_s == pytest.approx(0.001 + 0.003 + 0.004 / 4)
    assert m.fixed_s == pytest.approx(0.002 + 0.010 + 0.020 / 4)
    # the 1-layer stage's measured peak is what the model says a 1-layer first stage holds
    assert m.memory_bytes(1, first=True) == 302 * MiB


def test_profile_fit_when_noise_hides_the_layer_cost_keeps_the_one_layer_time(tmp_path):
    """The 3-layer stage measured no slower than the 1-layer one (timer or quota noise): the fit
    falls back to sharing the 1-layer time between fixed and per-layer cost, and the model of a
    1-layer stage still takes what was measured (it once counted that time twice)."""
    from host.planning.profile import build_profile, phone_model

    def run(n, p1, p2):
        return {"layers": n, "phase1_s": p1, "phase2_s": p2, "step_s": 0.0, "rss_peak_bytes": 300 * MiB,
                "pss_runtime_bytes": 200 * MiB, "weights": {"embed": 1, "readout": 1, "layers": n * 1000},
                "saved_activation_bytes": 1000 * n, "link_mbit": None}

    (tmp_path / "manifest.json").write_text(json.dumps({"export": {"seq_len": 16, "micro_batch": 2},
                                                        "model": {"config": {"hidden_size": 64, "vocab_size": 512}}}))
    prof = build_profile("p", {"memory_bytes": 8 << 30}, {1: run(1, 0.006, 0.053), 3: run(3, 0.003, 0.046)}, tmp_path)
    m = phone_model(prof, window_size=4)
    assert m.fixed_s + m.layer_s == pytest.approx(0.006 + 0.053)
    # with the stages' busy time per micro-batch (as profile_devices measures it) the planner's
    # cost is fitted on that, whatever the phases' own slopes: here 1.8 ms a layer, 7 ms fixed
    runs = {1: {**run(1, 0.006, 0.053), "busy_s": 0.0088}, 3: {**run(3, 0.003, 0.046), "busy_s": 0.0124}}
    m = phone_model(build_profile("p", {"memory_bytes": 8 << 30}, runs, tmp_path), window_size=4)
    assert (m.layer_s, m.fixed_s) == (pytest.approx(0.0018), pytest.approx(0.007))


def test_export_chunks_from_a_plan_file(tmp_path):
    from exporter.chunk_spec import chunks_from_arg
    from exporter.errors import ChunkSpecError

    assert chunks_from_arg("0-6,7-13,14-21") == "0-6,7-13,14-21"
    (tmp_path / "spec.txt").write_text("0-3,4-21\n")
    assert chunks_from_arg(str(tmp_path / "spec.txt")) == "0-3,4-21"
    (tmp_path / "bad.json").write_text('{"devices": ["a"]}')
    with pytest.raises(ChunkSpecError, match="no \"chunks\" spec"):
        chunks_from_arg(str(tmp_path / "bad.json"))


def test_a_budgeted_phone_is_paced_by_its_cpu_time():
    """On a CPU budget a stage's long-run time per micro-batch is its CPU time / share, whatever a
    short calibration's wall clock read; without a budget the wall time stands."""
    from host.planning.profile import paced_busy_s

    assert paced_busy_s(0.0143, 0.0300, 0.9) == pytest.approx(0.0300 / 0.9)
    assert paced_busy_s(0.0625, 0.0150, 0.3) == pytest.approx(0.0500)
    assert paced_busy_s(0.0143, 0.0300, None) == 0.0143
    assert paced_busy_s(0.0143, None, 0.9) == 0.0143  # a phone that does not report CPU time



def test_calibration_gives_faster_phones_more_micro_batches():
    """Every phone computes about as long as the slowest: 3x as fast, 3x the micro-batches (plus the
    warm-up one), never fewer than reps, never more than 8 x reps."""
    from host.planning.profile import calibration_counts

    assert calibration_counts([0.060, 0.020, 0.030], reps=24) == [25, 73, 49]
    assert calibration_counts([1.0, 0.01], reps=4) == [5, 33]          # capped at 8 x reps
    assert calibration_counts([0.05, 0.0], reps=4) == [5, 5]           # no pace measured: reps


def _calibration_telemetry(period_s, count, window, step_s, start=100.0, wait_every=0.0):
    """Micro-batch and window telemetry of a calibration stage that finishes a micro-batch every
    period_s and steps after every `window` of them (step_s each)."""
    mbs, wins, t, wait = [], [], start, 0.0
    for i in range(count):
        t += period_s
        wait += wait_every
        t += wait_every
        mbs.append({"micro_batch": i, "window": i // window, "phase1_start": t - period_s, "phase1_end": t - period_s / 2,
                    "phase2_start": t - period_s / 2, "phase2_end": t, "wait_s": wait, "cpu_s": i * period_s})
        if (i + 1) % window == 0:
            wins.append({"window": i // window, "step_s": step_s, "step_cpu_s": step_s, "seconds": 1.0})
            t += step_s
    return mbs, wins


def test_busy_time_leaves_out_waits_and_the_windows_steps():
    from host.planning.profile import _busy_per_micro_batch

    mbs, wins = _calibration_telemetry(0.010, 17, window=4, step_s=0.050, wait_every=0.003)
    assert _busy_per_micro_batch(mbs, wins) == pytest.approx(0.010)
    # without the window records the steps count as micro-batch time: what the fix is for
    assert _busy_per_micro_batch(mbs) == pytest.approx(0.010 + 4 * 0.050 / 16)


def test_phones_are_timed_only_while_all_of_them_compute(tmp_path, monkeypatch):
    """Two phones' calibration stages: the slow one runs on alone after the fast one is done (and
    faster then: 20 ms instead of 30). Only the span both ran in times it."""
    from host.planning.profile import _common_window, _stage_figures

    fast_mbs, fast_win = _calibration_telemetry(0.010, 21, window=4, step_s=0.0)
    slow_mbs, slow_win = _calibration_telemetry(0.030, 9, window=4, step_s=0.0)
    alone, _ = _calibration_telemetry(0.020, 8, window=4, step_s=0.0, start=slow_mbs[-1]["phase2_end"])
    slow_mbs += [{**r, "micro_batch": r["micro_batch"] + 9, "window": r["window"] + 3,
                  "wait_s": slow_mbs[-1]["wait_s"]} for r in alone]
    manifest = {"chunks": [{"saved_activation_bytes": 1000, "weights": "w.ptd"}], "files": []}

    def stage(mbs, win):
        return {"hello": {}, "mbs": mbs, "windows": win, "pushes": [], "manifest": manifest,
                "export_dir": tmp_path, "layers": 1}

    stages = [stage(fast_mbs, fast_win), stage(slow_mbs, slow_win)]
    window = _common_window(stages)
    assert window == (pytest.approx(100.060), pytest.approx(100.210))
    monkeypatch.setattr("host.planning.profile._weight_bytes", lambda *a: {"embed": 0, "readout": 0, "layers": 0})
    slow, fast = _stage_figures(stages[1], window), _stage_figures(stages[0], window)
    assert slow["busy_s"] == pytest.approx(0.030) and slow["timed_micro_batches"] == 6
    assert fast["busy_s"] == pytest.approx(0.010)

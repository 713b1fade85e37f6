"""TensorBoard: a real `zl-host run` (three emulated phones, the small export) leaves event files in
its run directory that TensorBoard's own reader (EventAccumulator) reads back: per stage task and
consistency loss per micro-batch, PSS, samples/s and active/wait per window, link bytes; and
`zl-host eval` on the run's adapter adds the held-out metrics there and shows its progress."""
from __future__ import annotations

import json

import pytest

from host.cli.zl_host import main

STEPS, WINDOW = 2, 2


@pytest.fixture(scope="module")
def tb_run(small_export, tmp_path_factory):
    from zl_common.data import synthetic_examples

    root = tmp_path_factory.mktemp("tb")
    data = root / "train.jsonl"
    data.write_text("".join(json.dumps(e) + "\n" for e in synthetic_examples(40, seed=3)))
    run = root / "run"
    assert main(["run", "--program", str(small_export[0]), "--data", str(data), "--devices", "emulated:3",
                 "--steps", str(STEPS), "--window", str(WINDOW), "--out", str(run)]) == 0
    return run, data


def _scalars(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: acc.Scalars(tag) for tag in acc.Tags()["scalars"]}


def test_run_writes_tensorboard_events_per_stage(tb_run):
    run, _ = tb_run
    assert list(run.glob("events.out.tfevents.*"))
    sc = _scalars(run)
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    tel = [r for r in recs if r["type"] == "TELEMETRY" and r.get("kind") == "micro_batch"]
    for k in range(3):
        # one point per micro-batch, the values metrics.jsonl holds
        task = {e.step: e.value for e in sc[f"task_loss/stage{k}"]}
        want = {r["micro_batch"]: r["task_loss"] for r in tel if r["stage"] == k}
        assert set(task) == set(range(STEPS * WINDOW)) == set(want)
        assert all(task[s] == pytest.approx(want[s], rel=1e-6) for s in want)
        assert len(sc[f"consistency_loss/stage{k}"]) == STEPS * WINDOW
        assert all(e.value > 10 for e in sc[f"pss_mib/stage{k}"])  # a real process's PSS, in MiB
        assert all(0 < e.value <= 1 for e in sc[f"active_fraction/stage{k}"])
        assert [e.step for e in sc[f"samples_per_s/stage{k}"]] == list(range(STEPS))
        assert all(e.value > 0 for e in sc[f"samples_per_s/stage{k}"])
        assert {e.step for e in sc[f"active_s/stage{k}"]} == {e.step for e in sc[f"wait_s/stage{k}"]} == {0, 1}
    # hidden states cross the links between stages: the first two stages send, bytes only grow
    out0 = [e.value for e in sc["link_mib_out/stage0"]]
    assert out0[-1] > 0 and out0 == sorted(out0)


def test_eval_adds_held_out_metrics_and_shows_progress(tb_run, small_export, capsys):
    run, data = tb_run
    capsys.readouterr()
    assert main(["eval", "--program", str(small_export[0]), "--adapter", str(run / "adapter"), "--data", str(data)]) == 0
    cap = capsys.readouterr()
    nll = float(cap.out.split("with adapter:  NLL ")[1].split()[0])
    # not a terminal: a line per pass at its start, per quarter and at the end
    for name in ("base model", "with adapter"):
        assert f"eval: {name}: loading the model" in cap.err
        assert f"eval: {name}: 0/" in cap.err
    sc = _scalars(run)
    step = json.loads((run / "summary.json").read_text())["micro_batches"]
    (e,) = sc["eval/nll_adapter"]
    assert e.step == step and e.value == pytest.approx(nll, abs=1e-4)
    assert {"eval/accuracy_adapter", "eval/nll_base", "eval/accuracy_base"} <= set(sc)


def test_zl_dist_ranks_write_events(small_export, tb_run, tmp_path):
    """zl-dist under real torchrun (Gloo, 3 ranks): each ZeroLock rank writes its stage's curves into
    the run dir as it goes; for torch's GPipe schedule rank 0 writes them from the gathered records."""
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    _, data = tb_run
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "dist"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--master-addr",
                        "127.0.0.1", "--master-port", str(port), "-m", "host.dist", "--program", str(small_export[0]),
                        "--data", str(data), "--steps", "1", "--window", "3", "--threads", "1",
                        "--schedule", "zerolock,gpipe", "--out", str(out)],
                       env={**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"},
                       capture_output=True, text=True, timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    zl = _scalars(out / "zerolock")
    for k in range(3):
        assert [e.step for e in zl[f"task_loss/stage{k}"]] == [0, 1, 2]
        assert [e.step for e in zl[f"samples_per_s/stage{k}"]] == [0]
    assert len(list((out / "zerolock").glob("events.out.tfevents.*"))) == 3  # one writer per rank
    gp = _scalars(out / "gpipe")
    assert {f"samples_per_s/stage{k}" for k in range(3)} <= set(gp)

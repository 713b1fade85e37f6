"""bench/quality_study.py's bookkeeping, without the model (beside the bench it tests: tests/ imports no
bench module): finished cells are reused, cells another live worker holds are left to it, a dead
worker's cell is taken over, and the report says whether the chosen LR is inside the sweep, at its
edge, or the sweep is not finished."""
from __future__ import annotations

import json
import subprocess
import sys

from bench import quality_study as QS


def study(tmp_path, *extra):
    args = ["run", "--cells", str(tmp_path), "--lrs", "1e-3,3e-3,1e-2", "--tasks", "wordnet", *extra]
    ns = parse(args)
    return QS.Study(ns)


def parse(argv):
    """main()'s parsing, without running: the namespace Study gets."""
    seen = {}

    class Stop(Exception):
        pass

    def fake_run(self):
        seen["a"] = self.a
        raise Stop

    real = QS.Study.run
    QS.Study.run = fake_run
    try:
        QS.main(argv)
    except Stop:
        pass
    finally:
        QS.Study.run = real
    return seen["a"]


def fake_cell(task, method, lr, split, nll, acc, budget=1024, seed=0):
    ev = {f"chunk_{k}": {"answer_nll": nll, "choice_accuracy": acc, "label_accuracy": acc, "delta_k": 0.0, "rows": 4}
          for k in range(3)}
    return {"task": task, "method": method, "lr": lr, "seed": seed, "split": split, "budget": budget, "epochs": 1,
            "targets": "qv", "eval": ev, "curve": [], "train_seconds": 1.0}


def write(tmp_path, r):
    name = QS.cell_name(r["task"], r["method"], r["lr"], r["seed"], r["budget"], 1, "qv", r["split"])
    f = tmp_path / name
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(json.dumps(r))
    return name


def test_finished_cells_are_reused_without_loading_the_model(tmp_path):
    s = study(tmp_path)
    r = fake_cell("wordnet", "bp", 3e-3, "validation", 0.5, 0.8)
    write(tmp_path, r)
    assert s.run_cell("wordnet", "bp", 3e-3, 0, 1024, "validation") == r
    assert s.base is None  # nothing was loaded: a rerun skips what is on disk


def test_a_live_workers_cell_is_left_to_it_and_a_dead_workers_taken_over(tmp_path):
    s = study(tmp_path)
    name = QS.cell_name("wordnet", "bp", 1e-2, 0, 1024, 1, "qv", "validation")
    lock = (tmp_path / name).with_suffix(".lock")
    lock.parent.mkdir(parents=True)
    lock.write_text(str(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"]).pid))
    assert s.claim(name) is False
    assert s.run_cell("wordnet", "bp", 1e-2, 0, 1024, "validation", wait=False) is None
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock.write_text(str(dead.pid))
    assert s.claim(name) is True and lock.read_text() == str(__import__("os").getpid())


def test_the_report_says_where_the_chosen_lr_lies(tmp_path):
    runs = [fake_cell("wordnet", "bp", lr, "validation", nll, 0.8) for lr, nll in ((1e-3, 0.6), (3e-3, 0.4), (1e-2, 0.5))]
    runs += [fake_cell("wordnet", "zl-last1-lens", lr, "validation", nll, 0.7) for lr, nll in ((1e-3, 0.6), (3e-3, 0.5))]
    runs += [fake_cell("wordnet", "bp", 3e-3, "test", 0.4, acc, seed=s) for s, acc in ((0, 0.8), (1, 0.9))]
    summary = QS.summarise(runs, [1e-3, 3e-3, 1e-2])
    md = QS.markdown(summary, None)
    bp = summary["wordnet"]["sweep"]["bp|qv|e1"]
    assert bp["chosen"] == 3e-3 and not bp["at_edge"] and "-> 0.003 (inside the sweep)" in md
    assert "-> 0.003 so far (partial sweep: 0.01 not run yet)" in md  # zl: two of three rates
    t = summary["wordnet"]["test"]["bp|qv|e1|n1024"]
    assert t["seeds"] == [0, 1] and abs(t["mean"] - 0.85) < 1e-9 and abs(t["std"] - 0.0707) < 1e-3
    runs[1]["eval"]["chunk_2"]["answer_nll"] = 0.9  # now 1e-2 wins: the top of the sweep
    assert "-> 0.01 (AT THE EDGE of the sweep)" in QS.markdown(QS.summarise(runs, [1e-3, 3e-3, 1e-2]), None)


def test_each_lora_parameter_belongs_to_the_chunk_of_its_layer():
    from bench import quality as Q

    name = "base_model.model.model.layers.{}.self_attn.q_proj.lora_A.default.weight"
    assert [Q.chunk_of(name.format(i)) for i in (0, 9, 10, 19, 20, 29)] == [0, 0, 1, 1, 2, 2]
    # every method with an LR per chunk names one for each chunk
    assert all(len(s) == len(Q.CHUNKS) for s in Q.LR_SCALES.values())


def test_a_quantized_base_trains_at_the_fp32_sweeps_rates_in_cells_of_its_own(tmp_path):
    s = study(tmp_path, "--base-weights", "int4", "--methods", "bp", "--budgets", "1024", "--seeds", "0,1")
    ran = []
    s.run_cell = lambda *args, **kw: ran.append(args)
    try:
        s.run()  # the fp32 sweep has not run: nothing to train at
        raise AssertionError("a quantized run started without the fp32 sweep's rates")
    except SystemExit as e:
        assert "fp32 one-epoch sweep of bp on wordnet is unfinished" in str(e)
    for lr, nll in ((1e-3, 0.6), (3e-3, 0.4), (1e-2, 0.5)):
        write(tmp_path, fake_cell("wordnet", "bp", lr, "validation", nll, 0.8))
    s.run()
    assert ran == [("wordnet", "bp", 3e-3, seed, 1024, "test") for seed in (0, 1)]
    fp32 = QS.cell_name("wordnet", "bp", 3e-3, 0, 1024, 1, "qv", "test")
    int4 = QS.cell_name("wordnet", "bp", 3e-3, 0, 1024, 1, "qv", "test", "int4")
    assert fp32 == "wordnet/bp_qv_n1024_e1_lr0.003_s0_test.json" and int4 != fp32 and "_int4_" in int4
    runs = [fake_cell("wordnet", "bp", 3e-3, "test", 0.4, 0.8), dict(fake_cell("wordnet", "bp", 3e-3, "test", 0.5, 0.7),
                                                                   base_weights="int4")]
    assert set(QS.summarise(runs)["wordnet"]["test"]) == {"bp|qv|e1|n1024", "bp|qv|e1|int4 base|n1024"}


def test_more_epochs_train_at_the_one_epoch_sweeps_rates_without_a_sweep_of_their_own(tmp_path):
    s = study(tmp_path, "--epochs", "2", "--methods", "bp", "--budgets", "2048", "--seeds", "0")
    ran = []
    s.run_cell = lambda *args, **kw: ran.append(args)
    for lr, nll in ((1e-3, 0.5), (3e-3, 0.4), (1e-2, 0.6)):
        write(tmp_path, fake_cell("wordnet", "bp", lr, "validation", nll, 0.8))
    s.run()
    assert ran == [("wordnet", "bp", 3e-3, 0, 2048, "test")]  # the epoch count comes from --epochs
    assert QS.cell_name("wordnet", "bp", 3e-3, 0, 2048, 2, "qv", "test") == "wordnet/bp_qv_n2048_e2_lr0.003_s0_test.json"


def test_the_real_pipeline_runs_alone_at_its_fast_twins_chosen_rate(tmp_path):
    import pytest

    for other in (["--methods", "zl-pipeline,bp"], ["--methods", "zl-pipeline", "--base-weights", "int8"]):
        with pytest.raises(SystemExit):  # argparse's one-line error
            parse(["run", "--cells", str(tmp_path), *other])
    s = study(tmp_path, "--methods", "zl-pipeline", "--budgets", "1024,2048", "--seeds", "0")
    ran = []
    s.run_cell = lambda *args, **kw: ran.append(args)
    with pytest.raises(SystemExit, match="sweep of zl-last1-lens on wordnet is unfinished"):
        s.run()
    for lr, nll in ((1e-3, 0.6), (3e-3, 0.5), (1e-2, 0.55)):
        write(tmp_path, fake_cell("wordnet", "zl-last1-lens", lr, "validation", nll, 0.8))
    s.run()
    assert ran == [("wordnet", "zl-pipeline", 3e-3, 0, budget, "test") for budget in (1024, 2048)]


def test_lastwide_targets_put_every_linear_at_rank_32_in_the_last_chunk_only():
    """`--targets lastwide` (issue 32's rank-per-chunk candidate): q/v at rank 8 in the first two
    chunks, every linear at rank 32 in the last, the same LoRA scale everywhere."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from bench import quality as Q

    base = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                        num_key_value_heads=2, num_hidden_layers=Q.CHUNKS[-1][1] + 1))
    pm = Q.peft_model(base, seed=0, targets="lastwide")
    adapted = {}
    for name, mod in pm.named_modules():
        if hasattr(mod, "lora_A") and "default" in mod.lora_A:
            layer = int(name.split(".layers.")[1].split(".")[0])
            adapted[(layer, name.rsplit(".", 1)[1])] = (mod.r["default"], mod.scaling["default"])
    last = range(Q.CHUNKS[-1][0], Q.CHUNKS[-1][1] + 1)
    for layer in range(Q.CHUNKS[-1][1] + 1):
        got = {proj: rs for (at_layer, proj), rs in adapted.items() if at_layer == layer}
        if layer in last:
            assert got == {p: (32, 2.0) for p in Q.LORA_TARGETS["all"]}, layer
        else:
            assert got == {"q_proj": (8, 2.0), "v_proj": (8, 2.0)}, layer


def test_another_split_trains_zerolock_at_the_default_splits_rates_in_cells_of_its_own(tmp_path, monkeypatch):
    """`--chunks` (issue 32: how deep the last chunk must be): ZeroLock's methods train that split at the
    LRs the default split's sweep chose, in cells named by its layer counts; BP has no split."""
    import pytest

    from bench import quality as Q

    monkeypatch.setattr(Q, "CHUNKS", Q.CHUNKS)  # set_chunks sets it for the process: restored after the test
    monkeypatch.setattr(Q, "LORA_TARGETS", Q.LORA_TARGETS)  # and the targets it derives from CHUNKS
    monkeypatch.setattr(Q, "LORA_RANK_PATTERNS", Q.LORA_RANK_PATTERNS)
    for bad in (["--chunks", "0-4,5-9"], ["--chunks", "0-4,5-9,10-19,20-29"],
                ["--chunks", "0-4,5-9,10-29", "--targets", "lastwide"]):
        with pytest.raises(SystemExit):  # argparse's one-line error
            parse(["run", "--cells", str(tmp_path), *bad])
    s = study(tmp_path, "--chunks", "0-4,5-9,10-29", "--methods", "bp,zl-last1-lens", "--budgets", "1024", "--seeds", "0")
    assert Q.CHUNKS == ((0, 4), (5, 9), (10, 29))
    assert Q.chunk_of("base_model.model.model.layers.12.self_attn.q_proj.lora_A.default.weight") == 2
    ran = []
    s.run_cell = lambda *args, **kw: ran.append(args)
    for m in ("bp", "zl-last1-lens"):
        for lr, nll in ((1e-3, 0.5), (3e-3, 0.4), (1e-2, 0.6)):
            write(tmp_path, fake_cell("wordnet", m, lr, "validation", nll, 0.8))
    s.run()
    assert ran == [("wordnet", m, 3e-3, 0, 1024, "test") for m in ("bp", "zl-last1-lens")]
    split = "0-4,5-9,10-29"
    assert QS.cell_name("wordnet", "zl-last1-lens", 3e-3, 0, 1024, 1, "qv", "test", "fp32", split) == \
        "wordnet/zl-last1-lens_qv_c5-5-20_n1024_e1_lr0.003_s0_test.json"
    assert QS.cell_name("wordnet", "bp", 3e-3, 0, 1024, 1, "qv", "test", "fp32", split) == \
        QS.cell_name("wordnet", "bp", 3e-3, 0, 1024, 1, "qv", "test")
    assert Q.LORA_RANK_PATTERNS["lastwide"] == {r"layers\.(10|11|12|13|14|15|16|17|18|19|"
                                                r"20|21|22|23|24|25|26|27|28|29)\..*": 32}, \
        "lastwide's last chunk follows the split (it was fixed to the default's at import)"
    assert parse(["run", "--cells", str(tmp_path), "--chunks", split, "--budgets", "2048"]).budgets == [2048], \
        "no sweep of its own, so no need for the sweep's budget"
    runs = [fake_cell("wordnet", "zl-last1-lens", 3e-3, "test", 0.4, 0.8),
            dict(fake_cell("wordnet", "zl-last1-lens", 3e-3, "test", 0.5, 0.7), chunks=split)]
    assert set(QS.summarise(runs)["wordnet"]["test"]) == \
        {"zl-last1-lens|qv|e1|n1024", f"zl-last1-lens|qv|e1|chunks {split}|n1024"}


def test_each_method_name_picks_its_alphas_readout_and_lr_per_chunk():
    """Q.Trainer maps the study's method names onto zl_mobile.reference's trainer (whose arithmetic
    tests/test_reference_trainer.py checks): backprop without alphas, the programs' path for one
    static alpha, a lens or a tail:D readout with per-chunk alphas, an LR factor per chunk."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from bench import quality as Q
    from zl_mobile.reference import readouts

    torch.manual_seed(0)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                        num_key_value_heads=2, num_hidden_layers=Q.CHUNKS[-1][1] + 1)).eval()
    lenses = {k: (torch.eye(32), torch.zeros(32)) for k in (-1, 9, 19, *Q.tail_lens_boundaries("zl-tail2-lens"))}
    pm = Q.peft_model(base, seed=0)
    try:
        bp = Q.Trainer(pm, "bp", 1e-3, 12, 3)
        assert bp.alphas is None and bp.readout is None
        zl = Q.Trainer(pm, "zl0.5", 1e-3, 12, 3)
        assert zl.alphas == (0.5, 0.5, 0.5) and zl.readout is None and zl.chunks == Q.CHUNKS
        lens = Q.Trainer(pm, "zl-last1-lens", 1e-3, 12, 3, lenses)
        assert lens.alphas == (0.5, 0.5, 1.0) and type(lens.readout) is readouts.LensReadout
        tail = Q.Trainer(pm, "zl-tail2-lens", 1e-3, 12, 3, lenses)
        assert isinstance(tail.readout, readouts.TailReadout) and tail.readout.depth == 2
        ra = Q.Trainer(pm, "zl0.5-ra", 1e-3, 12, 3)
        assert isinstance(ra.readout, readouts.AdapterReadout) and "readout_adapter.0.up" in ra.params
        last = Q.Trainer(pm, "zl-lastonly-lens", 1e-3, 12, 3, lenses)
        assert last.lr_scales == (0.0, 0.0, 1.0) and len(last.opt) == 1  # no optimizer where the LR is 0
    finally:
        pm.unload()


def test_tail_readouts_train_at_the_defaults_swept_rate_on_the_split_asked(tmp_path):
    """Issue 49's depth curve: tail:D methods have no sweep of their own; they train at the LR the
    default's (zl-last1-lens) sweep chose, on --split (validation for the curve), in cells named tail:D."""
    import pytest

    for lr, nll in ((1e-3, 0.5), (3e-3, 0.4), (1e-2, 0.6)):
        write(tmp_path, fake_cell("wordnet", "zl-last1-lens", lr, "validation", nll, 0.8))
    s = study(tmp_path, "--methods", "zl-tailall,zl-tail2-lens", "--budgets", "1024", "--seeds", "0", "--split", "validation")
    ran = []
    s.run_cell = lambda *args, **kw: ran.append(args)
    s.run()
    assert ran == [("wordnet", m, 3e-3, 0, 1024, "validation") for m in ("zl-tailall", "zl-tail2-lens")]
    assert QS.cell_name("wordnet", "zl-tail2-lens", 3e-3, 0, 1024, 1, "qv", "validation") == \
        "wordnet/zl-tail2-lens_qv_n1024_e1_lr0.003_s0_validation.json"
    with pytest.raises(SystemExit):  # a sweep's run has its validation cells already
        parse(["run", "--cells", str(tmp_path), "--split", "validation"])


def test_the_depth_table_sets_each_tail_beside_the_default_and_bp_at_their_swept_rates():
    runs = [fake_cell("wordnet", m, lr, "validation", nll, acc) for m, lr, nll, acc in
            (("bp", 1e-3, 0.4, 0.9), ("bp", 3e-3, 0.5, 0.95), ("zl-last1-lens", 1e-3, 0.6, 0.7),
             ("zl-last1-lens", 3e-3, 0.5, 0.75), ("zl-tailall", 3e-3, 0.45, 0.85), ("zl-tail2-lens", 3e-3, 0.55, 0.8))]
    runs.append(fake_cell("wordnet", "zl-tailall", 3e-3, "test", 0.45, 0.85, budget=2048))  # no reference there
    rows = [ln for ln in QS.depth_table(runs).splitlines()[2:]]
    got = [(c[4], c[5], c[6], c[7]) for c in (ln.strip("| ").split(" | ") for ln in rows)]
    assert got == [("bp", "- (backprop)", "0.001", "0.900"), ("zl-last1-lens", "0 (lens)", "0.003", "0.750"),
                   ("zl-tail2-lens", "2", "0.003", "0.800"), ("zl-tailall", "all", "0.003", "0.850"),
                   ("zl-tailall", "all", "0.003", "0.850")]

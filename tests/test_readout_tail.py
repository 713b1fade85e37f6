"""zl-export --readout tail:D (issue 49): chunk k's local loss reads h_k through D of the model's
own frozen later layers on the phone (phase 2), then the final norm at the top or a lens at the
tail's end. tail:all gives chunk k the backprop gradient with the later chunks at the base."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from exporter import readout_lens
from exporter.chunk_model import ChunkModel, add_lora, example_inputs, input_names
from exporter.cli import main as export_main
from exporter.model_source import load_model_dir
from exporter.verify import ExportedModelSizes, sample_lora, verify_all
from host.run.settings import RunSettings
from tests.conftest import run_pipeline, small_export_config, small_micro_batches
from tests.test_eager_backend import TOL, _rel, _zl_batch
from tests.test_export_bp import _batch
from zl_common.program import ChunkProgram
from zl_mobile.eager_program import EagerChunkProgram


def _model_param(global_name: str) -> str:
    """A peft adapter key (base_model...lora_A.weight) -> the parameter's name in the peft model."""
    return global_name[:-len(".weight")] + ".default.weight"


def _full_model_ce(peft_model, ids, attn, pos, idx, tgt, w):
    logits = peft_model(input_ids=ids, attention_mask=attn, position_ids=pos).logits
    rows = logits.reshape(-1, logits.shape[-1]).index_select(0, idx)
    return (F.cross_entropy(rows, tgt, reduction="none") * w).sum() / w.sum()


def test_tail_all_gradient_is_backprops(small_model_dir, tmp_path):
    """tail:all, alpha = 1: chunk 0's phase 2, run in ExecuTorch, returns the gradient autograd
    gives through the whole model (the later chunks' LoRA at zero), and the model's own CE."""
    from exporter.export import export_zerolock_chunk

    model = load_model_dir(small_model_dir).eval()
    cfg = small_export_config(readout="tail:all")
    peft_model = add_lora(model, cfg)
    chunk = ChunkModel(peft_model, 0, 0, cfg).eval()
    assert len(chunk.tail_out) == 2 and chunk.lens_out is None  # layers 1-2, then the final norm
    entry = export_zerolock_chunk(0, chunk, cfg, model.config, tmp_path)
    assert entry["index"] == 0 and entry["layers"] == [0, 0] and (tmp_path / entry["lora_init"]).is_file()
    prog = ChunkProgram(tmp_path, entry)
    lora = sample_lora(entry, seed=3)  # lora_B nonzero: every gradient exercised
    inputs = example_inputs(chunk, cfg, model.config.vocab_size, model.config.hidden_size, seed=5)
    batch = {**dict(zip(input_names(True), inputs)), "alpha": torch.tensor([1.0])}
    h, saved = prog.phase1(lora, batch)
    res = prog.phase2(lora, saved, batch)
    assert set(res.grads) == set(lora)  # the tail is readout only: no gradient of its own

    params = dict(peft_model.named_parameters())
    with torch.no_grad():
        for n, v in lora.items():
            params[_model_param(n)].copy_(v)
    assert all(float(p.detach().abs().max()) == 0 for n, p in params.items() if "lora_B" in n and ".layers.0." not in n)
    ids, attn, pos, idx, tgt, w, _ = inputs
    ce = _full_model_ce(peft_model, ids, attn, pos, idx, tgt, w)
    ce.backward()
    assert res.task_loss == pytest.approx(float(ce), rel=1e-5)
    for n, g in res.grads.items():
        ref = params[_model_param(n)].grad
        assert float((g - ref).norm() / ref.norm()) < 1e-4, n

    # what the test can tell apart: the static readout (no tail) gives another gradient
    static = ChunkModel(peft_model, 0, 0, small_export_config()).eval()
    for p in static.lora_parameters().values():
        p.grad = None
    loss, *_ = static(*inputs[:-1], torch.tensor([1.0]))
    loss.backward()
    worst = min(float((static.lora_parameters()[local].grad - res.grads[n]).norm() / res.grads[n].norm())
                for local, n in zip(static.lora_parameters(), lora))
    assert worst > 1e-2


def test_tail_layers_are_the_stored_base_weights(small_model_dir):
    """With --base-weights int4 the tail runs the quantized base modules themselves (the same
    Parameters, stored once), and no LoRA tensor is reachable from it."""
    from exporter.base_weights import QuantizedLinear, quantize_base

    model = load_model_dir(small_model_dir).eval()
    cfg = small_export_config(readout="tail:all", base_weights="int4")
    quantize_base(model, "int4", cfg.decode_block_weights)
    peft_model = add_lora(model, cfg)
    chunk = ChunkModel(peft_model, 0, 1, cfg)
    linears = [m for m in chunk.tail_out.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(isinstance(m, QuantizedLinear) for m in linears)
    assert not any("lora" in n for n, _ in chunk.tail_out.named_parameters())
    assert not any("lora" in n for n, _ in chunk.tail_in.named_parameters())
    held = {id(p) for p in model.model.layers[2].parameters()}
    assert {id(p) for p in chunk.tail_out.parameters()} <= held
    # the consistency tail (h_{k-1} through this chunk's own layers at the base) shares their weights
    own = {id(p) for p in chunk.layers.parameters()}
    assert {id(p) for p in chunk.tail_in[0].parameters()} <= own
    assert set(chunk.lora_parameters()) == {n for n, _ in chunk.layers.named_parameters(prefix="layers")
                                            if "lora_" in n}


@pytest.mark.parametrize("spec", ["tail:x", "tail:-1", "tail:0", "tail:", "tail:1.5", "deep"])
def test_a_bad_readout_gets_one_line(tmp_path, capsys, spec):
    assert export_main(["--model", "tiny", "--readout", spec, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.startswith("zl-export: error:")]
    assert len(lines) == 1, err
    assert repr(spec) in lines[0] and "tail:all" in lines[0]
    assert not (tmp_path / "out").exists()


def test_tail_manifest_records_the_readout(small_export_tail):
    out, manifest, _, _ = small_export_tail
    assert manifest["export"]["readout"] == "tail:1"
    assert manifest["readout_lens"]["after_layers"] == [0, 1]  # where tails end below the top (layer 2)
    tails = [c["readout_tail"] for c in manifest["chunks"]]
    assert tails[0] == {"out": {"layers": [1, 1], "reads": "lens", "lens_after": 1},
                        "in": {"layers": [0, 0], "reads": "lens", "lens_after": 0}}
    assert tails[1]["out"] == {"layers": [2, 2], "reads": "norm"}
    assert tails[2]["out"] == {"layers": [], "reads": "norm"} and tails[2]["in"]["layers"] == [2, 2]
    # the eager backend's weights carry the tail's layers and the lenses at its ends
    stored = load_file(str(out / manifest["chunks"][0]["eager_weights"]))
    assert any(k.startswith("model.layers.1.") for k in stored)
    assert sorted(readout_lens.from_tensors(stored)) == [0, 1]


def test_tail_programs_equal_eager_and_read_through_the_tail(small_export_tail, small_model_dir):
    """Each chunk's ExecuTorch program equals the eager backend's; at the LoRA init, chunk 0's task
    loss is the CE of lm_head(lens(layer 1's output)) and chunk 1's is the whole model's CE."""
    out, manifest, _, cfg = small_export_tail
    model = load_model_dir(small_model_dir).eval()
    lenses = readout_lens.from_tensors(load_file(str(out / manifest["readout_lens"]["file"])))
    eps = model.config.rms_norm_eps
    b0 = _zl_batch(cfg, "input_ids", _batch(cfg, model.config.vocab_size, seed=4)["input_ids"])
    with torch.no_grad():
        hs = model.model(input_ids=b0["input_ids"], attention_mask=b0["attention_mask"],
                         output_hidden_states=True).hidden_states
    idx, tgt, w = b0["loss_index"], b0["loss_target"], b0["loss_weight"]

    def ce(u):
        return float((F.cross_entropy(u @ model.lm_head.weight.T, tgt, reduction="none") * w).sum() / w.sum())

    h = h_init = None
    for c in manifest["chunks"]:
        k = c["index"]
        x_prog, e_prog = ChunkProgram(out, c), EagerChunkProgram(out, c)
        x = b0["input_ids"] if k == 0 else h
        b = {**b0, c["first_input"]: x}
        lora = sample_lora(c, seed=k)
        h_x, saved_x = x_prog.phase1(lora, b)
        h_e, saved_e = e_prog.phase1(lora, b)
        assert _rel(h_e, h_x) <= TOL, k
        r_x, r_e = x_prog.phase2(lora, saved_x, b), e_prog.phase2(lora, saved_e, b)
        for key in ("loss", "task_loss", "consis_loss"):
            assert getattr(r_e, key) == pytest.approx(getattr(r_x, key), rel=TOL, abs=TOL), (k, key)
        for n, g in r_x.grads.items():
            assert _rel(r_e.grads[n], g) <= TOL, (k, n)
        h = h_x
        # at the exported init (lora_B = 0) the chunks compute the base model
        init = load_file(str(out / c["lora_init"]))
        hi = {**b0, c["first_input"]: b0["input_ids"] if k == 0 else h_init}
        h_init, saved = x_prog.phase1(init, hi)
        r = x_prog.phase2(init, saved, hi)
        if k == 0:
            rows = hs[2].reshape(-1, hs[2].shape[-1])[idx]
            assert r.task_loss == pytest.approx(ce(readout_lens.apply(rows, *lenses[1], eps)), rel=1e-4)
        if k == 1:
            rows = hs[-1].reshape(-1, hs[-1].shape[-1])[idx]  # the final norm's output
            assert r.task_loss == pytest.approx(ce(rows), rel=1e-4)


def test_tail_export_passes_verify(small_export_tail):
    out, manifest, artifacts, cfg = small_export_tail
    rows = verify_all(out, artifacts, cfg, ExportedModelSizes(manifest), report=lambda msg: None)
    assert len(rows) == 3 and all(r["grad:" + n]["err"] <= r["grad:" + n]["tol"]
                                  for r, c in zip(rows, manifest["chunks"]) for n in (t["name"] for t in c["lora"]))


def test_tail_trains_in_an_emulated_pipeline(small_export_tail, tmp_path_factory):
    out, manifest, _, _ = small_export_tail
    mbs = small_micro_batches(out, n_examples=4)
    settings = RunSettings(windows=2, window_size=2, lr=2e-2, inflight_depth=4)
    result, records = run_pipeline(out, tmp_path_factory.mktemp("pipe_tail"), settings, mbs)
    commits = sorted((r["stage"], r["window"]) for r in records if r["type"] == "CHECKPOINT_COMMITTED")
    assert commits == [(k, w) for k in range(3) for w in range(2)]
    losses = [r["loss"] for r in records if r["type"] == "TELEMETRY" and r.get("kind") == "micro_batch"]
    assert losses and all(np.isfinite(losses))
    assert any(np.abs(result["lora"][n]).max() > 0 for n in result["lora"] if "lora_B" in n)

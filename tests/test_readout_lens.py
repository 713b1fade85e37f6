"""The calibrated readout lens (exporter/readout_lens.py, zl-export --readout lens): the fit,
the programs that read through it (ExecuTorch and eager alike), and what it is for: a chunk's
readout closer to the final layer's than the final norm gives."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from exporter import readout_lens
from exporter.verify import sample_lora
from tests.conftest import SMALL_CHUNKS, small_export_config, small_micro_batches
from tests.test_eager_backend import TOL, _rel, _zl_batch
from tests.test_export_bp import _batch
from zl_common.program import ChunkProgram
from zl_mobile.eager_program import EagerChunkProgram


def test_fit_recovers_an_affine_map():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(400, 16, generator=g) * torch.linspace(0.5, 30, 16)  # uneven scales, as real states
    a0, b0 = torch.randn(16, 16, generator=g), torch.randn(16, generator=g)
    fit = readout_lens.LensFit(16, eps=1e-5)
    for part in h.split(150):  # accumulated over batches
        fit.add(part, readout_lens.apply(part, a0, b0, 1e-5))
    a, b = fit.solve(ridge=1e-10)
    assert fit.n == 400
    assert torch.allclose(a, a0, atol=1e-3) and torch.allclose(b, b0, atol=1e-3)


def test_fit_without_positions_is_an_error():
    with pytest.raises(ValueError, match="needs text"):
        readout_lens.LensFit(8, eps=1e-5).solve(1e-3)


@pytest.fixture(scope="module")
def lens_export(small_model_dir, tmp_path_factory):
    """The small model in three chunks with --readout lens fitted on the synthetic set."""
    from exporter.export import export_model

    cfg = small_export_config(readout="lens")
    out = tmp_path_factory.mktemp("lens") / "out"
    manifest, artifacts = export_model(str(small_model_dir), SMALL_CHUNKS, out, cfg, eager_weights=True)
    return out, manifest, artifacts, cfg


def test_lens_export_records_and_stores_its_lenses(lens_export):
    out, manifest, artifacts, cfg = lens_export
    info = manifest["readout_lens"]
    assert manifest["export"]["readout"] == "lens"
    assert info["after_layers"] == [-1, 0, 1] and info["calibration"] == "synthetic" and info["positions"] > 100
    lenses = readout_lens.from_tensors(load_file(str(out / info["file"])))
    assert sorted(lenses) == [-1, 0, 1]
    for k, art in enumerate(artifacts):
        chunk = art.chunk
        assert (chunk.lens_in is not None) and (chunk.lens_out is not None) == (k < 2)  # the last reads via the norm
        assert torch.equal(chunk.lens_in[0], lenses[art.first - 1][0])
        # the eager backend's weights file carries the same lenses
        stored = readout_lens.from_tensors(load_file(str(out / manifest["chunks"][k]["eager_weights"])))
        assert sorted(stored) == sorted(i for i in (art.first - 1, art.last) if i in lenses)


def test_lens_programs_equal_eager_and_read_through_the_lens(lens_export, small_export):
    """Each chunk's ExecuTorch program equals the eager backend on the same export, and its task
    loss is the CE of lm_head(lens(h)) (the last chunk: of the final norm's readout, as the static
    export's program gives for the same input)."""
    out, manifest, _, cfg = lens_export
    static_out, static_manifest, _, _ = small_export
    lenses = readout_lens.from_tensors(load_file(str(out / manifest["readout_lens"]["file"])))
    weights = load_file(str(out / manifest["chunks"][0]["eager_weights"]))
    head, norm_w = weights["lm_head.weight"], weights["model.norm.weight"]
    eps = manifest["model"]["config"]["rms_norm_eps"]
    h = None
    for c, c_static in zip(manifest["chunks"], static_manifest["chunks"]):
        k = c["index"]
        x_prog, e_prog = ChunkProgram(out, c), EagerChunkProgram(out, c)
        lora = sample_lora(c, seed=k)
        b = _zl_batch(cfg, c["first_input"], _batch(cfg, 512, seed=4)["input_ids"] if h is None else h)
        h_x, saved_x = x_prog.phase1(lora, b)
        h_e, saved_e = e_prog.phase1(lora, b)
        assert _rel(h_e, h_x) <= TOL, k
        r_x, r_e = x_prog.phase2(lora, saved_x, b), e_prog.phase2(lora, saved_e, b)
        for key in ("loss", "task_loss", "consis_loss"):
            assert getattr(r_e, key) == pytest.approx(getattr(r_x, key), rel=TOL, abs=TOL), (k, key)
        for n, g in r_x.grads.items():
            assert _rel(r_e.grads[n], g) <= TOL, (k, n)
        rows = h_x.reshape(-1, h_x.shape[-1])[b["loss_index"]]
        if k < 2:
            u = readout_lens.apply(rows, *lenses[c["layers"][1]], eps)
        else:
            u = readout_lens.rms(rows, eps) * norm_w
        w = b["loss_weight"]
        ce = (F.cross_entropy(u @ head.T, b["loss_target"], reduction="none") * w).sum() / w.sum()
        assert r_x.task_loss == pytest.approx(float(ce), rel=1e-4), k
        s_prog = ChunkProgram(static_out, c_static)
        s_lora = {n: lora[n] for n in lora}
        h_s, saved_s = s_prog.phase1(s_lora, b)
        r_s = s_prog.phase2(s_lora, saved_s, b)
        if k < 2:
            assert abs(r_s.task_loss - r_x.task_loss) > 1e-3, k  # the lens is in the program
        else:
            assert r_s.task_loss == pytest.approx(r_x.task_loss, rel=1e-5)  # the model's own head
            assert abs(r_s.consis_loss - r_x.consis_loss) > 1e-4  # p_{k-1} through the lens before it
        h = h_x


def test_lens_reads_closer_to_the_final_layer_than_the_norm(lens_export, small_model_dir):
    """What the lens is for: on held-out text, the readout through it is closer (KL) to the final
    layer's distribution than the final norm's readout of the same state."""
    from exporter.model_source import load_model_dir

    out, manifest, _, cfg = lens_export
    lenses = readout_lens.from_tensors(load_file(str(out / manifest["readout_lens"]["file"])))
    model = load_model_dir(small_model_dir).eval()
    mbs = small_micro_batches(out, n_examples=16, micro_batch=4, seq_len=cfg.seq_len)[-2:]
    eps = model.config.rms_norm_eps
    with torch.no_grad():
        for b in mbs:
            mask = torch.as_tensor(b["attention_mask"]) > 0
            hs = model.model(input_ids=torch.as_tensor(b["input_ids"]), attention_mask=torch.as_tensor(b["attention_mask"]),
                             output_hidden_states=True).hidden_states
            final = F.log_softmax(model.lm_head(hs[-1][mask]), -1)
            for after in (0, 1):
                h = hs[after + 1][mask]
                kl = {name: F.kl_div(F.log_softmax(model.lm_head(u), -1), final, log_target=True, reduction="batchmean")
                      for name, u in (("norm", model.model.norm(h)), ("lens", readout_lens.apply(h, *lenses[after], eps)))}
                assert kl["lens"] < kl["norm"], (after, kl)


def test_missing_calibration_data_is_one_line_and_leaves_nothing(small_model_dir, tmp_path):
    from exporter.errors import ExportError
    from exporter.export import export_model

    out = tmp_path / "out"
    with pytest.raises(ExportError) as e:
        export_model(str(small_model_dir), SMALL_CHUNKS, out, small_export_config(readout="lens"),
                     calibration=str(tmp_path / "missing.jsonl"))
    msg = str(e.value)
    assert msg.startswith("--calibration-data: data file not found") and "\n" not in msg
    assert not out.exists() and not list(tmp_path.glob("out*"))

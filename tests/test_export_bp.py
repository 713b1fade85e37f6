"""The back-propagation (BP) baseline stages: chunk_k_bp.pte run as a pipeline through
ExecuTorch (stage forwards, then backwards passing grad_h_in upstream) gives the gradients of
eager back-propagation through the whole peft model, and its backward recomputes no forward."""
import pytest
import torch
from peft import get_peft_model
from transformers import LlamaForCausalLM

from exporter.chunk_model import PROBE, PROBE_GRAD, bp_example_inputs, bp_input_names, lora_config
from exporter.lower import joint_program
from exporter.manifest import ManifestError, load_manifest
from exporter.two_phase import split_at_marker
from exporter.verify import bp_zero_probe, run_named, sample_lora, verify_all
from zl_common.manifest import ChunkEntry
from zl_common.program import ChunkProgram

from .conftest import SMALL_CHUNKS, matmul_flops, small_export_config


@pytest.fixture(scope="module")
def bp_export(small_model_dir, tmp_path_factory):
    """(out_dir, manifest, artifacts, cfg): the small model's BP programs only, three chunks."""
    from exporter.export import export_model

    cfg = small_export_config()
    out = tmp_path_factory.mktemp("export_bp") / "out"
    manifest, artifacts = export_model(str(small_model_dir), SMALL_CHUNKS, out, cfg, modes=("bp",))
    return out, manifest, artifacts, cfg


def _names(method, key):
    return [t["name"] for t in method[key]]


def test_manifest_describes_the_bp_programs(bp_export):
    out, manifest, artifacts, cfg = bp_export
    m = load_manifest(out)  # every listed file exists with its sha256
    assert m["modes"] == ["bp"]
    paths = {f["path"] for f in m["files"]}
    for c in m["chunks"]:
        k, bp = c["index"], c["bp"]
        assert "program" not in c and "methods" not in c  # no ZeroLock program in a bp-only export
        assert {bp["program"], bp["weights"], c["lora_init"]} <= paths
        assert bp["program"] == f"chunk_{k}_bp.pte" and bp["weights"] == f"chunk_{k}_bp.ptd"
        assert bp["last"] == (k == 2)
        p1, p2 = bp["methods"]["phase1"], bp["methods"]["phase2"]
        lora = [t["name"] for t in c["lora"]]
        grads = ["grad:" + n for n in lora]
        assert _names(p1, "outputs")[0] == "h_out"
        assert all(n.startswith("saved_") for n in _names(p1, "outputs")[1:])
        assert set(_names(p2, "inputs")) - set(lora) <= set(_names(p1, "outputs")) | {
            "grad_h_out", "loss_index", "loss_target", "loss_weight"}
        if k == 0:
            assert _names(p1, "inputs") == lora + ["input_ids", "attention_mask", "position_ids"]
            assert _names(p2, "outputs") == grads
        else:
            assert _names(p1, "inputs") == [PROBE] + lora + ["h_in", "attention_mask", "position_ids"]
            assert p1["inputs"][0] == {"name": PROBE, "shape": [2, 16, 64], "dtype": "float32"}
        if k == 1:
            assert _names(p2, "outputs") == [PROBE_GRAD] + grads
        if k < 2:
            assert _names(p2, "inputs")[-1] == "grad_h_out" and "h_out" not in _names(p2, "inputs")
        else:
            assert _names(p2, "outputs") == ["loss", PROBE_GRAD] + grads
            assert _names(p2, "inputs")[-3:] == ["loss_index", "loss_target", "loss_weight"]
        assert ChunkEntry.from_json(c).for_mode("bp").json["methods"] is bp["methods"]
        with pytest.raises(ManifestError):
            ChunkEntry.from_json(c).for_mode("zerolock")


def _batch(cfg, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    B, S, N = cfg.micro_batch, cfg.seq_len, cfg.readout_rows
    ids = torch.randint(0, vocab, (B, S), generator=g)
    attn = torch.ones(B, S, dtype=torch.long)
    attn[1, S - 5:] = 0  # right padding
    pos = torch.arange(S).repeat(B, 1)
    valid = (attn.reshape(-1) > 0).nonzero().squeeze(1)
    n = 6  # fewer valid loss positions than readout rows: the rest are weight-0 padding
    idx = torch.zeros(N, dtype=torch.long)
    idx[:n] = valid[torch.randperm(len(valid), generator=g)[:n]].sort().values
    tgt = torch.zeros(N, dtype=torch.long)
    tgt[:n] = torch.randint(0, vocab, (n,), generator=g)
    w = torch.zeros(N)
    w[:n] = 1.0
    return dict(input_ids=ids, attention_mask=attn, position_ids=pos, loss_index=idx, loss_target=tgt, loss_weight=w)


def _eager_global(small_model_dir, cfg, lora, b):
    """Eager BP through the whole peft model: global CE at the valid positions."""
    full = get_peft_model(LlamaForCausalLM.from_pretrained(small_model_dir), lora_config(cfg)).eval()
    params = {n.replace(".default.", "."): p for n, p in full.named_parameters() if "lora_" in n}
    assert set(params) == set(lora)
    with torch.no_grad():
        for n, v in lora.items():
            params[n].copy_(v)
    logits = full(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]).logits
    z = logits.reshape(-1, logits.shape[-1]).index_select(0, b["loss_index"])
    nll = -torch.log_softmax(z, -1).gather(1, b["loss_target"][:, None]).squeeze(1)
    loss = (nll * b["loss_weight"]).sum() / b["loss_weight"].sum().clamp(min=1.0)
    loss.backward()
    return loss.item(), {n: p.grad.detach().clone() for n, p in params.items()}


def test_bp_pipeline_equals_eager_backprop(bp_export, small_model_dir):
    out, manifest, artifacts, cfg = bp_export
    vocab = manifest["model"]["config"]["vocab_size"]
    b = _batch(cfg, vocab, seed=4)
    entries = [ChunkEntry.from_json(c).for_mode("bp").json for c in manifest["chunks"]]
    stages = [ChunkProgram(out, e) for e in entries]
    loras = [sample_lora(e, seed=10 + k) for k, e in enumerate(entries)]

    # forward, stage by stage: each keeps its phase1 outputs (h_out + saved_i) for its backward
    fwd, h = [], None
    for k, (st, e) in enumerate(zip(stages, entries)):
        first = {"input_ids": b["input_ids"]} if k == 0 else {"h_in": h, **bp_zero_probe(e)}
        f = run_named(st, "phase1", {**b, **first, **loras[k]})  # picks the inputs it names
        fwd.append(f)
        h = f["h_out"]
    # backward, last stage first: it computes the global loss; each returns grad_h_in upstream
    grads, g_up, loss = {}, None, None
    for k in reversed(range(3)):
        extra = {k2: b[k2] for k2 in ("loss_index", "loss_target", "loss_weight")} if k == 2 else {"grad_h_out": g_up}
        r = run_named(stages[k], "phase2", {**fwd[k], **loras[k], **extra})
        if k == 2:
            loss = float(r["loss"])
        if k > 0:
            g_up = r[PROBE_GRAD]
            assert g_up.shape == (2, 16, 64)
        else:
            assert PROBE_GRAD not in r
        grads.update({n[5:]: t for n, t in r.items() if n.startswith("grad:")})

    all_lora = {n: v for lo in loras for n, v in lo.items()}
    loss_e, grads_e = _eager_global(small_model_dir, cfg, all_lora, b)
    assert abs(loss - loss_e) <= 1e-5 * abs(loss_e)
    assert set(grads) == set(grads_e)
    for n, ge in grads_e.items():
        assert ge.abs().max() > 0, n
        rel = ((grads[n] - ge).abs().max() / ge.abs().max()).item()
        assert rel <= 1e-5, (n, rel)


def test_verify_checks_the_bp_programs(bp_export):
    out, manifest, artifacts, cfg = bp_export

    class C:
        vocab_size, hidden_size = 512, 64
    rows = verify_all(out, artifacts, cfg, C, report=lambda s: None)
    assert len(rows) == 3
    from exporter.chunk_model import PROBE_GRAD
    from exporter.verify import failures

    assert all(failures(d) == [] for d in rows)
    assert [PROBE_GRAD in d for d in rows] == [False, True, True] and [("loss" in d) for d in rows] == [False, False, True]
    assert all(r["err"] < 1e-4 for d in rows for n, r in d.items() if n == "h_out" or n.startswith("grad"))


@pytest.mark.parametrize("k", [1, 2])
def test_bp_backward_does_not_recompute_the_forward(bp_export, k):
    out, manifest, artifacts, cfg = bp_export
    chunk = artifacts[k].bp_chunk
    inputs = bp_example_inputs(chunk, cfg, 512, 64)
    ep = joint_program(chunk, inputs)
    joint = matmul_flops(ep)
    split = split_at_marker(ep, bp_input_names(False, chunk.is_last), ("loss",) if chunk.is_last else ())
    f1, f2 = matmul_flops(split.phase1.program), matmul_flops(split.phase2.program)
    assert f1 > 0 and f2 > 0 and f1 + f2 == joint  # every matmul of the joint graph runs once
    fwd_only = matmul_flops(torch.export.export(chunk, inputs, strict=False).run_decompositions())
    # the last stage's readout: logits and dL/dz @ lm_head (readout_loss runs both in the forward)
    readout = 2 * 2 * cfg.readout_rows * 64 * 512 if chunk.is_last else 0
    assert f1 == fwd_only - readout  # the whole forward (less the last stage's readout) is phase 1


def test_bp_weights_share_the_zerolock_file(small_model_dir, tmp_path):
    """--mode both: the BP program reads its frozen weights from chunk_k.ptd (same keys), and
    runs from it; here on one chunk holding the whole model (first and last stage at once)."""
    from exporter.export import export_model

    cfg = small_export_config()
    manifest, artifacts = export_model(str(small_model_dir), "0-2", tmp_path / "out", cfg, modes=("zerolock", "bp"))
    c = load_manifest(tmp_path / "out")["chunks"][0]
    assert c["program"] == "chunk_0.pte" and c["bp"]["program"] == "chunk_0_bp.pte"
    assert c["bp"]["weights"] == c["weights"] == "chunk_0.ptd"
    assert not (tmp_path / "out" / "chunk_0_bp.ptd").exists()
    assert ChunkEntry.from_json(c).for_mode("zerolock").json is c
    e = ChunkEntry.from_json(c).for_mode("bp").json
    assert PROBE not in _names(e["methods"]["phase1"], "inputs")
    assert _names(e["methods"]["phase2"], "outputs")[0] == "loss"
    assert PROBE_GRAD not in _names(e["methods"]["phase2"], "outputs")

    b = _batch(cfg, 512, seed=1)
    lora = sample_lora(e, seed=3)
    prog = ChunkProgram(tmp_path / "out", e)
    f = run_named(prog, "phase1", {**b, **lora})
    r = run_named(prog, "phase2", {**b, **f, **lora})
    loss_e, grads_e = _eager_global(small_model_dir, cfg, lora, b)
    assert abs(float(r["loss"]) - loss_e) <= 1e-5 * abs(loss_e)
    for n, ge in grads_e.items():
        assert ((r["grad:" + n] - ge).abs().max() / ge.abs().max()).item() <= 1e-5, n

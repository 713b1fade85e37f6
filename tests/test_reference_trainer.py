"""zl_mobile.reference, the eager ZeroLock trainer, as the oracle: the phones (emulated, ExecuTorch
programs) train the LoRA it trains; its two paths (the programs' ChunkModel and plain autograd) give
one gradient; tail:all gives each chunk backprop's gradient; tail:D reads through D base layers;
delta_k is the distance to the local loss's true optimum."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from zl_mobile.reference import metrics, readouts, trainer
from zl_mobile.reference.trainer import ReferenceTrainer, chunk_of, lora_params

CHUNKS = ((0, 9), (10, 19), (20, 29))


def _t(b, k):
    return torch.from_numpy(b[k])


def _tiny_peft(seed=0, chunks=CHUNKS):
    """A tiny Llama with the chunks' layer count under q/v LoRA (r 8, lora_alpha 16), every LoRA weight
    random (B too: an untrained adapter's zero B would hide whether the tail runs the later chunks' LoRA)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    base = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                        num_key_value_heads=2, num_hidden_layers=chunks[-1][1] + 1)).eval()
    for p in base.parameters():
        p.requires_grad_(False)
    pm = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for p in lora_params(pm).values():
            p.copy_(torch.randn_like(p) * 0.2)
    return pm


def _tiny_batch(rows=3, S=12, vocab=64):
    g = np.random.default_rng(1)
    ids = g.integers(1, vocab, size=(rows, S))
    att = np.ones((rows, S), dtype=np.int64)
    att[1, 9:] = 0  # a padded row
    labels = np.full((rows, S), -100)
    labels[:, 5:8] = g.integers(1, vocab, size=(rows, 3))
    return {"input_ids": ids, "attention_mask": att, "labels": labels,
            "position_ids": np.broadcast_to(np.arange(S), (rows, S)).copy()}


def test_each_lora_parameter_belongs_to_the_chunk_of_its_layer():
    name = "base_model.model.model.layers.{}.self_attn.q_proj.lora_A.default.weight"
    assert [chunk_of(name.format(i), CHUNKS) for i in (0, 9, 10, 19, 20, 29)] == [0, 0, 1, 1, 2, 2]
    assert chunk_of(name.format(12), ((0, 4), (5, 9), (10, 29))) == 2


def test_the_autograd_path_with_the_static_readout_is_the_programs_module():
    """With no readout of its own the trainer runs ChunkModel's forward (what zl-export traces); given
    the static readout it writes the same local loss out in plain autograd: one gradient, one loss."""
    b = _tiny_batch()
    got = []
    for readout in (None, "static"):
        pm = _tiny_peft()
        tr = ReferenceTrainer(pm, CHUNKS, 1e-3, 12, 3, alphas=(0.5,) * 3,
                              readout=readouts.StaticReadout(pm) if readout else None)
        losses = tr.micro_batch(b, 0)
        got.append((losses, {n: p.grad.clone() for n, p in tr.params.items()}))
    (l0, g0), (l1, g1) = got
    assert set(l0) == set(l1) == {f"{t}_{k}" for t in ("task", "consis") for k in range(3)}
    for k in l0:
        assert l1[k] == pytest.approx(l0[k], rel=1e-5), k
    assert set(g0) == set(g1)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-4, atol=1e-6, msg=n)
    # alpha moves the gradient: the comparison above can tell a wrong alpha apart
    pm = _tiny_peft()
    tr = ReferenceTrainer(pm, CHUNKS, 1e-3, 12, 3, alphas=(1.0,) * 3)
    tr.micro_batch(b, 0)
    assert any(float((p.grad - g0[n]).abs().max()) > 1e-4 for n, p in tr.params.items())


def test_tail_all_gives_each_chunk_the_exact_backprop_gradient_with_the_later_chunks_at_the_base():
    """Issue 49's tail:all: chunk k's local CE read through every later layer at its base weights is,
    for chunk k's LoRA, the gradient autograd gives through the whole model with the later chunks'
    LoRA at zero (and none of it reaches the later chunks' LoRA)."""
    pm = _tiny_peft()
    b = _tiny_batch()
    tr = ReferenceTrainer(pm, CHUNKS, 1e-3, 12, 3, alphas=(1.0, 1.0, 1.0),  # the task CE alone, to compare with BP's
                          readout=readouts.TailReadout(pm, None, "all", 12, CHUNKS))
    tr.micro_batch(b, 0)
    got = {n: p.grad.clone() for n, p in tr.params.items()}
    params = lora_params(pm)
    saved = {n: p.detach().clone() for n, p in params.items()}
    llama = readouts.causal_lm(pm)
    valid = _t(b, "labels") != -100
    for k in range(len(CHUNKS)):
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(torch.zeros_like(p) if chunk_of(n, CHUNKS) > k and "lora_B" in n else saved[n])
        for p in params.values():
            p.grad = None
        h = llama.model(input_ids=_t(b, "input_ids"), attention_mask=_t(b, "attention_mask")).last_hidden_state
        F.nll_loss(F.log_softmax(llama.lm_head(h[valid]), -1), _t(b, "labels")[valid]).backward()
        mine = [n for n in params if chunk_of(n, CHUNKS) == k]
        assert mine
        for n in mine:
            torch.testing.assert_close(got[n], params[n].grad, rtol=1e-4, atol=1e-6, msg=n)


def test_tail_d_reads_through_d_base_layers_then_the_lens_at_that_depth():
    """tail:D's spans and lenses: D layers after the chunk (the embedding's for p_{k-1}), the lens at
    that boundary below the top (fitted where the lens readout has none), the final norm at the top;
    the tail's layers run at the base weights whatever the LoRA holds."""
    from exporter.readout_lens import apply

    assert [readouts.tail_span(k, 2, CHUNKS, 30) for k in (-1, 0, 1, 2)] == [(0, 1), (10, 11), (20, 21), (30, 29)]
    assert [readouts.tail_span(k, 10, CHUNKS, 30)[1] for k in (-1, 0, 1)] == [9, 19, 29]
    assert readouts.tail_lens_boundaries(2, CHUNKS, 30) == [1, 11, 21]
    assert readouts.tail_lens_boundaries(10, CHUNKS, 30) == [] and readouts.tail_lens_boundaries("all", CHUNKS, 30) == []
    pm = _tiny_peft()
    b = _tiny_batch()
    lenses = readouts.fit_lenses(readouts.causal_lm(pm), [b], CHUNKS, log=lambda *_: None,
                                 extra=readouts.tail_lens_boundaries(2, CHUNKS, 30))
    assert {-1, 1, 9, 11, 19, 21} <= set(lenses)
    with pytest.raises(ValueError, match="no lens after layer 1"):
        readouts.TailReadout(pm, {k: v for k, v in lenses.items() if k != 1}, 2, 12, CHUNKS)
    ro = readouts.TailReadout(pm, lenses, 2, 12, CHUNKS)
    llama = readouts.causal_lm(pm)
    x, att, pos = (_t(b, k) for k in ("input_ids", "attention_mask", "position_ids"))
    valid = _t(b, "labels") != -100
    eps = llama.model.norm.variance_epsilon
    with torch.no_grad():
        hs = llama.model(input_ids=x, attention_mask=att, output_hidden_states=True).hidden_states
        with pm.disable_adapter():
            h_base = llama.model(input_ids=x, attention_mask=att, output_hidden_states=True).hidden_states
        # chunk 0's h (trained LoRA) -> layers 10, 11 at the base -> the lens after layer 11
        got = ro.read(0, hs[10], valid, att, pos)
        h = hs[10]
        mask = torch.where(torch.ones(12, 12, dtype=torch.bool).tril()[None, None] & (att[:, None, None, :] > 0), 0.0,
                           torch.finfo(torch.float32).min)
        with pm.disable_adapter():
            for layer in llama.model.layers[10:12]:
                h = layer(h, attention_mask=mask, position_ids=pos, position_embeddings=llama.model.rotary_emb(h, pos))
        torch.testing.assert_close(got, apply(h[valid], *lenses[11], eps))
        # the embedding's p_{k-1}: the base model's layers 0-1, then the lens after layer 1
        torch.testing.assert_close(ro.read(-1, hs[0], valid, att, pos), apply(h_base[2][valid], *lenses[1], eps),
                                   rtol=1e-4, atol=1e-5)
        # the last chunk: the final norm, no layers
        torch.testing.assert_close(ro.read(2, hs[30], valid, att, pos), llama.model.norm(hs[30][valid]))
    tr = ReferenceTrainer(pm, CHUNKS, 1e-3, 12, 3, alphas=(0.5, 0.5, 1.0), readout=ro)
    losses = tr.micro_batch(b, 0)
    assert set(losses) == {f"{t}_{k}" for t in ("task", "consis") for k in range(3)}
    assert all(p.grad is not None for p in tr.params.values())
    assert len(tr.chunk_cpu) == 3 and all(c > 0 for c in tr.chunk_cpu)  # each chunk's CPU share, counted


@pytest.mark.parametrize("alpha", [0.2, 0.5, 0.9])
def test_delta_k_is_the_distance_to_the_local_losss_minimiser(alpha):
    """p_k*, delta_k's closed form, is where alpha CE(p, y) + (1 - alpha) KL(p || q) is smallest over
    the simplex: mirror descent on the loss itself ends there (delta_k of it ~ 0); q does not."""
    g = torch.Generator().manual_seed(0)
    logq = F.log_softmax(torch.randn(4, 7, generator=g), dim=-1)
    y = torch.tensor([0, 3, 6, 2])
    onehot, logp = F.one_hot(y, 7).double(), logq.double()
    for _ in range(400):  # exponentiated gradient: p <- p exp(-step dL/dp), normalised
        grad = -alpha * onehot / logp.exp() + (1 - alpha) * (logp - logq.double())
        logp = F.log_softmax(logp - 0.5 * grad, dim=-1)
    assert float(metrics.delta_k(logp.float(), logq, y, alpha).abs().max()) < 1e-6
    assert float(metrics.delta_k(logq, logq, y, alpha).min()) > 1e-2


def _uneven_answers(export_dir, lengths):
    """Micro-batches of the synthetic task whose answers are `lengths` tokens long (one row each,
    the first row of each micro-batch): a window's micro-batches then differ in valid positions."""
    from tests.conftest import small_micro_batches

    mbs = small_micro_batches(export_dir, n_examples=2 * len(lengths))[:len(lengths)]
    out = []
    for b, n in zip(mbs, lengths):
        b = {k: v.copy() for k, v in b.items()}
        labels = np.full_like(b["labels"], -100)
        real = np.flatnonzero(b["attention_mask"][0, :-1] > 0)[-n:]  # the row's last n positions with a next token
        labels[0, real] = b["input_ids"][0, real + 1]
        b["labels"] = labels
        out.append(b)
    return out


def test_the_phones_train_the_lora_the_reference_trainer_trains(small_export, small_model_dir, tmp_path):
    """Three emulated phones running the ExecuTorch programs, two windows of answers 1, 2, 3 and 1
    tokens long, end with the LoRA zl_mobile.reference trains from the same start in plain autograd."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    from host.run.settings import RunSettings
    from tests.conftest import run_pipeline
    from zl_mobile.checkpoint import CheckpointStore

    out, manifest = small_export[0], small_export[1]
    e = manifest["export"]
    mbs = _uneven_answers(out, (1, 2, 3, 1))
    lr = 1e-2
    run_pipeline(out, tmp_path, RunSettings(windows=2, window_size=2, lr=lr, inflight_depth=2, schedule="zerolock"), mbs)
    phones = {}
    for d in sorted((tmp_path / "phones").glob("*/stages/test/stage_*")):
        ck = CheckpointStore(d).load()
        assert ck is not None and ck.step == 2, d
        phones.update(ck.lora)

    model = LlamaForCausalLM.from_pretrained(small_model_dir, torch_dtype=torch.float32).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    pm = get_peft_model(model, LoraConfig(r=e["lora_rank"], lora_alpha=e["lora_alpha"], lora_dropout=0.0,
                                          target_modules=list(e["target_modules"])))
    params = {n.replace(".default", ""): p for n, p in lora_params(pm).items()}
    init = {}
    for c in manifest["chunks"]:
        init.update(load_file(str(out / c["lora_init"])))
    with torch.no_grad():
        for n, t in init.items():
            params[n].copy_(t)
    chunks = [tuple(c["layers"]) for c in manifest["chunks"]]
    tr = trainer.ReferenceTrainer(pm, chunks, lr, e["seq_len"], e["micro_batch"], alphas=(e["alpha"],) * len(chunks),
                                  readout=readouts.StaticReadout(pm), weight_decay=RunSettings.weight_decay)
    for i, b in enumerate(mbs):
        tr.micro_batch(b, i // 2)
        if i % 2 == 1:
            tr.end_window(i // 2)
    assert set(phones) == set(params)
    moved = 0
    for n, p in params.items():
        ref, got = p.detach() - init[n], phones[n] - init[n]  # each side's update
        if float(ref.norm()) > 0:
            moved += 1
            assert float((got - ref).norm() / ref.norm()) < 1e-3, n
    assert moved == len(params)  # two windows: lora_B moves first, then lora_A through it

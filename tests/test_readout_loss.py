"""exporter.readout_loss: the hand-written readout gradient equals autograd through the plain
formula (log_softmax over the whole vocabulary at once), for the loss terms alone and for a
chunk's LoRA gradients, whatever the position blocking and lm_head blocking."""
import pytest
import torch
import torch.nn.functional as F
from peft import get_peft_model

from exporter import readout_loss
from exporter.chunk_model import BPChunkModel, ChunkModel, example_inputs, lora_config
from exporter.model_source import load_model_dir

from .conftest import small_export_config


def plain_terms(u, u_prev, target, weight, w):
    """The seed's Eqs. (3)-(5) as written: CE and KL(p || stopgrad q), weighted means."""
    logp = F.log_softmax(u @ w.T, -1)
    denom = weight.sum().clamp(min=1.0)
    task = (-logp.gather(1, target[:, None]).squeeze(1) * weight).sum() / denom
    if u_prev is None:
        return task, None
    logq = F.log_softmax(u_prev @ w.T, -1).detach()
    consis = ((logp.exp() * (logp - logq)).sum(-1) * weight).sum() / denom
    return task, consis


@pytest.mark.parametrize("n,block,split,alpha", [(70, 32, (40, 60, 28), 0.5), (16, 64, (128,), 0.0),
                                                  (33, 8, (100, 28), 1.0), (5, 2, (64, 64), 0.3),
                                                  (70, None, (20000, 12000), 0.5)])  # default: 32 per block
@pytest.mark.parametrize("consistency", [True, False])
def test_loss_and_gradient_equal_autograd(n, block, split, alpha, consistency):
    g = torch.Generator().manual_seed(n)
    vocab, hidden = sum(split), 24
    w = torch.randn(vocab, hidden, generator=g) * 0.3
    u = torch.randn(n, hidden, generator=g, dtype=torch.float64).float().requires_grad_()
    u_prev = torch.randn(n, hidden, generator=g) if consistency else None
    target = torch.randint(0, vocab, (n,), generator=g)
    weight = (torch.rand(n, generator=g) > 0.3).float()  # some padding rows
    a = torch.tensor(alpha)

    task, consis = plain_terms(u, u_prev, target, weight, w)
    want = a * task + (1 - a) * consis if consistency else task
    (want_grad,) = torch.autograd.grad(want, u)

    got_task, got_consis, grad_u = readout_loss.loss_and_grad(u, u_prev, target, weight, a if consistency else 1.0,
                                                              list(w.split(list(split))), block=block)
    torch.testing.assert_close(got_task, task.detach(), rtol=1e-5, atol=1e-6)
    if consistency:
        torch.testing.assert_close(got_consis, consis.detach(), rtol=1e-5, atol=1e-6)
    else:
        assert got_consis is None
    torch.testing.assert_close(grad_u, want_grad, rtol=1e-4, atol=1e-7)
    assert grad_u[weight == 0].abs().max() == 0  # padding rows get no gradient


def test_blocks_hold_the_same_logits_size_whatever_the_vocabulary():
    assert readout_loss.position_block(32000) == 32       # TinyLlama: [32, 32000] f32 = 4 MiB
    assert readout_loss.position_block(512) == 2000       # a tiny vocabulary: one block for N <= 2000
    assert readout_loss.position_block(10**7) == 1


def test_with_gradient_keeps_the_value_and_routes_the_gradient():
    u = torch.randn(4, 3, requires_grad=True)
    g = torch.randn(4, 3)
    value = torch.tensor(1.2345678)
    out = readout_loss.with_gradient(value, u, g)
    assert out.item() == value.item()  # bit-identical, not merely close
    (du,) = torch.autograd.grad(out, u)
    assert torch.equal(du, g)


@pytest.fixture(scope="module")
def peft_model(small_model_dir):
    cfg = small_export_config()
    torch.manual_seed(0)
    model = get_peft_model(load_model_dir(small_model_dir), lora_config(cfg))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    return model, cfg


def _lora_grads(chunk, loss):
    params = chunk.lora_parameters()
    return dict(zip(params, torch.autograd.grad(loss, list(params.values()))))


def test_chunk_local_loss_gradients_equal_autograd(peft_model):
    model, cfg = peft_model
    chunk = ChunkModel(model, 1, 2, cfg).eval()
    x, attn, pos, idx, tgt, w, alpha = example_inputs(chunk, cfg, chunk.vocab_size, model.config.hidden_size)
    h = chunk.run_layers(x, attn, pos)
    loss, task, consis = chunk.local_loss(x, h, idx, tgt, w, alpha)
    got = _lora_grads(chunk, loss)

    lm_head = torch.cat(list(chunk.lm_head_blocks))
    rows = lambda t: chunk.norm(t.reshape(-1, t.shape[-1]).index_select(0, idx))  # noqa: E731
    h = chunk.run_layers(x, attn, pos)
    want_task, want_consis = plain_terms(rows(h), rows(x), tgt, w, lm_head)
    a = alpha.reshape(())
    want_loss = a * want_task + (1 - a) * want_consis
    want = _lora_grads(chunk, want_loss)

    torch.testing.assert_close(loss.detach(), want_loss.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(task, want_task.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(consis, want_consis.detach(), rtol=1e-5, atol=1e-6)
    assert set(got) == set(want) and all(want[k].abs().max() > 0 for k in want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-7)


def test_bp_global_loss_gradients_equal_autograd(peft_model):
    model, cfg = peft_model
    chunk = BPChunkModel(model, 1, 2, cfg, is_last=True).eval()
    x, attn, pos, idx, tgt, w, _ = example_inputs(chunk, cfg, chunk.vocab_size, model.config.hidden_size)
    h = chunk.run_layers(x, attn, pos)
    got_loss = chunk.global_loss(h, idx, tgt, w)
    got = _lora_grads(chunk, got_loss)
    h = chunk.run_layers(x, attn, pos)
    u = chunk.norm(h.reshape(-1, h.shape[-1]).index_select(0, idx))
    want_loss, _ = plain_terms(u, None, tgt, w, torch.cat(list(chunk.lm_head_blocks)))
    want = _lora_grads(chunk, want_loss)
    torch.testing.assert_close(got_loss.detach(), want_loss.detach(), rtol=1e-5, atol=1e-6)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-7)

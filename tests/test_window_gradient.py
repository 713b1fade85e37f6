"""Two loss details: a window's gradient is the mean over the window's valid positions (token
level), for ZeroLock and the BP baselines alike; and a micro-batch with more valid positions than
the program's --loss-positions is refused before the run, never cut.

The window-gradient tests run the real runtime (three emulated phones, ExecuTorch programs) for
one window of two micro-batches with 1 and 7 valid positions and read each stage's gradient back
from its checkpoint (AdamW's first moment after one step is (1 - beta1) * g). The reference is
independent of the programs: the HF model with peft LoRA, plain autograd through log_softmax."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from host.run.settings import RunSettings
from tests.conftest import run_pipeline, small_micro_batches
from zl_common.data import DataError, check_loss_positions
from zl_mobile.accumulate import WindowGradients
from zl_mobile.checkpoint import CheckpointStore

BETA1 = 0.9
N_VALID = (1, 7)


def _window(export_dir):
    """Two micro-batches of the synthetic task with exactly 1 and 7 valid positions."""
    mbs = small_micro_batches(export_dir, n_examples=4)[:2]
    out = []
    for b, n in zip(mbs, N_VALID):
        b = {k: v.copy() for k, v in b.items()}
        labels = np.full_like(b["labels"], -100)
        real = np.argwhere(b["attention_mask"][:, :-1] > 0)  # positions with a next token
        pick = real[np.linspace(0, len(real) - 1, n).astype(int)]
        for r, i in pick:
            labels[r, i] = b["input_ids"][r, i + 1]
        b["labels"] = labels
        assert int((labels != -100).sum()) == n
        out.append(b)
    return out


def _reference_grads(model_dir, export_dir, manifest, mbs, schedule, token_level=True):
    """dL/d(LoRA) with L the window's loss: ZeroLock's local losses (each chunk's input detached,
    p_{k-1} from the chunk's input) or BP's global CE; token-level mean over the window's valid
    positions, or (token_level=False) the mean of the micro-batch means."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    e = manifest["export"]
    model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    model = get_peft_model(model, LoraConfig(r=e["lora_rank"], lora_alpha=e["lora_alpha"], lora_dropout=0.0,
                                             target_modules=list(e["target_modules"])))
    params = {n.replace(".default", ""): p for n, p in model.named_parameters() if "lora_" in n}
    for c in manifest["chunks"]:
        for n, t in load_file(str(export_dir / c["lora_init"])).items():
            params[n].data.copy_(t)
    llama = model.base_model.model
    bounds = [c["layers"] for c in manifest["chunks"]]
    alpha = e["alpha"]
    if schedule == "zerolock":  # each chunk's input is detached: no gradient crosses a chunk
        starts = {first for first, _ in bounds if first > 0}
        hooks = [llama.model.layers[i].register_forward_pre_hook(
            lambda m, args, kw: ((args[0].detach(),) + args[1:], kw) if args else
            (args, {**kw, "hidden_states": kw["hidden_states"].detach()}), with_kwargs=True) for i in starts]
    else:
        hooks = []

    def readout(h):
        return F.log_softmax(llama.lm_head(llama.model.norm(h)).float(), dim=-1)

    total = torch.zeros(())
    n_all = sum(int((b["labels"] != -100).sum()) for b in mbs)
    for b in mbs:
        ids = torch.from_numpy(b["input_ids"])
        labels = torch.from_numpy(b["labels"])
        valid = labels != -100
        captured = {}  # the last layer's raw output (HF's last hidden state has the final norm applied)
        hook = llama.model.layers[-1].register_forward_hook(
            lambda m, a, o: captured.setdefault("h", o[0] if isinstance(o, tuple) else o))
        out = llama(input_ids=ids, attention_mask=torch.from_numpy(b["attention_mask"]), output_hidden_states=True)
        hook.remove()
        hs = list(out.hidden_states[:-1]) + [captured["h"]]  # [embedding, layer 0 out, ..., last layer out]
        tgt = labels[valid]
        if schedule == "zerolock":
            # the chunk outputs: hidden_states[last + 1], except the final one, which HF has normed
            for first, last in bounds:
                h_in = hs[first] if first > 0 else hs[0]
                h_out = hs[last + 1]
                logp = readout(h_out)[valid]
                with torch.no_grad():
                    logq = readout(h_in)[valid]
                ce = -logp.gather(1, tgt[:, None]).squeeze(1)
                kl = (logp.exp() * (logp - logq)).sum(-1)
                per_pos = alpha * ce + (1 - alpha) * kl
                total = total + (per_pos.sum() / n_all if token_level else per_pos.mean() / len(mbs))
        else:
            logp = F.log_softmax(out.logits.float(), dim=-1)[valid]
            ce = -logp.gather(1, tgt[:, None]).squeeze(1)
            total = total + (ce.sum() / n_all if token_level else ce.mean() / len(mbs))
    total.backward()
    for h in hooks:
        h.remove()
    return {n: p.grad.detach().clone() for n, p in params.items()}


def _stage_gradients(root) -> dict:
    grads = {}
    for d in sorted((root / "phones").glob("*/stages/test/stage_*")):
        ck = CheckpointStore(d).load()
        assert ck is not None and ck.window == 0, d
        grads.update({n[len("exp_avg/"):]: t / (1 - BETA1) for n, t in ck.optimizer.items() if n.startswith("exp_avg/")})
    return grads


def _rel(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


@pytest.mark.parametrize("schedule", ["zerolock", "gpipe"])
def test_window_gradient_is_the_token_level_mean(small_export, small_model_dir, tmp_path, schedule):
    out, manifest = small_export[0], small_export[1]
    mbs = _window(out)
    settings = RunSettings(windows=1, window_size=2, lr=1e-4, inflight_depth=2, schedule=schedule)
    result, _ = run_pipeline(out, tmp_path, settings, mbs)
    got = _stage_gradients(tmp_path)
    ref = _reference_grads(small_model_dir, out, manifest, mbs, schedule)
    old = _reference_grads(small_model_dir, out, manifest, mbs, schedule, token_level=False)
    assert set(got) == set(ref)
    moving = [n for n in ref if ref[n].abs().max() > 0]  # lora_A's gradient is 0 while lora_B is 0
    assert len(moving) >= len(ref) // 2
    for n in moving:
        assert _rel(got[n], ref[n]) < 1e-4, (n, _rel(got[n], ref[n]))
    # the mean of micro-batch means is a different gradient here: the test can tell them apart
    assert max(_rel(old[n], ref[n]) for n in moving) > 0.1


def test_window_gradients_weight_by_valid_positions():
    p = {"w": torch.zeros(2)}
    acc = WindowGradients(p)
    acc.add(0, {"w": torch.tensor([1.0, 0.0])}, 1)
    acc.add(0, {"w": torch.tensor([0.0, 1.0])}, 7)
    acc.add(0, {"w": torch.tensor([5.0, 5.0])}, 0)  # a padding-only micro-batch adds nothing
    assert torch.allclose(acc.mean(0)["w"], torch.tensor([1 / 8, 7 / 8]))
    acc.add(1, {"w": torch.tensor([3.0, 3.0])}, 0)
    assert torch.equal(acc.mean(1)["w"], torch.zeros(2))


# ------------------------------------------------------------------ --loss-positions refusal

def _batch_with_valid(counts, S=16):
    labels = np.full((len(counts), S), -100, dtype=np.int64)
    for r, n in enumerate(counts):
        labels[r, :n] = 5
    return {"labels": labels}


def test_check_loss_positions_refuses_with_the_fix():
    ok = [_batch_with_valid([4, 4]), _batch_with_valid([8, 0])]
    check_loss_positions(ok, 8, 2)  # exactly the capacity is fine
    bad = ok + [_batch_with_valid([6, 6]), _batch_with_valid([5, 4])]
    with pytest.raises(DataError) as e:
        check_loss_positions(bad, 8, 2)
    msg = str(e.value)
    assert "\n" not in msg
    assert "(2, 3)" in msg and "micro-batch 2 (tokenised rows 4-5) has 12" in msg
    assert "zl-export --loss-positions 12" in msg and "32" in msg


def test_zl_host_run_refuses_data_longer_than_the_program_reads(small_export, tmp_path, capsys):
    from host.cli.zl_host import main

    data = tmp_path / "long.jsonl"  # whole-text rows: every token is a target, > 8 per micro-batch
    words = "text : the market rose as stocks and shares traded higher topic : business"
    data.write_text("".join(json.dumps({"text": words}) + "\n" for _ in range(6)))
    rc = main(["run", "--program", str(small_export[0]), "--data", str(data), "--devices", "emulated:3",
               "--out", str(tmp_path / "r")])
    assert rc == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("zl-host: error:")]
    assert len(err) == 1, err
    assert "--loss-positions 8" in err[0] and "re-export with zl-export --loss-positions" in err[0]
    assert not (tmp_path / "r").exists()

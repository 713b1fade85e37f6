"""Generated answers judged as users judge them: for each held-out row the model writes its answer
to the last question (greedy, or sampled with a seed), which is compared with the reference by exact
match and token-level F1 (SQuAD's: lowercase, punctuation and extra spaces dropped, words counted),
the base model against the adapter."""
from __future__ import annotations

import itertools
import re
import string
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from host.evaluation.answers import answered_rows

SAMPLE_TEMPERATURE, SAMPLE_TOP_P = 0.7, 0.95  # --sample: a common chat setting


def last_turns(micro_batches: list[dict], n: int) -> list[tuple[list[int], list[int]]]:
    """Up to n rows as (prompt ids, reference ids): the reference is the row's last run of answer
    tokens (a chat's last assistant turn, a completion), the prompt every token before it."""
    out = []
    for real, labels, valid in itertools.islice(answered_rows(micro_batches), n):
        gaps = np.flatnonzero(np.diff(valid) > 1)
        start = valid[gaps[-1] + 1] if len(gaps) else valid[0]
        out.append((real[:start + 1].tolist(), labels[start:valid[-1] + 1].tolist()))
    return out
    return out


def normalize(text: str) -> list[str]:
    text = text.lower().translate(str.maketrans("", "", string.punctuation))
    return re.sub(r"\s+", " ", text).split()


def exact_match(pred: str, ref: str) -> float:
    return float(normalize(pred) == normalize(ref))


def token_f1(pred: str, ref: str) -> float:
    p, r = normalize(pred), normalize(ref)
    if not p or not r:
        return float(p == r)
    common = sum((Counter(p) & Counter(r)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(p), common / len(r)
    return 2 * precision * recall / (precision + recall)


def generate_both(model_dir: str, adapter_dir: Path, micro_batches: list[dict], tokenizer, n: int,
                  base_weights: str = "fp32", max_new_tokens: int | None = None, seed: int | None = None,
                  progress=None) -> dict:
    """{"rows": [{prompt, expected, base, adapter}], "base": {exact_match, f1}, "adapter": {...}, "n",
    "decoding"}. seed None: greedy; else sampled (SAMPLE_TEMPERATURE, SAMPLE_TOP_P) from that seed.
    max_new_tokens None: the longest reference's length + 4. `progress(done, total)` after each row."""
    from peft import PeftModel

    from exporter.base_weights import quantize_base
    from exporter.model_source import load_base_model

    pairs = last_turns(micro_batches, n)
    if not pairs:
        return {"rows": [], "n": 0}
    limit = max_new_tokens or max(len(r) for _, r in pairs) + 4
    model = load_base_model(model_dir)
    quantize_base(model, base_weights)
    model = PeftModel.from_pretrained(model, str(adapter_dir)).eval()
    eos = tokenizer.eos_token_id
    rows = []
    for k, (prompt, expected) in enumerate(pairs):
        ids = torch.tensor([prompt])
        answers = {}
        for name in ("base", "adapter"):
            if seed is not None:
                torch.manual_seed(seed + k)  # the same draws for both, row by row
            with torch.no_grad():
                if name == "base":
                    with model.disable_adapter():
                        out = _generate(model, ids, limit, eos, seed is not None)
                else:
                    out = _generate(model, ids, limit, eos, seed is not None)
            answers[name] = tokenizer.decode(out, skip_special_tokens=True).strip()
        ref = tokenizer.decode(expected, skip_special_tokens=True).strip()
        rows.append({"prompt": tokenizer.decode(prompt, skip_special_tokens=True).strip(), "expected": ref, **answers})
        if progress is not None:
            progress(k + 1, len(pairs))
    scores = {name: {"exact_match": float(np.mean([exact_match(r[name], r["expected"]) for r in rows])),
                     "f1": float(np.mean([token_f1(r[name], r["expected"]) for r in rows]))}
              for name in ("base", "adapter")}
    decoding = "greedy" if seed is None else f"sampled, T={SAMPLE_TEMPERATURE} top-p={SAMPLE_TOP_P}, seed {seed}"
    return {"rows": rows, "n": len(rows), "decoding": decoding, "max_new_tokens": limit, **scores}


def _generate(model, ids, max_new_tokens: int, eos: int | None, sample: bool) -> list[int]:
    """The continuation of ids [1, S] until eos or max_new_tokens, without the eos."""
    extra = dict(do_sample=True, temperature=SAMPLE_TEMPERATURE, top_p=SAMPLE_TOP_P, top_k=None) if sample else \
        dict(do_sample=False, temperature=None, top_p=None, top_k=None)
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         eos_token_id=eos, pad_token_id=eos if eos is not None else 0, **extra)
    new = out[0, ids.shape[1]:].tolist()
    return new[:new.index(eos)] if eos in new else new

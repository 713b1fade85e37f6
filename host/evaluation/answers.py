"""zl-host eval --show N: held-out prompts with the base model's and the adapter's answers side by
side (greedy decoding on the HF model, as evaluate() scores it)."""
from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import torch


def answered_rows(micro_batches: list[dict]):
    """(real ids, labels, labelled positions) of each row with an answer, in order; labels[i] is the
    target at position i (-100: none), so a prompt ends at an answer's first labelled position."""
    for b in micro_batches:
        for ids, labels, mask in zip(b["input_ids"], b["labels"], b["attention_mask"]):
            valid = np.flatnonzero(labels != -100)
            if len(valid):
                yield ids[mask > 0], labels, valid


def prompts_and_answers(micro_batches: list[dict], n: int) -> list[tuple[list[int], list[int]]]:
    """The first n rows with an answer: (prompt ids, expected answer ids)."""
    return [(real[:valid[0] + 1].tolist(), labels[valid].tolist())
            for real, labels, valid in itertools.islice(answered_rows(micro_batches), n)]


def side_by_side(model_dir: str, adapter_dir: Path, micro_batches: list[dict], tokenizer, n: int,
                 base_weights: str = "fp32", max_new_tokens: int = 8) -> list[dict]:
    """[{prompt, expected, base, adapter}] for the first n held-out rows."""
    from peft import PeftModel

    from exporter.base_weights import quantize_base
    from exporter.model_source import load_base_model

    model = load_base_model(model_dir)
    quantize_base(model, base_weights)
    model = PeftModel.from_pretrained(model, str(adapter_dir)).eval()
    eos = tokenizer.eos_token_id
    rows = []
    for prompt, expected in prompts_and_answers(micro_batches, n):
        ids = torch.tensor([prompt])
        answers = {}
        for name in ("base", "adapter"):
            with torch.no_grad():
                if name == "base":
                    with model.disable_adapter():
                        out = _greedy(model, ids, max_new_tokens, eos)
                else:
                    out = _greedy(model, ids, max_new_tokens, eos)
            answers[name] = tokenizer.decode(out, skip_special_tokens=True).strip()
        rows.append({"prompt": tokenizer.decode(prompt, skip_special_tokens=True).strip(),
                     "expected": tokenizer.decode(expected, skip_special_tokens=True).strip(), **answers})
    return rows


def _greedy(model, ids, max_new_tokens: int, eos: int | None) -> list[int]:
    """Greedy continuation of ids [1, S] until eos or max_new_tokens, without the eos."""
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False, temperature=None, top_p=None, top_k=None,
                         eos_token_id=eos, pad_token_id=eos if eos is not None else 0)
    new = out[0, ids.shape[1]:].tolist()
    return new[:new.index(eos)] if eos in new else new

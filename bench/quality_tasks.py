"""The quality study's two tasks on SmolLM2-135M (bench/quality_study.py), data and scoring:

  wordnet          WordNet noun gloss -> one of five categories (zl_common/data/wordnet.py);
                   scored by choice accuracy (argmax among the five label tokens)
  wordnet-reverse  WordNet noun gloss -> the synset's first lemma, written by the model
                   (zl_common/data/wordnet_reverse.py); scored by exact match of greedy generation

Both train on the answer tokens only (answer and eos), with the same encoding and micro-batches.
"""
from __future__ import annotations

import sys

import torch

TASKS = ("wordnet", "wordnet-reverse")
MAX_NEW_TOKENS = 12  # the longest two-word lemma is well under this many tokens


def load_task(task, tok, n_train, n_val, n_test, seq_len, data_seed=0):
    """(data, label_ids): data as bench/quality.py's make_data has it (encoded splits and their
    rows); label_ids the candidates of a classification task, [] for the generative one."""
    from zl_common.data import encode_examples, wordnet_splits
    from zl_common.data.wordnet_reverse import reverse_splits

    if task not in TASKS:
        sys.exit(f"bench/quality_tasks.py: unknown task {task!r}; use {', '.join(TASKS)}")
    splits = wordnet_splits(seed=data_seed) if task == "wordnet" else reverse_splits(seed=data_seed)
    have = {s: len(splits[s]) for s in splits}
    for name, n in (("train", n_train), ("validation", n_val), ("test", n_test)):
        if n > have[name]:
            sys.exit(f"bench/quality_tasks.py: {task} has {have[name]} {name} rows, {n} asked; lower the budget")
    out = {}
    for name, n in (("train", n_train), ("validation", n_val), ("test", n_test)):
        out[f"{name}_rows"] = list(splits[name][:n])
        out[name] = encode_examples(out[f"{name}_rows"], tok, seq_len)
        if len(out[name]) != n:
            sys.exit(f"bench/quality_tasks.py: {n - len(out[name])} {task} {name} rows lost their answer at "
                     f"--seq-len {seq_len}; raise it")
    if task == "wordnet":
        labels = sorted({e["completion"] for e in splits["train"]})
        label_ids = [tok(w, add_special_tokens=False)["input_ids"][0] for w in labels]
    else:
        label_ids = []
    return out, label_ids


def normalise(text: str) -> str:
    return " ".join(text.split())


@torch.no_grad()
def exact_match(model, tok, rows, seq_len, batch=16, max_new_tokens=MAX_NEW_TOKENS) -> dict:
    """Greedy generation after each row's prompt (tokenised as in training: bos + prompt, cut on the
    left to leave room for the answer), stopped at eos; exact match of the whitespace-normalised
    text against the completion. Returns the rate and a few (expected, generated) samples."""
    from zl_common.data.batching import _prompt_and_answer_ids

    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    eos = tok.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    prompts = []
    for r in rows:
        p, _ = _prompt_and_answer_ids(tok, r["prompt"], r["completion"])
        prompts.append(bos + p[max(0, len(bos) + len(p) - (seq_len - max_new_tokens)):])
    hits, samples = 0, []
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        L = max(len(p) for p in chunk)
        ids = torch.tensor([[pad] * (L - len(p)) + p for p in chunk])  # left padding: generation continues each row
        mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in chunk])
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=eos, pad_token_id=pad)
        for j, row in enumerate(rows[i:i + batch]):
            gen = out[j, L:].tolist()
            gen = gen[:gen.index(eos)] if eos in gen else gen
            text = normalise(tok.decode(gen, skip_special_tokens=True))
            ok = text == normalise(row["completion"])
            hits += ok
            if len(samples) < 8:
                samples.append([normalise(row["completion"]), text])
    return {"exact_match": hits / max(len(rows), 1), "rows": len(rows), "samples": samples}

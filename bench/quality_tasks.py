"""The quality study's two tasks on SmolLM2-135M (bench/quality_study.py), data and scoring:

  wordnet          WordNet noun gloss -> one of five categories (zl_common/data/wordnet.py);
                   scored by choice accuracy (argmax among the five label tokens)
  wordnet-reverse  WordNet noun gloss -> the synset's first lemma, written by the model
                   (zl_common/data/wordnet_reverse.py); scored by exact match of greedy generation
                   (zl_mobile.reference.metrics.exact_match)

Both train on the answer tokens only (answer and eos), with the same encoding and micro-batches.
"""
from __future__ import annotations

import sys

TASKS = ("wordnet", "wordnet-reverse")


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

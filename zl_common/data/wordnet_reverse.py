"""WordNet's reverse dictionary: a noun's definition in, the word out (a generative task).

Each noun synset in Debian's ``wordnet-base`` (``data.noun``) gives one example: the prompt is its
cleaned gloss, the answer the synset's first lemma (``grey_fox`` -> ``grey fox``), which the model
has to write; scoring is exact match of what it generates. Kept: noun synsets of every
lexicographer category (``categories`` narrows them), lemmas of at most
``MAX_WORDS`` plain words (letters, hyphen, apostrophe), only senses of the lemma that WordNet's
sense-tagged corpus saw (``index.noun``'s tagsense_cnt: the first senses of each lemma; this keeps
common words such as "beetle" and drops the genus names and rare species a 135M model cannot
know), and only glosses that do not spell out their own answer (a lemma that appears in its gloss
is a copy task, not a definition). A gloss shared by two synsets appears once. Split 80/10/10 by a
seed.

``--data wordnet-reverse`` (train), ``wordnet-reverse:validation``, ``wordnet-reverse:test``.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from pathlib import Path

from .examples import DataError, LoadedExamples
from .wordnet import _FIX, LEXNAMES, SPLIT_FRACTIONS, SPLITS, clean_gloss, parse_spec, wordnet_dir

NAME = "wordnet-reverse"
MAX_WORDS = 2
PROMPT_PREFIX, PROMPT_SUFFIX = "definition :", "word :"
_LEMMA = re.compile(r"^[A-Za-z][A-Za-z'-]*( [A-Za-z][A-Za-z'-]*)*$")


def format_prompt(gloss: str) -> str:
    return f"{PROMPT_PREFIX} {' '.join(gloss.split())} {PROMPT_SUFFIX}"


def tagged_senses(directory: Path | str | None = None) -> set[tuple[str, str]]:
    """(lemma, synset offset) of every noun sense the sense-tagged corpus counted (``index.noun``:
    lemma pos synset_cnt p_cnt [ptr...] sense_cnt tagsense_cnt offsets, most frequent first)."""
    path = Path(directory or wordnet_dir()) / "index.noun"
    if not path.is_file():
        raise DataError(f"WordNet's index.noun not found at {path}; {_FIX}")
    out = set()
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            parts = line.split()
            if line.startswith("  ") or len(parts) < 6 or not parts[3].isdigit():
                continue
            rest = parts[4 + int(parts[3]):]
            if len(rest) < 2 or not rest[1].isdigit():
                continue
            out.update((parts[0], o) for o in rest[2:2 + int(rest[1])])
    return out


def read_reverse_pairs(directory: Path | str | None = None,
                       categories=None) -> list[tuple[str, str, str]]:
    """(category, gloss, lemma) for every kept noun synset of ``data.noun``, in file order."""
    cats = set(categories or LEXNAMES.values())
    path = Path(directory or wordnet_dir()) / "data.noun"
    if not path.is_file():
        raise DataError(f"WordNet's data.noun not found at {path}; {_FIX}")
    common = tagged_senses(directory)
    out = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.startswith("  ") or "|" not in line:
                continue
            fields, gloss = line.split("|", 1)
            parts = fields.split()
            if len(parts) < 5 or parts[2] != "n" or not parts[1].isdigit():
                continue
            category = LEXNAMES.get(int(parts[1]))
            lemma = parts[4].replace("_", " ")
            text = clean_gloss(gloss)
            if category not in cats or len(text.split()) < 2 or not _LEMMA.match(lemma):
                continue
            if (parts[4].lower(), parts[0]) not in common:
                continue  # a sense the tagged corpus never saw: rare
            if len(lemma.split()) > MAX_WORDS:
                continue
            words = set(re.findall(r"[a-z']+", text.lower()))
            if any(w.lower() in words for w in re.split(r"[ -]", lemma)):
                continue  # the gloss names its answer
            out.append((category, text, lemma))
    if not out:
        raise DataError(f"{path}: no usable noun synsets read for {', '.join(sorted(cats))}; {_FIX}")
    return out


def reverse_splits(directory: Path | str | None = None, categories=None,
                   seed: int = 0) -> dict[str, LoadedExamples]:
    """{"train", "validation", "test"} -> prompt/completion examples; same seed, same splits."""
    seen: set[str] = set()
    pairs = []
    for _, text, lemma in read_reverse_pairs(directory, categories):
        if text not in seen:
            seen.add(text)
            pairs.append((text, lemma))
    pairs.sort()
    random.Random(seed).shuffle(pairs)
    n_train = int(round(len(pairs) * SPLIT_FRACTIONS[0]))
    n_val = int(round(len(pairs) * SPLIT_FRACTIONS[1]))
    parts = {"train": pairs[:n_train], "validation": pairs[n_train:n_train + n_val],
             "test": pairs[n_train + n_val:]}
    source = str(Path(directory or wordnet_dir()) / "data.noun")
    return {s: LoadedExamples([{"prompt": format_prompt(t), "completion": f" {w}"} for t, w in parts[s]],
                              source=f"{source} (reverse dictionary, {s}, seed {seed})",
                              n_read=len(parts[s]), rejected=Counter())
            for s in SPLITS}


def load_wordnet_reverse(spec: str = NAME, seed: int = 0) -> LoadedExamples:
    return reverse_splits(seed=seed)[parse_spec(spec, NAME) or "train"]

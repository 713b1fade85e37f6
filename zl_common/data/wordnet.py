"""WordNet noun glosses labelled by their lexicographer category: a real labelled English text set
that a registry package ships (Debian's ``wordnet-base``: ``apt-get install wordnet-base``).

Each noun synset in WordNet's ``data.noun`` has a gloss (its definition) and a lexicographer file
(``noun.animal``, ``noun.food``, ...; the number in the synset's second field, see lexnames(5WN)).
The task: read the definition, answer its category. A handful of well-separated categories is
kept, balanced (each cut to the smallest one's size), and split into train / validation / test by
a seed, fixed per class so every split is balanced too. Prompts and answers are built as for AG
News (``format_prompt`` / ``format_completion``), so the loss is on the answer tokens only.

``--data wordnet`` (the train split), ``wordnet:validation``, ``wordnet:test``; the database is
read from ``$WNSEARCHDIR`` (WordNet's own variable) or ``/usr/share/wordnet``.
"""

from __future__ import annotations

import os
import random
from collections import Counter
from pathlib import Path

from .examples import DataError, LoadedExamples
from .synthetic import format_completion, format_prompt

DEFAULT_DIR = "/usr/share/wordnet"
SPLITS = ("train", "validation", "test")
SPLIT_FRACTIONS = (0.8, 0.1, 0.1)

# lexicographer file numbers of the noun categories (WordNet 3.0, lexnames(5WN))
LEXNAMES = {3: "noun.Tops", 4: "noun.act", 5: "noun.animal", 6: "noun.artifact", 7: "noun.attribute",
            8: "noun.body", 9: "noun.cognition", 10: "noun.communication", 11: "noun.event",
            12: "noun.feeling", 13: "noun.food", 14: "noun.group", 15: "noun.location", 16: "noun.motive",
            17: "noun.object", 18: "noun.person", 19: "noun.phenomenon", 20: "noun.plant",
            21: "noun.possession", 22: "noun.process", 23: "noun.quantity", 24: "noun.relation",
            25: "noun.shape", 26: "noun.state", 27: "noun.substance", 28: "noun.time"}

# the default task: five categories whose glosses rarely overlap, each answered by one word
DEFAULT_CATEGORIES = {"noun.animal": "animal", "noun.plant": "plant", "noun.food": "food",
                      "noun.artifact": "object", "noun.location": "place"}

_FIX = "install WordNet's database (Debian: apt-get install wordnet-base) or set WNSEARCHDIR to its folder"


def wordnet_dir() -> Path:
    return Path(os.environ.get("WNSEARCHDIR") or DEFAULT_DIR)


def clean_gloss(gloss: str) -> str:
    """The definition part of a gloss: example sentences (``; "..."``) dropped."""
    definition = gloss.split('; "')[0].split(' "')[0] if '"' in gloss else gloss
    return " ".join(definition.strip().rstrip(";").split())


def read_noun_glosses(directory: Path | str | None = None) -> list[tuple[str, str]]:
    """(lexicographer category, cleaned gloss) of every noun synset in ``data.noun``."""
    path = Path(directory or wordnet_dir()) / "data.noun"
    if not path.is_file():
        raise DataError(f"WordNet's data.noun not found at {path}; {_FIX}")
    out = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            if line.startswith("  ") or "|" not in line:
                continue  # the license header, or not a synset line
            fields, gloss = line.split("|", 1)
            parts = fields.split()
            if len(parts) < 3 or parts[2] != "n" or not parts[1].isdigit():
                continue
            category = LEXNAMES.get(int(parts[1]))
            text = clean_gloss(gloss)
            if category and len(text.split()) >= 2:
                out.append((category, text))
    if not out:
        raise DataError(f"{path}: no noun synsets read (not WordNet's data.noun format); {_FIX}")
    return out


def wordnet_splits(directory: Path | str | None = None, categories: dict[str, str] | None = None,
                   seed: int = 0, per_class: int | None = None) -> dict[str, LoadedExamples]:
    """{"train", "validation", "test"} -> balanced prompt/completion examples.

    ``categories``: lexicographer name -> answer word (default ``DEFAULT_CATEGORIES``);
    ``per_class``: cap each category at this many synsets before splitting (default: the
    smallest category's size). Same seed, same splits."""
    categories = dict(categories or DEFAULT_CATEGORIES)
    unknown = sorted(set(categories) - set(LEXNAMES.values()))
    if unknown:
        raise DataError(f"unknown WordNet categories {', '.join(unknown)}; use noun lexicographer names such "
                        f"as {', '.join(sorted(DEFAULT_CATEGORIES))}")
    by_class: dict[str, list[str]] = {c: [] for c in categories}
    seen: set[str] = set()
    for category, text in read_noun_glosses(directory):
        if category in by_class and text not in seen:  # a gloss shared by two synsets appears once
            seen.add(text)
            by_class[category].append(text)
    empty = [c for c, xs in by_class.items() if not xs]
    if empty:
        raise DataError(f"WordNet at {directory or wordnet_dir()} has no glosses for {', '.join(empty)}; {_FIX}")
    n = min(len(xs) for xs in by_class.values())
    if per_class is not None:
        n = min(n, per_class)
    rng = random.Random(seed)
    splits: dict[str, list[dict]] = {s: [] for s in SPLITS}
    for category in sorted(categories):  # a fixed order: the split depends on the seed only
        texts = sorted(by_class[category])
        rng.shuffle(texts)
        texts = texts[:n]
        n_train = int(round(n * SPLIT_FRACTIONS[0]))
        n_val = int(round(n * SPLIT_FRACTIONS[1]))
        parts = {"train": texts[:n_train], "validation": texts[n_train:n_train + n_val],
                 "test": texts[n_train + n_val:]}
        for s, xs in parts.items():
            splits[s].extend({"prompt": format_prompt(t), "completion": format_completion(categories[category])}
                             for t in xs)
    source = str(Path(directory or wordnet_dir()) / "data.noun")
    out = {}
    for s in SPLITS:
        rows = splits[s]
        random.Random(f"{seed}-{s}").shuffle(rows)  # classes interleaved, not in blocks
        out[s] = LoadedExamples(rows, source=f"{source} ({s}, seed {seed})", n_read=len(rows), rejected=Counter())
    return out


def parse_spec(spec: str, name: str = "wordnet") -> str | None:
    """``NAME`` -> "train", ``NAME:SPLIT`` -> SPLIT; None for anything else (NAME: wordnet, or a
    task built on the same splits, such as wordnet-reverse)."""
    if spec == name:
        return "train"
    if spec.startswith(name + ":"):
        split = spec.split(":", 1)[1]
        if split not in SPLITS:
            raise DataError(f"unknown WordNet split {split!r} in --data {spec}; use {name}, {name}:validation "
                            f"or {name}:test")
        return split
    return None


def load_wordnet(spec: str = "wordnet", seed: int = 0) -> LoadedExamples:
    return wordnet_splits(seed=seed)[parse_spec(spec) or "train"]

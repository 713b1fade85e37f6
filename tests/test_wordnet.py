"""The WordNet task (zl_common/data/wordnet.py): noun glosses labelled by lexicographer category, read
from a fixture in WordNet's data.noun format and from Debian's wordnet-base (.ci/run installs it)."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from exporter.tiny_tokenizer import build_tiny_tokenizer
from zl_common.data import DataError, encode_examples, load_examples, wordnet_splits
from zl_common.data.wordnet import DEFAULT_DIR, read_noun_glosses

FIXTURE = Path(__file__).parent / "data" / "wordnet"
THREE = {"noun.animal": "animal", "noun.food": "food", "noun.plant": "plant"}


def test_reads_synsets_category_and_definition_only():
    rows = read_noun_glosses(FIXTURE)
    cats = Counter(c for c, _ in rows)
    assert cats == {"noun.animal": 4, "noun.food": 4, "noun.plant": 4, "noun.location": 4, "noun.artifact": 4,
                    "noun.act": 1}
    texts = dict((t, c) for c, t in rows)
    # the example sentence after the definition is dropped; the license header is not a synset
    assert "small fox of the woodlands of North America with a grey coat" in texts
    assert not any('"' in t or "fixture" in t for t in texts)
    assert "oat" not in texts  # a one-word gloss is skipped


def test_splits_are_balanced_disjoint_and_fixed_by_seed():
    a = wordnet_splits(FIXTURE, THREE, seed=0)
    b = wordnet_splits(FIXTURE, THREE, seed=0)
    c = wordnet_splits(FIXTURE, THREE, seed=5)
    assert {s: list(v) for s, v in a.items()} == {s: list(v) for s, v in b.items()}
    assert {s: list(v) for s, v in a.items()} != {s: list(v) for s, v in c.items()}
    assert [len(a[s]) for s in ("train", "validation", "test")] == [9, 0, 3]  # 4 per class: 3 / 0 / 1
    for s in a:
        assert set(Counter(e["completion"] for e in a[s]).values()) <= {len(a[s]) // 3}
    prompts = [e["prompt"] for s in a for e in a[s]]
    assert len(prompts) == len(set(prompts)) == 12
    ex = a["train"][0]
    assert ex["prompt"].startswith("text : ") and ex["prompt"].endswith(" topic :")  # as AG News
    assert ex["completion"] in {" animal", " food", " plant"}


def test_the_loss_is_on_the_answer_only():
    tok = build_tiny_tokenizer()
    ex = wordnet_splits(FIXTURE, THREE)["train"][:4]
    enc = encode_examples(ex, tok, 64)
    for e, row in zip(ex, enc):
        answer = tok(e["completion"], add_special_tokens=False)["input_ids"]
        assert row.n_targets == len(answer) + 1  # the answer's tokens and eos
        assert list(row.labels[row.labels != -100][:-1]) == answer


def test_data_wordnet_via_load_examples(monkeypatch):
    monkeypatch.setenv("WNSEARCHDIR", str(FIXTURE))
    train, test = load_examples("wordnet"), load_examples("wordnet:test")
    assert len(train) == 15 and len(test) == 5  # five default categories, 4 synsets each: 3 / 0 / 1
    assert {e["completion"] for e in test} == {" animal", " plant", " food", " object", " place"}


def test_bad_specs_name_the_fix(monkeypatch, tmp_path):
    with pytest.raises(DataError, match=r"unknown WordNet split 'dev' in --data wordnet:dev; use wordnet, "):
        load_examples("wordnet:dev")
    monkeypatch.setenv("WNSEARCHDIR", str(tmp_path))
    with pytest.raises(DataError, match=r"data.noun not found at .*apt-get install wordnet-base"):
        load_examples("wordnet")
    with pytest.raises(DataError, match="unknown WordNet categories noun.fish"):
        wordnet_splits(FIXTURE, {"noun.fish": "fish"})


def test_the_real_wordnet_database():
    """Debian's wordnet-base (WordNet 3.0): five categories, 2057 / 257 / 257 synsets each."""
    s = wordnet_splits(DEFAULT_DIR, seed=0)
    for name, n in (("train", 2057), ("validation", 257), ("test", 257)):
        counts = Counter(e["completion"] for e in s[name])
        assert counts == {f" {w}": n for w in ("animal", "plant", "food", "object", "place")}, name
    train = {e["prompt"] for e in s["train"]}
    assert not train & {e["prompt"] for e in s["test"]}

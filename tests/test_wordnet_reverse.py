"""The reverse-dictionary task (zl_common/data/wordnet_reverse.py): gloss in, the synset's first lemma
out; read from small files in WordNet's data.noun / index.noun formats, and from Debian's wordnet-base."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from exporter.model_source import build_tiny_model
from exporter.tiny_tokenizer import build_tiny_tokenizer
from zl_common.data import DataError, encode_examples, load_examples
from zl_common.data.wordnet_reverse import read_reverse_pairs, reverse_splits
from zl_mobile.reference.metrics import exact_match

# offset lexfile n w_cnt lemma lex_id ... | gloss   (05 animal, 13 food, 20 plant)
DATA = """\
  1 A fixture in the format of WordNet 3.0's data.noun; not WordNet's synsets.
00001000 05 n 02 grey_fox 0 gray_fox 0 000 | small canine of the woodlands with a silver coat; "a grey fox crossed"
00001100 05 n 01 kitten 0 000 | young domestic cat
00001200 05 n 01 heron 0 000 | a wading bird with long legs
00001300 05 n 01 Ardea 0 000 | type genus of the herons
00001400 05 n 01 bird 0 000 | a warm-blooded bird that lays eggs
00001500 13 n 01 apple_pie_a_la_mode 0 000 | pie served with ice cream
00001600 13 n 01 bread 0 000 | food made from dough of flour and water and baked
00001700 20 n 01 oak 0 000 | a tree of the genus Quercus
00001800 20 n 01 fern 0 000 | a flowerless plant with fronds
00001900 20 n 01 moss 0 000 | a flowerless plant with fronds
00002000 13 n 01 C3PO 0 000 | a food that is not one
"""
# lemma pos synset_cnt p_cnt [ptrs] sense_cnt tagsense_cnt offsets (tagged senses first)
INDEX = """\
  1 A fixture in the format of WordNet 3.0's index.noun.
ardea n 1 0 1 0 00001300
apple_pie_a_la_mode n 1 0 1 1 00001500
bird n 1 0 1 1 00001400
bread n 1 0 1 1 00001600
c3po n 1 0 1 1 00002000
fern n 1 0 1 1 00001800
grey_fox n 1 0 1 1 00001000
heron n 1 1 @ 1 1 00001200
kitten n 1 0 1 1 00001100
moss n 1 0 1 1 00001900
oak n 1 0 1 1 00001700
"""


@pytest.fixture()
def wn(tmp_path) -> Path:
    (tmp_path / "data.noun").write_text(DATA)
    (tmp_path / "index.noun").write_text(INDEX)
    return tmp_path


def test_first_lemma_of_common_senses_whose_gloss_does_not_name_it(wn):
    pairs = {lemma: (cat, gloss) for cat, gloss, lemma in read_reverse_pairs(wn)}
    # grey fox: first lemma, underscores to spaces, example sentence gone
    assert pairs["grey fox"] == ("noun.animal", "small canine of the woodlands with a silver coat")
    assert pairs["kitten"][0] == "noun.animal" and pairs["bread"][0] == "noun.food"
    assert "Ardea" not in pairs  # a sense the tagged corpus never saw (tagsense_cnt 0)
    assert "bird" not in pairs  # its gloss names the answer
    assert "oak" in pairs and "heron" in pairs  # a pointer field in index.noun is skipped correctly
    assert "apple pie a la mode" not in pairs and "C3PO" not in pairs  # over two words; not a plain word
    only = read_reverse_pairs(wn, categories=["noun.plant"])
    assert {lemma for _, _, lemma in only} == {"oak", "fern", "moss"}


def test_splits_fixed_by_seed_disjoint_and_a_shared_gloss_once(wn):
    a, b, c = reverse_splits(wn, seed=0), reverse_splits(wn, seed=0), reverse_splits(wn, seed=3)
    rows = lambda s: [(e["prompt"], e["completion"]) for k in ("train", "validation", "test") for e in s[k]]  # noqa: E731
    assert rows(a) == rows(b) and rows(a) != rows(c)
    prompts = [p for p, _ in rows(a)]
    assert len(prompts) == len(set(prompts)) == 6  # fern and moss share a gloss: kept once
    assert [len(a[k]) for k in ("train", "validation", "test")] == [5, 1, 0]
    e = next(e for e in a["train"] + a["validation"] if e["completion"] == " kitten")
    assert e["prompt"] == "definition : young domestic cat word :"


def test_the_loss_is_on_the_written_word_and_eos():
    tok = build_tiny_tokenizer()
    enc = encode_examples([{"prompt": "definition : world word :", "completion": " sports"}], tok, 16)[0]
    targets = [int(t) for t in enc.labels if t != -100]
    assert targets == [tok.convert_tokens_to_ids("sports"), tok.eos_token_id]


def test_specs_and_errors(wn, monkeypatch, tmp_path):
    monkeypatch.setenv("WNSEARCHDIR", str(wn))
    assert len(load_examples("wordnet-reverse")) == 5 and len(load_examples("wordnet-reverse:validation")) == 1
    with pytest.raises(DataError, match="wordnet-reverse:validation"):
        load_examples("wordnet-reverse:dev")
    (tmp_path / "only").mkdir()
    (tmp_path / "only" / "data.noun").write_text(DATA)
    monkeypatch.setenv("WNSEARCHDIR", str(tmp_path / "only"))
    with pytest.raises(DataError, match="index.noun not found.*apt-get install wordnet-base"):
        load_examples("wordnet-reverse")


def test_exact_match_is_the_same_alone_and_left_padded_in_a_batch():
    """Greedy generation from a row is what it is alone, whatever longer rows share its batch."""
    tok = build_tiny_tokenizer()
    model = build_tiny_model().eval()
    rows = [{"prompt": "text : world sports business world sports topic :", "completion": " sports"},
            {"prompt": "text : world topic :", "completion": " world"}]
    alone = [exact_match(model, tok, [r], seq_len=32, max_new_tokens=4)["samples"][0] for r in rows]
    together = exact_match(model, tok, rows, seq_len=32, max_new_tokens=4)
    assert together["samples"] == alone
    # scoring: a row whose expected text is what the model wrote counts, the other does not
    wrote = alone[1][1]
    hit = exact_match(model, tok, [{"prompt": rows[1]["prompt"], "completion": " " + wrote}], 32, max_new_tokens=4)
    assert hit["exact_match"] == (1.0 if wrote else 0.0)


def test_the_real_wordnet_database():
    s = reverse_splits()
    assert len(s["train"]) > 6000 and len(s["validation"]) > 500 and len(s["test"]) > 500
    assert {"prompt": "definition : young domestic cat word :", "completion": " kitten"} in (
        s["train"] + s["validation"] + s["test"])
    assert torch.tensor([len(e["completion"].split()) for e in s["train"]]).max() <= 2

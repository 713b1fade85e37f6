"""zl_common.data (synthetic set, loaders, encoding, micro-batches), exporter.tiny_tokenizer and
zl_mobile.readout."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exporter.tiny_tokenizer import TINY_VOCAB_SIZE, build_tiny_tokenizer, tiny_vocab
from zl_common.data import (
    DEFAULT_SYNTHETIC_N,
    IGNORE_INDEX,
    LABELS,
    DataError,
    encode_examples,
    load_examples,
    make_microbatches,
    synthetic_examples,
    synthetic_vocabulary,
)
from zl_mobile.readout import readout_positions


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def ids_of(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


# ------------------------------------------------------------------ synthetic + tokenizer

def test_synthetic_is_deterministic_and_balanced():
    a, b = synthetic_examples(400, seed=3), synthetic_examples(400, seed=3)
    assert a == b
    assert synthetic_examples(400, seed=4) != a
    assert synthetic_examples(5, seed=3) == synthetic_examples(5, seed=3)
    counts = Counter(ex["completion"] for ex in a)
    assert counts == {f" {label}": 100 for label in LABELS}
    for ex in a:
        assert set(ex) == {"prompt", "completion"}
        assert ex["prompt"].startswith("text : ") and ex["prompt"].endswith(" topic :")
        assert ex["completion"].startswith(" ") and ex["completion"][1:] in LABELS
    assert len({ex["prompt"] for ex in a}) > 300  # varied, not a handful of repeats
    assert synthetic_examples(0) == []
    with pytest.raises(ValueError):
        synthetic_examples(-1)


def test_synthetic_classes_are_learnable_from_keywords():
    """Words seen in one class only predict the class of held-out examples almost always."""
    train = synthetic_examples(2000, seed=0)
    seen: dict[str, set] = {}
    for ex in train:
        for w in ex["prompt"].split():
            seen.setdefault(w, set()).add(ex["completion"])
    exclusive = {w: next(iter(c)) for w, c in seen.items() if len(c) == 1}
    test = synthetic_examples(400, seed=1)
    correct = 0
    for ex in test:
        votes = Counter(exclusive[w] for w in ex["prompt"].split() if w in exclusive)
        correct += bool(votes) and votes.most_common(1)[0][0] == ex["completion"]
    assert correct / len(test) > 0.97


def test_tiny_tokenizer_covers_synthetic_vocab(tok):
    vocab = tok.get_vocab()
    assert [vocab[t] for t in ("<unk>", "<s>", "</s>", "<pad>")] == [0, 1, 2, 3]
    assert (tok.unk_token_id, tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2, 3)
    assert TINY_VOCAB_SIZE == 512 and len(tok) <= TINY_VOCAB_SIZE
    assert max(vocab.values()) < TINY_VOCAB_SIZE
    assert set(synthetic_vocabulary()) <= set(vocab)
    for ex in synthetic_examples(1000, seed=7):
        ids = ids_of(tok, ex["prompt"] + ex["completion"])
        assert tok.unk_token_id not in ids
        assert len(ids) == len((ex["prompt"] + ex["completion"]).split())  # one id per word
    # lowercase normalisation, unknown words, special tokens kept whole
    assert ids_of(tok, "TOPIC") == ids_of(tok, "topic")
    assert ids_of(tok, "zebra") == [0]
    assert tok.tokenize("<s> sports </s>") == ["<s>", "sports", "</s>"]
    # Llama-like: bos prepended, eos never appended
    assert tok("topic")["input_ids"] == [1] + ids_of(tok, "topic")


def test_tiny_tokenizer_is_deterministic_and_round_trips(tok, tmp_path):
    assert build_tiny_tokenizer().get_vocab() == tok.get_vocab() == tiny_vocab()
    from transformers import AutoTokenizer
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again.get_vocab() == tok.get_vocab()
    assert (again.bos_token, again.eos_token, again.pad_token, again.unk_token) == \
        ("<s>", "</s>", "<pad>", "<unk>")
    text = "Text : The striker SCORED the final . topic : sports"
    assert again(text)["input_ids"] == tok(text)["input_ids"]
    assert again.decode(tok(text)["input_ids"], skip_special_tokens=True) == text.lower()


# ------------------------------------------------------------------ loaders

AG_ROWS = (
    '3,"Wall St. Bears Claw Back Into the Black (Reuters)","Reuters - Short-sellers, '
    'Wall Street\'s dwindling\\band of ultra-cynics, are seeing green again."\n'
    '2,Phelps Wins Again,"ATHENS - Michael Phelps won his #39;fifth gold&lt;b&gt;, '
    'in the 200m."\n'
    '4,"New Chip, Faster","Intel said on Monday it will ship a chip."\n'
    '1,Talks Resume,Diplomats met in Geneva.\n'
)


def write(tmp_path, name, text, mode="w"):
    p = tmp_path / name
    if mode == "wb":
        p.write_bytes(text)
    else:
        p.write_text(text, encoding="utf-8")
    return str(p)


@pytest.mark.parametrize("header", ["", "Class Index,Title,Description\n"])
def test_ag_news_csv_with_and_without_header(tmp_path, header):
    rows = load_examples(write(tmp_path, "ag.csv", header + AG_ROWS))
    assert [r["completion"] for r in rows] == [" business", " sports", " science", " world"]
    assert rows.n_read == 4 and rows.n_rejected == 0
    first = rows[0]["prompt"]
    assert first == ("text : Wall St. Bears Claw Back Into the Black (Reuters) . Reuters - "
                     "Short-sellers, Wall Street's dwindling band of ultra-cynics, are "
                     "seeing green again. topic :")
    # quoted commas stay inside the field; AG escapes are undone
    assert "Phelps Wins Again . ATHENS - Michael Phelps won his 'fifth gold<b>, in the 200m." \
        in rows[1]["prompt"]
    assert rows[2]["prompt"] == ("text : New Chip, Faster . Intel said on Monday it will ship "
                                 "a chip. topic :")


def test_ag_news_csv_class_names_hf_layout_and_partial_rejects(tmp_path):
    rows = load_examples(write(tmp_path, "names.csv",
                               'Sci/Tech,A,b\nWorld,C,d\n7,bad,class\n2,"too","many","cols"\n'
                               '3,,\n'))
    assert [r["completion"] for r in rows] == [" science", " world"]
    assert rows.n_read == 5
    assert rows.rejected == Counter({"rows with a class outside 1-4": 1,
                                     "rows with 4 columns instead of 3": 1,
                                     "rows with empty title and description": 1})
    hf = load_examples(write(tmp_path, "hf.csv", 'text,label\n"Stocks fell, again",2\nGoal!,1\n'))
    assert [r["completion"] for r in hf] == [" business", " sports"]
    assert hf[0]["prompt"] == "text : Stocks fell, again topic :"


def test_jsonl_prompt_completion_and_text(tmp_path):
    lines = [json.dumps({"prompt": "q :", "completion": " a"}), "",
             json.dumps({"text": "free text, all trained"}),
             "{not json", json.dumps([1, 2]), json.dumps({"prompt": "x"}),
             json.dumps({"prompt": "x", "completion": "  "}), json.dumps({"text": 3}),
             json.dumps({"other": 1})]
    rows = load_examples(write(tmp_path, "d.jsonl", "\n".join(lines) + "\n"))
    assert list(rows) == [{"prompt": "q :", "completion": " a"},
                          {"text": "free text, all trained"}]
    assert rows.n_read == 8 and rows.n_rejected == 6
    arr = load_examples(write(tmp_path, "d.json", json.dumps([{"text": "t"}, {"x": 1}])))
    assert list(arr) == [{"text": "t"}] and arr.n_rejected == 1
    one_line = load_examples(write(tmp_path, "e.json", json.dumps({"text": "t"})))
    assert list(one_line) == [{"text": "t"}]


def test_load_none_is_synthetic():
    rows = load_examples(None)
    assert len(rows) == DEFAULT_SYNTHETIC_N and rows.source == "synthetic"
    assert list(rows) == synthetic_examples(DEFAULT_SYNTHETIC_N, seed=0)


def test_error_messages(tmp_path):
    def err(path):
        with pytest.raises(DataError) as e:
            load_examples(path)
        msg = str(e.value)
        assert "\n" not in msg
        return msg

    m = err(str(tmp_path / "nope.csv"))
    assert "not found" in m and "nope.csv" in m and "synthetic" in m
    m = err(str(tmp_path))
    assert "directory" in m
    m = err(write(tmp_path, "data.parquet", "x"))
    assert m.startswith(f"{tmp_path / 'data.parquet'}: not a readable Parquet file") and "to_parquet" in m
    m = err(write(tmp_path, "data.xlsx", "x"))
    assert "unknown data format '.xlsx'" in m and ".csv" in m and ".jsonl" in m and ".parquet" in m
    m = err(write(tmp_path, "README", "x"))
    assert "(no extension)" in m
    m = err(write(tmp_path, "bad.csv", "9,a,b\n0,c,d\n1,only two\n"))
    assert m.startswith(f"{tmp_path / 'bad.csv'}: no usable rows (3 rows read")
    assert "2 rows with a class outside 1-4" in m and "1 rows with 2 columns instead of 3" in m
    assert "expected AG News rows" in m
    m = err(write(tmp_path, "empty.csv", ""))
    assert "0 rows read" in m and "the file is empty" in m
    m = err(write(tmp_path, "bad.jsonl", '{"foo": 1}\nnot json\n'))
    assert "2 rows read" in m and "1 lines that are not valid JSON" in m
    assert '"prompt"' in m and '"text"' in m
    m = err(write(tmp_path, "latin.csv", b"1,caf\xe9,x\n", mode="wb"))
    assert "not UTF-8" in m


# ------------------------------------------------------------------ encoding

def test_labels_are_shifted_onto_answer_tokens(tok):
    ex = {"prompt": "text : the striker scored . topic :", "completion": " sports"}
    (enc,) = encode_examples([ex], tok, seq_len=32)
    p = ids_of(tok, ex["prompt"])
    sports = ids_of(tok, "sports")[0]
    assert enc.input_ids.tolist() == [1] + p + [sports, 2]
    expected = [IGNORE_INDEX] * len(enc.input_ids)
    expected[len(p)] = sports        # position of the last prompt token (":") predicts "sports"
    expected[len(p) + 1] = 2         # "sports" predicts eos
    assert enc.labels.tolist() == expected
    assert enc.input_ids.dtype == np.int64 and enc.labels.dtype == np.int64
    # the label at i is the input at i+1 wherever it is a target
    idx = np.flatnonzero(enc.labels != IGNORE_INDEX)
    assert (enc.labels[idx] == enc.input_ids[idx + 1]).all()

    (no_eos,) = encode_examples([ex], tok, seq_len=32, eos_is_target=False)
    assert np.flatnonzero(no_eos.labels != IGNORE_INDEX).tolist() == [len(p)]


def test_multi_token_answer_and_text_rows(tok):
    ex = {"prompt": "topic :", "completion": " world sports"}
    (enc,) = encode_examples([ex], tok, seq_len=16)
    w, s = ids_of(tok, "world sports")
    assert enc.input_ids.tolist() == [1, *ids_of(tok, "topic :"), w, s, 2]
    assert enc.labels.tolist() == [-100, -100, w, s, 2, -100]
    (txt,) = encode_examples([{"text": "the final . topic"}], tok, seq_len=16)
    t = ids_of(tok, "the final . topic")
    assert txt.input_ids.tolist() == [1, *t, 2]
    assert txt.labels.tolist() == [*t, 2, -100]
    (cut,) = encode_examples([{"text": "the final . topic"}], tok, seq_len=3)
    assert cut.input_ids.tolist() == [1, *t[:2]] and cut.labels.tolist() == [*t[:2], -100]


def test_answer_boundary_with_a_bpe_tokenizer():
    """Byte-level BPE merges the completion's leading space into its first token: the answer
    tokens must be those of the joined text, and decode back to exactly the completion."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    exs = synthetic_examples(200, seed=9)
    bpe.train_from_iterator([e["prompt"] + e["completion"] for e in exs],
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<s>", "</s>"]))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>")
    for e in encode_examples(exs[:20], tok, seq_len=64):
        targets = e.labels[e.labels != IGNORE_INDEX].tolist()
        assert targets[-1] == tok.eos_token_id
        assert tok.decode(targets[:-1]) in {f" {label}" for label in LABELS}
        assert e.input_ids[0] == tok.bos_token_id


def test_truncation_keeps_the_answer(tok):
    ex = {"prompt": "text : the striker scored . topic :", "completion": " sports"}
    p, sports = ids_of(tok, ex["prompt"]), ids_of(tok, "sports")[0]
    out = encode_examples([ex], tok, seq_len=6)
    assert out.n_truncated == 1
    (enc,) = out
    assert enc.input_ids.tolist() == [1, *p[-3:], sports, 2]   # bos kept, prompt cut on the left
    assert enc.labels.tolist() == [-100, -100, -100, sports, 2, -100]
    (tiny,) = encode_examples([ex], tok, seq_len=2)            # answer alone does not fit
    assert tiny.input_ids.tolist() == [1, sports] and tiny.labels.tolist() == [sports, -100]
    for ex in synthetic_examples(50):
        for seq_len in (4, 9, 64):
            (e,) = encode_examples([ex], tok, seq_len)
            assert len(e.input_ids) <= seq_len
            assert e.input_ids[-2] == ids_of(tok, ex["completion"])[0]
            assert e.n_targets == 2


def test_rows_without_targets_are_rejected_and_counted(tok):
    good = {"prompt": "topic :", "completion": " world"}
    out = encode_examples([good, {"prompt": "topic :", "completion": " "}], tok, seq_len=8,
                          eos_is_target=False)
    assert len(out) == 1 and out.n_rejected == 1
    assert "no answer token" in next(iter(out.rejected))
    with pytest.raises(ValueError, match="seq_len"):
        encode_examples([good], tok, seq_len=1)
    with pytest.raises(DataError, match="example 0 is not"):
        encode_examples([{"prompt": "only"}], tok, seq_len=8)


# ------------------------------------------------------------------ micro-batches

def test_microbatches_padding_and_masks(tok):
    exs = synthetic_examples(5, seed=2)
    enc = encode_examples(exs, tok, seq_len=24)
    batches = make_microbatches(enc, micro_batch_size=2, seq_len=24, pad_id=tok.pad_token_id)
    assert len(batches) == 3
    for b in batches:
        assert set(b) == {"input_ids", "attention_mask", "position_ids", "labels"}
        for v in b.values():
            assert v.dtype == np.int64 and v.shape == (2, 24)
        assert (b["position_ids"] == np.arange(24)).all()
    rows = [(b, r) for b in batches for r in range(2)]
    for (b, r), e in zip(rows, enc):
        n = len(e.input_ids)
        assert b["input_ids"][r, :n].tolist() == e.input_ids.tolist()
        assert (b["input_ids"][r, n:] == tok.pad_token_id).all()
        assert b["attention_mask"][r].tolist() == [1] * n + [0] * (24 - n)   # right padding
        assert b["labels"][r, :n].tolist() == e.labels.tolist()
        assert (b["labels"][r, n:] == IGNORE_INDEX).all()
    last = batches[-1]                                  # 5th row + one filler row
    assert (last["input_ids"][1] == tok.pad_token_id).all()
    assert (last["attention_mask"][1] == 0).all() and (last["labels"][1] == IGNORE_INDEX).all()
    assert len(make_microbatches(enc, 2, 24, 3, drop_last=True)) == 2
    assert len(make_microbatches(enc[:4], 2, 24, 3)) == 2
    assert make_microbatches([], 2, 24, 3) == []


def test_microbatches_reject_long_rows(tok):
    enc = encode_examples(synthetic_examples(2), tok, seq_len=64)
    with pytest.raises(DataError, match="seq_len=4"):
        make_microbatches(enc, 2, seq_len=4, pad_id=3)
    with pytest.raises(ValueError):
        make_microbatches(enc, 0, 64, 3)


# ------------------------------------------------------------------ readout positions

def test_readout_positions_gathers_valid_positions():
    labels = np.full((2, 5), -100, dtype=np.int64)
    labels[0, 3], labels[0, 4], labels[1, 1] = 7, 2, 9
    index, target, weight, dropped = readout_positions(labels, capacity=4)
    assert index.tolist() == [3, 4, 6, 0] and target.tolist() == [7, 2, 9, 0]
    assert weight.tolist() == [1, 1, 1, 0] and dropped == 0
    assert (index.dtype, target.dtype, weight.dtype) == (np.int64, np.int64, np.float32)
    assert (labels.reshape(-1)[index[:3]] == target[:3]).all()


def test_readout_positions_overflow_keeps_the_last():
    labels = np.arange(12, dtype=np.int64).reshape(3, 4)
    labels[0, 0] = -100                                   # 11 valid: flat 1..11
    index, target, weight, dropped = readout_positions(labels, capacity=4)
    assert index.tolist() == [8, 9, 10, 11] and target.tolist() == [8, 9, 10, 11]
    assert weight.tolist() == [1, 1, 1, 1] and dropped == 7
    i0, t0, w0, d0 = readout_positions(labels, capacity=0)
    assert i0.shape == (0,) and d0 == 11
    ie, te, we, de = readout_positions(np.full((2, 3), -100), capacity=3)
    assert ie.tolist() == [0, 0, 0] and we.sum() == 0 and de == 0
    with pytest.raises(ValueError):
        readout_positions(labels.astype(np.float32), 4)
    with pytest.raises(ValueError):
        readout_positions(labels, -1)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 4), st.integers(1, 6), st.integers(0, 12), st.data())
def test_readout_positions_matches_reference(b, s, capacity, data):
    flat = data.draw(st.lists(st.sampled_from([-100, -100, 0, 5, 511]), min_size=b * s,
                              max_size=b * s))
    labels = np.array(flat, dtype=np.int64).reshape(b, s)
    valid = [i for i, v in enumerate(flat) if v != -100]
    kept = valid[-capacity:] if capacity else []
    index, target, weight, dropped = readout_positions(labels, capacity)
    assert index.tolist() == kept + [0] * (capacity - len(kept))
    assert target.tolist() == [flat[i] for i in kept] + [0] * (capacity - len(kept))
    assert weight.tolist() == [1.0] * len(kept) + [0.0] * (capacity - len(kept))
    assert dropped == len(valid) - len(kept)


def test_pipeline_readout_matches_microbatch(tok):
    enc = encode_examples(synthetic_examples(8, seed=5), tok, seq_len=32)
    (b,) = make_microbatches(enc[:4], 4, 32, tok.pad_token_id)
    index, target, weight, dropped = readout_positions(b["labels"], capacity=16)
    assert dropped == 0 and weight.sum() == 8             # label word + eos per row
    label_ids = {ids_of(tok, lab)[0] for lab in LABELS}
    assert set(target[:8:2].tolist()) <= label_ids and set(target[1:8:2].tolist()) == {2}
    flat_inputs = b["input_ids"].reshape(-1)
    assert (flat_inputs[index[:8] + 1] == target[:8]).all()   # next token, same row



def test_a_parquet_table_loads_as_its_jsonl_twin(tmp_path):
    """Prompt/completion and text columns read from Parquet (pyarrow) give the rows the same records in
    JSONL give, with the same rejections counted."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [{"prompt": "Q: 2+2?", "completion": " 4"}, {"prompt": "Q: red?", "completion": " colour"},
               {"prompt": "Q: empty?", "completion": " "}]
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "qa.parquet")
    (tmp_path / "qa.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    from_parquet, from_jsonl = load_examples(str(tmp_path / "qa.parquet")), load_examples(str(tmp_path / "qa.jsonl"))
    assert list(from_parquet) == list(from_jsonl) and len(from_parquet) == 2
    assert from_parquet.rejected == from_jsonl.rejected and from_parquet.n_read == 3
    pq.write_table(pa.Table.from_pylist([{"text": "one line"}, {"text": "two"}]), tmp_path / "t.parquet")
    assert list(load_examples(str(tmp_path / "t.parquet"))) == [{"text": "one line"}, {"text": "two"}]
    pq.write_table(pa.Table.from_pylist([{"question": "a", "answer": "b"}]), tmp_path / "other.parquet")
    with pytest.raises(DataError) as e:
        load_examples(str(tmp_path / "other.parquet"))
    assert "no usable rows" in str(e.value) and '"messages" column' in str(e.value)

"""Chat data (zl_common/data/chat.py): conversations rendered with the tokenizer's template (or the
fallback), the loss on the assistant turns' tokens only, truncation stated, malformed rows refused
with one line naming the file and the row."""
from __future__ import annotations

import json

import pytest

from exporter.tiny_tokenizer import build_tiny_tokenizer
from zl_common.data import IGNORE_INDEX, DataError, encode_examples, load_examples, tokenized_microbatches, truncation_summary

CONVERSATION = [
    {"role": "system", "content": "text topic"},
    {"role": "user", "content": "the match today"},
    {"role": "assistant", "content": "sports"},
    {"role": "user", "content": "the market"},
    {"role": "assistant", "content": "business world"},
]

# SmolLM2-Instruct's template (ChatML, with its default system turn), as its tokenizer carries it
CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
          "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def masked_text(tok, enc) -> str:
    return tok.decode([int(t) for t in enc.labels if t != IGNORE_INDEX])


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_the_loss_sees_exactly_the_assistant_turns_with_the_fallback_template(tmp_path):
    tok = build_tiny_tokenizer()
    assert tok.chat_template is None  # the tiny model has none: the documented fallback renders it
    rows = load_examples(write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}]))
    [enc] = encode_examples(rows, tok, 64)
    assert masked_text(tok, enc) == "sports </s> business world </s>"
    # labels are shifted: each target is the next input token
    for i in range(len(enc.labels) - 1):
        assert enc.labels[i] in (IGNORE_INDEX, enc.input_ids[i + 1])


def test_the_tokenizers_own_template_is_used():
    tok = build_tiny_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.eos_token = "<|im_end|>"
    tok.chat_template = CHATML
    [enc] = encode_examples([{"messages": CONVERSATION[1:]}], tok, 64)
    text = tok.decode(enc.input_ids.tolist())
    assert text.startswith("<|im_start|> <unk>") and "<|im_start|> <unk> \n sports" not in text  # ChatML, not the fallback
    assert tok.convert_tokens_to_ids("<|im_start|>") in enc.input_ids
    assert masked_text(tok, enc) == "sports <|im_end|> business world <|im_end|>"


def test_long_rows_are_cut_at_the_end_and_the_run_is_told(tmp_path):
    tok = build_tiny_tokenizer()
    short = [{"role": "user", "content": "the match"}, {"role": "assistant", "content": "sports"}]
    rows = [{"messages": CONVERSATION}, {"messages": short}, {"messages": [{"role": "user", "content": "the " * 30},
                                                                           {"role": "assistant", "content": "world"}]}]
    enc = encode_examples(rows, tok, 20)
    # row 0 (25 tokens) keeps its first answer and loses 'business world </s>' (3); row 2 loses all: skipped
    assert [masked_text(tok, e) for e in enc] == ["sports </s>", "sports </s>"]
    assert enc.n_truncated == 2 and enc.answer_tokens_lost == 3 + 2
    line = truncation_summary(enc, 20)
    assert line == ("2 of 3 rows are longer than seq_len=20: cut at the end (chat rows keep their start); "
                    "5 answer tokens lost; 1 rows skipped (no answer token left)")
    said = []
    tokenized_microbatches(rows, tok, 20, 2, say=said.append)
    assert said == [line]
    assert truncation_summary(encode_examples(rows[:2], tok, 64), 64) == ""


@pytest.mark.parametrize("row, problem", [
    ('{"messages": [{"role": "user", "content": "hi"}', "line 2: not valid JSON"),
    ({"messages": [{"role": "robot", "content": "hi"}, {"role": "assistant", "content": "x"}]},
     "line 2: message 0 has unknown role 'robot'"),
    ({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]},
     "line 2: no assistant turn"),
    ({"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "x"}]},
     "line 2: message 0's content is not a string"),
    ({"prompt": "a", "completion": "b"}, 'line 2: not a {"messages": [...]} object'),
])
def test_a_malformed_chat_row_is_one_line_naming_file_and_row(tmp_path, row, problem):
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}, row])
    with pytest.raises(DataError) as e:
        load_examples(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}: {problem}") and "\n" not in msg


def test_chat_rows_from_parquet_are_the_jsonl_rows(tmp_path):
    """A "messages" column of role/content structs (pyarrow) reads as the JSONL chat file does; a bad
    row is named by its number."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([{"messages": CONVERSATION}] * 2), tmp_path / "chat.parquet")
    jsonl = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}] * 2)
    assert list(load_examples(str(tmp_path / "chat.parquet"))) == list(load_examples(jsonl))
    no_answer = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
    pq.write_table(pa.Table.from_pylist([{"messages": CONVERSATION}, {"messages": no_answer}]), tmp_path / "bad.parquet")
    with pytest.raises(DataError) as e:
        load_examples(str(tmp_path / "bad.parquet"))
    assert str(e.value).startswith(f"{tmp_path / 'bad.parquet'}: row 2: no assistant turn")


def test_wordnet_chat_conversations_train_on_the_word_only():
    """The README's chat file: system, "What is the word for <gloss>?", the word; the loss sees the word."""
    from zl_common.data.wordnet_chat import SYSTEM, wordnet_chat
    from zl_common.data.wordnet_reverse import reverse_splits

    rows = wordnet_chat(50)
    words = [ex["completion"].strip() for ex in reverse_splits()["train"][:50]]
    assert [r["messages"][2]["content"] for r in rows] == words
    for r in rows:
        roles = [m["role"] for m in r["messages"]]
        assert roles == ["system", "user", "assistant"] and r["messages"][0]["content"] == SYSTEM
        assert r["messages"][1]["content"].startswith("What is the word for ")
    tok = build_tiny_tokenizer()
    for r, enc in zip(rows, encode_examples(rows, tok, 256)):
        assert masked_text(tok, enc) == tok.decode(tok(r["messages"][2]["content"], add_special_tokens=False)
                                                   ["input_ids"] + [tok.eos_token_id])


def test_an_export_carries_the_models_chat_template(small_model_dir, tmp_path):
    # transformers 5 saves an instruct model's template as chat_template.jinja beside the tokenizer:
    # the export keeps it, so training and eval render chats as the model was taught, model dir gone
    import shutil

    from exporter.export import export_model
    from host.run.data import export_tokenizer

    from .conftest import small_export_config

    model = tmp_path / "model"
    shutil.copytree(small_model_dir, model)
    (model / "chat_template.jinja").write_text(CHATML)
    manifest, _ = export_model(str(model), "0-2", tmp_path / "out", small_export_config(readout="static"))
    shutil.rmtree(model)
    assert export_tokenizer(tmp_path / "out", manifest).chat_template == CHATML

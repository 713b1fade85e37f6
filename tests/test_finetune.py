"""zl-host finetune: a chat file to a PEFT and a GGUF adapter in one command on emulated phones
(export cached by model and settings), the held-out eval with generated answers scored by exact
match and token F1; a malformed row stops it before anything is started or written."""
from __future__ import annotations

import json

import numpy as np
import pytest

from host.cli.zl_host import build_parser, main
from host.evaluation.generation import exact_match, last_turns, token_f1
from zl_common.data import synthetic_examples


def chat_file(path, n=40):
    rows = [{"messages": [{"role": "system", "content": "topic"}, {"role": "user", "content": ex["prompt"]},
                          {"role": "assistant", "content": ex["completion"].strip()}]}
            for ex in synthetic_examples(n, seed=1)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_scores_are_squad_style():
    assert exact_match("The  Sports!", "the sports") == 1.0 and exact_match("sports news", "sports") == 0.0
    assert token_f1("sports news", "sports") == pytest.approx(2 / 3)
    assert token_f1("world", "sports") == 0.0 and token_f1("", "") == 1.0


def test_the_reference_is_the_last_answer_turn():
    # labels[i] is the target at position i: answers at 3-4 (first turn) and 7-8 (last turn)
    ids = np.array([[1, 10, 11, 12, 13, 14, 15, 16, 17, 3]])
    labels = np.full((1, 10), -100)
    labels[0, [3, 4, 7, 8]] = [13, 14, 17, 2]
    mask = np.array([[1] * 9 + [0]])
    [(prompt, ref)] = last_turns([{"input_ids": ids, "labels": labels, "attention_mask": mask}], 5)
    assert prompt == [1, 10, 11, 12, 13, 14, 15, 16] and ref == [17, 2]


def finetune_args(model, data, tmp_path):
    return ["finetune", "--model", str(model), "--data", str(data), "--devices", "emulated:3",
            "--seq-len", "24", "--micro-batch", "2", "--lora-rank", "4", "--lora-alpha", "8", "--backend", "portable",
            "--readout", "static", "--steps", "2", "--window", "2", "--generate", "4", "--show", "2",
            "--cache", str(tmp_path / "cache"), "--out", str(tmp_path / "run")]


@pytest.mark.parametrize("bad, problem", [
    ('{"messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "x"}]}',
     "line 3: message 1 has unknown role 'bot'"),
    ('{"messages": [{"role": "user", "content": "hi"}]}', "line 3: no assistant turn"),
    ('{"messages": [', "line 3: not valid JSON"),
])
def test_a_malformed_row_starts_nothing_and_writes_nothing(small_model_dir, tmp_path, capsys, bad, problem):
    data = chat_file(tmp_path / "chat.jsonl", 2)
    data.write_text(data.read_text() + bad + "\n")
    assert main(finetune_args(small_model_dir, data, tmp_path)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"zl-host: error: {data}: {problem}") and "\n" not in err
    assert not (tmp_path / "cache").exists() and not (tmp_path / "run").exists()


def test_finetune_a_chat_file_end_to_end(small_model_dir, tmp_path, capsys):
    from host.cli.finetune import cached_export, export_plan

    data = chat_file(tmp_path / "chat.jsonl")
    args = finetune_args(small_model_dir, data, tmp_path)
    assert main(args) == 0
    out, err = capsys.readouterr()
    run = tmp_path / "run"
    assert all(f"finetune [{k}/4]" in err for k in range(1, 5))
    assert "chat rows rendered with the fallback template" in err  # the small model's tokenizer has none
    assert (run / "adapter" / "adapter_config.json").is_file() and (run / "export" / "adapter.gguf").stat().st_size > 0
    ev = json.loads((run / "eval.json").read_text())
    gen = ev["generated"]
    assert gen["n"] == 4 and gen["decoding"] == "greedy"
    for who in ("base", "adapter"):
        assert ev[who]["tokens"] > 0 and 0 <= gen[who]["exact_match"] <= 1 and 0 <= gen[who]["f1"] <= 1
    # the references are the conversations' assistant turns: the synthetic set's labels
    assert {r["expected"] for r in gen["rows"]} <= {"world", "sports", "business", "science"}
    assert "exact match" in out and "2 held-out prompts" in out and "Held-out eval" in (run / "report.md").read_text()
    # the same model and settings again: the cached export, not a new one
    [program] = list((tmp_path / "cache").iterdir())
    stamp = (program / "manifest.json").stat().st_mtime_ns
    assert cached_export(build_parser().parse_args(args)) == program
    assert (program / "manifest.json").stat().st_mtime_ns == stamp and "reusing" in capsys.readouterr().err
    # the key covers the settings and the model's files
    other = export_plan(build_parser().parse_args(args[:-4] + ["--lora-rank", "2", "--cache", str(tmp_path / "cache")]))
    assert other[0] != program and other[1]["config"]["lora_rank"] == 2


def test_seq_len_auto_fits_the_longest_row_with_the_models_tokenizer(small_model_dir, capsys):
    from host.cli.finetune import auto_seq_len

    def chat(words):
        return {"messages": [{"role": "user", "content": " ".join(["the"] * words)},
                             {"role": "assistant", "content": "sports"}]}
    # <s> user : the x N \n assistant : sports </s>: N + 7 tokens with the fallback template
    assert auto_seq_len(str(small_model_dir), [chat(2)]) == 16
    assert auto_seq_len(str(small_model_dir), [chat(2), chat(10)]) == 32
    assert "the longest row has 17 tokens" in capsys.readouterr().err
    assert auto_seq_len(str(small_model_dir), [chat(600)]) == 512

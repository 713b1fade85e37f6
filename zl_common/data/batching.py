"""Tokenisation into fixed-shape micro-batches with next-token labels already shifted.

For a row ``input_ids = [bos] + prompt + completion + [eos]`` the labels are
``labels[i] = input_ids[i + 1]`` where position ``i + 1`` is an answer token (the completion
and the closing eos), else ``IGNORE_INDEX`` (-100). So ``labels[i]`` is what position ``i``
must predict; no consumer shifts again. ``{"text"}`` rows train on every token after bos.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from .examples import DataError

IGNORE_INDEX = -100


@dataclass(frozen=True)
class Encoded:
    """One tokenised example: ``input_ids`` and shifted ``labels``, both int64, same length."""

    input_ids: np.ndarray
    labels: np.ndarray

    @property
    def n_targets(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())


class EncodedList(list):
    """``list[Encoded]`` plus ``rejected`` (reason -> count), ``n_truncated`` (rows cut, of
    ``n_rows``) and ``answer_tokens_lost`` (answer tokens the cuts removed)."""

    def __init__(self, rows=(), *, rejected: Counter | None = None, n_truncated: int = 0):
        super().__init__(rows)
        self.rejected: Counter = rejected if rejected is not None else Counter()
        self.n_truncated = n_truncated
        self.answer_tokens_lost = 0
        self.n_rows = 0
        self.n_chat = 0  # chat rows among them (cut at the end; the others lose the prompt's start first)

    @property
    def n_rejected(self) -> int:
        return sum(self.rejected.values())


def _ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []


def _prompt_and_answer_ids(tokenizer, prompt: str, completion: str) -> tuple[list[int], list[int]]:
    """Tokenise prompt and completion as they appear joined (matters for BPE/SentencePiece);
    fall back to separate tokenisation where the joined text does not split at the boundary."""
    p = _ids(tokenizer, prompt)
    joint = _ids(tokenizer, prompt + completion)
    if joint[:len(p)] == p and len(joint) > len(p):
        return p, joint[len(p):]
    return p, _ids(tokenizer, completion)


def _shifted_labels(ids: list[int], answer_start: int) -> np.ndarray:
    """labels[i] = ids[i+1] for i+1 >= answer_start, else IGNORE_INDEX."""
    labels = np.full(len(ids), IGNORE_INDEX, dtype=np.int64)
    start = max(answer_start, 1)
    if start < len(ids):
        labels[start - 1:len(ids) - 1] = ids[start:]
    return labels


def encode_examples(examples, tokenizer, seq_len: int, *,
                    eos_is_target: bool = True) -> EncodedList:
    """Tokenise examples into :class:`Encoded` rows of at most ``seq_len`` tokens.

    Prompt/completion rows: ``[bos] + prompt + completion + [eos]``; when too long the prompt
    loses tokens from the left (bos is kept), then — only if the answer alone does not fit —
    the eos and the completion's tail go. Text rows: ``[bos] + text + [eos]`` cut on the right.
    Rows left with no target are rejected and counted in ``result.rejected``.
    ``eos_is_target=False`` trains only on the completion tokens.
    """
    if not isinstance(seq_len, int) or seq_len < 2:
        raise ValueError(f"seq_len must be an int >= 2, got {seq_len!r}")
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    out = EncodedList()
    for k, ex in enumerate(examples):
        out.n_rows += 1
        if isinstance(ex, dict) and "messages" in ex:
            from .chat import chat_ids

            ids, is_answer = chat_ids(tokenizer, ex["messages"])
            out.n_chat += 1
            if len(ids) > seq_len:  # cut at the end: the conversation's start is what later turns rest on
                out.n_truncated += 1
                out.answer_tokens_lost += sum(is_answer[seq_len:])
                ids, is_answer = ids[:seq_len], is_answer[:seq_len]
            labels = np.full(len(ids), IGNORE_INDEX, dtype=np.int64)
            for i in range(1, len(ids)):
                if is_answer[i]:
                    labels[i - 1] = ids[i]
        elif not isinstance(ex, dict) or not ({"prompt", "completion"} <= ex.keys()
                                              or "text" in ex):
            raise DataError(f"example {k} is not a {{'prompt','completion'}} or {{'text'}} "
                            f"dict: {str(ex)[:80]!r}; load data with zl_common.data.load_examples")
        elif "prompt" not in ex:
            ids = bos + _ids(tokenizer, ex["text"]) + eos
            if len(ids) > seq_len:
                ids = ids[:seq_len]
                out.n_truncated += 1
            labels = _shifted_labels(ids, answer_start=len(bos))
        else:
            p, c = _prompt_and_answer_ids(tokenizer, ex["prompt"], ex["completion"])
            answer = c + eos
            overflow = len(bos) + len(p) + len(answer) - seq_len
            if overflow > 0:
                out.n_truncated += 1
                cut = min(overflow, len(p))
                p = p[cut:]
                overflow -= cut
                if overflow > 0:
                    out.answer_tokens_lost += overflow
                    answer = answer[:len(answer) - overflow]
            ids = bos + p + answer
            labels = _shifted_labels(ids, answer_start=len(bos) + len(p))
            if not eos_is_target and eos and len(answer) == len(c) + 1:
                labels[len(ids) - 2] = IGNORE_INDEX  # the kept eos is not a target
        enc = Encoded(np.asarray(ids, dtype=np.int64), labels)
        if enc.n_targets == 0:
            out.rejected["rows with no answer token left after truncation to "
                         f"seq_len={seq_len}"] += 1
            continue
        out.append(enc)
    return out


def truncation_summary(encoded: EncodedList, seq_len: int) -> str:
    """The run's truncation policy and what it did, one line ('' when no row was too long)."""
    skipped = sum(n for why, n in encoded.rejected.items() if "truncation" in why)
    if not encoded.n_truncated:
        return ""
    where = ("cut at the end (chat rows keep their start)" if encoded.n_chat == encoded.n_rows else
             "prompts lose their start first, then answers their end" if not encoded.n_chat else
             "chat rows cut at the end, prompt rows lose their prompt's start first")
    return (f"{encoded.n_truncated} of {encoded.n_rows} rows are longer than seq_len={seq_len}: {where}; "
            f"{encoded.answer_tokens_lost} answer tokens lost; {skipped} rows skipped (no answer token left)")


def make_microbatches(encoded, micro_batch_size: int, seq_len: int, pad_id: int, *,
                      drop_last: bool = False) -> list[dict[str, np.ndarray]]:
    """Group rows into ``[B, S]`` int64 micro-batches (right padding to ``S = seq_len``).

    Keys: ``input_ids``, ``attention_mask`` (1 real, 0 pad), ``position_ids`` (0..S-1 on
    every row), ``labels`` (shifted, -100 = no target). An incomplete last batch is dropped
    when ``drop_last`` is set, else filled with padding rows (all pad, mask 0, labels -100).
    """
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    rows = list(encoded)
    for k, enc in enumerate(rows):
        if len(enc.input_ids) > seq_len or len(enc.labels) != len(enc.input_ids):
            raise DataError(f"row {k} has {len(enc.input_ids)} tokens / {len(enc.labels)} "
                            f"labels, more than seq_len={seq_len} or mismatched; encode with "
                            f"the same seq_len")
    n_full, rest = divmod(len(rows), micro_batch_size)
    n_batches = n_full + (1 if rest and not drop_last else 0)
    positions = np.broadcast_to(np.arange(seq_len, dtype=np.int64), (micro_batch_size, seq_len))
    batches = []
    for b in range(n_batches):
        chunk = rows[b * micro_batch_size:(b + 1) * micro_batch_size]
        input_ids = np.full((micro_batch_size, seq_len), pad_id, dtype=np.int64)
        attention = np.zeros((micro_batch_size, seq_len), dtype=np.int64)
        labels = np.full((micro_batch_size, seq_len), IGNORE_INDEX, dtype=np.int64)
        for r, enc in enumerate(chunk):
            n = len(enc.input_ids)
            input_ids[r, :n] = enc.input_ids
            attention[r, :n] = 1
            labels[r, :n] = enc.labels
        batches.append({"input_ids": input_ids, "attention_mask": attention,
                        "position_ids": positions.copy(), "labels": labels})
    return batches


def tokenized_microbatches(examples, tokenizer, seq_len: int, micro_batch_size: int, say=None) -> list[dict[str, np.ndarray]]:
    """encode_examples then make_microbatches (the last one padded), padding with the tokenizer's
    pad token, or its eos where it has none: what training, eval and the readout lens's
    calibration all read. `say(line)` hears the truncation policy when a row was too long."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    encoded = encode_examples(examples, tokenizer, seq_len)
    if say is not None and (line := truncation_summary(encoded, seq_len)):
        say(line)
    return make_microbatches(encoded, micro_batch_size, seq_len, pad, drop_last=False)


def check_loss_positions(batches, capacity: int, micro_batch_size: int | None = None) -> None:
    """Refuse micro-batches with more valid (answer) positions than the program reads out.

    A program gathers at most ``capacity`` positions (``zl-export --loss-positions``, default
    micro-batch x seq-len) for its readout; more would be cut. Raises :class:`DataError` with one
    line naming the micro-batches, the rows, the largest count and the export option to raise.
    """
    over = [(i, int((np.asarray(b["labels"]) != IGNORE_INDEX).sum())) for i, b in enumerate(batches)]
    over = [(i, n) for i, n in over if n > capacity]
    if not over:
        return
    worst_i, worst_n = max(over, key=lambda t: t[1])
    B = micro_batch_size or len(batches[worst_i]["labels"])
    S = np.asarray(batches[worst_i]["labels"]).shape[-1]
    names = ", ".join(str(i) for i, _ in over[:5]) + (f" and {len(over) - 5} more" if len(over) > 5 else "")
    raise DataError(
        f"{len(over)} micro-batch(es) ({names}) have more valid positions than the program's "
        f"--loss-positions {capacity}: micro-batch {worst_i} (tokenised rows {worst_i * B}-{worst_i * B + B - 1}) "
        f"has {worst_n}; re-export with zl-export --loss-positions {worst_n} or more (at most "
        f"micro-batch x seq-len = {B * S}), or shorten the answers")

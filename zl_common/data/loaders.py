"""Dataset loaders: AG News CSV, JSONL/JSON, and the built-in synthetic set.

Every loader returns a :class:`LoadedExamples` (a plain ``list`` of example dicts that also
records where it came from and how many rows were rejected and why). Examples are either
``{"prompt": str, "completion": str}`` (the completion is the trained answer) or
``{"text": str}`` (every token is a target). Problems are reported as :class:`DataError`
with a one-line message naming the file, what was read, and the fix.
"""

from __future__ import annotations

import csv
import html
import json
import os
import re
from collections import Counter

from .examples import DataError, LoadedExamples, rejection_reasons
from .synthetic import LABELS, format_completion, format_prompt, synthetic_examples
from .wordnet import load_wordnet  # WordNet noun glosses by category (zl_common/data/wordnet.py)
from .wordnet_reverse import load_wordnet_reverse

# Size of the built-in set used when no data file is given.
DEFAULT_SYNTHETIC_N = 2000

_AG_NAMES = {
    "world": "world",
    "sports": "sports",
    "business": "business",
    "sci/tech": "science",
    "scitech": "science",
    "sci-tech": "science",
    "science": "science",
}
_CSV_FIX = ("expected AG News rows 'class index (1-4), title, description' "
            "(optionally a header row; a 'text,label' header with labels 0-3 also works)")
_JSONL_FIX = ('expected one JSON object per line with string fields '
              '{"prompt": ..., "completion": ...} or {"text": ...}')


def _no_usable_rows(path: str, n_read: int, rejected: Counter, fix: str) -> DataError:
    return DataError(f"{path}: no usable rows ({n_read} rows read, rejected: "
                     f"{rejection_reasons(rejected)}); {fix}")


# ---------------------------------------------------------------- AG News CSV

_NUM_ENTITY = re.compile(r"#(\d{1,6});")


def clean_ag_text(s: str) -> str:
    """Undo AG News' escaping: ``\\`` line breaks, ``#39;`` and ``&amp;`` entities, spacing."""
    s = s.replace("\\n", " ").replace("\\", " ")
    s = _NUM_ENTITY.sub(lambda m: chr(int(m.group(1))), s)
    s = html.unescape(s)
    return " ".join(s.split())


def _ag_label(field: str, zero_based: bool) -> str | None:
    f = field.strip()
    if f.lstrip("-").isdigit():
        i = int(f) + (1 if zero_based else 0)
        return LABELS[i - 1] if 1 <= i <= 4 else None
    return _AG_NAMES.get(f.lower())


def ag_news_example(label: str, title: str, description: str) -> dict:
    """One AG News row as a prompt/completion example."""
    title, description = clean_ag_text(title), clean_ag_text(description)
    if title and description and title[-1] not in ".!?:":
        title += " ."
    return {"prompt": format_prompt(f"{title} {description}".strip()),
            "completion": format_completion(label)}


def load_ag_news_csv(path: str) -> LoadedExamples:
    """AG News CSV: ``class index (1-4), title, description`` rows, header optional.

    Class names (World, Sports, Business, Sci/Tech) are accepted in place of the index, and a
    ``text,label`` header (the Hugging Face export, labels 0-3) is recognised too.
    """
    rejected: Counter = Counter()
    rows: list[dict] = []
    n_read = 0
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f)
        bad_lines: list[int] = []

        def reject(why: str) -> None:
            rejected[why] += 1
            if len(bad_lines) < 5:
                bad_lines.append(reader.line_num)
        first = True
        hf_cols: tuple[int, int] | None = None  # (text column, label column)
        for record in reader:
            if not record or all(not c.strip() for c in record):
                continue
            if first:
                first = False
                head = [c.strip().lower() for c in record]
                if "text" in head and "label" in head:
                    hf_cols = (head.index("text"), head.index("label"))
                    continue
                f0 = record[0].strip()
                if not f0.lstrip("-").isdigit() and _ag_label(f0, zero_based=False) is None:
                    continue  # a header such as "Class Index,Title,Description"
            n_read += 1
            if hf_cols is not None:
                ti, li = hf_cols
                if len(record) <= max(ti, li):
                    reject("rows with too few columns")
                    continue
                label = _ag_label(record[li], zero_based=True)
                title, description = "", record[ti]
                bad_label = "rows with a label outside 0-3"
            else:
                if len(record) != 3:
                    reject(f"rows with {len(record)} columns instead of 3")
                    continue
                label = _ag_label(record[0], zero_based=False)
                title, description = record[1], record[2]
                bad_label = "rows with a class outside 1-4"
            if label is None:
                reject(bad_label)
                continue
            if not clean_ag_text(title) and not clean_ag_text(description):
                reject("rows with empty title and description")
                continue
            rows.append(ag_news_example(label, title, description))
    if not rows:
        raise _no_usable_rows(path, n_read, rejected, _CSV_FIX)
    return LoadedExamples(rows, source=path, n_read=n_read, rejected=rejected, bad_lines=bad_lines)


# ---------------------------------------------------------------- JSONL / JSON

def _check_record(obj) -> tuple[dict | None, str]:
    if not isinstance(obj, dict):
        return None, "rows that are not JSON objects"
    if "prompt" in obj or "completion" in obj:
        p, c = obj.get("prompt"), obj.get("completion")
        if not isinstance(p, str) or not isinstance(c, str):
            return None, "rows whose prompt/completion is missing or not a string"
        if not c.strip():
            return None, "rows with an empty completion"
        return {"prompt": p, "completion": c}, ""
    if "text" in obj:
        t = obj["text"]
        if not isinstance(t, str):
            return None, "rows whose text is not a string"
        if not t.strip():
            return None, "rows with empty text"
        return {"text": t}, ""
    return None, 'rows with neither "prompt"/"completion" nor "text"'


def load_jsonl(path: str) -> LoadedExamples:
    """JSONL (one object per line; blank lines skipped) or a JSON array of objects."""
    with open(path, encoding="utf-8-sig") as f:
        content = f.read()
    records: list = []
    stripped = content.lstrip()
    parsed_whole = False
    if stripped.startswith("["):
        try:
            whole = json.loads(content)
        except json.JSONDecodeError:
            pass
        else:
            records = list(whole)
            parsed_whole = True
    line_of: list[int | None] = [None] * len(records)  # a JSON array's elements have no line of their own
    if not parsed_whole:
        for number, line in enumerate(content.splitlines(), 1):
            if not line.strip():
                continue
            line_of.append(number)
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                records.append(_BAD_JSON)
    if any(isinstance(o, dict) and "messages" in o for o in records):
        return _load_chat(path, content, records if parsed_whole else None)
    return _from_records(path, records, line_of, _JSONL_FIX)


def load_parquet(path: str) -> LoadedExamples:
    """A Parquet table (pyarrow): one row per record, columns as JSONL's keys: "messages" (a list of
    role/content structs), "prompt"/"completion" or "text"."""
    import pyarrow.parquet as pq

    try:
        records = pq.read_table(path).to_pylist()
    except Exception as e:  # pyarrow's errors name the problem (not Parquet, truncated, ...)
        raise DataError(f"{path}: not a readable Parquet file ({str(e).splitlines()[0]}); "
                        f"write it with pandas.DataFrame.to_parquet or pyarrow.parquet.write_table") from None
    if any("messages" in o for o in records):
        return _load_chat(path, "", records)
    return _from_records(path, records, [None] * len(records), _PARQUET_FIX)


_PARQUET_FIX = 'expected a "messages" column, "prompt" and "completion" columns, or a "text" column'


def _from_records(path: str, records: list, line_of: list, fix: str) -> LoadedExamples:
    """Prompt/completion or text rows from parsed records; the rejected ones counted by reason."""
    rejected: Counter = Counter()
    rows: list[dict] = []
    bad_lines: list[int] = []
    for obj, number in zip(records, line_of):
        if obj is _BAD_JSON:
            row, why = None, "lines that are not valid JSON"
        else:
            row, why = _check_record(obj)
        if row is None:
            rejected[why] += 1
            if number is not None and len(bad_lines) < 5:
                bad_lines.append(number)
        else:
            rows.append(row)
    if not rows:
        raise _no_usable_rows(path, len(records), rejected, fix)
    return LoadedExamples(rows, source=path, n_read=len(records), rejected=rejected, bad_lines=bad_lines)


_BAD_JSON = object()


def _load_chat(path: str, content: str, array: list | None) -> LoadedExamples:
    """A chat file (zl_common/data/chat.py): every row must be a well-formed conversation; the first
    that is not stops the load with one line naming the file, the row and the problem."""
    from .chat import read_messages_row

    if array is not None:  # a JSON array's elements or a Parquet table's rows, counted from 1
        what = "row" if path.lower().endswith(".parquet") else "element"
        numbered = [(k, _chat_element(o), what) for k, o in enumerate(array, 1)]
    else:
        numbered = [(n, read_messages_row(line), "line") for n, line in enumerate(content.splitlines(), 1)
                    if line.strip()]
    rows = []
    for n, row, what in numbered:
        if isinstance(row, str):
            raise DataError(f"{path}: {what} {n}: {row}; {_CHAT_FIX}")
        rows.append({"messages": row["messages"]})
    return LoadedExamples(rows, source=path, n_read=len(rows))


def _chat_element(obj) -> dict | str:
    from .chat import check_messages

    if not isinstance(obj, dict) or "messages" not in obj:
        return 'not a {"messages": [...]} object (a chat file has chat rows only)'
    return check_messages(obj) or obj


_CHAT_FIX = ('expected one {"messages": [{"role": "system"|"user"|"assistant", "content": "..."}, ...]} '
             'object per line with at least one assistant turn')


# ---------------------------------------------------------------- dispatch

def load_examples(path: str | None) -> LoadedExamples:
    """Load a dataset by extension: ``.csv`` (AG News), ``.jsonl``/``.json`` or ``.parquet``.

    ``None`` gives the built-in synthetic set (``DEFAULT_SYNTHETIC_N`` examples, seed 0);
    ``"wordnet"`` / ``"wordnet:validation"`` / ``"wordnet:test"`` a split of WordNet's noun
    glosses labelled by category (``zl_common/data/wordnet.py``; Debian's ``wordnet-base``).
    """
    if path is None:
        return LoadedExamples(synthetic_examples(DEFAULT_SYNTHETIC_N, seed=0),
                              source="synthetic", n_read=DEFAULT_SYNTHETIC_N)
    path = os.fspath(path)
    if not os.path.exists(path) and (path == "wordnet" or path.startswith("wordnet:")):
        return load_wordnet(path)
    if not os.path.exists(path) and (path == "wordnet-reverse" or path.startswith("wordnet-reverse:")):
        return load_wordnet_reverse(path)  # gloss -> word, a generative task (zl_common/data/wordnet_reverse.py)
    if not os.path.exists(path):
        raise DataError(f"data file not found: {path}; pass an existing .csv (AG News), "
                        f".jsonl/.json or .parquet file, wordnet[:validation|test], wordnet-reverse[:validation|test], "
                        f"or no data file for the built-in synthetic set")
    if os.path.isdir(path):
        raise DataError(f"data path is a directory, not a file: {path}; pass the .csv or "
                        f".jsonl file inside it")
    ext = os.path.splitext(path)[1].lower()
    loader = {".csv": load_ag_news_csv, ".jsonl": load_jsonl, ".json": load_jsonl, ".parquet": load_parquet}.get(ext)
    if loader is not None:
        try:
            return loader(path)
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); "
                            f"save the file as UTF-8") from None
        except csv.Error as e:
            raise DataError(f"{path}: malformed CSV ({e}); {_CSV_FIX}") from None
    raise DataError(f"unknown data format {ext or '(no extension)'!r} for {path}; use .csv "
                    f"(AG News: class index, title, description), .jsonl/.json or .parquet "
                    f'({{"messages"}}, {{"prompt","completion"}} or {{"text"}} rows)')

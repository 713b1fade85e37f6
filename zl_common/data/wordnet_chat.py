"""A small chat file built from WordNet (Debian's ``wordnet-base``), for the README's chat fine-tune:
each of the reverse dictionary's noun glosses (zl_common/data/wordnet_reverse.py) becomes a 3-turn
conversation, a system turn, the user's "What is the word for <gloss>?" and the assistant's word.

    python -m zl_common.data.wordnet_chat --rows 400 --out wordnet_chat.jsonl
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .examples import DataError
from .wordnet_reverse import reverse_splits

SYSTEM = "You answer with a single English word or two-word term, nothing else."


def conversation(gloss: str, word: str) -> dict:
    return {"messages": [{"role": "system", "content": SYSTEM},
                         {"role": "user", "content": f"What is the word for {gloss}?"},
                         {"role": "assistant", "content": word}]}


def wordnet_chat(rows: int, split: str = "train", seed: int = 0, directory=None) -> list[dict]:
    """The first `rows` conversations of a split (the reverse dictionary's 80/10/10, by seed) of the
    WordNet in `directory` (default: the installed one)."""
    from .wordnet_reverse import PROMPT_PREFIX, PROMPT_SUFFIX

    out = []
    for ex in reverse_splits(directory, seed=seed)[split][:rows]:
        gloss = ex["prompt"].removeprefix(PROMPT_PREFIX).removesuffix(PROMPT_SUFFIX).strip()
        out.append(conversation(gloss, ex["completion"].strip()))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m zl_common.data.wordnet_chat", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=400, help="conversations to write (default %(default)s)")
    p.add_argument("--split", choices=("train", "validation", "test"), default="train")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, type=Path, help="the JSONL file to write")
    a = p.parse_args(argv)
    if a.rows < 1:
        p.error(f"--rows must be at least 1, got {a.rows}")
    try:
        rows = wordnet_chat(a.rows, a.split, a.seed)
    except DataError as e:
        print(f"wordnet_chat: error: {e}", file=sys.stderr)
        return 2
    a.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} conversations to {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

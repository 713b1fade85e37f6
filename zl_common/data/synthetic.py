"""A small, deterministic AG-News-like topic classification set (4 classes).

Each example is ``{"prompt": "text : <sentence> topic :", "completion": " <label>"}``.
Sentences are built from shared templates and per-class word lists, so the class is
carried by the content words (the templates and filler words are shared by every class):
a tiny model can learn it, and its loss falls within a few hundred steps.

The word lists are the vocabulary source of ``exporter.tiny_tokenizer``: every word this
module can emit is returned by :func:`synthetic_vocabulary`.
"""

from __future__ import annotations

import random
import re

# Label words in class-index order (AG News: 1 World, 2 Sports, 3 Business, 4 Sci/Tech).
LABELS: tuple[str, ...] = ("world", "sports", "business", "science")

PROMPT_PREFIX = "text :"
PROMPT_SUFFIX = "topic :"


def format_prompt(text: str) -> str:
    """The prompt every data source uses: ``"text : <text> topic :"``."""
    return f"{PROMPT_PREFIX} {' '.join(text.split())} {PROMPT_SUFFIX}"


def format_completion(label: str) -> str:
    """The answer: the label word after one space, e.g. ``" sports"``."""
    return f" {label}"


# Per-class content words. Every template slot is filled from the example's own class,
# so each sentence holds three to four class keywords.
_CLASS_WORDS: dict[str, dict[str, tuple[str, ...]]] = {
    "world": {
        "agent": ("president", "minister", "rebels", "diplomats", "army", "parliament",
                  "protesters", "envoy", "government", "militants"),
        "action": ("signed", "rejected", "condemned", "negotiated", "debated", "vetoed",
                   "endorsed", "suspended"),
        "thing": ("treaty", "ceasefire", "sanctions", "election", "constitution", "referendum",
                  "embargo", "truce", "resolution", "accord"),
        "place": ("capital", "border", "embassy", "province", "refugee camp", "united nations"),
    },
    "sports": {
        "agent": ("striker", "coach", "goalkeeper", "captain", "sprinter", "rookie",
                  "quarterback", "pitcher", "midfielder", "champion"),
        "action": ("scored", "won", "clinched", "defended", "lost", "equalised",
                   "retained", "forfeited"),
        "thing": ("final", "match", "title", "tournament", "cup", "medal", "playoff",
                  "penalty", "trophy", "derby"),
        "place": ("stadium", "arena", "league", "olympics", "locker room", "home ground"),
    },
    "business": {
        "agent": ("investors", "bank", "retailer", "ceo", "shareholders", "regulators",
                  "airline", "automaker", "lender", "startup"),
        "action": ("acquired", "reported", "raised", "cut", "forecast", "sold",
                   "restructured", "merged"),
        "thing": ("profit", "earnings", "merger", "stocks", "revenue", "dividend",
                  "shares", "bonds", "quarter", "layoffs"),
        "place": ("wall street", "stock exchange", "market", "boardroom", "headquarters",
                  "trading floor"),
    },
    "science": {
        "agent": ("researchers", "scientists", "astronomers", "engineers", "biologists",
                  "physicists", "nasa", "chemists", "programmers", "geologists"),
        "action": ("discovered", "launched", "developed", "tested", "observed",
                   "sequenced", "simulated", "measured"),
        "thing": ("planet", "genome", "vaccine", "satellite", "robot", "chip",
                  "galaxy", "molecule", "software", "telescope"),
        "place": ("laboratory", "observatory", "orbit", "space station", "university",
                  "research lab"),
    },
}

# Shared filler: carries no class information.
_ADJ = ("new", "major", "surprise", "record", "long awaited", "early", "late", "rare",
        "first", "second")
_WHEN = ("on monday", "on tuesday", "on wednesday", "on thursday", "on friday",
         "on saturday", "on sunday", "this week", "last night", "today")

_TEMPLATES = (
    "the {agent} {action} the {adj} {thing} {when} .",
    "{when} the {agent} {action} a {adj} {thing} at the {place} .",
    "the {agent} at the {place} {action} the {thing} .",
    "a {adj} {thing} : the {agent} {action} it {when} .",
    "the {agent} {action} the {thing} , officials at the {place} said {when} .",
    "after the {adj} {thing} , the {agent} {action} another {thing2} .",
)


def synthetic_examples(n: int, seed: int = 0) -> list[dict]:
    """``n`` deterministic examples, classes balanced (round robin) then shuffled by ``seed``.

    The same ``(n, seed)`` always gives the same list, on every platform.
    """
    if not isinstance(n, int) or n < 0:
        raise ValueError(f"synthetic_examples: n must be a non-negative int, got {n!r}")
    rng = random.Random(seed)
    out: list[dict] = []
    for i in range(n):
        label = LABELS[i % len(LABELS)]
        words = _CLASS_WORDS[label]
        template = rng.choice(_TEMPLATES)
        thing, thing2 = rng.sample(words["thing"], 2)
        sentence = template.format(
            agent=rng.choice(words["agent"]),
            action=rng.choice(words["action"]),
            thing=thing,
            thing2=thing2,
            place=rng.choice(words["place"]),
            adj=rng.choice(_ADJ),
            when=rng.choice(_WHEN),
        )
        out.append({"prompt": format_prompt(sentence), "completion": format_completion(label)})
    rng.shuffle(out)
    return out


def synthetic_vocabulary() -> list[str]:
    """Every whitespace/punctuation-separated word the synthetic set can contain, sorted."""
    words: set[str] = set(LABELS)
    words.update(format_prompt("").split())
    for slots in _CLASS_WORDS.values():
        for values in slots.values():
            for v in values:
                words.update(v.split())
    for group in (_ADJ, _WHEN):
        for v in group:
            words.update(v.split())
    for template in _TEMPLATES:
        words.update(re.sub(r"\{\w+\}", " ", template).split())
    return sorted(words)

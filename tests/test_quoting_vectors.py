"""The quoting rule (docs/PROTOCOL.md 7) against tests/vectors/quoting.json, which the Kotlin phone runs too."""
import json
from pathlib import Path

import pytest

from zl_mobile.protocol.quoting import quote

VECTORS = json.loads((Path(__file__).parent / "vectors" / "quoting.json").read_text(encoding="utf-8"))


@pytest.mark.parametrize("case", VECTORS, ids=lambda c: c["quoted"][:40])
def test_quote_matches_vector(case):
    assert quote(case["value"]) == case["quoted"]


def test_vectors_cover_the_rule():
    # The cases the rule must pin down: both cut-off sides, astral code points, a 60 KB value.
    lengths = {len(c["value"]) for c in VECTORS}
    assert {64, 65}.issubset(lengths) and max(lengths) >= 60000
    text = "".join(c["value"] for c in VECTORS)
    for ch in "\x1b\x07\r\n\t\"\\\x00\x7f\u00e9\u2028\U0001F600":
        assert ch in text, f"no vector holds {ch!r}"


def test_quoted_is_one_short_printable_line():
    for c in VECTORS:
        q = c["quoted"]
        assert all(0x20 <= ord(ch) <= 0x7E for ch in q), q[:80]
        assert len(q) <= 2 + 64 * 10 + len("...(4294967295 chars)")

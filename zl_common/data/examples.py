"""What every loader returns (LoadedExamples) and the error it raises (DataError), kept apart from
the loaders so that each loader module (loaders.py, wordnet.py) imports them without importing
the others."""
from __future__ import annotations

from collections import Counter


class DataError(ValueError):
    """A dataset problem, with a one-line message that says what to fix."""


class LoadedExamples(list):
    """A ``list[dict]`` of examples plus provenance: ``source``, ``n_read``, ``rejected``."""

    def __init__(self, rows=(), *, source: str = "", n_read: int = 0,
                 rejected: Counter | None = None, bad_lines: list | None = None):
        super().__init__(rows)
        self.source = source
        self.n_read = n_read
        self.rejected: Counter = rejected if rejected is not None else Counter()
        self.bad_lines: list[int] = bad_lines or []  # file line numbers of the first rejected rows

    @property
    def n_rejected(self) -> int:
        return sum(self.rejected.values())

    def rejected_summary(self) -> str:
        """'3 of 4 rows rejected (...; first at lines 2, 3, 4)', or '' when none were."""
        if not self.n_rejected:
            return ""
        where = f"; first at line{'s' if len(self.bad_lines) > 1 else ''} {', '.join(map(str, self.bad_lines))}" \
            if self.bad_lines else ""
        return f"{self.source}: {self.n_rejected} of {self.n_read} rows rejected ({rejection_reasons(self.rejected)}{where})"


MAX_REJECTED_FRACTION = 0.5  # more bad rows than this and the file is refused, not silently thinned


def check_rejected(examples: LoadedExamples) -> str:
    """Raise DataError when most rows were rejected; return a warning line when some were."""
    line = examples.rejected_summary()
    if line and examples.n_rejected > MAX_REJECTED_FRACTION * examples.n_read:
        raise DataError(f"{line}; fix or remove those rows: refusing to train on the {len(examples)} usable "
                        f"row{'s' if len(examples) != 1 else ''} left")
    return line


def rejection_reasons(rejected: Counter) -> str:
    return "; ".join(f"{n} {why}" for why, n in rejected.most_common()) or "the file is empty"

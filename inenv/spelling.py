"""The choice nearest to a mistyped word (pure, standard library only, so both the host side and the
in-environment side use it): nearest in spelling; between choices equally near, the nearest in number, then
the newer of two as near. A letter that looks like a digit counts as that digit (versions are typed with O
for 0: `13.O` is 13.0, not 13.2)."""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable

_LOOKALIKE = str.maketrans({"o": "0", "O": "0", "l": "1", "I": "1"})


def number(text: str) -> float | None:
    m = re.match(r"\d+(?:\.\d+)?", text)
    return float(m.group(0)) if m else None


def nearest(word: str, choices: Iterable[str]) -> tuple[str, float] | None:
    """(the nearest choice, its spelling similarity from 0 to 1), or None when there is no choice."""
    options = list(choices)
    if not options:
        return None
    plain = word.translate(_LOOKALIKE) if number(word.translate(_LOOKALIKE)) is not None else word

    def score(choice: str) -> tuple[float, float, float]:
        ratio = difflib.SequenceMatcher(None, plain, choice).ratio()
        a, b = number(plain), number(choice)
        if a is None or b is None:
            return ratio, 0.0, 0.0
        return ratio, -round(abs(a - b), 6), b

    best = max(options, key=score)
    return best, score(best)[0]

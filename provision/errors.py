"""The one error type for bad input or environment: rendered as one line, exit code 2."""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable


class InputError(Exception):
    """Bad input (matrix file, flags) or an unusable environment (no docker daemon)."""

    def __init__(self, message: str, *, file: str | None = None, key: str | None = None, line: int | None = None):
        self.message, self.file, self.key, self.line = message, file, key, line
        super().__init__(self.one_line())

    def one_line(self) -> str:
        where = ""
        if self.file:
            where = self.file + (f":{self.line}" if self.line else "")
        if self.key:
            where = f"{where}: {self.key}" if where else self.key
        return f"{where}: {self.message}" if where else self.message


# Letters typed for the digits they look like: `13.O` is 13.0, not 13.2 (equally near in spelling)
_LOOKALIKE = str.maketrans({"o": "0", "O": "0", "l": "1", "I": "1"})


def _number(text: str) -> float | None:
    m = re.match(r"\d+(?:\.\d+)?", text)
    return float(m.group(0)) if m else None


def suggest(word: str, choices: Iterable[str]) -> str:
    """' (did you mean 'x'?)' for the closest choice, or ''. Between choices equally near in spelling, the
    nearest in number wins (the newer of two as near), and a letter that looks like a digit counts as that
    digit (versions are typed with O for 0)."""
    options = list(choices)
    if not options:
        return ""
    plain = word.translate(_LOOKALIKE) if _number(word.translate(_LOOKALIKE)) is not None else word

    def score(choice: str) -> tuple[float, float, float]:
        ratio = difflib.SequenceMatcher(None, plain, choice).ratio()
        a, b = _number(plain), _number(choice)
        if a is None or b is None:
            return ratio, 0.0, 0.0
        return ratio, -round(abs(a - b), 6), b  # then the nearer number, then the newer of two as near

    best = max(options, key=score)
    return f" (did you mean '{best}'?)" if score(best)[0] >= 0.6 else ""

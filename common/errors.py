"""The one error type for bad input or environment: rendered as one line, exit code 2."""

from __future__ import annotations

from collections.abc import Iterable

from inenv.spelling import nearest


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


def suggest(word: str, choices: Iterable[str]) -> str:
    """' (did you mean 'x'?)' for the nearest choice (``inenv.spelling``) when it is near enough, or ''."""
    found = nearest(word, choices)
    return f" (did you mean '{found[0]}'?)" if found and found[1] >= 0.6 else ""

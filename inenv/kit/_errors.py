"""Error text from the libraries under test, cut to the part a person reads.

In-environment side: standard library only.
"""

from __future__ import annotations

ERROR_TAIL_CHARS = 600
NOTE_LINE_CHARS = 300


def error_tail(exc: BaseException, limit: int = ERROR_TAIL_CHARS) -> str:
    """The useful end of an exception message (torch prefixes long C++ stacks)."""
    text = f"{type(exc).__name__}: {exc}".strip()
    noise = ("frame #", "Exception raised")
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith(noise)]
    text = "\n".join(lines)
    return text[-limit:]


def last_line(text: str, limit: int = NOTE_LINE_CHARS) -> str:
    """The last non-empty line of an error, for a one-line note."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return (lines[-1] if lines else "")[:limit]

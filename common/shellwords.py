"""Lines a person pastes into a shell, built with shell quoting (pure, standard library only).

Every command or setting the report and ``checks advise`` print goes through here, so a value read from a
results file (a cell id, a variant's NCCL_ALGO) can never become shell syntax. A plain word stays as it
is (``--only cu130-torch2.11.0-sgl0.4.2-fi0.6.16``), so the printed lines read as before.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from common import escape

_ASSIGNMENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")


def command(words: Iterable[str]) -> str:
    """Words joined into one command line, each quoted where the shell would read it otherwise."""
    return " ".join(escape.shell(w) for w in words)


def setting(text: str) -> str:
    """An environment assignment (``NAME=value``: the value quoted) or a flag (quoted as one word)."""
    m = _ASSIGNMENT.match(text)
    if m:
        return m.group(0) + escape.shell(text[m.end():])
    return escape.shell(text)

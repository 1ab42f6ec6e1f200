"""A result's words as they may be recorded and published: nothing in them says where a clone, a home folder or
a temporary folder lives, and no interpreter patch release stands where the minor release is the fact (pure).

The same results give the same text on every machine: paths inside a clone (its venv cells, caches and
environment) are written from the clone's top (``.cache/venvs/<cell>/bin/python``), home folders as ``~``,
temporary folders as ``$TMPDIR/<name>`` with the random part of a made-up name as ``*``
(``$TMPDIR/stackprobe-fi-jit-*/jit-cache/...``), and ``cpython 3.11.7`` as ``cpython 3.11`` (an extension
module's tag names the minor release only). Applied when a result is recorded and again when results are read
for the table and the advice, so results recorded before these rules read the same way.
"""

from __future__ import annotations

import dataclasses
import re

from checks.results.result import ProbeResult

# The folders a clone keeps inside itself that notes name (venv cells, the caches, the project's environment).
_IN_CLONE = re.compile(r"(?<![\w.~$-])/(?:[^\s/'\"`]+/)*?(?=(?:\.cache/(?:venvs(?:-[^\s/]*)?|compile|pycache|"
                       r"fi-venv-[^\s/]*|kernels|registry)|\.venv)/)")
_HOME = re.compile(r"(?<![\w.~$-])/(?:root|home/[^\s/'\"`]+)(?=/|\b)")
_TMP = re.compile(r"(?<![\w.~$-])/(?:var/)?tmp(?=/|\b)(?:/(?P<name>[^\s/'\"`\])]+))?")
_MADE_UP = re.compile(r"(?<=.)[a-z0-9_]{8}$")  # mkdtemp's names end in 8 characters of [a-z0-9_]
_CPYTHON = re.compile(r"\b([cC][pP]ython) (\d+\.\d+)\.\d+\b")  # the interpreter as a tag names it


def _tmp(m: re.Match[str]) -> str:
    name = m["name"]
    if name is None:
        return "$TMPDIR"
    tail = _MADE_UP.search(name)
    if tail and (any(c.isdigit() for c in tail[0]) or "_" in tail[0]):  # eight letters may be a word, not mkdtemp's
        name = name[:tail.start()] + "*"
    return f"$TMPDIR/{name}"


def text(words: str, clone: str = "") -> str:
    """``words`` with every path written as the module says. ``clone``: this clone's folder, when known (at
    record time), also written from its top."""
    if not words:
        return words
    if clone:
        words = words.replace(clone.rstrip("/") + "/", "")
    words = _IN_CLONE.sub("", words)
    words = _HOME.sub("~", words)
    words = _TMP.sub(_tmp, words)
    return _CPYTHON.sub(r"\1 \2", words)


def result(r: ProbeResult, clone: str = "") -> ProbeResult:
    """``r`` with its note and remediation written as :func:`text` writes them (the same object when they
    already are)."""
    v = r.verdict
    note, remedy = text(v.note, clone), text(v.remediation, clone)
    if note == v.note and remedy == v.remediation:
        return r
    return dataclasses.replace(r, verdict=v.replace(note=note, remediation=remedy))

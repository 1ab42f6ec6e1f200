"""The grammars of the ids that name files and rows: host id, run id, cell id, probe id, variant and reason
code (host side, pure).

Ids read from results files and bundles come from other machines, so each is checked here before it names
a folder, a file, a table row or a word of a command a person pastes into a shell. Every grammar is a
full match over a small alphabet (no slash, no quote, no space, no shell or markup character) with a
length cap; the cell id must also be one ``common.cellid`` can parse.

- host id: ``<label>-<8 hex>``, the label a lower-case slug of the GPU model and count (``h200x2``) or
  ``cpu``, e.g. ``h200x2-5bce98f7``;
- run id: ``<UTC time>-<4 hex>``, e.g. ``20261201T021126Z-b42a``, the time a real one not later than now
  (plus an hour of clock skew between machines);
- probe id: lower-case words joined by ``-`` (``ar-latency``);
- variant: ``key=value`` parts joined by ``,`` (``ranks=2,env.NCCL_ALGO=Tree``), or empty;
- reason code: lower-case words joined by ``-`` (``fi-no-nvcc``), or empty.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta

from common import cellid, escape

# <label>-<8 hex>: the label is the GPU model slug and count (h200x2) or "cpu", the hash tells machines apart
HOST_ID = re.compile(r"[a-z0-9]+(?:-[a-z0-9]+)*-[0-9a-f]{8}")
RUN_ID = re.compile(r"[0-9]{8}T[0-9]{6}Z-[0-9a-f]{4}")  # checks.results.store.new_run_id: UTC start time and 4 hex
# A run id's time is when the run started: a time later than now by more than clocks drift apart is not one
RUN_CLOCK_SKEW = timedelta(hours=1)
PROBE_ID = re.compile(r"[a-z0-9]+(?:-[a-z0-9]+)*")
_PARAM = r"[A-Za-z][A-Za-z0-9_.]*=[A-Za-z0-9_.:+-]+"  # env.NCCL_ALGO=Tree, algo=allreduce:tree
VARIANT = re.compile(rf"(?:{_PARAM}(?:,{_PARAM})*)?")
REASON = re.compile(r"(?:[a-z0-9]+(?:-[a-z0-9]+)*)?")
CELL_CHARS = re.compile(r"[A-Za-z0-9._+-]+")
MAX_LEN = {"host id": 96, "run id": 24, "cell id": 160, "probe id": 64, "variant": 240, "reason code": 64}
SHAPE = {
    "host id": "<gpu-label>-<8 hex digits>, e.g. h200x2-5bce98f7",
    "run id": "<YYYYmmddTHHMMSSZ>-<4 hex digits> naming a real UTC time not in the future, e.g. 20261201T021126Z-b42a",
    "cell id": "a provision cell id, e.g. cu130-torch2.11.0-sgl0.4.2-fi0.6.18",
    "probe id": "lower-case words joined by '-', e.g. ar-latency",
    "variant": "key=value pairs joined by ',', e.g. ranks=2,backend=nccl",
    "reason code": "lower-case words joined by '-', e.g. fi-no-nvcc",
}
_GRAMMAR = {"host id": HOST_ID, "run id": RUN_ID, "probe id": PROBE_ID, "variant": VARIANT, "reason code": REASON}
_MAY_BE_EMPTY = frozenset({"variant", "reason code"})


def valid(kind: str, value: object) -> bool:
    """Whether ``value`` is a well-formed id of ``kind`` (a key of SHAPE)."""
    if not isinstance(value, str) or len(value) > MAX_LEN[kind]:
        return False
    if not value:
        return kind in _MAY_BE_EMPTY
    if kind == "cell id":
        return CELL_CHARS.fullmatch(value) is not None and cellid.parse(value) is not None
    if not value.isascii() or _GRAMMAR[kind].fullmatch(value) is None:
        return False
    return kind != "run id" or _started(value) is not None


def _started(run_id: str) -> datetime | None:
    """The UTC time a run id names, or None when it names no real time or one after now (plus the skew)."""
    try:
        t = datetime.strptime(run_id[:16], "%Y%m%dT%H%M%SZ").replace(tzinfo=UTC)
    except ValueError:
        return None
    return t if t <= datetime.now(UTC) + RUN_CLOCK_SKEW else None


def problem(kind: str, value: object) -> str | None:
    """None for a well-formed id, else one line saying what it should look like (the value shown repr'd and cut)."""
    if valid(kind, value):
        return None
    shown_value = repr(value if not isinstance(value, str) else value[:60] + ("..." if len(value) > 60 else ""))
    return f"{kind} {shown_value} is not of the form {SHAPE[kind]}"


def one_line(text: str) -> str:
    """Text from results as one terminal line: every character that is not printable (newlines, escape
    sequences, bidirectional overrides) written as its Python escape, the rest as it is, so no recorded text can
    start a line of its own or move the cursor in what a command prints."""
    return escape.terminal(text)


def shown(text: str) -> str:
    """A name from disk as one printable line: escapes for undecodable bytes, control and format characters."""
    return escape.terminal(text.replace("\\", "\\\\")) if escape.has_unsafe(text, "") or "\\" in text else text

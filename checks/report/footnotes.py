"""The notes under a table section (pure): one per distinct reason, where it applies said compactly.

Verdicts that are not a pass point to a note. Notes that differ only in one version-like token (``needs 2
GPUs`` / ``needs 4 GPUs``, ``trtllm_comm for 12.0a`` / ``for 12.0f``) are one note that lists the values
(``needs 2/4/8 GPUs``); a note that applies to many variants names its cells and counts per probe instead
of listing every variant id (one note of a full matrix run on a no-GPU host covers 120 variants).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from common import escape

NOTE_LIMIT = 300
# a version, an architecture or a count: 2, 12.0a, 0.6.8.post1, sm_120f
_VALUE = re.compile(r"(?<![\w.])(?:sm_)?\d+(?:\.\d+)*[a-z]?(?:\.post\d+)?(?![\w])")


def clean(text: object, limit: int = NOTE_LIMIT) -> str:
    s = " ".join(str(text or "").split())
    return s if len(s) <= limit else s[: limit - 1] + "…"


@dataclass(frozen=True)
class Occurrence:
    """One verdict that needs a note, in table order."""

    cell: str
    probe: str
    variant: str
    status: str
    reason_code: str
    note: str
    remediation: str
    # the catalogue's next step chosen for this verdict (a remedy of its NCCL release a result there shows passing:
    # checks.results.remedies); None: the catalogue's text for its code
    offered: str | None = None


@dataclass
class Footnote:
    number: int
    status: str
    reason_code: str
    message: str
    note: str
    remediation: str
    where: list[tuple[str, str, str]] = field(default_factory=list)  # (cell, probe, variant)

    @property
    def count(self) -> int:
        return len(self.where)

    @property
    def places(self) -> str:
        return places(self.where)


def _natural(value: str) -> tuple[object, ...]:
    return tuple(int(p) if p.isdigit() else p for p in re.split(r"(\d+)", value))


def _merged(notes: list[str]) -> list[str] | str:
    """One text for notes that differ in at most one value position, else the notes as they are."""
    if len(notes) == 1:
        return notes[0]
    values = [_VALUE.findall(n) for n in notes]
    differing = {i for i in range(len(values[0])) if len({tuple(v)[i] for v in values}) > 1}
    if len(differing) != 1:
        return notes
    [pos] = differing
    listed = "/".join(sorted(dict.fromkeys(v[pos] for v in values), key=_natural))
    parts = _VALUE.split(notes[0])
    out = [parts[0]]
    for i, v in enumerate(values[0]):
        out += [listed if i == pos else v, parts[i + 1]]
    return "".join(out)


def unknown_reason(code: str) -> str:
    """The message for a reason code this checkout's catalogue lacks (from a newer stackprobe, or made up)."""
    return (f"unknown reason code {escape.terminal(code)[:64]} (not in this checkout's catalogue; no next step "
            "known here)")


def footnotes(occurrences: list[Occurrence], messages: Mapping[str, str],
              remediations: Mapping[str, str]) -> tuple[list[Footnote], list[int]]:
    """The notes in first-seen order, and for each occurrence the number of its note. ``messages`` and
    ``remediations``: the reason catalogue's text by code. A message and a next step come only from this
    checkout's catalogue, never from what a result recorded: a results file or bundle from elsewhere is data, and
    its text must not tell the reader what to run. A code the catalogue lacks is said to be unknown."""
    def text(o: Occurrence) -> tuple[str, str, str]:
        message = messages.get(o.reason_code, "") if o.reason_code in messages or not o.reason_code else \
            unknown_reason(o.reason_code)
        chosen = o.offered if o.offered is not None else remediations.get(o.reason_code, "")
        return clean(o.note), clean(message), clean(chosen)

    groups: dict[tuple[str, ...], list[str]] = {}  # (status, code, note shape, remediation) -> distinct notes
    for o in occurrences:
        note, _, rem = text(o)
        notes = groups.setdefault((o.status, o.reason_code, _VALUE.sub("\0", note), rem), [])
        if note not in notes:
            notes.append(note)
    shown: dict[tuple[str, ...], str] = {}  # (group..., note) -> the note text it is shown under
    for key, notes in groups.items():
        merged = _merged(notes)
        for n in notes:
            shown[(*key, n)] = merged if isinstance(merged, str) else n

    out: list[Footnote] = []
    index: dict[tuple[str, ...], Footnote] = {}
    numbers: list[int] = []
    for o in occurrences:
        note, message, rem = text(o)
        final = shown[(o.status, o.reason_code, _VALUE.sub("\0", note), rem, note)]
        key = (o.status, o.reason_code, final, rem)
        if key not in index:
            index[key] = Footnote(len(out) + 1, o.status, o.reason_code, message,
                                  "" if final.rstrip(".") == message.rstrip(".") else final, rem)
            out.append(index[key])
        index[key].where.append((o.cell, o.probe, o.variant))
        numbers.append(index[key].number)
    return out, numbers


def places(where: list[tuple[str, str, str]]) -> str:
    """Where a note applies: one variant in full; more as cells (those with the same probes together) and,
    per probe, its variant or how many: ``c1, c2: ar-latency ×15, fi-jit module=x``."""
    if len(where) == 1:
        return " / ".join(where[0])
    per_cell: dict[str, dict[str, list[str]]] = {}
    for cell, probe, variant in where:
        per_cell.setdefault(cell, {}).setdefault(probe, []).append(variant)
    by_probes: dict[tuple[str, ...], list[str]] = {}
    for cell, probes in per_cell.items():
        entries = tuple(f"{p} ×{len(vs)}" if len(vs) > 1 else f"{p} {vs[0]}" for p, vs in probes.items())
        by_probes.setdefault(entries, []).append(cell)
    return "; ".join(f"{', '.join(cells)}: {', '.join(entries)}" for entries, cells in by_probes.items())

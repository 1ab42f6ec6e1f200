"""Selection of cells by CUDA prefix, torch channel or version, and id glob."""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence

from common import cellid
from common.errors import InputError, suggest
from common.resolve import Resolved


def cuda_matches(cuda: str, want: str) -> bool:
    """`13` selects every 13.x; `12.8` selects 12.8 only."""
    return cuda == want or cuda.startswith(want + ".")


def _id_torch(cell_id: str) -> str | None:
    """The torch version a cell id names (``2.11.0``, ``nightly``)."""
    parsed = cellid.parse(cell_id)
    return parsed.torch if parsed is not None else None


def select(cells: Sequence[Resolved], cuda: str | None = None, torch: str | None = None,
           only: Sequence[str] | str | None = None) -> list[Resolved]:
    globs = [only] if isinstance(only, str) else list(only or [])
    out = [
        r for r in cells
        if (cuda is None or cuda_matches(r.cell.cuda, cuda))
        and (torch is None or torch in (r.cell.torch, r.versions.get("torch"), _id_torch(r.cell_id)))
        and (not globs or any(fnmatch.fnmatchcase(r.cell_id, g) for g in globs))
    ]
    if not out:
        asked = " ".join(f"--{k} {v}" for k, v in (("cuda", cuda), ("torch", torch)) if v)
        asked += "".join(f" --only '{g}'" for g in globs)
        hint = suggest(cuda, sorted({r.cell.cuda for r in cells})) if cuda else ""
        raise InputError(f"no cell matches {asked.strip()}{hint}; run 'provision plan' to list the cell ids")
    return out

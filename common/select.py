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


SHAPE = {"cuda": "a CUDA version such as 13 or 12.8", "torch": "a torch channel (stable, nightly) or version such "
         "as 2.11.0", "only": "a glob of cell ids such as 'cu130-*'"}


def _torch_of(r: Resolved) -> set[str]:
    return {v for v in (r.cell.torch, r.versions.get("torch"), _id_torch(r.cell_id)) if v}


def select(cells: Sequence[Resolved], cuda: str | None = None, torch: str | None = None,
           only: Sequence[str] | str | None = None) -> list[Resolved]:
    """The cells every given selector admits; InputError naming an empty selector, or the one selector that
    leaves no cell of those the selectors before it admit (with the nearest value it could have meant)."""
    globs = [only] if isinstance(only, str) else list(only or [])
    for option, value in (("cuda", cuda), ("torch", torch), *(("only", g) for g in globs)):
        if value is not None and not value.strip():
            raise InputError(f"--{option} {value!r}: an empty selector selects nothing; give {SHAPE[option]}, or "
                             "leave the option out")
    steps = [("cuda", cuda, lambda r: cuda_matches(r.cell.cuda, cuda or ""), lambda rs: {r.cell.cuda for r in rs}),
             ("torch", torch, lambda r: torch in _torch_of(r), lambda rs: set().union(*map(_torch_of, rs))),
             ("only", " ".join(repr(g) for g in globs) if globs else None,
              lambda r: any(fnmatch.fnmatchcase(r.cell_id, g) for g in globs), lambda rs: {r.cell_id for r in rs})]
    out = list(cells)
    asked: list[str] = []
    for option, value, keeps, values in steps:
        if value is None:
            continue
        kept = [r for r in out if keeps(r)]
        if not kept:
            among = f" among the {len(out)} cell(s) {' '.join(asked)} selects" if asked else ""
            hint = suggest(globs[0] if option == "only" else value, sorted(values(out))) if out else ""
            raise InputError(f"no cell matches --{option} {value}{among}{hint}; run 'provision plan' to list the "
                             "cell ids")
        asked.append(f"--{option} {value}")
        out = kept
    return out

"""The interface other parts of stackprobe use (checks): plan the cells of a matrix file."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from common import reach
from common.catalog import Catalog
from common.catalog import load as load_catalog
from common.home import DATA_ROOT
from common.matrix import load as load_matrix
from common.resolve import Resolved, resolve
from common.select import select

DEFAULT_MATRIX = DATA_ROOT / "matrix.yaml"  # the checkout's, or the one packaged in the wheel


@dataclass(frozen=True)
class PlannedCell:
    cell_id: str
    status: str  # "resolved" | "unavailable" | "unreachable"
    reason: str
    versions: dict[str, str] = field(default_factory=dict)
    cuda: str = ""


def resolve_all(matrix_path: str | Path = DEFAULT_MATRIX, *, offline: bool = False,
                catalog: Catalog | None = None) -> list[Resolved]:
    """Every cell of the matrix, resolved; index hosts are checked once each unless offline."""
    cat = catalog or load_catalog()
    matrix = load_matrix(matrix_path, cat)
    static = [resolve(c, cat) for c in matrix.cells]
    if offline:
        return static
    hosts = {urlparse(s.where).hostname or "" for r in static for s in r.sources if s.where != "registry"}
    status = reach.check({h for h in hosts if h})
    return [resolve(c, cat, lambda h: status.get(h)) for c in matrix.cells]


def plan(matrix_path: str | Path = DEFAULT_MATRIX, cuda: str | None = None, torch: str | None = None,
         only: Sequence[str] | str | None = None, *, offline: bool = False) -> list[Resolved]:
    return select(resolve_all(matrix_path, offline=offline), cuda, torch, only)


def plan_cells(matrix_path: str | Path = DEFAULT_MATRIX, cuda: str | None = None, torch: str | None = None,
               only: Sequence[str] | str | None = None) -> list[PlannedCell]:
    """Cells of a matrix with their status. Raises common.errors.InputError on bad input."""
    return [PlannedCell(r.cell_id, r.status, r.reason, dict(r.versions), r.cell.cuda)
            for r in plan(matrix_path, cuda, torch, only)]

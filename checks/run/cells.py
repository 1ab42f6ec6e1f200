"""Where the selected cells come from (host side): the matrix's cells as `provision build` planned them, each
with its image state (Docker) or its venv (venv cells), or the one environment of an interpreter (local).
Each returns the cells and, for those that can run, the executor that runs them here."""

from __future__ import annotations

from typing import Any

from checks.run import venvcell
from checks.run.container import DockerExecutor, client
from checks.run.executor import Executor, LocalExecutor
from checks.run.options import RunOptions, UsageError
from checks.run.plan import CellState, CellTarget, ImageState, image_state, local_cell_id, matches_cuda, select_cells
from common.api import plan_cells
from common.errors import InputError

Cells = tuple[list[CellTarget], dict[str, Executor]]


def local(opts: RunOptions, python: str) -> tuple[CellTarget, LocalExecutor, dict[str, Any]]:
    """The environment of ``python`` as one cell, its executor, and what it reported about itself."""
    ex = LocalExecutor(python)
    inspect = ex.inspect()
    versions = {k: str(v) for k, v in (inspect.get("versions") or {}).items() if isinstance(v, str | int | float)}
    cell = CellTarget(local_cell_id(versions), CellState.LOCAL, versions=versions, image_status=ImageState.LOCAL)
    cells = [cell]
    if opts.cuda and not matches_cuda(versions.get("torch_cuda", ""), opts.cuda):
        cells = []
    if not select_cells(cells, list(opts.only)):
        raise UsageError(f"checks run: the local environment ({cell.cell_id}) does not match --cuda/--only")
    return cell, ex, inspect


def planned(opts: RunOptions) -> list[Any]:
    """The selected cells of the matrix (common.api.PlannedCell), as `provision build` planned them."""
    try:
        found = plan_cells(opts.matrix, cuda=opts.cuda, only=list(opts.only) or None)
    except InputError as exc:
        raise UsageError(exc.one_line()) from None
    if not found:
        raise UsageError(f"checks run: the selection matches no cell of {opts.matrix}")
    return found


def venv(opts: RunOptions) -> Cells:
    """Each selected cell's venv (envs/<cell>/build-venv.json), run by the local executor with its interpreter."""
    cells: list[CellTarget] = []
    executors: dict[str, Executor] = {}
    for pc in planned(opts):
        if pc.status != CellState.RESOLVED:
            cells.append(CellTarget(pc.cell_id, pc.status, pc.reason, dict(pc.versions)))
            continue
        vc = venvcell.read(opts.envs, pc.cell_id)
        versions = {**pc.versions, **({"from_base": vc.from_base} if vc.from_base else {})}
        cells.append(CellTarget(pc.cell_id, pc.status, pc.reason, versions, vc.python, vc.state, vc.reason))
        if vc.state is ImageState.BUILT and vc.python:
            executors[pc.cell_id] = LocalExecutor(vc.python, venvcell.BACKEND, vc.env, hermetic=vc.hermetic)
    return cells, executors


def docker(opts: RunOptions, gpus: int) -> Cells:
    """Each selected cell's image (envs/<cell>/build.json), one container per variant."""
    cells: list[CellTarget] = []
    for pc in planned(opts):
        if pc.status != CellState.RESOLVED:
            cells.append(CellTarget(pc.cell_id, pc.status, pc.reason, dict(pc.versions)))
            continue
        state, tag, why = image_state(opts.envs, pc.cell_id)
        cells.append(CellTarget(pc.cell_id, pc.status, pc.reason, dict(pc.versions), tag, state, why))
    runnable = [c for c in cells if c.image_status is ImageState.BUILT and c.image]
    executors: dict[str, Executor] = {}
    if runnable:
        daemon = client()  # no Docker: one line, exit 2
        for c in runnable:
            executors[c.cell_id] = DockerExecutor(image=str(c.image), gpus_on_host=gpus, _client=daemon)
    return cells, executors

"""A venv cell as `checks run --backend venv` runs it, read from the envs/<cell>/build-venv.json that
`provision build --backend venv` wrote: its interpreter, the environment its ranks get, and which packages
its base environment provides (an overlay cell)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from checks.run.executor import code_path
from checks.run.plan import ImageState, image_state
from common.build import backend, buildrecord
from common.build.celltoolkit import cell_env

BACKEND = backend.VENV


@dataclass(frozen=True)
class VenvCell:
    state: ImageState  # built | failed | missing
    python: str | None = None
    reason: str = ""
    env: tuple[tuple[str, str], ...] = ()  # set for the ranks on top of the runner's environment
    from_base: str = ""  # e.g. "torch, triton, nvidia-*, cuda-* +12 others"; "" for a full cell
    hermetic: bool = True  # a full cell; an overlay cell runs in its base environment's, the host's


def rank_env(record: Mapping[str, object], environ: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The ranks' environment on top of the runner's (common.build.celltoolkit.cell_env, with the probes' code: this
    checkout, or an installed wheel's copy of the in-environment package)."""
    return cell_env(record, environ, code_path())


def read(envs_dir: Path, cell_id: str, environ: Mapping[str, str] = os.environ) -> VenvCell:
    loaded = buildrecord.read(envs_dir / cell_id, backend.VENV)
    path, record = loaded.path, loaded.record
    build = f"`provision build --backend venv --only {cell_id}`"
    if record is None:
        if loaded.problem:
            return VenvCell(ImageState.MISSING, reason=f"{path} {loaded.problem}: rerun {build}")
        state, image, _ = image_state(envs_dir, cell_id)
        also = (f"; its Docker image {image} is built: checks run --backend docker runs that"
                if state == ImageState.BUILT else "")
        return VenvCell(ImageState.MISSING, reason=f"no {path}: run {build}{also}")
    if record.backend != BACKEND:
        what = f"a Docker image ({record.tag})" if record.tag else "no venv"
        return VenvCell(ImageState.MISSING,
                        reason=f"{path} records {what}: run {build}, or checks run --backend docker")
    if not record.runnable:
        return VenvCell(ImageState.FAILED, reason=record.reason or f"build status {record.data.get('status', '')!r}")
    python = record.python or ""
    if not python or not os.access(python, os.X_OK):
        return VenvCell(ImageState.MISSING, reason=f"the venv's interpreter {python or '?'} is gone: rerun {build}")
    return VenvCell(ImageState.BUILT, python, "", rank_env(record.data, environ), record.from_base_summary,
                    hermetic=not record.base_python)

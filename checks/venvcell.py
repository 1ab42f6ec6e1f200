"""A venv cell as `checks run --backend venv` runs it, read from the envs/<cell>/build.json that
`provision build --backend venv` wrote: its interpreter, the environment its ranks get, and which packages
its base environment provides (an overlay cell)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from checks.executor import CODE_ROOT
from checks.plan import ImageState

BACKEND = "venv"


@dataclass(frozen=True)
class VenvCell:
    state: ImageState  # built | failed | missing
    python: str | None = None
    reason: str = ""
    env: tuple[tuple[str, str], ...] = ()  # set for the ranks on top of the runner's environment
    from_base: str = ""  # e.g. "torch, triton, nvidia-*, cuda-* +12 others"; "" for a full cell


def rank_env(record: Mapping[str, object], environ: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    """The venv's scripts first on PATH (then the base's: its ninja, say); CUDA_HOME when the cell made one
    from the toolkit wheels (flashinfer and torch look there first); only this checkout on PYTHONPATH, so the
    caller's path cannot put other packages in front of the cell's."""
    path = [str(p) for p in record.get("path") or [] if p]  # type: ignore[union-attr]
    out = [("PATH", os.pathsep.join([*path, environ.get("PATH", os.defpath)])), ("PYTHONPATH", str(CODE_ROOT))]
    if record.get("cuda_home"):
        out.append(("CUDA_HOME", str(record["cuda_home"])))
    return tuple(out)


def read(envs_dir: Path, cell_id: str, environ: Mapping[str, str] = os.environ) -> VenvCell:
    path = envs_dir / cell_id / "build.json"
    build = f"`provision build --backend venv --only {cell_id}`"
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return VenvCell(ImageState.MISSING, reason=f"no {path}: run {build}")
    except (OSError, ValueError) as exc:
        return VenvCell(ImageState.MISSING, reason=f"{path} unreadable ({exc}): rerun {build}")
    if record.get("backend") != BACKEND:
        what = f"a Docker image ({record.get('tag')})" if record.get("tag") else "no venv"
        return VenvCell(ImageState.MISSING,
                        reason=f"{path} records {what}: run {build}, or checks run --backend docker")
    status = str(record.get("status", ""))
    if status not in ("built", "skipped-unchanged"):
        return VenvCell(ImageState.FAILED, reason=str(record.get("reason") or f"build status {status!r}"))
    python = str(record.get("python") or "")
    if not python or not os.access(python, os.X_OK):
        return VenvCell(ImageState.MISSING, reason=f"the venv's interpreter {python or '?'} is gone: rerun {build}")
    return VenvCell(ImageState.BUILT, python, "", rank_env(record, environ), str(record.get("from_base_summary") or ""))

"""A cell's build records, ``envs/<cell>/build.json`` (its Docker image) and ``envs/<cell>/build-venv.json`` (its
venv), and the self-check both builders run: one home for what every builder writes and reads back."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from common import canonical
from common.build import backend, buildrecord
from common.build.buildrecord import BuildStatus
from inenv import atomic
from inenv.selfcheck import SHARED as SELFCHECK_SHARED

SELFCHECK = Path(__file__).resolve().parent.parent / "inenv" / "selfcheck.py"
SELFCHECK_ROOT = "/opt/stackprobe-code"  # in the image: the self-check beside the checks/ modules it imports


def selfcheck_files() -> list[tuple[Path, str]]:
    """(host path, image path) of the self-check and each module it shares with the probes."""
    root = SELFCHECK.parent.parent
    return [(SELFCHECK, f"{SELFCHECK_ROOT}/selfcheck.py"),
            *((root / rel, f"{SELFCHECK_ROOT}/{rel}") for rel in SELFCHECK_SHARED)]


def selfcheck_texts() -> list[str]:
    """The self-check's files as the image tag hashes them: layout-free (common.canonical, the spelling of
    probe hashes), so a module that moves to another folder leaves built images current."""
    return [canonical.layout_free_source(host.read_text()) for host, _ in selfcheck_files()]


def versions(facts: dict[str, Any]) -> dict[str, str | None]:
    t = facts.get("torch") or {}
    return {"torch": t.get("version"), "torch_cuda": t.get("cuda"),
            "sgl_kernel": (facts.get("sgl_kernel") or {}).get("version"),
            "flashinfer": (facts.get("flashinfer") or {}).get("version"),
            "nccl": t.get("nccl"), "python": facts.get("python")}


def record(folder: Path, **kw: Any) -> dict[str, Any]:
    """Write the cell's build record for the backend ``kw`` names (``backend``; none: Docker), in that
    backend's own file (common.build.backend.RECORD_NAMES)."""
    status: BuildStatus = kw.pop("status")
    rec = {"cell_id": folder.name, "status": status.value, "tag": kw.pop("tag", None),
           "image_id": kw.pop("image_id", None), "reason": kw.pop("reason", ""),
           "selfcheck": kw.pop("selfcheck", {}), "versions": kw.pop("versions", {}),
           "built_at": datetime.now(UTC).isoformat(timespec="seconds"), **kw}
    write(folder, rec)
    return rec


def write(folder: Path, rec: dict[str, Any]) -> None:
    """Write ``rec`` as the cell's build record in its backend's own file (common.build.backend.RECORD_NAMES; none:
    Docker), atomically: the one writer of these files, as common.build.buildrecord is their one reader."""
    atomic.write_json(folder / backend.RECORD_NAMES[str(rec.get("backend") or backend.DOCKER)], rec, indent=1)


def previous(folder: Path, of: str = backend.DOCKER) -> dict[str, Any]:
    """The record of the cell's last build by backend ``of``; {} when there is none or it cannot be read."""
    found = buildrecord.read(folder, of).record
    return dict(found.data) if found is not None else {}

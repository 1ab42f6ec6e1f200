"""A cell's build record (``envs/<cell>/build.json``, ``build-venv.json``): its status, one type, and one reader
for both sides: `provision build` writes and rereads it (provision.cellrecord), `checks run` reads it to know
which cells can run (checks.run.plan, checks.run.venvcell)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from common import backend


class BuildStatus(StrEnum):
    """How a cell's last build by one backend ended, as its record says."""

    BUILT = "built"
    UNCHANGED = "skipped-unchanged"  # nothing to do: the inputs match the build that is there
    FAILED = "failed"
    WOULD_BUILD = "would-build"  # --dry-run: the plan of a build, never written to a record

    @property
    def runnable(self) -> bool:
        """A record with this status names a cell that can run."""
        return self in (BuildStatus.BUILT, BuildStatus.UNCHANGED)

    @classmethod
    def of(cls, record: dict[str, Any]) -> BuildStatus | None:
        """The status a record (as read from disk) names, or None when it names none this type knows."""
        try:
            return cls(str(record.get("status", "")))
        except ValueError:
            return None


def runnable(record: dict[str, Any]) -> bool:
    """A record (as read from disk) whose status names a cell that can run."""
    status = BuildStatus.of(record)
    return status is not None and status.runnable


@dataclass(frozen=True)
class Loaded:
    """What reading a cell's record gave: the record (None when absent or unreadable) and, when unreadable,
    why (without the path)."""

    path: Path
    record: dict[str, Any] | None = None
    problem: str = ""

    @property
    def status(self) -> BuildStatus | None:
        return BuildStatus.of(self.record) if self.record is not None else None

    @property
    def runnable(self) -> bool:
        return self.record is not None and runnable(self.record)


def read(folder: Path, of: str = backend.DOCKER) -> Loaded:
    """The record of the cell in ``folder`` that backend ``of`` wrote; absent or unreadable says so."""
    path = backend.record_file(folder, of)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return Loaded(path)
    except (OSError, ValueError) as exc:
        return Loaded(path, problem=f"unreadable ({exc})")
    if not isinstance(data, dict):
        return Loaded(path, problem="unreadable (not a JSON object)")
    return Loaded(path, data)

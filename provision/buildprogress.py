"""What `provision build` says while it builds (pure), for Docker images and venv cells alike: which cell of
how many, what it is doing and for how long, and the time left estimated from each cell's last build
(``build_s`` in its build record); and which lines of `docker build` output a person watching needs.

The whole output of `docker build` goes to the cell's build log. The console gets one line per build step as
it starts (BuildKit's ``#7 [3/9] RUN ...``, the classic builder's ``Step 3/9 : RUN ...``) and every error
line; layer digests (``#5 sha256:... 10MB / 120MB``), download progress and the steps' own output stay in
the log."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from common.build.buildrecord import BuildStatus
from common.progress import Estimate, duration, estimate
from provision.render import CERTENV, Base


def last_build_s(previous: dict[str, Any]) -> float | None:
    """How long a cell's last build took (its build record), if it was ever timed."""
    value = previous.get("build_s")
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


DIGEST_CHARS = 16


def digests(parts: dict[str, str]) -> dict[str, str]:
    """Each named input of a build by a digest of its text."""
    return {name: hashlib.sha256(text.encode()).hexdigest()[:DIGEST_CHARS] for name, text in parts.items()}


def inputs_hash(inputs: dict[str, str]) -> str:
    """One digest of a build's named inputs (``digests``): what an image tag or a venv's build hash says."""
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:12]


def why_built(previous: dict[str, Any], inputs: dict[str, str]) -> str:
    """Why a cell that was built before builds again, from its last build record: the inputs whose digest
    differs from the one that build recorded, else what else sends it back ("" when it was never built)."""
    if not previous:
        return ""
    status = BuildStatus.of(previous)
    if status is not None and not status.runnable:
        return "its last build failed"
    before = previous.get("inputs")
    if not isinstance(before, dict):
        return "its last build recorded no inputs to compare"
    changed = sorted(k for k in set(inputs) | set(before) if before.get(k) != inputs.get(k))
    if changed:
        return f"{', '.join(changed)} changed since its last build"
    return "what its last build made is gone"


class Planned(Protocol):
    """A cell about to be built, as the progress lines name it."""

    @property
    def cell_id(self) -> str: ...

    @property
    def target(self) -> str: ...  # what the build makes: an image tag, a venv folder

    @property
    def last_build_s(self) -> float | None: ...

    @property
    def why(self) -> str: ...  # why it builds again ("" when never built)


@dataclass(frozen=True)
class Locked:
    """A locked cell about to be built, with the record of its last build (its build record)."""

    folder: Path
    cell: dict[str, Any]
    previous: dict[str, Any]
    inputs: dict[str, str] = field(default_factory=dict, kw_only=True)  # digests, as why_built compares them

    @property
    def cell_id(self) -> str:
        return str(self.cell["cell_id"])

    @property
    def last_build_s(self) -> float | None:
        return last_build_s(self.previous)

    @property
    def why(self) -> str:
        return why_built(self.previous, self.inputs)


@dataclass(frozen=True)
class Step(Locked):
    """A cell ready to build as an image: its Dockerfile written, its tag known."""

    base: Base
    dockerfile: Path
    tag: str

    @property
    def target(self) -> str:
        return self.tag


@dataclass(frozen=True)
class VenvStep(Locked):
    """A cell to make as a virtual environment at ``venv``."""

    venv: Path

    @property
    def target(self) -> str:
        return str(self.venv)


@dataclass
class BuildProgress:
    """Counts and text for the builds of one `provision build`: cell n of N (N: the cells that build),
    what each is doing and for how long, and the time left from each cell's last build (its build record).
    ``noun``: what the cells become (images, venv cells)."""

    steps: Sequence[Planned]
    done: set[str] = field(default_factory=set)
    noun: str = "images"

    def _number(self, step: Planned) -> str:
        return f"cell {self.steps.index(step) + 1} of {len(self.steps)}"

    def left(self) -> Estimate:
        return estimate(s.last_build_s for s in self.steps if s.cell_id not in self.done)

    def opening(self, unchanged: int, failed: int = 0) -> str:
        """Said once before the first build: how many cells build and how long that should take."""
        parts = [f"{len(self.steps)} to build"] + ([f"{unchanged} unchanged"] if unchanged else []) + (
            [f"{failed} failed before building"] if failed else [])
        head = f"{self.noun}: {', '.join(parts)}"
        return head + (f"; {self.left().text()} by their last builds" if self.steps else "")

    def start_line(self, step: Planned) -> str:
        last = f"last build {duration(step.last_build_s)}" if step.last_build_s is not None else "never built here"
        why = f"; {step.why}" if step.why else ""
        return f"{self._number(step)}: building {step.target} ({last}{why})"

    def tick_line(self, step: Planned, elapsed: float, current: str) -> str:
        last = f" of {duration(step.last_build_s)} last time" if step.last_build_s is not None else ""
        now = f"; at {current}" if current else ""
        return f"{step.cell_id} ({self._number(step)}) building for {duration(elapsed)}{last}{now}"

    def end_line(self, step: Planned, status: str, elapsed: float) -> str:
        left = self.left()
        rest = f", {left.text()} left" if left.steps else ""
        count = f"{len(self.done)} of {len(self.steps)} done"
        return f"{self._number(step)}: {status} after {duration(elapsed)} · {count}{rest}"


def begin(prepared: Sequence[Any], step_type: type, report: Callable[[str, str], None],
          noun: str = "images") -> tuple[list[Any], BuildProgress]:
    """The cells of one `provision build` that build (those prepared as ``step_type``) and their progress,
    after saying once how many build, how many are unchanged and how many failed before building (the other
    prepared values are their build records)."""
    steps = [p for p in prepared if isinstance(p, step_type)]
    progress = BuildProgress(steps, noun=noun)
    if prepared:
        records = [p for p in prepared if not isinstance(p, step_type)]
        report("", progress.opening(sum(1 for r in records if r["status"] == BuildStatus.UNCHANGED),
                                    sum(1 for r in records if r["status"] == BuildStatus.FAILED)))
    return steps, progress


# --- docker build's output -------------------------------------------------------------------------

STEP_LIMIT = 160  # a RUN step can be a page of shell; the log has it whole
_BUILDKIT_STEP = re.compile(r"^#(?P<id>\d+) \[(?:[\w.-]+ )?(?P<n>\d+)/(?P<of>\d+)\] (?P<what>.+)$")
_BUILDKIT_EXPORT = re.compile(r"^#(?P<id>\d+) exporting to image$")  # minutes for a large image
_CLASSIC_STEP = re.compile(r"^Step (?P<n>\d+)/(?P<of>\d+) : (?P<what>.+)$")
_ERROR = re.compile(r"^(#\d+ ERROR|ERROR[: ]|error: |The command .* returned a non-zero code)")


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= STEP_LIMIT else text[: STEP_LIMIT - 1] + "…"


def _what(text: str) -> str:
    """A step without what every download step repeats (cache and secret mounts, the CA bundle export)."""
    text = re.sub(r"--mount=\S+\s*", "", " ".join(text.split()))
    return _short(text.replace(" ".join(CERTENV.split()) + " ", ""))


def step(line: str) -> tuple[str, str] | None:
    """(step key, ``step 3/9: RUN ...``) when ``line`` starts a build step; BuildKit repeats a step's header
    when its output resumes after another step's, so the key lets the caller say each step once."""
    line = line.strip()
    m = _BUILDKIT_STEP.match(line)
    if m:
        return m["id"], f"step {m['n']}/{m['of']}: {_what(m['what'])}"
    m = _BUILDKIT_EXPORT.match(line)
    if m:
        return m["id"], "exporting the image"
    m = _CLASSIC_STEP.match(line)
    if m:
        return f"step{m['n']}", f"step {m['n']}/{m['of']}: {_what(m['what'])}"
    return None


def error(line: str) -> str | None:
    """The line, shortened, when it reports an error."""
    line = line.strip()
    return _short(line) if _ERROR.match(line) else None

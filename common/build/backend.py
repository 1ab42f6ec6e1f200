"""Where cells are built and run: Docker images, or virtual environments (venv cells) where there is no
Docker daemon. One rule for `provision build` and `checks run` (pure; the callers probe the daemon)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from common.errors import InputError

DOCKER, VENV, AUTO = "docker", "venv", "auto"
CHOICES = (AUTO, DOCKER, VENV)
# Each backend keeps its own record of a cell's build in the cell's folder, so building a cell one way leaves
# the other way's build as it was: switching backends rebuilds nothing either one built before. The one reader
# of these files is common.build.buildrecord.
RECORD_NAMES = {DOCKER: "build.json", VENV: "build-venv.json"}


@dataclass(frozen=True)
class Choice:
    backend: str
    line: str = ""  # one line for the user when the backend was not the one asked for by name


BUILD_VENVS = "building the cells as venv cells (virtual environments)"
RUN_VENVS = "running the probes in venv cells (virtual environments)"


def choose(requested: str, docker_problem: Callable[[], str | None], overlay: bool = False,
           doing: str = BUILD_VENVS) -> Choice:
    """``auto``: Docker when its daemon answers, else venv cells, said in one line. An overlay
    (``--base-python``/``--wheels``) exists only as a venv cell. ``docker_problem`` returns why the daemon
    cannot be used, or None; it is asked only under ``auto``."""
    if requested not in CHOICES:
        raise InputError(f"--backend {requested}: choose one of {', '.join(CHOICES)}")
    if requested == DOCKER:
        if overlay:
            raise InputError("--base-python and --wheels build venv cells: use --backend venv (or leave it out)")
        return Choice(DOCKER)
    if requested == VENV or overlay:
        return Choice(VENV)
    problem = docker_problem()
    if problem is None:
        return Choice(DOCKER)
    return Choice(VENV, fallback_line(problem, doing))


def fallback_line(problem: str, doing: str = BUILD_VENVS) -> str:
    """What happens when ``auto`` finds no daemon and what that means for the verdicts."""
    return (f"no Docker daemon answers ({problem}): {doing} instead of Docker images; the same locks, "
            "self-check and probes, so the same verdicts (`--backend docker` insists on Docker)")

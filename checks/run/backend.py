"""Where a run's cells come from and where their variants run: the :class:`Backend` protocol and the one
registry of its implementations, checks.run.backends.BACKENDS (host side).

A backend answers four questions for the run session (checks.run.session), which never asks which backend it
drives:

- ``targets(opts)``: the selected cells, the host facts of where they run and the GPU count each worker is
  told (exit 2 with one line when the backend cannot be used here);
- ``prepare(opts, targets)``: the run's settings for each cell (compile cache, GPU lock) put in place, and
  the fingerprint of each running cell's environment (None: that cell reuses nothing);
- ``run(opts, work, hooks)``: start every item of the work that is still to run, poll until each is
  recorded through the shared recorder (checks.run.runner.begin), and on Ctrl-C ``cancel`` what it started
  before the KeyboardInterrupt is reported as an interrupted run;
- ``cancel()``: end everything the run started (process groups, containers, Slurm jobs); safe to repeat.

Capabilities are attributes, not questions about the kind: ``gpu_lock`` (whether its workers take turns on
this host's GPU lock, inenv.gpugate). Docker, venv and local cells run on this host through an executor per
cell and the thread pool of checks.run.runner; Slurm (checks.run.slurm.backend) submits the same work items as jobs.
A new backend (Kubernetes, podman) is one class with these methods and one entry in BACKENDS.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from checks.run.executor import EnvPrint
from checks.run.options import CompileTargets, RunOptions
from checks.run.plan import CellTarget
from checks.run.runner import Hooks, RunReport, Work


@dataclass(frozen=True)
class Targets:
    """The selected cells and where they run: the host facts the run records and plans with, the GPU
    count every worker is told (for Slurm, the most one job asks for), and the targets the compile probes
    build for there (options.compile_targets: ``--target-arch`` and those GPUs, decided once)."""

    cells: list[CellTarget]
    facts: dict[str, Any]
    gpus: int
    compile: CompileTargets
    # what a user's environment already holds for this GPU (cell -> flashinfer comm module -> SASS targets), read
    # from the environment itself; cells provision built say what they carry in their build records instead
    holds: Mapping[str, Mapping[str, tuple[str, ...]]] = field(default_factory=dict)


class Backend(Protocol):
    name: str  # the manifest's executor
    gpu_lock: bool  # whether its workers take turns on this host's GPU lock

    def targets(self, opts: RunOptions) -> Targets: ...

    def prepare(self, opts: RunOptions, targets: Targets) -> dict[str, EnvPrint | None]: ...

    def run(self, opts: RunOptions, work: Work, hooks: Hooks) -> RunReport: ...

    def cancel(self) -> None: ...

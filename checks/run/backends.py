"""The registry of backends (checks.run.backend.Backend), keyed by the name `checks run --backend` takes, and the
backends that run cells on this host through one executor per cell: Docker images, venv cells and one
local interpreter. Slurm's is in checks.run.slurm.backend."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from checks.results import hostfacts
from checks.run import cells, runner
from checks.run.backend import Backend, Targets
from checks.run.container import client, unreachable
from checks.run.executor import (
    EnvPrint,
    Executor,
    ExecutorError,
    LocalExecutor,
    for_run,
    gpu_lock_path,
    run_token,
)
from checks.run.options import AUTO, DOCKER, LOCAL, SLURM, VENV, RunOptions, UsageError, compile_targets
from checks.run.runner import Hooks, RunReport, Work
from checks.run.slurm.backend import SlurmBackend
from common.build import backend as provision_backend
from common.caches import compile_cache_dir
from common.errors import InputError

FINGERPRINTS_AT_ONCE = 8


def _peer_facts(executors: dict[str, Executor], gpus: int) -> dict[str, Any] | None:
    """What one environment reports about the GPUs (peer access, multicast), when one can be asked."""
    if not executors or not gpus:
        return None
    try:
        return next(iter(executors.values())).inspect()
    except ExecutorError as exc:  # one broken environment must not stop the run; its variants say why
        print(f"warning: peer access and multicast unknown: {exc}", file=sys.stderr)
        return None


def fingerprints(executors: dict[str, Executor]) -> dict[str, EnvPrint | None]:
    """Each cell's environment fingerprint, the cells asked at once: each answer is a process started in the
    environment (a container on Docker), and a run's plan waits for the last of them."""
    if not executors:
        return {}
    with ThreadPoolExecutor(max_workers=min(FINGERPRINTS_AT_ONCE, len(executors))) as pool:
        return dict(zip(executors, pool.map(lambda ex: ex.fingerprint(), executors.values()), strict=True))


def close_all(executors: Iterable[Executor]) -> None:
    """What the executors kept between variants (serving workers) ends with the run, every executor's at once:
    each server may take a moment to leave (checks.run.serving.CLOSE_WAIT_S)."""
    found = list(executors)
    if not found:
        return
    with ThreadPoolExecutor(max_workers=len(found)) as pool:
        list(pool.map(lambda ex: ex.close(), found))


@dataclass
class HostBackend:
    """Cells that run on this host, one executor per cell, up to ``--jobs`` variants at once."""

    name: str
    find: Callable[[RunOptions, int], cells.Cells]
    gpu_lock: bool = True
    executors: dict[str, Executor] = field(default_factory=dict)
    # the cell is a user's own environment: what its flashinfer already holds for this GPU counts as carried
    own_env: bool = False

    def targets(self, opts: RunOptions) -> Targets:
        smi = hostfacts.gpu_facts()
        gpus = int(smi["gpu_count"])
        found, self.executors = self.find(opts, gpus)
        facts = hostfacts.with_inspect(smi, _peer_facts(self.executors, gpus))
        capability = facts.get("compute_capability")
        holds = {cid: have for cid, ex in self.executors.items()
                 if self.own_env and gpus and isinstance(capability, str) and isinstance(ex, LocalExecutor)
                 and (have := cells.env_modules(ex, capability))}
        return Targets(found, facts, gpus, compile_targets(opts.target_archs, gpus, capability), holds)

    def prepare(self, opts: RunOptions, targets: Targets) -> dict[str, EnvPrint | None]:
        cache = compile_cache_dir(opts.compile_cache, opts.no_compile_cache)
        lock = gpu_lock_path() if self.gpu_lock and targets.gpus else None
        self.executors = for_run(self.executors, targets.compile.archs, cache, str(targets.facts["host_id"]), lock,
                                 run_token(), warm=not opts.cold_ranks, gpu_alone=opts.gpu_alone)
        return fingerprints(self.executors)

    def run(self, opts: RunOptions, work: Work, hooks: Hooks) -> RunReport:
        try:
            return runner.execute(opts, replace(work, executors=self.executors), hooks)
        finally:
            close_all(self.executors.values())

    def cancel(self) -> None:
        for ex in self.executors.values():
            ex.sweep()


def _local(opts: RunOptions, gpus: int) -> cells.Cells:
    cell, ex, _ = cells.local(opts, opts.python or sys.executable)
    return [cell], {cell.cell_id: ex}


def _docker(opts: RunOptions, gpus: int) -> cells.Cells:
    return cells.images(opts, gpus) if opts.images else cells.docker(opts, gpus)


def docker_backend() -> Backend:
    return HostBackend(DOCKER, _docker)


def venv_backend() -> Backend:
    return HostBackend(VENV, lambda opts, gpus: cells.venv(opts))


def local_backend() -> Backend:
    return HostBackend(LOCAL, _local, own_env=True)


BACKENDS: dict[str, Callable[[], Backend]] = {
    DOCKER: docker_backend,
    VENV: venv_backend,
    LOCAL: local_backend,
    SLURM: SlurmBackend,
}


def resolve(requested: str) -> tuple[str, str]:
    """The backend a run uses and the line that says why, when ``auto`` chose it: Docker when its daemon
    answers, else venv cells (one rule with `provision build`, common.build.backend)."""
    if requested != AUTO:
        if requested == DOCKER:
            client()  # insisted on: fails now (ExecutorError with the fix), even when no image would run
        return requested, ""
    try:
        chosen = provision_backend.choose(AUTO, unreachable, doing=provision_backend.RUN_VENVS)
    except InputError as exc:
        raise UsageError(f"checks run: {exc.one_line()}") from None
    return chosen.backend, chosen.line

"""What one `checks run` was asked to do: the command line resolved once into a frozen :class:`RunOptions`
(host side). Every later step takes the options or the values it needs; nothing changes them.

Where cells come from and where their variants run is one choice, ``backend`` (the registry is
checks.run.backends.BACKENDS): ``docker`` (cell images), ``venv`` (venv cells), ``local`` (one interpreter,
``--python``), ``slurm`` (jobs on a cluster) or ``auto`` (Docker when its daemon answers, else venv cells).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from common import outputs
from common.home import DATA_ROOT, WORK_ROOT
from inenv.probe import LEVELS, QUICK

REPO = WORK_ROOT  # the checkout, or the current folder for an installed wheel (common.home)
AUTO, DOCKER, VENV, LOCAL, SLURM = "auto", "docker", "venv", "local", "slurm"
BACKEND_CHOICES = (AUTO, DOCKER, VENV, LOCAL, SLURM)
MAX_DEFAULT_JOBS = 4
MAX_BUDGET_S = 7 * 86400.0  # --budget: a week, in seconds


class UsageError(Exception):
    """Bad input: printed as one line, exit 2."""


def default_jobs() -> int:
    """The CPU cores this process may use, at most MAX_DEFAULT_JOBS (each compile job is itself parallel)."""
    return max(1, min(MAX_DEFAULT_JOBS, len(os.sched_getaffinity(0))))


@dataclass(frozen=True)
class SlurmOptions:
    """What the Slurm backend asks of the cluster."""

    partition: str | None = None
    gpus_per_job: int | None = None  # None: the partition's GPUs per node
    time_minutes: int | None = None  # None: each job's own estimate
    container_image: str | None = None
    sbatch_args: tuple[str, ...] = ()


@dataclass(frozen=True)
class RunOptions:
    """One `checks run`, validated (:meth:`check`) before anything runs."""

    probes: tuple[str, ...] = ()  # probe ids; empty with all_probes
    all_probes: bool = False
    cuda: str | None = None
    only: tuple[str, ...] = ()
    backend: str = AUTO
    python: str | None = None  # the interpreter of the local backend (and of Slurm nodes when given)
    images: tuple[str, ...] = ()  # existing images to probe as cells (docker; slurm: its container image)
    slurm: SlurmOptions = SlurmOptions()
    resume: bool = False
    fresh: bool = False
    jobs: int = field(default_factory=default_jobs)  # the command line's default too
    level: str | None = None  # None: quick first, then full (two passes; checks.run.session)
    as_json: bool = False
    # --cold-ranks: every variant in rank processes of its own; default: a cell's variants share rank processes
    # kept between them where the executor can keep them (local, venv, Docker: checks.run.serving, inenv.warm)
    cold_ranks: bool = False
    # --gpu-alone: every GPU variant has the GPUs alone; default: those that time nothing (ranks sharing a GPU,
    # depth=setup) run side by side on the GPU lock held shared (inenv.gpugate)
    gpu_alone: bool = False
    budget_s: float | None = None  # --budget: the seconds the whole command may take (checks.run.cost.budget)
    soak_s: float | None = None  # --soak: the seconds each variant of a probe that replays under load replays
    timeout_scale: float = 1.0
    target_archs: tuple[str, ...] | None = None  # --target-arch; None: not given, the host decides (compile_targets)
    compile_cache: Path | None = None
    no_compile_cache: bool = False
    results: Path = REPO / "results"
    matrix: Path = DATA_ROOT / "matrix.yaml"
    envs: Path = REPO / "envs"
    report: Path | None = None  # the table regenerated at the end; None: not regenerated
    argv: tuple[str, ...] = ()

    def check(self) -> RunOptions:
        """The options themselves when they are consistent; else UsageError naming the option."""
        if self.timeout_scale <= 0:
            raise UsageError("checks run: --timeout-scale must be > 0")
        if self.budget_s is not None and not (math.isfinite(self.budget_s) and 0 < self.budget_s <= MAX_BUDGET_S):
            raise UsageError(f"checks run: --budget {self.budget_s / 60:g}: give the minutes this host can spare, "
                             f"more than 0 and at most {MAX_BUDGET_S / 60:g}")
        if self.soak_s is not None and not (math.isfinite(self.soak_s) and 0 < self.soak_s <= MAX_BUDGET_S):
            raise UsageError(f"checks run: --soak {self.soak_s / 60:g}: give the minutes each load variant replays, "
                             f"more than 0 and at most {MAX_BUDGET_S / 60:g}")
        if self.soak_s is not None and self.level == QUICK:
            raise UsageError("checks run: --soak replays the load probe's variants, which the quick level does not "
                             "run; leave out --level quick")
        reports = (self.report, self.report.with_suffix(".html")) if self.report is not None else ()
        if (why := outputs.first_problem((p, "checks run: --report") for p in reports)) is not None:
            raise UsageError(why)
        if self.jobs < 1:
            raise UsageError(f"checks run: --jobs {self.jobs}: give 1 or more")
        if self.backend not in BACKEND_CHOICES:
            raise UsageError(f"checks run: --backend {self.backend}: choose one of {', '.join(BACKEND_CHOICES)}")
        if self.level is not None and self.level not in LEVELS:
            raise UsageError(f"checks run: --level {self.level}: choose one of {', '.join(LEVELS)}")
        if self.all_probes and self.probes:
            raise UsageError("checks run: give --all or --probe, not both")
        if self.resume and self.fresh:
            raise UsageError("checks run: --resume continues the latest run and --fresh reruns everything; give one")
        if self.compile_cache is not None and self.no_compile_cache:
            raise UsageError("checks run: --compile-cache names a cache and --no-compile-cache shares none; give one")
        if self.images and self.backend not in (DOCKER, SLURM):
            raise UsageError(f"checks run: --image runs existing images with --backend docker (or slurm), not "
                             f"--backend {self.backend}")
        if self.images and self.python is not None:
            raise UsageError("checks run: --image runs the image's own python3; give --image or --python, not both")
        if self.backend == SLURM and (len(self.images) > 1 or (self.images and self.slurm.container_image
                                                               not in (None, self.images[0]))):
            raise UsageError("checks run: with --backend slurm give one image (--image or --container-image)")
        if any(not i or i.startswith("-") or any(c.isspace() for c in i) for i in self.images):
            raise UsageError("checks run: --image: give image names or ids, comma-separated, e.g. "
                             "--image my/serving:1.2,other:latest")
        if self.python is not None and self.backend not in (LOCAL, SLURM):
            raise UsageError(f"checks run: --python is the interpreter of --backend local (or slurm); with "
                             f"--backend {self.backend} the cells bring their own")
        given = [flag for flag, value in (("--partition", self.slurm.partition), ("--gpus-per-job",
                 self.slurm.gpus_per_job), ("--time", self.slurm.time_minutes), ("--container-image",
                 self.slurm.container_image), ("--sbatch-arg", self.slurm.sbatch_args or None)) if value is not None]
        if given and self.backend != SLURM:
            raise UsageError(f"checks run: {', '.join(given)} {'is' if len(given) == 1 else 'are'} for --backend "
                             f"slurm, not --backend {self.backend}")
        if not self.all_probes and not self.probes:
            raise UsageError("checks run: choose probes with --all or --probe ID (see `checks list`)")
        if self.slurm.gpus_per_job is not None and self.slurm.gpus_per_job < 0:
            raise UsageError(f"checks run: --gpus-per-job {self.slurm.gpus_per_job}: give 0 or more")
        if self.slurm.time_minutes is not None and self.slurm.time_minutes < 1:
            raise UsageError(f"checks run: --time {self.slurm.time_minutes}: give 1 or more minutes")
        return self


CROSS_TARGETS = ("12.0a", "12.0f")  # what a host without a GPU compiles for when --target-arch is not given


@dataclass(frozen=True)
class CompileTargets:
    """The targets the compile probes build for beside the local GPU (fi-jit's ``arch=local``), decided once
    from ``--target-arch`` and the host's GPUs, and the line the plan says it with."""

    archs: tuple[str, ...]
    why: str


def compile_targets(asked: tuple[str, ...] | None, gpus: int, capability: str | None) -> CompileTargets:
    """``--target-arch`` when given; else on a host with a GPU none (each module is compiled, when it must be,
    for that GPU only: a user's GPU host needs no other), and on a host without one :data:`CROSS_TARGETS` (the
    CPU machine builds what GPU hosts are given to carry). Pure."""
    here = f"the local GPU (compute capability {capability or 'unknown'})" if gpus else ""
    if asked is not None:
        named = ", ".join(asked) or "none"
        return CompileTargets(asked, f"compile targets: {named} (--target-arch)" + (f", and {here}" if here else ""))
    if gpus:
        return CompileTargets((), f"compile targets: {here} only, this host's own; cross targets only when "
                                  f"asked (--target-arch {','.join(CROSS_TARGETS)})")
    return CompileTargets(CROSS_TARGETS, f"compile targets: {', '.join(CROSS_TARGETS)} (no GPU here: the cross "
                                         "targets GPU hosts are given to carry; --target-arch names others)")


def backend_from_flags(backend: str, executor: str | None, local: bool, images: bool = False) -> str:
    """The one backend of ``--backend``, given the older spellings ``--executor local|docker|slurm`` and
    ``--local`` (deprecated aliases of ``--backend local|docker|slurm``); two that disagree are refused.
    ``auto`` with ``--image`` is docker (an image runs in a container)."""
    named = [(f"--backend {backend}", backend)] if backend != AUTO else []
    if executor:
        named.append((f"--executor {executor}", executor))
    if local:
        named.append(("--local", LOCAL))
    chosen = {value for _, value in named}
    if len(chosen) > 1:
        raise UsageError(f"checks run: {' and '.join(flag for flag, _ in named)} name different backends; "
                         "give one --backend")
    return chosen.pop() if chosen else DOCKER if images else AUTO

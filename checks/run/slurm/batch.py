"""How a run becomes Slurm jobs: which variants share a job, what each job asks for, and the files that
tell the allocated node what to run (pure, host side).

A job holds the variants of one cell that need the same number of GPUs. The GPU variants of a cell go
in one job per GPU count, asking for exactly that many (``--gres=gpu:N``), so a cell waits for each size
of allocation once. A variant needs as many GPUs as it has ranks, or, where its ranks share GPUs, every
GPU a job may have. Probes that need no GPU (inventories, cross-compiles of many minutes each) get one job
per cell and probe, so that they run side by side; on a partition with GPUs they still get one, since a
local run shows them the host's GPUs and they look at it (inventory checks that its architecture runs the
stack; fi-jit's ``local`` target compiles for it).

The node runs the same worker command the local executor runs, under the same isolation and hard
timeout, and writes each variant's raw outcome to the job's folder; the host turns outcomes into
verdicts exactly as it does for a local run.
"""

from __future__ import annotations

import json
import math
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from checks.run.plan import WorkItem
from inenv import kit

SCRIPT_FILE = "job.sh"  # the batch script sbatch gets
LOG_FILE = "slurm.out"  # the batch step's stdout and stderr (slurmstepd writes its kill notices here)
NODE_MARGIN_S = 120  # per job: Python start-up, host facts, the node's inspection of its GPUs


@dataclass(frozen=True)
class JobPlan:
    """One Slurm job: the cell it runs, the GPUs it asks for and its variants (indexes into the run's items)."""

    cell_id: str
    gpus: int
    probe_id: str  # "" for a GPU job, which holds every GPU probe's variants of its size
    items: tuple[int, ...]
    hard_timeouts_s: tuple[float, ...]  # per variant, as the local executor would enforce them
    cpus: int  # the most ranks any of its variants starts

    @property
    def name(self) -> str:
        return f"{self.cell_id} {self.probe_id or 'gpu'}" + (f" x{self.gpus} GPU" if self.gpus else "")

    def time_minutes(self) -> int:
        """The job's time limit when the user gives none: every variant at its hard timeout, plus start-up."""
        return max(1, math.ceil((sum(self.hard_timeouts_s) + NODE_MARGIN_S) / 60))


def gpus_needed(item: WorkItem, gpus_per_job: int) -> int:
    if not item.spec.needs_gpu:
        return min(1, gpus_per_job)
    if item.variant.share_gpu:
        return gpus_per_job
    return item.variant.ranks


def plan_jobs(items: Sequence[WorkItem], gpus_per_job: int, hard_timeout: Any) -> list[JobPlan]:
    """The jobs for the items that run (decided items need no job), in the order of their first variant.
    ``hard_timeout``: the local executor's hard limit for a variant's timeout (one rule for both)."""
    groups: dict[tuple[str, int, str], list[int]] = {}
    for i, item in enumerate(items):
        if item.decided is None:
            key = (item.cell.cell_id, gpus_needed(item, gpus_per_job), "" if item.spec.needs_gpu else item.spec.id)
            groups.setdefault(key, []).append(i)
    return [JobPlan(cell, gpus, probe, tuple(idx), tuple(float(hard_timeout(items[i].timeout_s)) for i in idx),
                    max(items[i].variant.ranks for i in idx))
            for (cell, gpus, probe), idx in groups.items()]


@dataclass(frozen=True)
class Request:
    """What every job of a run asks Slurm for, beyond its GPUs."""

    partition: str | None = None
    time_minutes: int | None = None  # None: each job's own estimate
    extra: tuple[str, ...] = ()  # passed to sbatch as given (account, QOS, constraint...)


def sbatch_args(job: JobPlan, request: Request, run_name: str, folder: Path) -> list[str]:
    """sbatch's options for one job. ``--no-requeue``: a job whose node fails ends as NODE_FAIL and is
    recorded so, instead of starting over from its first variant. Every job of a run has the same name,
    so one ``scancel --name`` reaches even a job whose submission reply never arrived."""
    args = ["--parsable", f"--job-name={run_name}", f"--output={folder / LOG_FILE}", "--no-requeue",
            "--nodes=1", "--ntasks=1", f"--cpus-per-task={max(1, job.cpus)}",
            f"--time={request.time_minutes or job.time_minutes()}", f"--chdir={folder}"]
    if request.partition:
        args.append(f"--partition={request.partition}")
    if job.gpus:
        args.append(f"--gres=gpu:{job.gpus}")
    return [*args, *request.extra]


@dataclass(frozen=True)
class Launch:
    """How the node starts a cell's interpreter: a path on the node (a venv cell, or ``--python``), or an
    image through the site's pyxis plugin (``srun --container-image``), with the code and the job folder
    mounted. ``env``: what the local executor sets last for that cell (a venv cell's PATH, PYTHONPATH and
    CUDA_HOME)."""

    python: str
    image: str | None = None
    env: tuple[tuple[str, str], ...] = ()


def node_command(launch: Launch, code_root: Path, folder: Path) -> list[str]:
    run = [launch.python, "-m", "checks.run.slurm.node", str(folder)]
    if launch.image is None:
        return run
    mounts = f"{code_root}:{code_root}:ro,{folder}:{folder}"
    cache = dict(launch.env).get(kit.COMPILE_CACHE_ENV)  # the shared compile cache, read-write
    if cache:
        mounts += f",{cache}:{cache}"
    return ["srun", "--ntasks=1", f"--container-image={launch.image}", f"--container-mounts={mounts}",
            f"--container-workdir={folder}", *run]


def batch_script(command: Sequence[str], code_root: Path, probe_path: str = "",
                 env: Sequence[tuple[str, str]] = ()) -> str:
    """The batch script: the environment the local executor gives its workers, then the node runner."""
    lines = [
        "#!/bin/bash",
        "# written by `checks run --backend slurm`: runs the variants in job.json on this node",
        f"export PYTHONPATH={shlex.quote(str(code_root))}${{PYTHONPATH:+:$PYTHONPATH}}",
        "export PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1",
        "unset VIRTUAL_ENV  # the cell's interpreter, not the environment stackprobe itself runs in",
    ]
    if probe_path:
        lines.append(f"export STACKPROBE_PROBE_PATH={shlex.quote(probe_path)}")
    lines.extend(f"export {name}={shlex.quote(value)}" for name, value in env)
    lines.append("exec " + shlex.join(command))
    return "\n".join(lines) + "\n"


def job_json(job: JobPlan, items: Sequence[WorkItem], worker_args: Any, python: str) -> str:
    """What the node runs: per variant its index in the run, the worker command and the hard timeout.
    ``worker_args(variant, gpus, timeout_s)``: the local executor's arguments (one home for them)."""
    variants = [{"index": i, "label": f"{items[i].spec.id} {items[i].variant.key}",
                 "argv": [python, *worker_args(items[i].variant, job.gpus, items[i].timeout_s)],
                 "hard_timeout_s": hard}
                for i, hard in zip(job.items, job.hard_timeouts_s, strict=True)]
    return json.dumps({"cell_id": job.cell_id, "gpus": job.gpus, "variants": variants}, indent=1)

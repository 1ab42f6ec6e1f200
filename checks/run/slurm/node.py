"""Runs one Slurm job's variants on the allocated node (in-environment side: standard library only).

    python -m checks.run.slurm.node JOB_FOLDER
    python -m checks.run.slurm.node --facts GPUS     # this node's host facts as JSON on stdout

Reads ``job.json`` (written by the host), records the node's host facts in ``facts.json``, then runs
each variant's worker command exactly as the local executor does (own session, hard timeout, every
leftover process killed) and writes its raw outcome to ``<index>.outcome.json`` the moment it ends, after
marking its start in ``<index>.started``. The host reads these files from the shared folder while the
job runs, so a job ended by Slurm (time limit, memory, node failure) loses only the variant in flight,
and that one is recorded with Slurm's cause.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from checks.results import hostfacts
from checks.run import isolate
from inenv import atomic
from inenv.probe import RESULT_MARKER

JOB_FILE = "job.json"  # what the host asks this node to run
FACTS_FILE = "facts.json"  # this node's host facts, written before the first variant
INSPECT_TIMEOUT_S = 300


def started_path(folder: Path, index: int) -> Path:
    return folder / f"{index}.started"


def outcome_path(folder: Path, index: int) -> Path:
    return folder / f"{index}.outcome.json"


def _inspect(python: str) -> dict[str, Any] | None:
    """The environment's own view of its GPUs (peer access, multicast, SM counts), as the local run has it."""
    try:
        proc = subprocess.run([python, "-m", "inenv.worker", "--inspect"], capture_output=True, text=True,
                              timeout=INSPECT_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_MARKER)]
    try:
        data = json.loads(lines[-1][len(RESULT_MARKER):]) if lines else None
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


def node_facts(gpus: int) -> dict[str, Any]:
    facts = hostfacts.collect(_inspect(sys.executable) if gpus else None)
    facts["slurm"] = {k: os.environ.get(v) for k, v in (("job_id", "SLURM_JOB_ID"), ("node", "SLURMD_NODENAME"),
                                                         ("partition", "SLURM_JOB_PARTITION"),
                                                         ("gpus", "CUDA_VISIBLE_DEVICES"))}
    facts["slurm"]["hostname"] = socket.gethostname()
    return facts


def run_job(folder: Path) -> int:
    job = json.loads((folder / JOB_FILE).read_text())
    atomic.write_json(folder / FACTS_FILE, node_facts(int(job.get("gpus") or 0)))
    env = dict(os.environ)
    for v in job["variants"]:
        index = int(v["index"])
        atomic.write_text(started_path(folder, index), f"{time.time():.3f}\n")
        print(f"stackprobe: {v['label']}: started", file=sys.stderr, flush=True)
        p = isolate.run_isolated(list(v["argv"]), env, float(v["hard_timeout_s"]), cwd=str(folder))
        atomic.write_json(outcome_path(folder, index), dataclasses.asdict(p))
        print(f"stackprobe: {v['label']}: ended after {p.duration_s:.1f}s", file=sys.stderr, flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 2 and args[0] == "--facts" and args[1].isdigit():
        print(json.dumps(node_facts(int(args[1]))))
        return 0
    if len(args) != 1:
        print("usage: python -m checks.run.slurm.node JOB_FOLDER | --facts GPUS", file=sys.stderr)
        return 2
    return run_job(Path(args[0]))


if __name__ == "__main__":
    sys.exit(main())

"""The long modules of `provision build`'s kernel stage, as a process of their own (common.kernelstage says why).

    python -m provision.kernelstage JOB.json

``JOB.json`` (written by provision.buildsession): the cells, their backend and target lists, the parallel
builds, the modules, the envs folder. Each cell's record is read again here (the quick stage just rewrote it),
the modules are built and installed exactly as `provision build --wait-kernels` builds them in its own run
(provision.kernels.carry), and the lines it says go to the log the state file names, one event a line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from common import buildrecord, kernelstage
from provision import kernels


def start(job: dict[str, Any], folder: Path = kernelstage.FOLDER) -> kernelstage.Stage:
    """Write the job, start the stage's process (its own session: Ctrl-C in the terminal that started
    `provision build` does not reach it, and nothing waits on it) and record it in the state file."""
    folder.mkdir(parents=True, exist_ok=True)
    job_path = folder / "stage-job.json"
    job_path.write_text(json.dumps(job, indent=1))
    log_path = folder / "stage.log"
    with open(log_path, "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", kernelstage.MARKER, str(job_path)], cwd=kernels.CODE_ROOT,
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    stage = kernelstage.Stage(proc.pid, time.time(), log_path, int(job.get("builds", 0)))
    kernelstage.write_state(stage, folder)
    return stage


def run(job: dict[str, Any], log: Any) -> int:
    lock = threading.Lock()

    def report(cid: str, msg: str) -> None:
        with lock:
            log.write(f"{time.strftime('%H:%M:%S')} {cid + ' ' if cid else ''}{msg}\n")
            log.flush()

    envs = Path(job["envs"])
    records = []
    for cid in job["cells"]:
        loaded = buildrecord.read(envs / cid, job["backend"])
        if loaded.record is not None:
            records.append(dict(loaded.record))
    archs = {cid: tuple(a) for cid, a in job["archs"].items()}
    t0 = time.monotonic()
    where = {k: Path(job[k]) for k in ("kernels_root", "cache") if job.get(k)}  # tests keep them in their folder
    done = kernels.carry(records, archs, int(job["jobs"]), envs, report, modules=tuple(job["modules"]), **where)
    carried = sum(1 for r in done for row in ((r.get("kernels") or {}).get("modules") or {}).values()
                  if isinstance(row, dict) and row.get("carried"))
    report("", f"kernels: the stage ended after {round(time.monotonic() - t0)} s; {carried} module(s) carried "
               "in its cells")
    return 0


def _main(argv: list[str]) -> int:
    if len(argv) != 1:
        sys.stderr.write("usage: python -m provision.kernelstage JOB.json\n")
        return 2
    try:
        job = json.loads(Path(argv[0]).read_text())
        return run(job, sys.stdout)
    finally:
        kernelstage.clear(os.getpid(), Path(argv[0]).parent)


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))

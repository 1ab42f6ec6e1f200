"""The long modules after `provision build` returns (common.build.kernelstage): ``python -m provision.kernels JOB``.

``JOB.json`` (written by provision.buildsession): the cells, their backend and target lists, the parallel
builds, the modules, the envs folder. Each cell's record is read again (the quick stage just rewrote it), the
modules are built and installed as `provision build --wait-kernels` builds them in its own run, and the lines
it says go to the log the state file names, one event a line. A stopped stage stops what it started.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from common.build import buildrecord, kernelstage
from common.caches import CODE_ROOT
from inenv import atomic, lifetime
from provision.dockercli import Docker
from provision.kernels.carriers import stage_label, stopping
from provision.kernels.stage import carry


def start(job: dict[str, Any], folder: Path | None = None) -> kernelstage.Stage:
    """Take the folder's stage lock (kernelstage.StageBusy when another process holds it), write the job, start
    the stage's process (its own session: Ctrl-C in the terminal that started `provision build` does not reach
    it, and nothing waits on it; it inherits the lock and holds it until it ends) and record it in the state
    file (``folder``: common.build.kernelstage's, unless given). Nothing is written through a link: the job and the
    state are replaced by renames, the log opened with O_NOFOLLOW."""
    folder = (folder or kernelstage.FOLDER).absolute()
    lock = kernelstage.take_lock(folder)
    try:
        job_path = kernelstage.job_path(folder)
        atomic.write_text(job_path, json.dumps(job, indent=1))
        log_path = folder / kernelstage.LOG
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            proc = subprocess.Popen([sys.executable, "-m", kernelstage.MARKER, str(job_path)], cwd=CODE_ROOT,
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True, pass_fds=(lock,))
        finally:
            os.close(log)
        stage = kernelstage.Stage(proc.pid, time.time(), log_path, int(job.get("builds", 0)))
        kernelstage.write_state(stage, folder)
    finally:
        os.close(lock)  # the stage's own copy holds the lock from here
    return stage


def stop_builds(signum: int, folder: Path) -> None:
    """End every build the stage started and the stage itself: the containers of its Docker builds, then every
    process under it or in its process group (compilers included), stopped first so none forks away; its state
    file is removed and the stage exits with 128 + the signal's number. For SIGTERM and SIGINT."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    killed, unnamed = 0, 0
    builds = stopping()  # no build starts from now on
    for cidfile, docker in builds:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            cid = cidfile.read_text().strip() if cidfile.exists() else ""
            unnamed += not cid
            if cid and docker.run("kill", cid, timeout=60).returncode == 0:
                killed += 1
    group = os.getpgrp() if os.getpgrp() == os.getpid() else None  # its own session's group: none of the caller's
    killed += lifetime.end_below(os.getpid(), group)
    if unnamed:  # a `docker run` was creating its container when the stage stopped: no cidfile names it yet
        time.sleep(1.0)  # the daemon may finish creating it after its client has gone
        killed += sweep(builds[0][1])
    with contextlib.suppress(OSError, ValueError, RuntimeError):  # RuntimeError: a write of the stage's own cut
        sys.stdout.write(f"{time.strftime('%H:%M:%S')} kernels: the stage was stopped ({signal.Signals(signum).name}):"
                         f" {killed} build process(es) and container(s) ended with it\n")
        sys.stdout.flush()
    kernelstage.clear(os.getpid(), folder)
    os._exit(128 + signum)


def sweep(docker: Docker) -> int:
    """Remove every container labelled as this stage's build (running, or created and never started); how many."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        listed = docker.run("ps", "-aq", "--filter", f"label={stage_label()}", timeout=60)
        cids = listed.stdout.split() if listed.returncode == 0 else []
        if cids and docker.run("rm", "-f", *cids, timeout=120).returncode == 0:
            return len(cids)
    return 0


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
            records.append(dict(loaded.record.data))
    archs = {cid: tuple(a) for cid, a in job["archs"].items()}
    t0 = time.monotonic()
    where = {k: Path(job[k]) for k in ("kernels_root", "cache") if job.get(k)}  # tests keep them in their folder
    done = carry(records, archs, int(job["jobs"]), envs, report, modules=tuple(job["modules"]), **where)
    carried = sum(1 for r in done for row in ((r.get("kernels") or {}).get("modules") or {}).values()
                  if isinstance(row, dict) and row.get("carried"))
    report("", f"kernels: the stage ended after {round(time.monotonic() - t0)} s; {carried} module(s) carried "
               "in its cells")
    return 0


def _main(argv: list[str]) -> int:
    if len(argv) != 1:
        sys.stderr.write("usage: python -m provision.kernels JOB.json\n")
        return 2
    folder = Path(argv[0]).parent
    for sig in (signal.SIGTERM, signal.SIGINT):  # stopping the stage stops what it started
        signal.signal(sig, lambda signum, frame: stop_builds(signum, folder))
    try:
        with contextlib.suppress(OSError):
            os.nice(10)  # the quick pass `checks run` answers with meanwhile comes first; its builds inherit this
        job = json.loads(Path(argv[0]).read_text())
        return run(job, sys.stdout)
    finally:
        kernelstage.clear(os.getpid(), folder)

"""The Slurm backend of `checks run --backend slurm` (checks.run.backend.Backend): submit the run's work items as
Slurm jobs, follow them through the queue, record every verdict through the run's recorder, and cancel
every job on Ctrl-C (host side; the side effects of the Slurm backend).

Jobs and their files live in ``.cache/slurm/<run_id>/<n>/`` of this checkout, which the compute nodes must
share (they import the checks code from it). Each node writes its host facts and one raw outcome per
variant there; this process turns them into verdicts as they appear, exactly as the local executor does,
and appends them to the run's store. The run's host facts come from one short step on a node of the
partition (``srun ... python -m checks.run.slurm.node --facts``) before anything is planned, so resuming,
reusing earlier results and the run lock work on that host's results folder as on any other backend's; a
job that lands on another kind of node writes ``results/<that host_id>/<run_id>.jsonl``. When no node can
be asked, the run's host is ``slurm-<partition>-<hash>``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from checks.results import hostfacts, ids, portable
from checks.results.result import Verdict
from checks.results.store import RunStore
from checks.run import cells, classify
from checks.run.backend import Targets
from checks.run.executor import (
    CODE_ROOT,
    EnvPrint,
    ExecutorError,
    LocalExecutor,
    hard_timeout,
    parse_result_text,
    run_env,
    run_token,
    worker_args,
)
from checks.run.isolate import ProcessOutcome
from checks.run.options import SLURM, RunOptions, compile_targets
from checks.run.plan import CellState, CellTarget, ImageState, WorkItem
from checks.run.runner import Hooks, Recorder, RunReport, Work, begin, iso, level_variant, now_iso
from checks.run.slurm import acct, batch, offer
from checks.run.slurm.node import FACTS_FILE, JOB_FILE, outcome_path, started_path
from common import cellid, reasons
from common.caches import compile_cache_dir
from common.home import WORK_CACHE, WORK_ROOT
from inenv import atomic
from inenv.registry import PROBE_PATH_ENV
from inenv.status import Status

JOBS_ROOT = WORK_CACHE / "slurm"  # the checkout's .cache, or the current folder's for an installed wheel
POLL_ENV = "STACKPROBE_SLURM_POLL_S"
DEFAULT_POLL_S = 5.0  # one squeue per poll: gentle on a site's controller
END_WAIT_S = 30.0  # a job that left the queue: how long its record (and its files, on NFS) may lag
CANCEL_WAIT_S = 60.0


def _cmd(cmd: list[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return subprocess.CompletedProcess(cmd, 255, "", str(exc))


def queue(name: str) -> dict[str, acct.Queued] | None:
    """This run's jobs still in the queue, or None when squeue did not answer (try again later)."""
    p = _cmd(["squeue", "-h", f"--name={name}", "-o", acct.SQUEUE_FORMAT])
    return acct.parse_squeue(p.stdout) if p.returncode == 0 else None


def job_end(job_id: str) -> acct.JobEnd | None:
    """How a job that left the queue ended: the first source with a final state for it."""
    fields = ["-n", "-P", "-o", acct.SACCT_FIELDS, "-j", job_id]
    for source, cmd, parse in (
        ("sacct", ["sacct", "-X", *fields], acct.parse_sacct),
        ("sacct --completion", ["sacct", "--completion", *fields], acct.parse_sacct),
        ("scontrol", ["scontrol", "show", "job", "-o", job_id], None),
    ):
        p = _cmd(cmd)
        if p.returncode != 0:
            continue
        found = acct.parse_scontrol(p.stdout) if parse is None else parse(p.stdout, source)
        end = found.get(job_id)
        if end is not None and end.terminal:
            return end
    return None


def cancel(name: str, job_ids: list[str]) -> list[str]:
    """Cancel every job of the run (by name, which also reaches a job whose sbatch reply was lost, and by
    id) and wait until none is left in the queue; returns the ids still there after CANCEL_WAIT_S."""
    _cmd(["scancel", f"--name={name}"])
    if job_ids:
        _cmd(["scancel", *job_ids])
    deadline = time.monotonic() + CANCEL_WAIT_S
    left: dict[str, acct.Queued] | None = None
    while time.monotonic() < deadline:
        left = queue(name)
        if left == {}:
            return []
        time.sleep(0.5)
    return sorted(left or {})


@dataclass
class Job:
    """One submitted job as this run follows it."""

    n: int
    plan: batch.JobPlan
    folder: Path
    time_limit: int
    job_id: str = ""
    shown: str = ""  # the queue state last printed
    started: set[int] = field(default_factory=set)
    recorded: set[int] = field(default_factory=set)
    left_queue_at: float | None = None
    end: acct.JobEnd | None = None
    facts: dict[str, Any] | None = None
    done: bool = False

    def log_tail(self) -> str:
        try:
            data = (self.folder / batch.LOG_FILE).read_bytes()
        except OSError:
            return ""
        return data[-4000:].decode(errors="replace")


def started_iso(folder: Path, index: int) -> str:
    """When the node started a variant (its start mark), as the local runner records it; "" if it never did."""
    try:
        stamp = float(started_path(folder, index).read_text().strip())
    except (OSError, ValueError):
        return ""
    return iso(stamp)


@dataclass
class Stores:
    """The run's store, and one per other kind of node a job lands on (each with the run's manifest, its host
    facts that node's), written when that node first reports."""

    run: RunStore
    manifest: Mapping[str, Any]  # the run's manifest; another node kind's store gets it with its own facts
    by_host: dict[str, RunStore] = field(default_factory=dict)

    def for_facts(self, facts: dict[str, Any]) -> RunStore:
        host_id = str(facts.get("host_id") or self.run.host_id)
        if not ids.valid("host id", host_id):  # a node's facts name the results folder: never a path or a crafted name
            raise ExecutorError(f"a node reported host id {ids.shown(host_id)[:80]!r}, not <label>-<8 hex digits>")
        if host_id == self.run.host_id:
            return self.run
        if host_id not in self.by_host:
            store = RunStore(self.run.root, host_id, self.run.run_id)
            store.write_manifest({**self.manifest, "host_id": host_id, "facts": facts})
            self.by_host[host_id] = store
        return self.by_host[host_id]


def unplaced_facts(partition: str, why: str) -> dict[str, Any]:
    """Host facts when no node of the partition could be asked: none, beyond the partition."""
    digest = hostfacts.host_id([], f"{hostfacts.machine_key()}/{partition}").removeprefix("cpu-")
    return {"host_id": f"slurm-{hostfacts.slug(partition)}-{digest}", "gpu_count": 0, "gpus": [], "gpu_name": None,
            "no_gpu_reason": f"no node of partition {partition} could be asked ({why})",
            "slurm": {"partition": partition}}


@dataclass
class Tracker:
    """Follows the submitted jobs and records what comes back through the run's recorder."""

    items: list[WorkItem]  # the items the jobs run; a job's plan indexes into them
    jobs: list[Job]
    stores: Stores
    recorder: Recorder
    launches: dict[str, batch.Launch]  # by cell
    say: Callable[[str], None]

    @property
    def catalogue(self) -> reasons.Catalogue:
        return self.recorder.work.catalogue

    def record(self, index: int, verdict: Verdict, store: RunStore | None, started_at: str = "") -> None:
        self.recorder.record(self.items[index], verdict, started_at or now_iso(), store)

    def _store(self, job: Job) -> RunStore | None:
        if job.facts is None:
            path = job.folder / FACTS_FILE
            try:
                job.facts = json.loads(path.read_text()) if path.exists() else None
            except (OSError, ValueError):
                job.facts = None
        return self.stores.for_facts(job.facts) if isinstance(job.facts, dict) else None

    def harvest(self, job: Job) -> None:
        """Record every outcome the node has written and say which variants started."""
        store = self._store(job)
        for index, hard in zip(job.plan.items, job.plan.hard_timeouts_s, strict=True):
            if index in job.recorded:
                continue
            if index not in job.started and started_path(job.folder, index).exists():
                job.started.add(index)
                item = self.items[index]
                self.say(f"job {job.job_id}: {item.spec.id} {item.variant.key} started")
                if self.recorder.hooks.on_start:
                    self.recorder.hooks.on_start(item)
            path = outcome_path(job.folder, index)
            if not path.exists():
                continue
            try:
                p = ProcessOutcome(**json.loads(path.read_text()))
            except (OSError, ValueError, TypeError):
                continue  # not readable yet (a shared file system may show it late): next poll
            item = self.items[index]
            v = classify.from_process(p, self.catalogue, hard)
            python = self.launches[job.plan.cell_id].python
            v = v.with_evidence(command=portable.text(f"{python} -m inenv.worker {item.spec.id}", str(WORK_ROOT)),
                                slurm={"job": job.job_id, "node": (job.facts or {}).get("slurm", {}).get("node")})
            job.recorded.add(index)
            self.record(index, v, store, started_iso(job.folder, index))

    def settle(self, job: Job) -> None:
        """A job that left the queue: its end, its last outcomes, and a cause for every variant without one."""
        now = time.monotonic()
        job.left_queue_at = job.left_queue_at or now
        job.end = job.end or job_end(job.job_id)
        self.harvest(job)
        missing = [i for i in job.plan.items if i not in job.recorded]
        patient = now - job.left_queue_at < END_WAIT_S
        if missing and patient and (job.end is None or job.end.state == "COMPLETED"):
            return  # the record or the files may still be on their way
        tail = job.log_tail()
        for index in missing:
            v = acct.unfinished(job.job_id, job.end, index in job.started, tail, job.time_limit,
                                      str(job.folder), self.catalogue)
            job.recorded.add(index)
            self.record(index, v, self._store(job), started_iso(job.folder, index))
        job.done = True
        self.say(f"job {job.job_id}: ended {job.end.state if job.end else 'without a record'}")

    def poll(self, name: str) -> None:
        live = queue(name)
        for job in self.jobs:
            if job.done or not job.job_id:
                continue
            if live is None:  # squeue did not answer: nothing is concluded from silence
                self.harvest(job)
                continue
            q = live.get(job.job_id)
            if q is not None and q.state not in acct.TERMINAL:
                shown = q.describe()
                if shown != job.shown:
                    job.shown = shown
                    self.say(f"job {job.job_id}: {shown}")
                self.harvest(job)
            else:
                self.settle(job)

    @property
    def finished(self) -> bool:
        return all(j.done for j in self.jobs)


def submit(job: Job, items: list[WorkItem], request: batch.Request, launch: batch.Launch,
           name: str) -> str:
    """Write the job's files and sbatch it; sets job.job_id, or returns sbatch's complaint. ``items``: as
    the worker gets them (a quick run's variants carry their level)."""
    atomic.write_text(job.folder / JOB_FILE, batch.job_json(job.plan, items, worker_args, launch.python))
    script = job.folder / batch.SCRIPT_FILE
    command = batch.node_command(launch, CODE_ROOT, job.folder)
    atomic.write_text(script, batch.batch_script(command, CODE_ROOT, os.environ.get(PROBE_PATH_ENV, ""),
                                                      launch.env))
    p = _cmd(["sbatch", *batch.sbatch_args(job.plan, request, name, job.folder), str(script)])
    if p.returncode != 0:
        return (p.stderr.strip().splitlines() or [f"sbatch exited {p.returncode}"])[-1]
    job.job_id = p.stdout.strip().split(";")[0]  # --parsable: id[;cluster]
    return ""


def _srun(partition: str, launch: batch.Launch, argv: list[str], extra: list[str]) -> list[str]:
    """One step on a node of the partition: ``argv`` with the cell's interpreter, or in its image (pyxis)."""
    cmd = ["srun", f"--partition={partition}", "--nodes=1", "--ntasks=1", "--time=10", *extra]
    if launch.image is not None:
        cmd += [f"--container-image={launch.image}", f"--container-mounts={CODE_ROOT}:{CODE_ROOT}:ro"]
    return [*cmd, f"--export=ALL,PYTHONPATH={CODE_ROOT}", launch.python, *argv]


def image_cell(image: str, partition: str) -> CellTarget:
    """The cell an image holds, read inside it on a node (pyxis) as `checks run --image` reads an image on this
    host (checks.run.cells.FACTS_CODE: versions, torch's import, serving engines), and named the same way."""
    p = _cmd(_srun(partition, batch.Launch("python3", image), ["-c", cells.FACTS_CODE], []), timeout=3600)
    data, err = parse_result_text(p.stdout)
    if data is None:
        last = (p.stderr.strip().splitlines() or ["no output"])[-1]
        raise ExecutorError(f"--container-image {image}: reading what is inside failed: {err or last}")
    versions = cells.image_versions(image, "", data)
    return CellTarget(str(cellid.existing_image(versions)), CellState.LOCAL, versions=versions, image=image,
                      image_status=ImageState.BUILT)


def node_facts(opts: RunOptions, site: offer.Site, gpus: int, launch: batch.Launch,
               say: Callable[[str], None]) -> dict[str, Any]:
    """The host facts of a node of the partition, as its jobs will record them (asked with the GPUs one job
    may have); the partition's stand-in facts when no node can be asked."""
    extra = [*([f"--gres=gpu:{gpus}"] if gpus else []), *opts.slurm.sbatch_args]
    p = _cmd(_srun(site.partition, launch, ["-m", "checks.run.slurm.node", "--facts", str(gpus)], extra), timeout=3600)
    try:
        facts = json.loads(p.stdout) if p.returncode == 0 else None
    except ValueError:
        facts = None
    if isinstance(facts, dict) and facts.get("host_id"):
        return facts
    why = (p.stderr.strip().splitlines() or [f"srun exited {p.returncode}"])[-1]
    say(f"slurm: host facts unknown, no node answered: {why}")
    return unplaced_facts(site.partition, why)


def _plan_lines(site: offer.Site, gpus: int, jobs: list[Job]) -> list[str]:
    lines = [f"slurm: partition {site.partition}, at most {gpus} GPU(s) per job"
             + (", container images (pyxis)" if site.images else "")
             + f"; {sum(len(j.plan.items) for j in jobs)} variant(s) in {len(jobs)} job(s)"]
    for j in jobs:
        lines.append(f"  job {j.n}: {j.plan.cell_id}, {len(j.plan.items)} variant(s), {j.plan.gpus} GPU(s), "
                     f"--time {j.time_limit}")
    return lines


def _first_free(root: Path) -> int:
    """The number of the next job folder under a run's folder (a resumed run adds to the killed one's)."""
    taken = [int(p.name) for p in root.iterdir() if p.name.isdigit()] if root.is_dir() else []
    return max(taken, default=-1) + 1


@dataclass
class SlurmBackend:
    """Variants as Slurm jobs submitted from this host (checks.run.backend.Backend)."""

    name: str = SLURM
    gpu_lock: bool = False  # Slurm gives each job its GPUs
    site: offer.Site | None = None
    launches: dict[str, batch.Launch] = field(default_factory=dict)
    executors: dict[str, LocalExecutor] = field(default_factory=dict)  # for fingerprints, by cell
    job_name: str = ""
    job_ids: list[str] = field(default_factory=list)

    def _site(self, opts: RunOptions) -> offer.Site:
        try:
            site = offer.survey(opts.slurm.partition)
            if opts.slurm.container_image and not site.images:
                raise ExecutorError(offer.no_images_reason(offer.srun_help()))
        except offer.SiteError as exc:
            raise ExecutorError(str(exc)) from None
        return site

    def targets(self, opts: RunOptions) -> Targets:
        """The cells and how a node starts each: an image (--container-image), one interpreter (--python, as
        the local backend), or by default the venv cells of the matrix (`provision build --backend venv`),
        each with the interpreter and environment the local executor gives it; the host facts of a node."""
        site = self.site = self._site(opts)
        gpus = site.gpus_per_node if opts.slurm.gpus_per_job is None else opts.slurm.gpus_per_job
        image = opts.slurm.container_image
        if image:
            cell = image_cell(image, site.partition)
            found = [cell]
            self.launches = {cell.cell_id: batch.Launch("python3", image)}
        elif opts.python:
            cell, ex, _ = cells.local(opts, opts.python)
            found, self.executors = [cell], {cell.cell_id: ex}
            self.launches = {cell.cell_id: batch.Launch(opts.python)}
        else:
            found, executors = cells.venv(opts)  # GPU facts come from each node, not from here
            self.executors = {cid: ex for cid, ex in executors.items() if isinstance(ex, LocalExecutor)}
            self.launches = {cid: batch.Launch(ex.python, env=ex.extra_env) for cid, ex in self.executors.items()}
        first = next(iter(self.launches.values()), batch.Launch(sys.executable))
        facts = node_facts(opts, site, gpus, first, lambda line: print(line, file=sys.stderr, flush=True))
        return Targets(found, facts, gpus, compile_targets(opts.target_archs, gpus, facts.get("compute_capability")))

    def prepare(self, opts: RunOptions, targets: Targets) -> dict[str, EnvPrint | None]:
        cache = compile_cache_dir(opts.compile_cache, opts.no_compile_cache)
        if cache is not None:
            cache.mkdir(parents=True, exist_ok=True)  # on the shared file system the code is on, as the nodes see it
        token = run_token()
        envs = {cid: run_env(cid, targets.compile.archs, cache, token=token) for cid in self.launches}
        self.launches = {cid: replace(launch, env=(*envs[cid], *launch.env)) for cid, launch in self.launches.items()}
        # the interpreters are on the file system the nodes share: what they hold is read from here
        return {cid: ex.with_run_env(envs[cid]).fingerprint() for cid, ex in self.executors.items()}

    def run(self, opts: RunOptions, work: Work, hooks: Hooks) -> RunReport:
        """Record what needs no job, submit a job per group of the rest, follow them until every variant is
        recorded; Ctrl-C cancels every job and keeps what finished."""
        assert self.site is not None, "targets() first"
        rec, items = begin(opts.resume, opts.level, work, hooks)
        self.job_name = f"stackprobe-{work.store.run_id}"
        jobs = self._jobs(opts, work, items)
        for line in _plan_lines(self.site, work.gpus, jobs):
            hooks.say(line)
        tracker = Tracker(items, jobs, Stores(work.store, work.manifest), rec, self.launches, hooks.say)
        poll_s = float(os.environ.get(POLL_ENV) or DEFAULT_POLL_S)
        try:
            self._submit_all(opts, tracker, [dataclasses.replace(it, variant=level_variant(it, opts.level, opts.soak_s))
                                             for it in items])
            while not tracker.finished:
                time.sleep(min(poll_s, 1.0) if all(not j.shown for j in jobs) else poll_s)
                tracker.poll(self.job_name)
        except KeyboardInterrupt:
            rec.report.interrupted = True
            self._cancel_all(tracker, hooks.say)
        return rec.report

    def _jobs(self, opts: RunOptions, work: Work, items: list[WorkItem]) -> list[Job]:
        root = JOBS_ROOT / work.store.run_id
        first = _first_free(root)
        return [Job(n, plan, root / str(first + n), opts.slurm.time_minutes or plan.time_minutes())
                for n, plan in enumerate(batch.plan_jobs(items, work.gpus, hard_timeout))]

    def _submit_all(self, opts: RunOptions, tracker: Tracker, leveled: list[WorkItem]) -> None:
        """sbatch every job; a refused one records its variants as not run. ``leveled``: the items as the
        workers get them (a quick run's variants carry their level)."""
        assert self.site is not None
        request = batch.Request(self.site.partition, opts.slurm.time_minutes, opts.slurm.sbatch_args)
        for job in tracker.jobs:
            job.folder.mkdir(parents=True, exist_ok=True)
            why = submit(job, leveled, request, self.launches[job.plan.cell_id], self.job_name)
            if job.job_id:
                self.job_ids.append(job.job_id)
            if why:
                job.done = True
                for index in job.plan.items:
                    tracker.record(index, classify.decided(Status.NOT_RUN, "slurm-submit-failed", f"sbatch: {why}",
                                                           tracker.catalogue), None)
            else:
                tracker.say(f"job {job.job_id}: submitted ({job.plan.name}, {len(job.plan.items)} variant(s), "
                            f"folder {job.folder})")

    def cancel(self) -> None:
        if self.job_name:
            cancel(self.job_name, self.job_ids)

    def _cancel_all(self, tracker: Tracker, say: Callable[[str], None]) -> None:
        """Ctrl-C: cancel every job of the run, however often Ctrl-C is pressed again meanwhile; keep what
        finished (an outcome the node wrote is a whole result)."""
        while True:
            try:
                say(f"interrupted: cancelling {len(self.job_ids)} job(s) (scancel --name={self.job_name})")
                left = cancel(self.job_name, self.job_ids)
                break
            except KeyboardInterrupt:
                continue
        say(f"still in the queue: {', '.join(left)}" if left else "no job of this run is left in the queue")
        for job in tracker.jobs:
            if job.job_id:
                tracker.harvest(job)
        print("interrupted: results finished so far are kept", file=sys.stderr)

"""`checks run --executor slurm`: submit a run's variants as Slurm jobs, follow them through the queue,
record every verdict, and cancel every job on Ctrl-C (host side; the side effects of the Slurm executor).

Jobs and their files live in ``.cache/slurm/<run_id>/<n>/`` of this checkout, which the compute nodes must
share (they import the checks code from it). Each node writes its host facts and one raw outcome per
variant there; this process turns them into verdicts as they appear, exactly as the local executor does,
and appends them to ``results/<node host_id>/<run_id>.jsonl``, so a run over several nodes gives one
results folder per kind of node. Variants decided without running, and those of a job that never reached
a node, are recorded with the first node's results (or, when no job reached one, under
``slurm-<partition>-<hash>``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from checks import atomic, classify, hostfacts, ids, manifest, provenance, reasons, slurm_acct, slurm_jobs, slurm_site
from checks.executor import (
    CODE_ROOT,
    ExecutorError,
    LocalExecutor,
    compile_cache_dir,
    hard_timeout,
    run_env,
    worker_args,
)
from checks.isolate import ProcessOutcome
from checks.plan import CellState, CellTarget, ImageState, WorkItem, plan_work, summary_counts
from checks.probe import HostView
from checks.provenance import Provenance
from checks.registry import PROBE_PATH_ENV
from checks.result import ProbeResult, Verdict
from checks.runner import RunReport, assemble, decided_verdict, iso, now_iso
from checks.slurm_node import FACTS_FILE, JOB_FILE, outcome_path, started_path
from checks.status import ORDER, Status
from checks.store import RunStore, new_run_id

JOBS_ROOT = CODE_ROOT / ".cache" / "slurm"
POLL_ENV = "STACKPROBE_SLURM_POLL_S"
DEFAULT_POLL_S = 5.0  # one squeue per poll: gentle on a site's controller
END_WAIT_S = 30.0  # a job that left the queue: how long its record (and its files, on NFS) may lag
CANCEL_WAIT_S = 60.0


def _cmd(cmd: list[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return subprocess.CompletedProcess(cmd, 255, "", str(exc))


def queue(name: str) -> dict[str, slurm_acct.Queued] | None:
    """This run's jobs still in the queue, or None when squeue did not answer (try again later)."""
    p = _cmd(["squeue", "-h", f"--name={name}", "-o", slurm_acct.SQUEUE_FORMAT])
    return slurm_acct.parse_squeue(p.stdout) if p.returncode == 0 else None


def job_end(job_id: str) -> slurm_acct.JobEnd | None:
    """How a job that left the queue ended: the first source with a final state for it."""
    fields = ["-n", "-P", "-o", slurm_acct.SACCT_FIELDS, "-j", job_id]
    for source, cmd, parse in (
        ("sacct", ["sacct", "-X", *fields], slurm_acct.parse_sacct),
        ("sacct --completion", ["sacct", "--completion", *fields], slurm_acct.parse_sacct),
        ("scontrol", ["scontrol", "show", "job", "-o", job_id], None),
    ):
        p = _cmd(cmd)
        if p.returncode != 0:
            continue
        found = slurm_acct.parse_scontrol(p.stdout) if parse is None else parse(p.stdout, source)
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
    left: dict[str, slurm_acct.Queued] | None = None
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
    plan: slurm_jobs.JobPlan
    folder: Path
    time_limit: int
    job_id: str = ""
    shown: str = ""  # the queue state last printed
    started: set[int] = field(default_factory=set)
    recorded: set[int] = field(default_factory=set)
    left_queue_at: float | None = None
    end: slurm_acct.JobEnd | None = None
    facts: dict[str, Any] | None = None
    done: bool = False

    def log_tail(self) -> str:
        try:
            data = (self.folder / slurm_jobs.LOG_FILE).read_bytes()
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
    """One results store per node host, each with its manifest, written when that host first reports."""

    root: Path
    run_id: str
    write_manifest: Callable[[RunStore, dict[str, Any]], None]
    by_host: dict[str, RunStore] = field(default_factory=dict)
    first: RunStore | None = None

    def for_facts(self, facts: dict[str, Any]) -> RunStore:
        host_id = str(facts["host_id"])
        if not ids.host_ok(host_id):  # a node's facts name the results folder: never a path or a crafted name
            raise ExecutorError(f"a node reported host id {ids.shown(host_id)[:80]!r}, not <label>-<8 hex digits>")
        if host_id not in self.by_host:
            store = RunStore(self.root, host_id, self.run_id)
            self.write_manifest(store, facts)
            self.by_host[host_id] = store
            self.first = self.first or store
        return self.by_host[host_id]


def unplaced_facts(partition: str) -> dict[str, Any]:
    """Host facts for variants whose job never reached a node: none, beyond the partition they asked for."""
    digest = hostfacts.host_id([], f"{hostfacts.machine_key()}/{partition}").removeprefix("cpu-")
    return {"host_id": f"slurm-{hostfacts.slug(partition)}-{digest}", "gpu_count": 0, "gpus": [], "gpu_name": None,
            "no_gpu_reason": f"no job of this run reached a node of partition {partition}",
            "slurm": {"partition": partition}}


@dataclass
class Tracker:
    """Follows the submitted jobs and records what comes back."""

    items: list[WorkItem]
    jobs: list[Job]
    stores: Stores
    catalogue: reasons.Catalogue
    codes: dict[str, Provenance]
    launches: dict[str, slurm_jobs.Launch]  # by cell
    partition: str
    say: Callable[[str], None]
    report: RunReport = field(default_factory=RunReport)
    pending_decided: list[int] = field(default_factory=list)

    def record(self, index: int, verdict: Verdict, store: RunStore | None, started_at: str = "") -> None:
        item = self.items[index]
        store = store or self.stores.first or self.stores.for_facts(unplaced_facts(self.partition))
        result = assemble(item, verdict, store.run_id, store.host_id, started_at or now_iso(),
                          self.codes.get(item.spec.id))
        store.append(result)
        self.report.results.append(result)
        v = verdict
        self.say(f"{v.status:>11} {item.cell.cell_id} {item.spec.id} {item.variant.key} ({v.duration_s:.1f}s) "
                 f"{v.reason_code}".rstrip())

    def _store(self, job: Job) -> RunStore | None:
        if job.facts is None:
            path = job.folder / FACTS_FILE
            try:
                job.facts = json.loads(path.read_text()) if path.exists() else None
            except (OSError, ValueError):
                job.facts = None
            if job.facts is not None:
                store = self.stores.for_facts(job.facts)
                self.flush_decided(store)
        return self.stores.for_facts(job.facts) if job.facts is not None else None

    def flush_decided(self, store: RunStore | None) -> None:
        for index in self.pending_decided:
            self.record(index, decided_verdict(self.items[index], self.catalogue), store)
        self.pending_decided.clear()

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
            v = v.with_evidence(command=f"{python} -m checks.worker {item.spec.id}",
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
            v = slurm_acct.unfinished(job.job_id, job.end, index in job.started, tail, job.time_limit,
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
            if q is not None and q.state not in slurm_acct.TERMINAL:
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



def submit(job: Job, items: list[WorkItem], request: slurm_jobs.Request, launch: slurm_jobs.Launch,
           name: str) -> str:
    """Write the job's files and sbatch it; sets job.job_id, or returns sbatch's complaint."""
    atomic.write_text(job.folder / JOB_FILE, slurm_jobs.job_json(job.plan, items, worker_args, launch.python))
    script = job.folder / slurm_jobs.SCRIPT_FILE
    command = slurm_jobs.node_command(launch, CODE_ROOT, job.folder)
    atomic.write_text(script, slurm_jobs.batch_script(command, CODE_ROOT, os.environ.get(PROBE_PATH_ENV, ""),
                                                      launch.env))
    p = _cmd(["sbatch", *slurm_jobs.sbatch_args(job.plan, request, name, job.folder), str(script)])
    if p.returncode != 0:
        return (p.stderr.strip().splitlines() or [f"sbatch exited {p.returncode}"])[-1]
    job.job_id = p.stdout.strip().split(";")[0]  # --parsable: id[;cluster]
    return ""


def image_cell(image: str, partition: str) -> CellTarget:
    """The cell an image holds, asked inside it on a node (pyxis), as `--local` asks an interpreter."""
    from checks.executor import parse_result_text
    from checks.plan import local_cell_id

    cmd = ["srun", f"--partition={partition}", "--ntasks=1", "--time=10", f"--container-image={image}",
           f"--container-mounts={CODE_ROOT}:{CODE_ROOT}:ro", f"--export=ALL,PYTHONPATH={CODE_ROOT}",
           "python3", "-m", "checks.worker", "--inspect"]
    p = _cmd(cmd, timeout=3600)
    data, err = parse_result_text(p.stdout)
    if data is None:
        last = (p.stderr.strip().splitlines() or ["no output"])[-1]
        raise ExecutorError(f"--container-image {image}: environment inspection failed: {err or last}")
    versions = {k: str(v) for k, v in (data.get("versions") or {}).items() if isinstance(v, str | int | float)}
    return CellTarget(local_cell_id(versions), CellState.LOCAL, versions=versions, image=image,
                      image_status=ImageState.BUILT)


def targets(args: argparse.Namespace, site: slurm_site.Site) -> tuple[list[CellTarget], dict[str, slurm_jobs.Launch]]:
    """The cells and how a node starts each: an image (--container-image), one interpreter (--python, as
    --local), or by default the venv cells of the matrix (`provision build --backend venv`), each with the
    interpreter and environment the local executor gives it."""
    from checks import cli

    if args.container_image:
        cell = image_cell(args.container_image, site.partition)
        return [cell], {cell.cell_id: slurm_jobs.Launch("python3", args.container_image)}
    if args.python:
        t = cli.local_targets(args)
        return t.cells, {c.cell_id: slurm_jobs.Launch(args.python) for c in t.cells}
    t = cli.venv_targets(args, 0)  # GPU facts come from each node, not from here
    return t.cells, {cid: slurm_jobs.Launch(ex.python, env=ex.extra_env) for cid, ex in t.executors.items()
                     if isinstance(ex, LocalExecutor)}


def _plan_lines(site: slurm_site.Site, gpus: int, items: list[WorkItem], jobs: list[Job], probes: int) -> list[str]:
    counts = summary_counts(items)
    lines = [f"slurm: partition {site.partition}, at most {gpus} GPU(s) per job"
             + (", container images (pyxis)" if site.images else ""),
             f"plan {len(counts)} cell(s) x {probes} probe(s) = {len(items)} variant(s) in {len(jobs)} job(s)"]
    for cell_id, c in counts.items():
        lines.append(f"  {cell_id}: {c.pop('run', 0)} to run")
        lines.extend(f"    {n} decided without running, {why}" for why, n in sorted(c.items()))
    for j in jobs:
        lines.append(f"  job {j.n}: {j.plan.cell_id}, {len(j.plan.items)} variant(s), {j.plan.gpus} GPU(s), "
                     f"--time {j.time_limit}")
    return lines


def summary_lines(results: list[ProbeResult]) -> list[str]:
    per: dict[tuple[str, str, str], Counter[Status]] = {}
    for r in results:
        per.setdefault((r.host_id, r.cell_id, r.probe_id), Counter())[r.verdict.status] += 1
    return [f"  {host} {cell} {probe}: " + ", ".join(f"{c[s]} {s}" for s in ORDER if c[s])
            for (host, cell, probe), c in sorted(per.items())]


def run(args: argparse.Namespace, con: Any, probes: dict[str, Any], catalogue: reasons.Catalogue,
        archs: tuple[str, ...]) -> int:
    """`checks run --executor slurm`, after the command line has chosen the probes."""
    from checks import cli  # the command line imports this module when it is asked for Slurm

    if args.resume:
        raise cli.UsageError("checks run: --resume is not supported with --executor slurm; run the cell again")
    try:
        site = slurm_site.survey(args.partition)
        if args.container_image and not site.images:
            raise ExecutorError(slurm_site.no_images_reason(slurm_site.srun_help()))
    except slurm_site.SiteError as exc:
        raise ExecutorError(str(exc)) from None
    gpus = site.gpus_per_node if args.gpus_per_job is None else args.gpus_per_job
    cells, launches = targets(args, site)
    cache = compile_cache_dir(getattr(args, "compile_cache", None), getattr(args, "no_compile_cache", False))
    if cache is not None:
        cache.mkdir(parents=True, exist_ok=True)  # on the shared file system the code is on, as the nodes see it
    launches = {cid: replace(launch, env=(*run_env(cid, archs, cache), *launch.env))
                for cid, launch in launches.items()}
    items = plan_work(cells, probes, HostView(gpu_count=gpus, target_archs=archs), args.timeout_scale)
    run_id = new_run_id()
    name = f"stackprobe-{run_id}"
    request = slurm_jobs.Request(site.partition, args.time, tuple(args.sbatch_arg))
    jobs = [Job(n, plan, JOBS_ROOT / run_id / str(n), args.time or plan.time_minutes())
            for n, plan in enumerate(slurm_jobs.plan_jobs(items, gpus, hard_timeout))]

    def say(text: str) -> None:
        con.print(text, markup=False, highlight=False)

    for line in _plan_lines(site, gpus, items, jobs, len(probes)):
        say(line)
    code = provenance.checkout()
    hashes = provenance.probe_hashes(probes)

    def write_manifest(store: RunStore, facts: dict[str, Any]) -> None:
        store.write_manifest(manifest.build(run_id, store.host_id, now_iso(), "slurm", facts, cells, probes, code,
                                            hashes, args.argv))
        say(f"results {store.results_path}")

    tracker = Tracker(items, jobs, Stores(args.results, run_id, write_manifest), catalogue,
                      {pid: code.for_probe(h) for pid, h in hashes.items()}, launches, site.partition, say)
    tracker.pending_decided = [i for i, it in enumerate(items) if it.decided is not None]
    poll_s = float(os.environ.get(POLL_ENV) or DEFAULT_POLL_S)
    try:
        for job in jobs:
            job.folder.mkdir(parents=True, exist_ok=True)
            why = submit(job, items, request, launches[job.plan.cell_id], name)
            if why:
                job.done = True
                for index in job.plan.items:
                    tracker.record(index, classify.decided(Status.NOT_RUN, "slurm-submit-failed", f"sbatch: {why}",
                                                           catalogue), None)
            else:
                say(f"job {job.job_id}: submitted ({job.plan.name}, {len(job.plan.items)} variant(s), "
                    f"folder {job.folder})")
        while not tracker.finished:
            time.sleep(min(poll_s, 1.0) if all(not j.shown for j in jobs) else poll_s)
            tracker.poll(name)
    except KeyboardInterrupt:
        tracker.report.interrupted = True
        _cancel_all(tracker, name, say)
    tracker.flush_decided(tracker.stores.first)
    say("summary")
    for line in summary_lines(tracker.report.results):
        say(line)
    if args.json:
        print(json.dumps([r.to_json() for r in tracker.report.results], indent=2, sort_keys=True))
    return 130 if tracker.report.interrupted else 0


def _cancel_all(tracker: Tracker, name: str, say: Callable[[str], None]) -> None:
    """Ctrl-C: cancel every job of the run, however often Ctrl-C is pressed again meanwhile; keep what
    finished (an outcome the node wrote is a whole result)."""
    ids = [j.job_id for j in tracker.jobs if j.job_id]
    while True:
        try:
            say(f"interrupted: cancelling {len(ids)} job(s) (scancel --name={name})")
            left = cancel(name, ids)
            break
        except KeyboardInterrupt:
            continue
    say(f"still in the queue: {', '.join(left)}" if left else "no job of this run is left in the queue")
    for job in tracker.jobs:
        if job.job_id:
            tracker.harvest(job)
    print("interrupted: results finished so far are kept", file=sys.stderr)

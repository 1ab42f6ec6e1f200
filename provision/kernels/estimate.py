"""How long the kernel stage has left: the CPU seconds its builds spend (this process's tree from /proc, a
container's from what its carrier reads) against each job's expected cost (this stage's builds, this host's
earlier ones, or fi-jit's declared costs scaled by how this stage's builds compared with them)."""

from __future__ import annotations

import os
import resource
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path

from common.progress import duration
from inenv.probes.fi_jit import BUILD_COST
from provision.kernels.jobs import Job


def tree_cpu_s(pid: int | None = None) -> float:
    """CPU seconds of this process's children: those that ended (their whole trees, as each waited for its
    own) and every live descendant so far, read from /proc; what runs in a container is not ours to read."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = usage.ru_utime + usage.ru_stime
    root = pid or os.getpid()
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        parents[int(entry.name)] = int(fields[1])
        times[int(entry.name)] = sum(int(x) for x in fields[11:15]) / tick  # utime stime cutime cstime
    ours = {root}
    changed = True
    while changed:
        changed = False
        for p, parent in parents.items():
            if parent in ours and p not in ours:
                ours.add(p)
                changed = True
    return total + sum(times[p] for p in ours if p != root and p in times)


OVERRUN = 0.25  # a build past its estimate is taken to be this fraction of what it has spent from its end


class StageProgress:
    """What the kernel stage says while it runs: which module and target of how many is compiling, the CPU
    seconds spent, and the time left. A job's cost is, first, what this stage measured for its module (CPU
    seconds per target of the builds that finished in it), else this host's earlier builds (``learned``), else
    fi-jit's declared cost (a prior) scaled by how this stage's builds compared with their own estimates.

    The time left moves smoothly: a running build counts what it has spent (the stage's CPU seconds less the
    ended builds', shared among the running ones by how long each has run), and one past its estimate counts
    :data:`OVERRUN` of what it has spent as still to come, so its share grows while it overruns; such a build
    also scales the declared costs of the rest as a finished one would (what it spent over its declared cost),
    so its end changes the scale by no more than its last seconds did."""

    def __init__(self, todo: Sequence[Job], jobs: int, learned: Mapping[str, float],
                 live: Callable[[], float | None] = lambda: 0.0, copied: Collection[tuple[str, str]] = ()) -> None:
        self.live = live  # CPU seconds of running builds outside this process's tree (None: unreadable)
        self.copied = frozenset(copied)  # jobs another cell's build of the same inputs answers: nothing to compile
        self.todo, self.jobs, self.learned = list(todo), max(1, jobs), dict(learned)
        self.declared = dict(BUILD_COST)  # CPU seconds per target fi-jit declares for each module
        self.index = {(j.cell_id, j.module): i + 1 for i, j in enumerate(self.todo)}
        self.running: dict[tuple[str, str], float] = {}
        self.finished: set[tuple[str, str]] = set()
        self.measured: dict[str, list[float]] = {}  # module -> CPU seconds per target, this stage's builds
        self.scale_pairs: list[tuple[float, float]] = []  # (estimated, measured) CPU seconds of finished builds
        self.started_at: dict[tuple[str, str], float] = {}  # each running build's estimate when it began
        self.cpu0 = tree_cpu_s()
        self.reported_cpu = 0.0
        self.lock = threading.Lock()

    def scale(self, overrun: Sequence[tuple[float, float]] = ()) -> float | None:
        """Measured over declared CPU seconds (fi-jit's declared costs of the targets built) of the builds that
        finished in this stage and of the running ones past their estimate (``overrun``: (declared, spent so
        far)); before either, this host's earlier builds over fi-jit's declared costs for the same modules (the
        quick module built in ``provision build`` gives one); None when neither exists. Always over the declared
        costs, never over an estimate a scale already made: the scale multiplies declared costs."""
        pairs = [*self.scale_pairs, *overrun]
        estimated = sum(e for e, _ in pairs)
        if estimated > 0:
            return sum(m for _, m in pairs) / estimated
        both = [(self.declared[m], per) for m, per in self.learned.items() if self.declared.get(m, 0.0) > 0]
        declared = sum(d for d, _ in both)
        return sum(per for _, per in both) / declared if declared > 0 else None

    def cost(self, job: Job, factor: float | None = None) -> tuple[float, bool]:
        """(CPU seconds this job should take, whether from this host's own builds: this stage's or earlier);
        ``factor``: the declared costs' scale (default: :meth:`scale` of the finished builds). A job another
        cell's build answers (``copied``) costs nothing."""
        if (job.cell_id, job.module) in self.copied:
            return 0.0, True
        seen = self.measured.get(job.module)
        if seen:
            return sum(seen) / len(seen) * len(job.archs), True
        per = self.learned.get(job.module)
        if per is not None:
            return per * len(job.archs), True
        factor = self.scale() if factor is None else factor
        return job.cost * (factor if factor is not None else 1.0), False

    def begin(self, job: Job) -> None:
        estimate = self.cost(job)[0]
        with self.lock:
            self.running[(job.cell_id, job.module)] = time.monotonic()
            self.started_at[(job.cell_id, job.module)] = estimate

    def end(self, job: Job) -> None:
        with self.lock:
            self.running.pop((job.cell_id, job.module), None)
            self.finished.add((job.cell_id, job.module))

    def spent(self, cpu_s: float, job: Job | None = None, built: int | None = None) -> None:
        """A build ended having spent ``cpu_s`` compiling (0 for a cached one) on ``built`` of ``job``'s targets
        (all of them when None; fewer when flashinfer's gate refused some); the measurement then serves the
        jobs still to come."""
        with self.lock:
            self.reported_cpu += cpu_s
            if job is None or cpu_s <= 0 or not job.archs:
                return
            targets = min(built, len(job.archs)) if built else len(job.archs)
            self.started_at.pop((job.cell_id, job.module), None)
            declared = job.cost * targets / len(job.archs)  # the scale is measured over declared, whatever
            self.measured.setdefault(job.module, []).append(cpu_s / targets)  # the estimate at its start stood on
            if declared > 0:
                self.scale_pairs.append((declared, cpu_s))

    def position(self, job: Job) -> str:
        return f"[{self.index.get((job.cell_id, job.module), 0)}/{len(self.todo)}]"

    def cpu_s(self, running: float | None) -> float:
        """CPU seconds the stage's compiles spent so far: read from /proc where the builds are our processes,
        else (builds in containers) as each finished build reported it plus ``running``, what the running
        containers' cgroups say (``live()``, read once by the caller)."""
        return max(tree_cpu_s() - self.cpu0, self.reported_cpu + (running or 0.0))

    def spent_by_running(self, running_cpu: float | None, now: float) -> dict[tuple[str, str], float]:
        """CPU seconds each running build has spent: the stage's CPU seconds (``running_cpu``: the running
        containers' reading, as :meth:`cpu_s` takes it) less what the ended builds reported, shared by how long
        each has run; with no reading, each build's wall seconds (one core each)."""
        with self.lock:
            walls = {k: max(0.0, now - t) for k, t in self.running.items()}
        if running_cpu is None or not walls:
            return walls
        spent = max(0.0, self.cpu_s(running_cpu) - self.reported_cpu)
        total = sum(walls.values())
        return {k: spent * w / total if total > 0 else spent / len(walls) for k, w in walls.items()}

    def left_s(self, running_cpu: float | None = 0.0) -> tuple[float, str]:
        """Seconds left (the jobs not finished, less what the running ones have spent, over the parallel
        slots) and what the estimate stands on (``running_cpu``: see :meth:`spent_by_running`)."""
        now = time.monotonic()
        done = self.spent_by_running(running_cpu, now)
        with self.lock:
            declared = {(j.cell_id, j.module): j.cost for j in self.todo}
            overrun = [(declared.get(k, 0.0), d) for k, d in done.items() if k in self.started_at
                       and d > self.started_at[k] > 0 and declared.get(k, 0.0) > 0]
        factor = self.scale(overrun)
        total, own, prior = 0.0, 0, 0
        with self.lock:
            for j in self.todo:
                key = (j.cell_id, j.module)
                if key in self.finished or key in self.copied:
                    continue
                cost, learned = self.cost(j, factor)
                own, prior = own + learned, prior + (not learned)
                if key in done:
                    cost = self.started_at.get(key, cost)
                    total += cost - done[key] if done[key] <= cost else OVERRUN * done[key]
                else:
                    total += cost
        declared = ("fi-jit's declared build costs: no build of these modules here yet" if factor is None else
                    f"fi-jit's declared build costs x{factor:.2f} as this stage's finished builds ran"
                    if self.scale_pairs else
                    f"fi-jit's declared build costs x{factor:.2f} as this stage's running builds past their "
                    "estimate ran" if overrun else
                    f"fi-jit's declared build costs x{factor:.2f} as this host's builds of "
                    f"{', '.join(sorted(self.learned))} ran")
        basis = ("by this host's earlier kernel builds" if not prior else
                 f"by {declared}" if not own else
                 f"by this host's builds for {own}, {declared} for {prior}")
        cores = max(1, min(self.jobs * 2, os.cpu_count() or 1))
        return total / cores, basis

    def left_text(self, running_cpu: float | None = 0.0) -> str:
        seconds, basis = self.left_s(running_cpu)
        if all((j.cell_id, j.module) in self.copied for j in self.todo):
            return "nothing to compile"
        return f"about {duration(seconds)} left ({basis})"

    def tick_line(self, elapsed: float) -> str:
        now = time.monotonic()
        with self.lock:
            running = sorted(self.running.items(), key=lambda kv: kv[1])
            done = len(self.finished)
        what = "; ".join(f"{self.position(self._job(k))} {k[1]} for {' '.join(self._job(k).archs)} in {k[0]} "
                         f"({duration(now - t)})" for k, t in running) or "between builds"
        running_cpu = self.live()
        spent = (f"{self.cpu_s(running_cpu):.0f} CPU-s spent by the builds that ended (a running container's "
                 f"could not be read), {duration(elapsed)} in" if running_cpu is None else
                 f"{self.cpu_s(running_cpu):.0f} CPU-s spent in {duration(elapsed)}")
        return f"kernels: {done}/{len(self.todo)} done, compiling {what}; {spent}; {self.left_text(running_cpu)}"

    def _job(self, key: tuple[str, str]) -> Job:
        return next(j for j in self.todo if (j.cell_id, j.module) == key)

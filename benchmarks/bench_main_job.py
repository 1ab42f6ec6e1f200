"""The README's main job on a matrix, cold and then warm: time per phase, disk growth, ratios to the targets.

    uv run python benchmarks/bench_main_job.py [--backend docker|venv] [--matrix matrix.yaml] [--with-cells]
                                               [--skip-warm]
    uv run python benchmarks/bench_main_job.py --recorded benchmarks/results/main-job-<host>-<stamp>.json

The main job is ``provision build && checks run --all``. Cold means: the cells are built already (unless
``--with-cells``), and everything else starts empty: a fresh results folder (so no result can be reused)
and a fresh compile cache (so every fi-jit module is compiled). Warm is the same job again, with nothing
changed: same results folder, same compile cache. ``--with-cells`` (``--with-images``) first removes the
matrix's built cells, so the cold run also builds every one: for ``--backend docker`` the cells' images and the
BuildKit cache, for ``--backend venv`` the cells' virtual environments (uv's download cache stays, as it does
for a user who ran the tests first).

Phases, from the job's own output and records: build (``provision build`` wall time), then inside ``checks
run``: compile probes (fi-jit), GPU probes (every probe whose spec needs a GPU) and the rest (inventory), each
as the span from its first variant's start to its last variant's end plus the busy seconds it used (the sum
of its variants' durations; spans overlap when variants run in parallel), then the table (``checks report``,
timed apart). Disk growth is the free-space change of the filesystems holding the Docker root, the repo and
uv's cache, with ``docker system df`` and the cache folders' sizes beside it.

The floor: no schedule finishes a pass sooner than its compilers' CPU seconds spread over every core, after
the build (``provision build``) that must come first: floor = compile CPU-s / cores + build wall. The kernels
the build compiles for its cells (its last stage) are compiles too: their CPU seconds (the build records'
``kernels.compile_cpu_s``) join the compile CPU, and the stage's wall (``kernels.stage_s``) leaves the build
wall. The cold
wall (build + checks run + report) is printed against it as a ratio (target: within 1.05x), per backend
(``--backend docker`` builds images and runs in containers, ``--backend venv`` builds virtual environments);
the JSON records the backend. ``first_table_s`` (per pass): seconds from the start of ``checks run`` to the
first time the table it regenerates is written (watched on disk). With no ``--level`` (the default, as the
README's main job runs it) that is the quick pass's table, the first answer, written before the full pass
starts; when the run writes none, the separate ``checks report`` makes it. ``first_answer_s`` (per pass): the
same table counted as the user counts it, from the start of the main job's first command (``provision build``
included); ``floor_s`` (per pass): the floor above, in seconds.

Targets (for this 2-core machine): cold under 13.5 min (today 40 min 37 s), the first answer within 5 min of
the first command, warm under 60 s, disk growth under 20 GB (today 59 GB). Printed as ratios: under 1.00 meets
the target. Output is also written to
``benchmarks/results/main-job-<host>-<stamp>.json`` and ``.txt``. ``--recorded FILE`` prints a recorded
result again, with the floor worked out from its numbers, and runs nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from common.build import buildrecord, kernelstage
from inenv.kit import COMPILE_LEDGER as LEDGER

ROOT = Path(__file__).resolve().parent.parent
OUT_DIR = ROOT / "benchmarks" / "results"
GB = 1e9

# The targets and the measurement they were set against (this machine, the default matrix of that day).
TARGET_COLD_S = 13.5 * 60
TARGET_WARM_S = 60.0
TARGET_FIRST_ANSWER_S = 5 * 60.0
TARGET_DISK_B = 20 * GB
BEFORE = {"cold_s": 40 * 60 + 37, "disk_b": 59 * GB, "build_s": 8.5 * 60}
TARGET_FLOOR_RATIO = 1.05  # the cold wall within this much of its floor, per backend
BACKENDS = ("docker", "venv")


def _tool(*args: str) -> list[str]:
    """A stackprobe command run with this interpreter (the project's environment under `uv run`)."""
    module = {"provision": "provision.cli", "checks": "checks.cli"}[args[0]]
    return [sys.executable, "-m", module, *args[1:]]


def timed(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> tuple[float, int]:
    """Run ``cmd`` with its output in ``log`` (the job's progress is long); (wall seconds, exit code)."""
    t0 = time.monotonic()
    with log.open("ab") as fh:
        fh.write(("$ " + " ".join(cmd) + "\n").encode())
        fh.flush()
        rc = subprocess.run(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, env=env).returncode
    return time.monotonic() - t0, rc


def free_bytes(paths: Iterable[Path]) -> dict[str, int]:
    """Free bytes per distinct filesystem among ``paths`` (keyed by the first path seen on it)."""
    out: dict[str, int] = {}
    seen: set[int] = set()
    for p in paths:
        while not p.exists():
            p = p.parent
        dev = os.stat(p).st_dev
        if dev not in seen:
            seen.add(dev)
            out[str(p)] = shutil.disk_usage(p).free
    return out


def growth(before: dict[str, int], after: dict[str, int]) -> int:
    return sum(before[k] - after.get(k, before[k]) for k in before)


def du(path: Path) -> int:
    if not path.exists():
        return 0
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):  # a file removed while walking
                total += os.lstat(os.path.join(dirpath, f)).st_size
    return total


def docker_root() -> Path | None:
    try:
        out = subprocess.run(["docker", "info", "--format", "{{.DockerRootDir}}"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return Path(out.stdout.strip()) if out.returncode == 0 and out.stdout.strip() else None


def docker_df() -> dict[str, str]:
    """`docker system df` sizes by type (Images, Build Cache, ...), as docker prints them."""
    try:
        out = subprocess.run(["docker", "system", "df", "--format", "{{.Type}}\t{{.Size}}"], capture_output=True,
                             text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return dict(line.split("\t", 1) for line in out.stdout.splitlines() if "\t" in line)


def uv_cache_dir() -> Path:
    try:
        out = subprocess.run(["uv", "cache", "dir"], capture_output=True, text=True, timeout=30)
        if out.returncode == 0 and out.stdout.strip():
            return Path(out.stdout.strip())
    except (OSError, subprocess.TimeoutExpired):
        pass
    return Path.home() / ".cache" / "uv"


def gpu_probes() -> set[str]:
    """Ids of the probes whose spec needs a GPU, as `checks list` reports them."""
    out = subprocess.run(_tool("checks", "list", "--json"), cwd=ROOT, capture_output=True, text=True, check=True)
    return {p["id"] for p in json.loads(out.stdout) if p.get("needs_gpu")}


def _stamp(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC).timestamp()


def phases(runs: Iterable[Path], gpu: set[str]) -> dict[str, dict[str, float]]:
    """Per phase of one `checks run` (its results files ``runs``): span from the first start to the last end of
    the variants it ran, busy seconds, variants run, variants reused (carried from an earlier run with the
    same inputs: they keep their original start, so they count apart and add no time) and variants decided
    without running (a GPU probe on a host without a GPU, a cell that cannot be built: no worker started,
    so they take 0 s and count apart too)."""
    out: dict[str, dict[str, float]] = {}
    for path in runs:
        for line in path.read_text().splitlines():
            r = json.loads(line)
            phase = "compile" if r["probe_id"] == "fi-jit" else "gpu" if r["probe_id"] in gpu else "other"
            p = out.setdefault(phase, {"first": float("inf"), "last": 0.0, "busy_s": 0.0, "variants": 0,
                                       "reused": 0, "decided": 0})
            if (r.get("evidence") or {}).get("reused_from"):
                p["reused"] += 1
                continue
            start, dur = _stamp(r["started_at"]), float(r.get("duration_s") or 0.0)
            if dur == 0.0:
                p["decided"] += 1
                continue
            p["first"] = min(p["first"], start)
            p["last"] = max(p["last"], start + dur)
            p["busy_s"] += dur
            p["variants"] += 1
    for p in out.values():
        first, last = p.pop("first"), p.pop("last")
        p["span_s"] = last - first if p["variants"] else 0.0
    return out


def compile_cpu_s(runs: Iterable[Path]) -> float:
    """CPU seconds of every build a run compiled (fi-jit's compile_cpu_s; cached builds compiled nothing, and a
    result carried from an earlier run compiled nothing in this one): divided by the cores, the least wall time
    any schedule of those compiles can take on this machine."""
    total = 0.0
    for path in runs:
        for line in path.read_text().splitlines():
            r = json.loads(line)
            if r["probe_id"] == "fi-jit" and not (r.get("evidence") or {}).get("reused_from"):
                total += float((r.get("metrics") or {}).get("compile_cpu_s") or 0.0)
    return round(total, 1)


def floor_s(compile_cpu: float, cores: int, build_s: float) -> float:
    """The least wall a pass can take: its compilers' CPU seconds over every core, after the build."""
    return compile_cpu / max(1, cores) + build_s


def kernel_stage(matrix: Path, backend: str) -> tuple[float, float]:
    """(compile CPU-s, wall s) of the kernel stage of the last `provision build`, from the matrix's cells'
    build records (``kernels``); (0, 0) where none has one."""
    plan = subprocess.run(_tool("provision", "plan", "--no-reach-check", "--json", "--matrix", str(matrix)), cwd=ROOT,
                          capture_output=True, text=True)
    cpu, wall = 0.0, 0.0
    for cell in {c["cell_id"] for c in json.loads(plan.stdout or "[]")}:
        found = buildrecord.read(ROOT / "envs" / cell, backend).record
        k = found.data.get("kernels") if found is not None else None
        if not isinstance(k, dict):
            continue
        cpu += float(k.get("compile_cpu_s") or 0.0)
        wall = max(wall, float(k.get("stage_s") or 0.0))
    return round(cpu, 1), round(wall, 1)


def pass_floor(p: dict[str, Any], cores: int) -> tuple[float, float, float]:
    """(compile CPU-s, build wall outside compiling, floor) of one recorded pass. Where the compile cache
    counted the pass's compiles, its CPU seconds are every compile's (the kernel stage's and fi-jit's, each
    once), and the build's own compiles leave its wall as if spread over every core; a pass recorded before
    that count uses the results' and the build records' figures."""
    counted = p.get("compiles") or {}
    if float(counted.get("cpu_s") or 0.0) > 0:
        cpu = float(counted["cpu_s"])
        build = max(0.0, float(p["build_s"]) - float(counted.get("during_build_cpu_s") or 0.0) / max(1, cores))
        return cpu, build, floor_s(cpu, cores, build)
    cpu = float(p.get("compile_cpu_s") or 0.0) + float(p.get("kernel_cpu_s") or 0.0)
    build = float(p["build_s"]) - float(p.get("kernel_stage_s") or 0.0)
    return cpu, build, floor_s(cpu, cores, build)


def ledger(cache: Path) -> list[dict[str, Any]]:
    """The compile cache's ledger (one line per build that ran the compilers into it), unreadable lines left out."""
    try:
        text = (cache / LEDGER).read_text(errors="replace")
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            row = json.loads(line)
            if isinstance(row, dict) and isinstance(row.get("key"), str):
                out.append(row)
    return out


def _cpu(rows: list[dict[str, Any]]) -> float:
    return round(sum(float(r.get("compile_cpu_s") or 0.0) for r in rows if isinstance(r.get("compile_cpu_s"),
                                                                                   (int, float))), 1)


def compiled_twice(cache: Path, rows: list[dict[str, Any]]) -> list[str]:
    """Keys the compilers ran for more often than the store holds entries of: the same object compiled twice.
    One key can rightly hold several entries, one per set of headers the build read (two flashinfer releases
    whose sources are the same but a header differs), and each was compiled once."""
    out = []
    for key, n in sorted(_counts(rows).items()):
        try:
            entries = sum(1 for d in (cache / key).iterdir() if (d / "record.json").is_file())
        except OSError:
            entries = 0
        if n > max(1, entries):
            out.append(key)
    return out


def _counts(rows: list[dict[str, Any]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in rows:
        out[r["key"]] = out.get(r["key"], 0) + 1
    return out


def first_answer_s(p: dict[str, Any]) -> float:
    """Seconds from the start of the main job's first command (``provision build``) to the first table: the
    recorded figure, or for a pass recorded without one, the build's wall plus the first table's seconds into
    ``checks run`` (the two commands run back to back)."""
    if p.get("first_answer_s") is not None:
        return float(p["first_answer_s"])
    return round(float(p["build_s"]) + float(p["first_table_s"]), 1)


class TableWatch:
    """When a file is first written after :meth:`start` (its modification time changes or it appears),
    polled from a thread: the time to the first table, whoever writes it."""

    def __init__(self, path: Path, every_s: float = 0.5) -> None:
        self.path, self.every_s = path, every_s
        self.first_s: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _mtime(self) -> float | None:
        try:
            return self.path.stat().st_mtime_ns / 1e9
        except OSError:
            return None

    def start(self) -> TableWatch:
        self.t0, self._before = time.monotonic(), self._mtime()
        self._thread.start()
        return self

    def _poll(self) -> None:
        while self.first_s is None and not self._stop.wait(self.every_s):
            self._check()

    def _check(self) -> None:
        now = self._mtime()
        if self.first_s is None and now is not None and now != self._before:
            self.first_s = time.monotonic() - self.t0

    def stop(self) -> float | None:
        self._stop.set()
        self._thread.join()
        self._check()  # a table written in the last poll interval
        return self.first_s


def cpu_seconds() -> tuple[float, float]:
    """This machine's CPU seconds so far, every core together, from /proc/stat: (idle, steal). Idle counts
    iowait too (a core waiting on the disk does no work); steal is what the hypervisor gave other machines.
    (0, 0) where /proc/stat cannot be read."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
        hz = os.sysconf("SC_CLK_TCK")
        idle, iowait, steal = (int(fields[i]) for i in (4, 5, 8))
    except (OSError, ValueError, IndexError):
        return 0.0, 0.0
    return (idle + iowait) / hz, steal / hz


class CpuClock:
    """Idle and stolen CPU seconds over a pass, sampled from a thread every ``every_s`` (the timeline, for
    where in the pass the cores sat idle) and read at each :meth:`mark`."""

    def __init__(self, every_s: float = 10.0) -> None:
        self.every_s = every_s
        self.samples: list[tuple[float, float, float]] = []  # (seconds since start, idle s, steal s) so far
        self.marks: dict[str, tuple[float, float, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _now(self) -> tuple[float, float, float]:
        idle, steal = cpu_seconds()
        return round(time.monotonic() - self.t0, 1), round(idle - self.idle0, 1), round(steal - self.steal0, 1)

    def start(self) -> CpuClock:
        self.t0 = time.monotonic()
        self.idle0, self.steal0 = cpu_seconds()
        self._thread.start()
        return self

    def _poll(self) -> None:
        while not self._stop.wait(self.every_s):
            self.samples.append(self._now())

    def mark(self, name: str) -> None:
        self.marks[name] = self._now()

    def stop(self) -> dict[str, Any]:
        """Per span between marks (in the order marked), its wall, idle and stolen CPU seconds, and the timeline."""
        self._stop.set()
        self._thread.join()
        spans: dict[str, dict[str, float]] = {}
        last = (0.0, 0.0, 0.0)
        for name, at in self.marks.items():
            spans[name] = {"wall_s": round(at[0] - last[0], 1), "idle_cpu_s": round(at[1] - last[1], 1),
                           "steal_cpu_s": round(at[2] - last[2], 1)}
            last = at
        return {"spans": spans, "timeline": [list(s) for s in self.samples]}


def remove_images(matrix: Path, log: Path) -> None:
    """Remove the images of the matrix's cells (``stackprobe/<cell>:*``, not the base images) and the BuildKit
    cache, so the cold pass builds them as a new user would."""
    plan = subprocess.run(_tool("provision", "plan", "--no-reach-check", "--json", "--matrix", str(matrix)), cwd=ROOT,
                          capture_output=True, text=True, check=True)
    cells = {c["cell_id"] for c in json.loads(plan.stdout)}
    listed = subprocess.run(["docker", "images", "--format", "{{.Repository}}:{{.Tag}}"], capture_output=True,
                            text=True, check=True).stdout.split()
    refs = [r for r in listed if r.split(":", 1)[0].removeprefix("stackprobe/") in cells]
    if refs:
        timed(["docker", "rmi", *refs], log)
    timed(["docker", "builder", "prune", "-af"], log)


def remove_venvs(matrix: Path, log: Path) -> None:
    """Remove the virtual environments of the matrix's cells, so the cold pass makes them again."""
    from provision.options import VENVS  # lazy: the benchmark's one use of the project's layout

    plan = subprocess.run(_tool("provision", "plan", "--no-reach-check", "--json", "--matrix", str(matrix)), cwd=ROOT,
                          capture_output=True, text=True, check=True)
    with log.open("a") as fh:
        for cell in sorted({c["cell_id"] for c in json.loads(plan.stdout)}):
            if (VENVS / cell).is_dir():
                fh.write(f"$ rm -r {VENVS / cell}\n")
                shutil.rmtree(VENVS / cell)


def checks_run(matrix: Path, results: Path, cache: Path, table: Path, level: str | None,
               backend: str) -> list[str]:
    """The main job's `checks run --all`; ``level`` None leaves --level out: the quick pass, then the full."""
    return _tool("checks", "run", "--all", "--backend", backend, "--matrix", str(matrix), "--results", str(results),
                 "--compile-cache", str(cache), *(["--level", level] if level else []), "--report", str(table))


def watched(cmd: list[str], table: Path, log: Path,
            env: dict[str, str] | None = None) -> tuple[float, int, float | None]:
    """``cmd`` timed, with the seconds from its start to the first write of ``table`` (None: never written):
    (wall seconds, exit code, first table seconds)."""
    seen = TableWatch(table).start()
    run_s, rc = timed(cmd, log, env)
    return run_s, rc, seen.stop()


def one_pass(label: str, matrix: Path, results: Path, cache: Path, log: Path, gpu: set[str],
             watch: list[Path], level: str | None = None, backend: str = "docker") -> dict[str, Any]:
    """The main job once: build, run (which regenerates the table), report; each timed, with the disk it took
    and when the first table was written."""
    free0 = free_bytes(watch)
    env = dict(os.environ, STACKPROBE_COMPILE_CACHE=str(cache))
    table = results / "compatibility.md"
    job = TableWatch(table).start()  # the user's clock: from the start of the first command
    cpu = CpuClock().start()
    build_s, build_rc = timed(_tool("provision", "build", "--backend", backend, "--matrix", str(matrix)), log, env)
    cpu.mark("build")
    inline = ledger(cache)  # what the build compiled before it returned (the long modules may go on after it)
    before = set(results.glob("*/*.jsonl"))
    run_at = time.monotonic() - job.t0
    run_s, run_rc, first = watched(checks_run(matrix, results, cache, table, level, backend), table, log, env)
    cpu.mark("run")
    kernel_cpu, kernel_wall = kernel_stage(matrix, backend)  # after the run, which waits for the kernel stage
    compiled = ledger(cache)
    report_s, report_rc = timed(_tool("checks", "report", "--results", str(results), "--out", str(table)), log, env)
    answered = job.stop()
    cpu.mark("report")
    if level == "quick":
        stop_stage(log)
    free1 = free_bytes(watch)
    new = set(results.glob("*/*.jsonl")) - before
    phased = phases(new, gpu)
    p: dict[str, Any] = {
        "label": label,
        "build_s": round(build_s, 1), "build_rc": build_rc,
        "kernel_cpu_s": kernel_cpu, "kernel_stage_s": kernel_wall,
        "run_s": round(run_s, 1), "run_rc": run_rc,
        "report_s": round(report_s, 1), "report_rc": report_rc,
        "total_s": round(build_s + run_s + report_s, 1),
        "first_table_s": round(first if first is not None else run_s + report_s, 1),
        "first_answer_s": round(answered if answered is not None else run_at + run_s + report_s, 1),
        "phases": {k: {kk: round(vv, 1) for kk, vv in v.items()} for k, v in phased.items()},
        "disk_growth_b": growth(free0, free1),
        "compile_cpu_s": compile_cpu_s(new),
        "runs_recorded": len(new),  # a warm pass that learns nothing records none
        # the compile cache's own count of the builds that ran the compilers, whoever ran them (the kernel
        # stage or fi-jit): a key compiled twice is work done twice
        "compiles": {"builds": len(compiled), "cpu_s": _cpu(compiled),
                     "during_build": len(inline), "during_build_cpu_s": _cpu(inline),
                     "keys_compiled_twice": compiled_twice(cache, compiled)},
        # CPU the pass left idle or the hypervisor took, per command (where the wall went beyond the floor)
        "cpu": cpu.stop(),
    }
    p["floor_s"] = round(pass_floor(p, os.cpu_count() or 1)[2], 1)
    return p


def stop_stage(log: Path, wait_s: float = 60.0) -> None:
    """End the kernel stage `provision build` left running (the long modules' builds, which a quick level never
    waits for) as a stopped stage ends: its build containers and compilers with it. So a quick-level measurement
    leaves no compile behind it to slow what runs next on the machine, a warm pass included."""
    stage = kernelstage.running()
    if stage is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(stage.pid, signal.SIGTERM)
    deadline = time.monotonic() + wait_s
    while kernelstage.running() is not None and time.monotonic() < deadline:
        time.sleep(0.5)
    with log.open("a") as fh:
        fh.write(f"stopped the kernel stage (pid {stage.pid}, {stage.builds} module build(s)): a quick-level "
                 "measurement does not wait for the long modules\n")


def ratio_line(name: str, value: float, target: float, unit: str) -> str:
    return f"{name}: {value:.1f} {unit} / target {target:.1f} {unit} = {value / target:.2f}x"


def floor_line(p: dict[str, Any], cores: int) -> str:
    """The pass's compile CPU-s, its floor and its wall against it."""
    cpu, build, floor = pass_floor(p, cores)
    if cpu <= 0:
        return "    compile CPU 0 s: nothing compiled, no floor to compare with"
    ratio = f"{p['total_s'] / floor:.2f}x" if floor > 0 else "n/a"
    return (f"    compile CPU {cpu:.0f} s; floor {cpu:.0f} / {cores} cores + build {build:.1f} s = "
            f"{floor / 60:.1f} min; wall {p['total_s'] / 60:.1f} min = {ratio} of the floor")


def render(meta: dict[str, Any], passes: list[dict[str, Any]]) -> list[str]:
    backend = meta.get("backend") or "not recorded"
    lines = [f"main job on {meta['matrix']} ({meta['host']}, {meta['cores']} cores, {meta['date']}, "
             f"level {meta.get('level', 'full')}, backend {backend})"]
    for p in passes:
        first = (f"first table {p['first_table_s']} s into checks run, {first_answer_s(p)} s after the first "
                 "command; ") if "first_table_s" in p else ""
        recorded = f"; {p['runs_recorded']} run(s) recorded" if "runs_recorded" in p else ""
        lines.append(f"[{p['label']}] build {p['build_s']} s (rc {p['build_rc']}), checks run {p['run_s']} s "
                     f"(rc {p['run_rc']}), report {p['report_s']} s; {first}total {p['total_s']} s; "
                     f"disk +{p['disk_growth_b'] / GB:.2f} GB{recorded}")
        lines.append(floor_line(p, int(meta["cores"])))
        if p.get("compiles"):
            c = p["compiles"]
            twice = ", ".join(c["keys_compiled_twice"]) or "none"
            lines.append(f"    compiles counted by the compile cache: {c['builds']} ({c['during_build']} before "
                         f"provision build returned), {c['cpu_s']:.0f} CPU-s; compiled twice: {twice}")
        if isinstance(p.get("cpu"), dict) and p["cpu"].get("spans"):
            lines.append("    CPU left idle (stolen by the hypervisor): " + ", ".join(
                f"{name} {sp['idle_cpu_s']:.0f} ({sp['steal_cpu_s']:.0f}) of {sp['wall_s'] * int(meta['cores']):.0f} "
                "core-s" for name, sp in p["cpu"]["spans"].items()))
        for name, ph in sorted(p["phases"].items()):
            lines.append(f"    {name:8} span {ph['span_s']:7.1f} s  busy {ph['busy_s']:7.1f} s  "
                         f"variants run {int(ph['variants'])}, reused {int(ph['reused'])}, "
                         f"decided without running {int(ph.get('decided', 0))}")
    cold = next((p for p in passes if p["label"] == "cold"), None)
    warm = next((p for p in passes if p["label"] == "warm"), None)
    if cold:
        floor = pass_floor(cold, int(meta["cores"]))[2]
        if floor > 0:
            lines.append(f"cold wall / floor ({backend}): {cold['total_s'] / 60:.1f} / {floor / 60:.1f} min = "
                         f"{cold['total_s'] / floor:.2f}x / target {TARGET_FLOOR_RATIO:.2f}x = "
                         f"{cold['total_s'] / floor / TARGET_FLOOR_RATIO:.2f}x")
        if "first_table_s" in cold:
            lines.append(ratio_line("first answer", first_answer_s(cold) / 60, TARGET_FIRST_ANSWER_S / 60, "min"))
        lines.append(ratio_line("cold total", cold["total_s"] / 60, TARGET_COLD_S / 60, "min")
                     + f" (before: {BEFORE['cold_s'] / 60:.1f} min, now {cold['total_s'] / BEFORE['cold_s']:.2f}x)")
        disk = meta["disk_growth_b"]
        lines.append(ratio_line("disk growth", disk / GB, TARGET_DISK_B / GB, "GB")
                     + f" (before: {BEFORE['disk_b'] / GB:.0f} GB)")
    if warm:
        lines.append(ratio_line("warm total", warm["total_s"], TARGET_WARM_S, "s"))
    lines.append("docker system df: " + ", ".join(f"{k} {v}" for k, v in meta.get("docker_df", {}).items()))
    lines.append("caches: " + ", ".join(f"{k} {v / GB:.2f} GB" for k, v in meta.get("caches_b", {}).items()))
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--matrix", type=Path, default=ROOT / "matrix.yaml")
    ap.add_argument("--with-cells", "--with-images", dest="with_cells", action="store_true",
                    help="remove the matrix's built cells first (images and BuildKit cache, or venvs), so the "
                    "cold run builds them")
    ap.add_argument("--skip-warm", action="store_true")
    ap.add_argument("--warm-only", action="store_true",
                    help="only the warm pass, over the results and compile cache an earlier run kept in --work")
    ap.add_argument("--level", choices=("quick", "full"), help="checks run --level (default: none, so the quick "
                    "pass writes the first table and the full pass follows); quick: the first answer alone, and "
                    "the kernel stage the build left running is stopped after each pass")
    ap.add_argument("--work", type=Path, help="keep the results and compile cache here (default: a temp dir)")
    ap.add_argument("--backend", choices=BACKENDS, default="docker",
                    help="provision build and checks run --backend (default docker)")
    ap.add_argument("--recorded", type=Path, metavar="JSON",
                    help="print a recorded result again, with its floor, and run nothing")
    args = ap.parse_args(argv)
    if args.recorded:
        return show_recorded(args.recorded)
    if args.warm_only and (args.work is None or args.with_cells or args.skip_warm):
        print("--warm-only needs --work (the folder of an earlier run) and neither --with-cells nor --skip-warm",
              file=sys.stderr)
        return 2
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-main-job-"))
    work.mkdir(parents=True, exist_ok=True)
    results, cache = work / "results", work / "compile-cache"
    for d in (results, cache):
        filled = d.exists() and any(d.iterdir())
        if filled and not args.warm_only:
            print(f"{d} is not empty: a cold run needs empty caches (pass another --work)", file=sys.stderr)
            return 2
        if not filled and args.warm_only:
            print(f"{d} is empty: --warm-only needs the results and compile cache of an earlier run", file=sys.stderr)
            return 2
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    host = socket.gethostname()
    log = OUT_DIR / f"main-job-{host}-{stamp}.log"
    uv_cache = uv_cache_dir()
    watch = [ROOT, uv_cache, *([r] if (r := docker_root()) else [])]
    if args.with_cells:
        (remove_images if args.backend == "docker" else remove_venvs)(args.matrix, log)
    free0 = free_bytes(watch)
    gpu = gpu_probes()
    passes = [] if args.warm_only else [one_pass("cold", args.matrix, results, cache, log, gpu, watch, args.level,
                                                 args.backend)]
    if not args.skip_warm:
        passes.append(one_pass("warm", args.matrix, results, cache, log, gpu, watch, args.level, args.backend))
    meta = {
        "backend": args.backend,
        "matrix": str(args.matrix.relative_to(ROOT) if args.matrix.is_relative_to(ROOT) else args.matrix),
        "host": host, "cores": os.cpu_count(), "date": stamp, "with_cells": args.with_cells,
        **({"warm_only": True} if args.warm_only else {}),
        "level": args.level or "quick, then full",
        "disk_growth_b": growth(free0, free_bytes(watch)),
        "docker_df": docker_df(),
        "caches_b": {"compile cache": du(cache), "uv cache": du(uv_cache)},
        "work": str(work), "log": str(log.relative_to(ROOT)),
    }
    lines = render(meta, passes)
    print("\n".join(lines))
    (OUT_DIR / f"main-job-{host}-{stamp}.json").write_text(json.dumps({**meta, "passes": passes}, indent=1) + "\n")
    (OUT_DIR / f"main-job-{host}-{stamp}.txt").write_text("\n".join(lines) + "\n")
    return 0 if all(p["build_rc"] == 0 and p["run_rc"] in (0, 1) for p in passes) else 1


def show_recorded(path: Path) -> int:
    """Print a recorded result with this version's lines (the floor included); 2 when it cannot be read."""
    try:
        data = json.loads(path.read_text())
        passes = data["passes"]
        lines = render(data, passes)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        print(f"{path}: not a bench_main_job result ({type(exc).__name__}: {exc}); give a main-job-*.json "
              "from benchmarks/results/", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

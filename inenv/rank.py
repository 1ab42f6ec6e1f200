"""One rank of a probe variant: ``python -m inenv.rank``, started by ``inenv.worker``.

In-environment side: standard library plus the libraries the probe imports. The rank writes its
outcome to ``<workdir>/rank-<i>.json`` (atomically) as soon as the probe returns, waits briefly until
every rank of the variant has written its own (rank 0 holds the rendezvous store a late peer may still
need), and exits without tearing its process group down: nothing after the outcome can change it, a
teardown costs about half a second per NCCL variant (2x H200) and can hang after graph capture.
A rank that has a GPU initialises the CUDA driver in a thread while the probe imports its libraries
(cuInit takes 0.4 s there and reads no variable a probe sets).

A gated rank (``inenv.gpugate``: its worker passed a go pipe) does what its probe declares in
``SPEC.preload`` (imports, the rendezvous) and then waits for the worker to let it go; the probe runs only
after that.

A warm rank (``inenv.warm``: its worker passed a reply pipe in ``ENV_REPLY_FD``) runs one variant after
another: each request on stdin brings the variant's whole environment and log file; the rank runs it as above,
tears its process group down, checks that nothing it cannot clear is left (:func:`unusable`) and replies
``idle`` with whether it may run another; a rank that may not exits.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import gc
import importlib
import json
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from inenv import atomic, gpugate
from inenv.kit import _dist
from inenv.kit._dist import keep_multicast_off
from inenv.probe import RUN_STATUSES, RankContext, Variant, outcome
from inenv.registry import ProbeLocation, load

# Environment the launcher sets for every rank (besides RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*).
ENV_LOCATION = "STACKPROBE_PROBE_LOCATION"
ENV_PROBE = "STACKPROBE_PROBE"
ENV_VARIANT = "STACKPROBE_VARIANT"
ENV_WORKDIR = "STACKPROBE_WORKDIR"
ENV_DEVICE = "STACKPROBE_DEVICE"
# The CPU threads of each rank of a multi-rank variant, as torchrun sets them (the launcher puts "1" in the rank's
# environment unless its own environment has a value): the host runs up to one rank a core (checks.run.runner's
# rank cap), and torch's default of a thread per core in every rank would put 8 ranks x 16 threads on 16 cores
# while their agreement checks do their CPU work.
CPU_THREADS_ENV = "OMP_NUM_THREADS"
# A folder: each rank writes cProfile statistics of its probe there (rank-<i>.prof), to find where a
# variant's seconds go (benchmarks/bench_variant_floor.py reads them).
ENV_PROFILE = "STACKPROBE_RANK_PROFILE"
# Key of the outcome file that carries the rank's clock (time.time() when main began, when a gated rank had
# preloaded and was let go, and when the probe returned); the launcher takes it out, so a probe's outcome is
# never changed by it.
CLOCK_KEY = "_clock"

TRACEBACK_TAIL_CHARS = 4000
# After its outcome, how long a rank waits for every peer's before it exits anyway (the launcher's grace
# after the last outcome is longer, so a rank never outlives it for this wait).
PEERS_WAIT_S = 2.0
# A rank whose own code (not the probe's: that is caught in run_probe) raised prints this line with the
# traceback and exits with HARNESS_EXIT, so the worker records the harness's failure, never the feature's.
HARNESS_MARK = "stackprobe rank: harness failure"
HARNESS_EXIT = 3
# A warm rank (inenv.warm): the write end of its reply pipe; its requests come on stdin, one JSON line each.
ENV_REPLY_FD = "STACKPROBE_RANK_REPLY_FD"
# Modules whose import leaves process-wide state a later variant could meet (symmetric memory's group
# registrations, custom allreduce IPC workspaces): a warm rank that imported one is not reused.
STATEFUL_MODULES = ("torch.distributed._symmetric_memory", "flashinfer.comm", "sgl_kernel.allreduce")
# Names a probe may set in its rank's environment without making the rank unfit for reuse: the rendezvous
# address (init_dist's setdefault of what the launcher already set) and the multicast-off values every GPU
# probe sets before CUDA starts (the same values in every variant).
_ENV_SETTLED = ("MASTER_ADDR", "MASTER_PORT")
TEARDOWN_LIMIT_S = 2.0  # a warm rank's teardown after a variant: longer, and the rank is not reused
TEARDOWN_THREAD = "stackprobe-teardown"


def outcome_path(workdir: Path, rank: int) -> Path:
    return workdir / f"rank-{rank}.json"


def log_path(workdir: Path, rank: int) -> Path:
    return workdir / f"rank-{rank}.log"


def context_from_env(env: dict[str, str]) -> RankContext:
    device = env.get(ENV_DEVICE, "")
    return RankContext(
        rank=int(env["RANK"]),
        world_size=int(env["WORLD_SIZE"]),
        local_rank=int(env.get("LOCAL_RANK", env["RANK"])),
        device_index=int(device) if device else None,
        variant=Variant.from_json(json.loads(env[ENV_VARIANT])),
        workdir=Path(env[ENV_WORKDIR]),
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=int(env.get("MASTER_PORT", "0")),
        env=dict(env),
    )


def _checked(result: Any) -> dict[str, Any]:
    """A probe must return an outcome(); anything else is a probe bug, reported as `fail`."""
    if not isinstance(result, dict) or result.get("status") not in RUN_STATUSES:
        shown = repr(result)[:200]
        return outcome("fail", note=f"probe returned {shown}, not an outcome()", reason_code="probe-bug")
    return result


def run_probe(ctx: RankContext, location: ProbeLocation) -> dict[str, Any]:
    try:
        module = load(location)
        return _checked(module.run(ctx))
    except BaseException as exc:  # SystemExit and KeyboardInterrupt from a probe are failures too
        tb = traceback.format_exc()
        last = f"{type(exc).__name__}: {exc}".strip()
        return outcome("fail", note=last[:500], evidence={"traceback": tb[-TRACEBACK_TAIL_CHARS:]})


def warm_driver() -> threading.Thread:
    """cuInit in a daemon thread: the driver's own initialisation overlaps the probe's imports. It creates no
    context on any device (the probe still picks its own), and a failure here is left for the probe's CUDA
    calls to meet and report as they would have."""
    def init() -> None:
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libcuda.so.1").cuInit(0)

    thread = threading.Thread(target=init, name="stackprobe-cuinit", daemon=True)
    thread.start()
    return thread


def wait_for_peers(workdir: Path, world_size: int, limit_s: float, poll_s: float = 0.005) -> bool:
    """Until every rank's outcome file exists (True) or ``limit_s`` has passed (False)."""
    end = time.monotonic() + limit_s
    while True:
        if all(outcome_path(workdir, r).exists() for r in range(world_size)):
            return True
        if time.monotonic() >= end:
            return False
        time.sleep(poll_s)


def cpu_threads(env: dict[str, str]) -> None:
    """torch's CPU threads as :data:`CPU_THREADS_ENV` in the rank's environment says, where torch was imported before
    the rank had that environment (a warm rank forked from a process that imported it reads no variable again);
    a torch imported later reads the variable itself."""
    torch = sys.modules.get("torch")
    wanted = env.get(CPU_THREADS_ENV, "")
    if torch is not None and wanted.isdigit() and int(wanted) > 0 and hasattr(torch, "set_num_threads"):
        with contextlib.suppress(Exception):
            if torch.get_num_threads() != int(wanted):
                torch.set_num_threads(int(wanted))


def preload(location: ProbeLocation, ctx: RankContext) -> None:
    """Do what the probe declares it may do before it has the GPUs (``SPEC.preload``), in order: import each
    module named, and call each ``module:function`` with this rank's context. Whatever fails here is left for
    the probe's own code to meet and report, as it would have without this."""
    try:
        steps = tuple(load(location).SPEC.preload)
    except Exception:
        return
    if steps:
        keep_multicast_off()  # as every GPU probe does before torch starts CUDA: now before anything is imported
    for step in steps:
        name, _, function = step.partition(":")
        with contextlib.suppress(Exception):
            module = importlib.import_module(name)
            if function:
                getattr(module, function)(ctx)


def _profiled(ctx: RankContext, location: ProbeLocation, folder: str) -> dict[str, Any]:
    if not folder:
        return run_probe(ctx, location)
    import cProfile

    prof = cProfile.Profile()
    result = prof.runcall(run_probe, ctx, location)
    try:
        prof.dump_stats(str(Path(folder) / f"rank-{ctx.rank}.prof"))
    except OSError as exc:
        ctx.log(f"cannot write the profile: {exc}")
    return result


def main() -> None:
    try:
        _main()
    except BaseException:  # the rank's own code failed (a gate pipe, the outcome write on a full disk)
        print(f"{HARNESS_MARK}\n{traceback.format_exc()[-TRACEBACK_TAIL_CHARS:]}", file=sys.stderr, flush=True)
        os._exit(HARNESS_EXIT)


def harness_failed(code: int, log: str) -> bool:
    """Whether a rank that exited with ``code`` and wrote ``log`` failed in its own code (see HARNESS_MARK)."""
    return code == HARNESS_EXIT and HARNESS_MARK in log


def _main() -> None:
    reply = os.environ.get(ENV_REPLY_FD, "")
    if reply:
        _serve(int(reply))
        return
    started = time.time()
    faulthandler.enable()  # a segfault or abort leaves the Python stack in the rank log
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the watchdog asks for stacks before killing
    env = dict(os.environ)
    ctx = context_from_env(env)
    cpu_threads(env)
    if ctx.device_index is not None:
        warm_driver()
    location = ProbeLocation.from_arg(env[ENV_PROBE], env[ENV_LOCATION])
    clock = {"main": started}
    if env.get(gpugate.GO_FD_ENV):
        preload(location, ctx)
        clock["ready"] = time.time()
        gpugate.say_ready(env)
        gpugate.wait_for_go(env)
        clock["go"] = time.time()
    _probe_and_report(ctx, location, env, clock)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no teardown, no interpreter shutdown: library atexit hooks can hang after a correct result


def _probe_and_report(ctx: RankContext, location: ProbeLocation, env: dict[str, str],
                      clock: dict[str, float]) -> tuple[dict[str, Any], bool]:
    """Run the probe, write its outcome with the clock, and wait for the peers' outcomes: the outcome and
    whether every peer reported in time."""
    result = _profiled(ctx, location, env.get(ENV_PROFILE, ""))
    result[CLOCK_KEY] = {**clock, "probe_done": time.time()}
    if ctx.rank == 0:
        # lazy: inenv.envinfo costs 8 ms at every rank's start; only rank 0 reads it, after the probe
        from inenv.envinfo import runtime_versions

        try:
            runtime = runtime_versions()
        except Exception:
            runtime = {}
        if runtime:
            result.setdefault("evidence", {})["runtime"] = runtime
    atomic.write_json(outcome_path(ctx.workdir, ctx.rank), result, indent=None)
    return result, wait_for_peers(ctx.workdir, ctx.world_size, PEERS_WAIT_S)


def _changed_env(before: dict[str, str]) -> list[str]:
    """The names the variant set, changed or removed in this process's environment, less those that leave
    nothing behind (_ENV_SETTLED, and the multicast-off values a GPU probe sets)."""
    now = dict(os.environ)
    settled = dict(keep_multicast_off({}))  # the values every GPU probe sets, for this process's opt-in
    names = sorted({*before, *now})
    return [n for n in names if before.get(n) != now.get(n) and n not in _ENV_SETTLED
            and not (n in settled and now.get(n) == settled[n])]


def unusable(result: dict[str, Any], peers_reported: bool, env: dict[str, str], threads: set[int | None]) -> str:
    """Why this warm rank must not run another variant ("" when it may), after tearing down what a variant
    leaves that can be cleared: every process group, the CUDA caching allocator's free blocks. Conservative:
    a variant that did not end well (a failure, a silent peer), that changed the process's environment (a
    library may have read it already: NCCL reads its settings once), imported a module of STATEFUL_MODULES,
    left a thread of its own running, or after which the device reports an error or the group cannot be
    destroyed, ends the rank."""
    if result.get("status") not in ("pass", "partial", "skip"):
        return f"the variant ended {result.get('status')}"
    if not peers_reported:
        return "a peer rank did not report"
    changed = _changed_env(env)
    if changed:
        return f"the variant set {', '.join(changed[:5])} in the process environment"
    stateful = [m for m in STATEFUL_MODULES if m in sys.modules]
    if stateful:
        return f"the variant imported {', '.join(stateful)}"
    failed: list[str] = []

    def teardown() -> None:
        try:
            dist = sys.modules.get("torch.distributed")
            if dist is not None and dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
            gc.collect()
            torch = sys.modules.get("torch")
            if torch is not None and torch.cuda.is_initialized():
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
        except Exception as exc:
            failed.append(f"teardown failed: {type(exc).__name__}: {str(exc)[:200]}")

    # in a thread of its own, bounded: a group's destruction can hang (NCCL after graph capture), and a rank
    # that would only wait for it is better ended at once than after the worker's grace
    thread = threading.Thread(target=teardown, name=TEARDOWN_THREAD, daemon=True)
    thread.start()
    thread.join(TEARDOWN_LIMIT_S)
    if thread.is_alive():
        return f"the process group's teardown took more than {TEARDOWN_LIMIT_S:g} s"
    if failed:
        return failed[0]
    left = [t.name for t in threading.enumerate() if t.ident not in threads and t.is_alive()
            and t.name not in ("stackprobe-cuinit", TEARDOWN_THREAD)]
    if left:
        return f"the variant left threads running: {', '.join(left[:5])}"
    return ""


def _reply(fd: int, message: dict[str, Any]) -> None:
    os.write(fd, (json.dumps(message) + "\n").encode())


def _log_to(path: str) -> None:
    """From now on this process's stdout and stderr (and faulthandler's stacks) go to ``path``."""
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _serve(reply_fd: int) -> None:
    """A warm rank's loop: one variant per request line on stdin (see the module's docstring)."""
    started = time.time()
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # the requests come on a descriptor of their own: what a probe starts gets /dev/null as stdin (as a one-shot
    # rank's children do) and neither pipe, so it can neither read a request nor hold the reply pipe open
    requests = os.fdopen(os.dup(0), "rb")
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.set_inheritable(reply_fd, False)
    driver_warmed = False
    while True:
        line = requests.readline()
        if not line:
            break  # the worker is done with this group
        request = json.loads(line)
        started = started or time.time()
        _log_to(str(request["log"]))
        env = {str(k): str(v) for k, v in request["env"].items()}
        os.environ.clear()
        os.environ.update(env)
        ctx = context_from_env(env)
        cpu_threads(env)
        if ctx.device_index is not None and not driver_warmed:
            warm_driver()
            driver_warmed = True
        location = ProbeLocation.from_arg(env[ENV_PROBE], env[ENV_LOCATION])
        clock = {"main": started}
        _dist._prepared.clear()  # a store a variant joined and never used is not the next one's
        threads = {t.ident for t in threading.enumerate()}
        if request.get("gated"):
            preload(location, ctx)
            clock["ready"] = time.time()
            _reply(reply_fd, {"ev": "ready"})
            if not requests.readline():
                break  # the worker gave the variant up before letting it go
            clock["go"] = time.time()
        result, peers = _probe_and_report(ctx, location, env, clock)
        why = unusable(result, peers, env, threads)
        sys.stdout.flush()
        sys.stderr.flush()
        _reply(reply_fd, {"ev": "idle", "reuse": not why, "why": why})
        if why:
            break
        started = 0.0
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

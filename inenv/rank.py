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
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
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
from inenv.kit._dist import keep_multicast_off
from inenv.probe import RUN_STATUSES, RankContext, Variant, outcome
from inenv.registry import ProbeLocation, load

# Environment the launcher sets for every rank (besides RANK, WORLD_SIZE, LOCAL_RANK, MASTER_*).
ENV_LOCATION = "STACKPROBE_PROBE_LOCATION"
ENV_PROBE = "STACKPROBE_PROBE"
ENV_VARIANT = "STACKPROBE_VARIANT"
ENV_WORKDIR = "STACKPROBE_WORKDIR"
ENV_DEVICE = "STACKPROBE_DEVICE"
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
    started = time.time()
    faulthandler.enable()  # a segfault or abort leaves the Python stack in the rank log
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the watchdog asks for stacks before killing
    env = dict(os.environ)
    ctx = context_from_env(env)
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
    wait_for_peers(ctx.workdir, ctx.world_size, PEERS_WAIT_S)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no teardown, no interpreter shutdown: library atexit hooks can hang after a correct result


if __name__ == "__main__":
    main()

"""Runs one probe variant inside an environment and prints one result line.

    python -m inenv.worker --probe ID --variant JSON [--gpus N] [--timeout S] [--queue S] [--workdir DIR]
    python -m inenv.worker --inspect

In-environment side: standard library only (the ranks import the libraries under test). Stdout
carries exactly one line, ``RESULT_MARKER + json``; everything else goes to stderr or to rank logs.
The host-side watchdog is the hard limit; ``--timeout`` here is the soft one that collects stacks.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from inenv import envinfo, gpugate, progress, rank
from inenv.lifetime import SCRATCH_ENV, die_with_parent
from inenv.probe import RESULT_MARKER, Variant, combine_worst, outcome, untimed
from inenv.registry import ProbeLocation, ProbeNotFound, find
from inenv.status import GOOD, Status

LOG_TAIL_BYTES = 3000
ENV_PARAM_PREFIX = "env."  # a variant param "env.NCCL_ALGO=Tree" is exported to the ranks; "" unsets it
DEFAULT_GRACE_S = 3.0  # after every outcome arrived: time a rank gets to exit (rank.PEERS_WAIT_S is less)
PEER_GRACE_S = 5.0  # after a rank died without an outcome: time the others get before they are ended
FAILED_PEER_GRACE_S = 10.0  # after a rank reported a failure: time the silent others get to report
STACK_DUMP_WAIT_S = 1.0
KEPT = "kept"  # a rank's ``exit`` in the evidence when it was kept running for the next variant (inenv.warm)
STALLED = "stalled"  # how a rank ended by the stall watchdog is described (its ``stopped`` starts with it)


@contextlib.contextmanager
def reserved_port() -> Iterator[int]:
    """A free port for rank 0's rendezvous store, held bound (SO_REUSEADDR, never listening) while the ranks
    run: rank 0's store binds it beside the holder, and nothing else gets it in between. A port merely found
    free and let go was once taken before rank 0 bound it (EADDRINUSE, 2x H200): connect() hands out free
    ports as source ports, and the peers' connects to a store not yet listening are such connects."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        yield int(s.getsockname()[1])


def module_available(name: str) -> bool:
    """Whether `name` can be imported, without importing it (a dotted name is looked up on disk)."""
    top, _, rest = name.partition(".")
    spec = importlib.util.find_spec(top)
    if spec is None:
        return False
    if not rest:
        return True
    paths = list(spec.submodule_search_locations or [])
    for part in rest.split("."):
        nxt = []
        for p in paths:
            base = Path(p) / part
            if base.is_dir():
                nxt.append(str(base))
            elif any(Path(p).glob(f"{part}.py")) or any(Path(p).glob(f"{part}.*.so")):
                return part == rest.split(".")[-1]
        if not nxt:
            return False
        paths = nxt
    return True


def placed_on(variant: Variant, gpus: int) -> int:
    """How many of the host's ``gpus`` the variant's ranks go on: all of them, or the count a sharing variant
    names (``Variant.gpus``)."""
    return min(gpus, variant.gpus) if variant.share_gpu and variant.gpus else gpus


def device_for(rank_index: int, gpus: int, share_gpu: bool) -> int | None:
    """Rank i uses GPU i; ranks sharing GPUs wrap around. CUDA_VISIBLE_DEVICES is never narrowed per
    rank, since peer access and IPC need every device visible in every rank."""
    if gpus == 0 or (rank_index >= gpus and not share_gpu):
        return None
    return rank_index % gpus if share_gpu else rank_index


PYCACHE_ENV = "STACKPROBE_PYCACHE"  # the folder bytecode_cache makes its folder in (default: the temporary one)


def bytecode_folder_name(uid: int) -> str:
    """The name of a user's bytecode folder under the temporary directory (a container gets one mounted)."""
    return f"stackprobe-pycache-{uid}"


def bytecode_cache(root: Path | None = None) -> str | None:
    """A folder of this user's alone where the ranks keep the bytecode Python compiles, or None when none can
    be had safely (made elsewhere, shared, not a folder).

    The runner starts workers with PYTHONDONTWRITEBYTECODE so nothing is written into the environment; where
    the environment ships no bytecode of its own (a uv-built venv or image) every rank then compiled torch and
    flashinfer from source again: 2.1-3.3 s of each rank's start on 2x H200. PYTHONPYCACHEPREFIX puts the
    bytecode in this folder instead, outside the environment; Python checks each file against its source's
    size and time before using it, and replaces files atomically, so ranks may share it. The host names where
    (``PYCACHE_ENV``: its cache folder, so nothing of a run is left outside the folder it works in)."""
    given = os.environ.get(PYCACHE_ENV)
    folder = (root or Path(given or tempfile.gettempdir())) / bytecode_folder_name(os.getuid())
    try:
        if given and not root:
            folder.parent.mkdir(parents=True, exist_ok=True)  # the host's cache folder, named by the host
        folder.mkdir(mode=0o700, exist_ok=True)
        st = folder.lstat()
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        return None  # another user's, or writable by others: its bytecode would run in every rank
    return str(folder)


def keep_bytecode() -> None:
    """This process from now on: bytecode in :func:`bytecode_cache`, as the ranks keep theirs."""
    folder = bytecode_cache()
    if folder and not sys.pycache_prefix:
        sys.pycache_prefix = folder
        sys.dont_write_bytecode = False


def rank_env(base: dict[str, str], variant: Variant, location: ProbeLocation, workdir: Path, rank_index: int,
             port: int, device: int | None, pycache: str | None = None) -> dict[str, str]:
    env = dict(base)
    if pycache:
        env.setdefault("PYTHONPYCACHEPREFIX", pycache)
        env.pop("PYTHONDONTWRITEBYTECODE", None)
    for name, value in variant.params:
        if name.startswith(ENV_PARAM_PREFIX):
            var = name[len(ENV_PARAM_PREFIX):]
            if value == "":
                env.pop(var, None)
            else:
                env[var] = value
    env.update(
        {
            "RANK": str(rank_index),
            "LOCAL_RANK": str(rank_index),
            "WORLD_SIZE": str(variant.ranks),
            "LOCAL_WORLD_SIZE": str(variant.ranks),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            rank.ENV_PROBE: location.probe_id,
            rank.ENV_LOCATION: location.to_arg(),
            rank.ENV_VARIANT: json.dumps(variant.to_json()),
            rank.ENV_WORKDIR: str(workdir),
            rank.ENV_DEVICE: "" if device is None else str(device),
            "PYTHONUNBUFFERED": "1",
        }
    )
    if variant.ranks > 1:
        env.setdefault(rank.CPU_THREADS_ENV, "1")  # see rank.CPU_THREADS_ENV; a value the caller set stays
    return env


def tail(path: Path, limit: int = LOG_TAIL_BYTES) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - limit))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def signal_name(returncode: int) -> str:
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal {-returncode}"


@dataclass
class RankState:
    index: int
    proc: subprocess.Popen[bytes]
    spawned_at: float = 0.0  # time.time() when it was started
    outcome: dict[str, Any] | None = None
    ended_at: float | None = None  # when it exited without an outcome
    reported_at: float | None = None
    exited_at: float | None = None  # time.time() when the launcher saw it gone
    clock: dict[str, float] = field(default_factory=dict)  # the rank's own times (rank.CLOCK_KEY)
    stopped: str = ""  # why the launcher ended it, if it did

    @property
    def reported(self) -> bool:
        return self.outcome is not None


@dataclass
class LaunchResult:
    outcomes: list[dict[str, Any]]
    complete: bool  # every rank reported
    hang: bool
    ranks: list[dict[str, Any]] = field(default_factory=list)
    log_tails: dict[str, str] = field(default_factory=dict)
    phases: dict[str, float] = field(default_factory=dict)  # where the seconds went (phases())
    # each rank's last progress record (inenv.progress), for ranks that wrote one: where a hung rank stopped
    progress: dict[int, dict[str, Any]] = field(default_factory=dict)


def _read_outcome(workdir: Path, index: int) -> dict[str, Any] | None:
    path = rank.outcome_path(workdir, index)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        return outcome("fail", note=f"rank {index} wrote an unreadable outcome: {exc}", reason_code="harness-error")


def _take_clock(s: RankState) -> None:
    """Move the rank's clock out of its outcome (the outcome stays what the probe returned)."""
    if isinstance(s.outcome, dict):
        clock = s.outcome.pop(rank.CLOCK_KEY, None)
        if isinstance(clock, dict):
            s.clock = {k: float(v) for k, v in clock.items() if isinstance(v, (int, float))}


def _note_exits(states: list[RankState]) -> None:
    """When the launcher first sees each rank gone (for the teardown phase)."""
    now = time.time()
    for s in states:
        if s.exited_at is None and s.proc.poll() is not None:
            s.exited_at = now


def phases(states: list[RankState], finished_at: float, queued_s: float | None = None) -> dict[str, float]:
    """Seconds of one launch by phase, the slowest rank each (pure): ``start`` from spawning a rank to its
    main() (interpreter and the harness's imports); for a gated launch (inenv.gpugate) ``preload`` until
    its preloads were imported and ``queued``, the worker's wait for the GPUs; ``probe`` from main(), or from
    being let go, until the probe returned (its imports of the libraries, CUDA and NCCL set-up, the test);
    ``report`` until the launcher saw the outcome, and ``teardown`` from the last outcome until every rank
    was gone. ``total`` counts everything, the wait included. A phase no rank reached is left out."""
    def slowest(pairs: list[tuple[float | None, float | None]]) -> float | None:
        spans = [b - a for a, b in pairs if a is not None and b is not None]
        return round(max(spans), 3) if spans else None

    out = {
        "start": slowest([(s.spawned_at, s.clock.get("main")) for s in states]),
        "preload": slowest([(s.clock.get("main"), s.clock.get("ready")) for s in states]),
        "queued": None if queued_s is None else round(queued_s, 3),
        "probe": slowest([(s.clock.get("go", s.clock.get("main")), s.clock.get("probe_done")) for s in states]),
        "report": slowest([(s.clock.get("probe_done"), s.reported_at) for s in states]),
    }
    reported = [s.reported_at for s in states if s.reported_at is not None]
    if reported:
        out["teardown"] = round(max(s.exited_at or finished_at for s in states) - max(reported), 3)
    out["total"] = round(finished_at - min(s.spawned_at for s in states), 3) if states else None
    return {k: v for k, v in out.items() if v is not None}


def _kill(states: list[RankState], why: str, sig: int = signal.SIGKILL) -> None:
    for s in states:
        if s.proc.poll() is None:
            s.stopped = s.stopped or why
            with contextlib.suppress(ProcessLookupError):
                s.proc.send_signal(sig)


class GpusBusy(RuntimeError):
    """The gate never opened: another variant held the host's GPUs for the whole wait."""


def launch(location: ProbeLocation, variant: Variant, workdir: Path, gpus: int, timeout_s: float,
           grace_s: float = DEFAULT_GRACE_S, peer_grace_s: float = PEER_GRACE_S,
           failed_grace_s: float = FAILED_PEER_GRACE_S, while_starting: Any = None,
           gate: gpugate.Gate | None = None) -> LaunchResult:
    """Start every rank, wait for their outcomes and exits. ``while_starting`` (no arguments) runs once the
    ranks are started, while they import their libraries: work of the worker's own that then costs no time.
    With a ``gate`` the ranks preload and wait until this worker holds the GPU lock; the soft timeout counts
    from then, and the lock is let go as soon as every outcome is in (or never will be)."""
    with reserved_port() as port:
        try:
            return _launch(location, variant, workdir, gpus, timeout_s, port, grace_s, peer_grace_s,
                           failed_grace_s, while_starting, gate)
        finally:
            if gate is not None:
                gate.close()


def _launch(location: ProbeLocation, variant: Variant, workdir: Path, gpus: int, timeout_s: float, port: int,
            grace_s: float, peer_grace_s: float, failed_grace_s: float, while_starting: Any,
            gate: gpugate.Gate | None) -> LaunchResult:
    states = _start_ranks(location, variant, workdir, gpus, port, while_starting, gate)
    hang = _watch(states, workdir, timeout_s, peer_grace_s, failed_grace_s)
    if gate is not None:
        gate.release()  # the GPUs are done with: the next variant may go while these ranks exit
    # Every outcome is in (or never will be): allow a short exit, then end whatever is left.
    end = time.monotonic() + grace_s
    while time.monotonic() < end and any(s.proc.poll() is None for s in states):
        _note_exits(states)
        time.sleep(0.02)
    _kill(states, f"still running {grace_s:.0f}s after reporting (exit hang)")
    for s in states:
        s.proc.wait()
    finished = time.time()

    return _collect(states, workdir, hang, finished, gate)


def _start_ranks(location: ProbeLocation, variant: Variant, workdir: Path, gpus: int, port: int,
                 while_starting: Any, gate: gpugate.Gate | None) -> list[RankState]:
    """Every rank process started and, with a gate, every rank ready and the GPUs this variant's; on any
    failure the ranks started are ended before it is raised."""
    pycache = bytecode_cache()
    states: list[RankState] = []
    fds = (gate.rank_fd(), gate.ready_fd()) if gate is not None else ()
    try:
        for i in range(variant.ranks):
            env = rank_env(dict(os.environ), variant, location, workdir, i, port,
                           device_for(i, placed_on(variant, gpus), variant.share_gpu), pycache)
            if fds:
                env[gpugate.GO_FD_ENV], env[gpugate.READY_FD_ENV] = (str(fd) for fd in fds)
            with open(rank.log_path(workdir, i), "wb") as log:
                spawned = time.time()
                proc = subprocess.Popen([sys.executable, "-m", "inenv.rank"], env=env, stdin=subprocess.DEVNULL,
                                        stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent,
                                        pass_fds=fds)
            states.append(RankState(i, proc, spawned_at=spawned))
        if gate is not None:
            gate.close_rank_end()
        if while_starting is not None:
            while_starting()
        if gate is not None:
            gate.await_ready(variant.ranks, lambda: all(s.proc.poll() is None for s in states))
        if gate is not None and not gate.open():
            raise GpusBusy(f"another variant held this host's GPUs (lock {gate.path}) for the whole "
                           f"{gate.queue_s:.0f} s this one could wait")
    except BaseException:
        _kill(states, "the launch did not go ahead")
        for s in states:
            s.proc.wait()
        raise

    return states


def _watch(states: list[RankState], workdir: Path, timeout_s: float, peer_grace_s: float,
           failed_grace_s: float) -> bool:
    """Wait for every rank's outcome, ending the ranks a dead or failed peer leaves waiting; True when the
    watchdog ended them (a hang): the soft timeout, or a rank whose progress record (inenv.progress) stood still
    past the stall deadline it declares."""
    deadline = time.monotonic() + timeout_s
    hang = False
    watch = progress.Watch(workdir)
    while True:
        now, wall = time.monotonic(), time.time()
        for s in states:
            if s.outcome is None:
                s.outcome = _read_outcome(workdir, s.index)
                if s.outcome is not None:
                    s.reported_at = wall
            if s.outcome is None and s.ended_at is None and s.proc.poll() is not None:
                s.outcome = _read_outcome(workdir, s.index)  # it may have written just before exiting
                if s.outcome is None:
                    s.ended_at = now
                else:
                    s.reported_at = wall
            _take_clock(s)
        _note_exits(states)
        waiting = [s for s in states if s.outcome is None and s.ended_at is None]
        if not waiting:
            break
        dead = [s.ended_at for s in states if s.ended_at is not None]
        if dead and now - min(dead) > peer_grace_s:
            _kill(waiting, f"ended {peer_grace_s:.0f}s after a peer rank died without reporting")
            break
        failed = [s.reported_at for s in states if s.reported_at is not None and s.outcome
                  and s.outcome.get("status") not in GOOD]
        if failed and wall - min(failed) > failed_grace_s:
            # The others usually wait in a collective for the rank that gave up; the verdict is already `fail`.
            _kill(waiting, f"ended {failed_grace_s:.0f}s after a peer rank reported a failure")
            break
        stalled = watch.stalled([s.index for s in waiting], now)
        if stalled:
            hang = True
            _kill(waiting, "", signal.SIGUSR1)  # faulthandler writes every thread's stack to the log
            time.sleep(STACK_DUMP_WAIT_S)
            for s in waiting:
                rec = stalled.get(s.index)
                s.stopped = s.stopped or (f"{STALLED}: its progress record stood still for {rec.get('stall_s')} s "
                                          f"({progress.describe(rec)})" if rec else "ended with a peer that stalled")
            _kill(waiting, "")
            break
        if now > deadline:
            hang = True
            _kill(waiting, "", signal.SIGUSR1)  # faulthandler writes every thread's stack to the log
            time.sleep(STACK_DUMP_WAIT_S)
            _kill(waiting, f"watchdog: no outcome after {timeout_s:.0f}s")
            break
        time.sleep(0.02)

    return hang


def _collect(states: list[RankState], workdir: Path, hang: bool, finished: float,
             gate: gpugate.Gate | None) -> LaunchResult:
    """The outcome of every rank, made for those that ended without reporting, and what the verdict shows."""
    outcomes: list[dict[str, Any]] = []
    ranks: list[dict[str, Any]] = []
    tails: dict[str, str] = {}
    for s in states:
        code = s.proc.returncode
        # a warm rank (inenv.warm) kept for the next variant has not exited
        shown = KEPT if code is None else signal_name(code) if code < 0 else code
        info: dict[str, Any] = {"rank": s.index, "exit": shown}
        if s.stopped:
            info["stopped"] = s.stopped
        if s.outcome is not None:
            info["status"] = s.outcome.get("status")
            if info["status"] not in (Status.PASS, Status.SKIP) and s.outcome.get("note"):
                info["note"] = str(s.outcome["note"])[:300]
            outcomes.append(s.outcome)
        elif s.ended_at is not None:
            own_log = tail(rank.log_path(workdir, s.index))
            if code < 0:
                made = outcome("fail", note=f"rank {s.index} killed by {signal_name(code)}",
                               evidence={"signal": signal_name(code), "rank_log": own_log})
                made["status"] = Status.CRASH.value  # outcome() only allows what a probe may return
            elif rank.harness_failed(code, own_log):
                last = next((ln for ln in reversed(own_log.splitlines()) if ln.strip()), "")
                made = outcome("fail", note=f"rank {s.index} failed in stackprobe's own rank code: {last[:300]}",
                               reason_code="harness-error", evidence={"exit_code": code, "rank_log": own_log})
                made["status"] = Status.NOT_RUN.value  # the harness failed: the feature was never judged
            else:
                made = outcome("fail", note=f"rank {s.index} exited with code {code} without reporting",
                               evidence={"exit_code": code, "rank_log": own_log})
            info["status"] = made["status"]
            outcomes.append(made)
        if s.outcome is None or s.outcome.get("status") not in (Status.PASS, Status.SKIP):
            text = tail(rank.log_path(workdir, s.index))
            if text.strip():
                tails[f"rank{s.index}"] = text
        ranks.append(info)
    return LaunchResult(outcomes, complete=all(s.outcome is not None for s in states), hang=hang, ranks=ranks,
                        log_tails=tails, phases=phases(states, finished, None if gate is None else gate.waited_s),
                        progress=progress.read_all(workdir, (s.index for s in states)))


# A silent rank whose stack dump shows it inside a JIT build (ninja run by flashinfer's or torch's extension
# builder) never reached the feature: the watchdog measured the compiler, not the collective.
_JIT_BUILD_FRAMES = re.compile(r'File "[^"]*/(?:flashinfer/jit/[^"]*", line \d+ in (?:run_ninja|build)|'
                               r'torch/utils/cpp_extension\.py", line \d+ in _run_ninja_build)')


def ranks_in_jit_build(log_tails: dict[str, str]) -> list[str]:
    """The ranks (log keys) whose last stack dump was taken inside a JIT build."""
    out = []
    for key, text in sorted(log_tails.items()):
        dump = text[text.rfind("most recent call first"):] if "most recent call first" in text else ""
        if dump and _JIT_BUILD_FRAMES.search(dump):
            out.append(key)
    return out


# A feature that refuses a world size says so in its own words; these are the forms seen (torch symmetric
# memory's two-shot "Not implemented for world_size=3", flashinfer's custom allreduce "Odd num gpus is not
# supported for now", its PCIe IPC workspace "world size 3 unsupported; expected one of (2, 4, 8)", and a lookup
# keyed by world size that lacks it, e.g. flashinfer's one-shot heuristics table holding 2, 4 and 8:
# "KeyError: 3"). ``{n}`` is the world size the variant ran at.
_REFUSED = r"(?:not (?:implemented|supported)|unsupported)"
_WORLD_REFUSALS = (r"world[_ ]size\s*(?:=|of|:)?\s*{n}\b[^\n]*?\b" + _REFUSED,
                   _REFUSED + r"[^\n]*?\bworld[_ ]size\s*(?:=|of|:)?\s*{n}\b",
                   r"\bKeyError: {n}\s*$")
_ODD_REFUSAL = r"\bodd (?:num|number)(?: of)? (?:gpus|ranks)\b[^\n]*\bnot supported"


def refuses_world_size(note: str, world: int) -> bool:
    """Whether a rank's failure note is the feature refusing ``world`` ranks (pure)."""
    text = note.strip()
    if world % 2 and re.search(_ODD_REFUSAL, text, re.IGNORECASE):
        return True
    return any(re.search(pattern.format(n=world), text, re.IGNORECASE | re.MULTILINE)
               for pattern in _WORLD_REFUSALS)


def world_size_refused(merged: dict[str, Any], ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """A failed multi-rank verdict whose every failing rank names the feature's refusal of this world size
    gets ``world-size-refused`` (the feature does not run at this size; not a fault of the run), with the
    probe's own code kept in evidence; any other verdict is returned as it is."""
    world = len(ranks)
    failing = [str(r.get("note") or "") for r in ranks if r.get("status") == Status.FAIL.value]
    if (world < 2 or merged.get("status") != Status.FAIL.value or not failing
            or not all(refuses_world_size(n, world) for n in failing)):
        return merged
    out = dict(merged)
    out["evidence"] = {**(merged.get("evidence") or {}), "probe_reason_code": merged.get("reason_code")}
    out["reason_code"] = "world-size-refused"
    out["note"] = f"refuses {world} ranks: {merged.get('note') or failing[0]}"
    return out


def merge(module: ModuleType, result: LaunchResult) -> dict[str, Any]:
    building = ranks_in_jit_build(result.log_tails) if result.hang else []
    if building:
        merged = outcome("fail", reason_code="jit-build-timeout",
                         note=f"the watchdog fired while {', '.join(building)} was still JIT-compiling a module "
                         "(ninja on its stack): the feature was never reached, so this is no verdict on it")
        merged["status"] = Status.NOT_RUN.value
    elif result.hang:
        silent = [r["rank"] for r in result.ranks if "status" not in r]
        where = "; ".join(f"rank {i} {progress.describe(rec)}" for i, rec in sorted(result.progress.items()))
        if any(str(r.get("stopped", "")).startswith(STALLED) for r in result.ranks):
            merged = outcome("fail", note=f"{STALLED}: ranks without an outcome: {silent}; {where}"[:900],
                             reason_code="progress-stalled")
        else:
            merged = outcome("fail", note=f"watchdog fired; ranks without an outcome: {silent}"
                             + (f"; {where}" if where else ""), reason_code="hang")
        merged["status"] = Status.HANG.value
    elif result.complete and hasattr(module, "combine"):
        merged = module.combine(result.outcomes)
    else:
        merged = combine_worst(result.outcomes)
    merged = dict(merged)
    evidence = dict(merged.get("evidence") or {})
    evidence["ranks"] = result.ranks
    if result.log_tails:
        evidence["log_tail"] = result.log_tails
    runtime = next((o.get("evidence", {}).get("runtime") for o in result.outcomes if o.get("evidence", {})
                    .get("runtime")), None)
    if runtime:
        evidence["runtime"] = runtime
    if result.phases:
        evidence["phases"] = result.phases
    if result.progress and merged.get("status") not in GOOD:
        evidence["progress"] = {str(i): rec for i, rec in sorted(result.progress.items())}
    merged["evidence"] = evidence
    return world_size_refused(merged, result.ranks)


def skip_reason(module: ModuleType, variant: Variant, gpus: int) -> tuple[str, str] | None:
    """(reason_code, note) when the variant cannot run here; checked before any rank is launched.

    The planner never makes a variant the probe cannot test, but a worker run by hand can be given one.
    Too few ranks and ranks sharing a GPU the probe needs to itself are refused as `skip`, the verdict for
    "not tested here" (like too few GPUs): not `pass`, since a one-rank allreduce returns its input and
    would pass having tested nothing; and not `fail`, which would blame the stack for a variant that never
    reached the feature."""
    spec = module.SPEC
    least = spec.min_ranks_for(variant)
    if variant.ranks < least:
        return "too-few-ranks", (f"{spec.id} needs at least {least} ranks to test anything (over one rank a "
                                 f"collective returns its input); this variant has {variant.ranks}")
    missing = [m for m in spec.requires if not module_available(m)]
    if missing:
        return "missing-package", f"{', '.join(missing)} not installed in this environment"
    if variant.skip:
        return variant.skip.code, variant.skip.note
    if not spec.needs_gpu:
        return None
    if gpus == 0:
        if spec.runs_without_gpu(variant):
            return None  # it reads what it can and says what it skipped
        return "no-gpu", "no GPU on this host"
    if variant.share_gpu and spec.distinct_gpus:
        return "not-applicable", f"{spec.id} needs a GPU per rank; this variant puts ranks on shared GPUs"
    if variant.ranks > gpus and not variant.share_gpu:
        return "too-few-gpus", f"needs {variant.ranks} GPUs, host has {gpus}"
    return None


def preflight(module: ModuleType, variant: Variant) -> dict[str, Any] | None:
    """The probe's own verdict before any rank starts (its optional ``preflight(variant)``), from what the
    environment's files show without importing the libraries under test; None: launch the ranks. A preflight
    that breaks is no verdict: the ranks then decide as without one."""
    check = getattr(module, "preflight", None)
    if not callable(check):
        return None
    try:
        return check(variant)
    except Exception as exc:
        print(f"inenv.worker: {variant.probe_id} preflight failed, launching the ranks: {exc}", file=sys.stderr)
        return None


def gate_for(spec: Any, gpus: int, queue_s: float | None, env: dict[str, str] | None = None,
             shared: bool = False) -> gpugate.Gate | None:
    """The GPU gate of a launch: only a probe that uses GPUs, on a host that has them, when the host named a
    lock file (inenv.gpugate.ENV); ``shared``: the variant times nothing (inenv.probe.shallow), so it holds the
    lock beside others of its kind."""
    env = os.environ if env is None else env
    path = env.get(gpugate.ENV, "")
    if not path or not spec.needs_gpu or gpus <= 0:
        return None
    alone = env.get(gpugate.ALONE_ENV) == "1"  # the run asked for every variant to have the GPUs alone
    return gpugate.Gate(path, gpugate.DEFAULT_QUEUE_S if queue_s is None else queue_s, shared=shared and not alone)


def scratch_root() -> str | None:
    """The folder the host made for this worker's scratch (removed by the host when the worker ends), when it
    exists here (inside a container the host's path does not: the container's own temporary folder serves)."""
    root = os.environ.get(SCRATCH_ENV)
    return root if root and os.path.isdir(root) else None


Launcher = Callable[..., LaunchResult]  # launch()'s signature: how a variant's ranks are had


def run_variant(probe_id: str, variant: Variant | None = None, gpus: int | None = None,
                timeout_s: float | None = None, workdir: Path | None = None,
                keep_workdir: bool = False, queue_s: float | None = None,
                launcher: Callable[[ModuleType], Launcher] | None = None,
                env_versions: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run one variant (default: the probe's smallest default world size, no params) and merge its ranks.
    ``queue_s``: how long it may wait for the host's GPUs (inenv.gpugate), not counted in its duration.
    ``launcher``: given the probe's module, what starts its ranks (default :func:`launch`: fresh processes;
    inenv.warm keeps them between variants). ``env_versions``: the environment's versions when already read
    (a serving worker reads them once)."""
    started = time.monotonic()
    waited = 0.0
    location, module = find(probe_id)
    variant = variant or Variant(probe_id, min(module.SPEC.ranks))
    gpus = envinfo.gpu_count_hint() if gpus is None else gpus
    skipped = skip_reason(module, variant, gpus)
    env_versions = dict(env_versions or {})

    def read_versions() -> None:
        if not env_versions:
            env_versions.update(envinfo.versions())  # runs nvcc: done while the ranks import their libraries

    decided = outcome("skip", note=skipped[1], reason_code=skipped[0]) if skipped else preflight(module, variant)
    if decided is not None:
        result = decided
    else:
        own = workdir is None
        wd = Path(tempfile.mkdtemp(prefix=f"stackprobe-{probe_id}-", dir=scratch_root())) if own else workdir
        wd.mkdir(parents=True, exist_ok=True)
        gate = gate_for(module.SPEC, gpus, queue_s, shared=untimed(module.SPEC, variant))
        try:
            # A probe that needs no GPU gets no device (ranks may outnumber GPUs); all GPUs stay visible.
            start = launch if launcher is None else launcher(module)
            launched = start(location, variant, wd, gpus if module.SPEC.needs_gpu else 0,
                             timeout_s or module.SPEC.timeout_s, while_starting=read_versions, gate=gate)
            result = merge(module, launched)
        except GpusBusy as exc:
            result = outcome("skip", note=str(exc), reason_code="gpus-busy")
            result["status"] = Status.NOT_RUN.value
        finally:
            waited = gate.waited_s if gate is not None else 0.0
            if own and not keep_workdir:
                shutil.rmtree(wd, ignore_errors=True)
    if not env_versions:
        read_versions()
    result.setdefault("evidence", {})["env"] = env_versions
    result["evidence"]["gpus_visible"] = gpus
    if decided is None and gate is not None and gate.shared:
        result["evidence"]["gpu_lock"] = "shared"  # it may have run beside other variants that time nothing
    result["duration_s"] = round(time.monotonic() - started - waited, 3)
    return result


def emit(payload: dict[str, Any]) -> None:
    sys.stdout.write(RESULT_MARKER + json.dumps(payload, sort_keys=True, default=str) + "\n")
    sys.stdout.flush()


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m inenv.worker", description=__doc__.split("\n")[0])
    p.add_argument("--inspect", action="store_true", help="print the environment's versions and GPU facts")
    p.add_argument("--probe", help="probe id")
    p.add_argument("--variant", help="Variant.to_json() as JSON (default: the probe's smallest default world "
                   "size, no params)")
    p.add_argument("--gpus", type=int, help="GPUs visible here (default: ask nvidia-smi)")
    p.add_argument("--timeout", type=float, help="soft timeout in seconds (default: the probe's)")
    p.add_argument("--queue", type=float, help="seconds it may wait for the host's GPUs when STACKPROBE_GPU_LOCK "
                   f"names a lock file (default {gpugate.DEFAULT_QUEUE_S:g})")
    p.add_argument("--workdir", type=Path, help="scratch directory (default: a fresh temporary one)")
    p.add_argument("--keep-workdir", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if args.inspect:
        keep_bytecode()  # it imports torch, as a rank does
        emit(envinfo.inspect_runtime())
        return 0
    if not args.probe:
        print("inenv.worker: give --probe ID (or --inspect)", file=sys.stderr)
        return 2
    try:
        variant = Variant.from_json(json.loads(args.variant)) if args.variant else None
    except (ValueError, KeyError, TypeError) as exc:
        print(f"inenv.worker: --variant is not a Variant JSON object: {exc}", file=sys.stderr)
        return 2
    try:
        result = run_variant(args.probe, variant, args.gpus, args.timeout, args.workdir, args.keep_workdir,
                             args.queue)
    except ProbeNotFound as exc:
        print(f"inenv.worker: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # the harness itself failed: still one parseable line for the host
        result = outcome("fail", note=f"harness error: {type(exc).__name__}: {exc}", reason_code="harness-error",
                         evidence={"traceback": traceback.format_exc()[-rank.TRACEBACK_TAIL_CHARS:]})
    emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Warm ranks: a serving worker that keeps its rank processes from one variant to the next.

    python -m inenv.warm

reads one request per line on stdin (:func:`request_line`) and prints for each the one result line
``python -m inenv.worker`` prints for that variant, in order; it ends, and ends every rank it kept, when stdin
closes. In-environment side: standard library only.

What is kept: per group key (:func:`group_key`: the world size, each rank's device and the variant's
``env.NAME`` params, which libraries read once per process) a group of ``inenv.rank`` processes that have
imported the probe's libraries and made their CUDA context. Each variant still gets a rendezvous on a port
of its own and a process group of its own, torn down after its outcome. What makes a group end instead of
serving the next variant (the next one then starts fresh ranks, as ``inenv.worker`` does):

- the variant did not end well: a rank failed, crashed, exited, hung (the soft timeout), a peer was silent,
  or a rank was still busy ``grace_s`` after the last outcome;
- a rank finds it unfit (inenv.rank.unusable): the variant changed the process's environment, imported a
  module that keeps process-wide state (symmetric memory, custom allreduce workspaces), left a thread
  running, or the device reports an error, or the group cannot be destroyed;
- the variant left a process running (ended by its token: inenv.lifetime.VARIANT_TOKEN_ENV);
- the probe declares ``ProbeSpec.fresh_ranks`` (its variants run in fresh ranks, as one-shot ones do);
- the groups kept hold more than ``STACKPROBE_WARM_RANKS`` ranks (16): the least recently used ends.

Whatever ends a group, the variant's verdict is made from its ranks' outcomes, exits and logs exactly as
``inenv.worker`` makes it (its ``_watch``, ``_collect`` and ``merge``). The evidence gains ``warm``: whether
the ranks were reused, the group's run count, their pids and, when the group ended, why.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
import time
import traceback
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, BinaryIO

from inenv import forked, gpugate, rank, worker
from inenv.lifetime import VARIANT_TOKEN_ENV, die_with_parent, end_all_with_env
from inenv.probe import LEVEL_ENV, Variant, outcome
from inenv.registry import ProbeLocation, ProbeNotFound

# Variant params a library reads each time it is used, never once per process: no part of a group's key.
PER_CALL_ENV = frozenset({worker.ENV_PARAM_PREFIX + LEVEL_ENV})
RANKS_LIMIT_ENV = "STACKPROBE_WARM_RANKS"
DEFAULT_RANKS_LIMIT = 16
LEFTOVERS_KEY = "_leftovers"  # in a served result: processes the variant left, ended by the server
END_WAIT_S = 1.0  # a group ended between variants: how long its idle ranks get to leave on their own
GroupKey = tuple[int, tuple[int | None, ...], tuple[tuple[str, str], ...]]


def request_line(variant: Variant, gpus: int | None, timeout_s: float | None, queue_s: float | None) -> str:
    """One request of the serving worker: what ``inenv.worker``'s --variant, --gpus, --timeout and --queue say."""
    return json.dumps({"probe": variant.probe_id, "variant": variant.to_json(), "gpus": gpus,
                       "timeout": timeout_s, "queue": queue_s}) + "\n"


def group_key(variant: Variant, devices: list[int | None]) -> GroupKey:
    """Which variants may share rank processes: the same world size, the same device per rank, and the same
    ``env.NAME`` params (but PER_CALL_ENV)."""
    env = tuple(sorted((n, v) for n, v in variant.params
                       if n.startswith(worker.ENV_PARAM_PREFIX) and n not in PER_CALL_ENV))
    return variant.ranks, tuple(devices), env


@dataclass
class WarmRank:
    """One kept rank: its process (requests on its stdin) and its reply pipe's read end."""

    proc: subprocess.Popen[bytes]
    reply: int
    spawned_at: float = 0.0
    buf: bytes = b""
    ready: bool = False
    idle: dict[str, Any] | None = None

    def send(self, line: str) -> bool:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(line.encode())
            self.proc.stdin.flush()
            return True
        except (OSError, ValueError):
            return False

    def read(self) -> None:
        """Take what the rank replied so far (``ready``, ``idle``)."""
        while True:
            try:
                chunk = os.read(self.reply, 65536)
            except OSError:  # nothing more now (non-blocking), or the pipe is gone
                break
            if not chunk:
                break
            self.buf += chunk
        while b"\n" in self.buf:
            line, self.buf = self.buf.split(b"\n", 1)
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if message.get("ev") == "ready":
                self.ready = True
            elif message.get("ev") == "idle":
                self.idle = message

    def begin(self) -> None:
        self.ready, self.idle = False, None


@dataclass
class Group:
    key: GroupKey
    ranks: list[WarmRank]
    runs: int = 0

    def alive(self) -> bool:
        return all(r.proc.poll() is None for r in self.ranks)

    def pids(self) -> list[int]:
        return [r.proc.pid for r in self.ranks]

    def end(self, wait_s: float = END_WAIT_S) -> None:
        """Close every rank's requests (an idle one leaves), then kill what is left; every process reaped."""
        for r in self.ranks:
            with contextlib.suppress(OSError, ValueError):
                if r.proc.stdin is not None:
                    r.proc.stdin.close()
        until = time.monotonic() + wait_s
        while time.monotonic() < until and any(r.proc.poll() is None for r in self.ranks):
            time.sleep(0.01)
        for r in self.ranks:
            if r.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    r.proc.kill()
            r.proc.wait()
            with contextlib.suppress(OSError):
                os.close(r.reply)
            r.reply = -1


def _wait_replies(ranks: list[WarmRank], done: Callable[[], bool], limit_s: float) -> None:
    """Read the ranks' replies until ``done()`` or ``limit_s`` passed."""
    until = time.monotonic() + limit_s
    while True:
        for r in ranks:
            r.read()
        left = until - time.monotonic()
        if done() or left <= 0:
            return
        fds = [r.reply for r in ranks if r.reply >= 0]
        if fds:
            select.select(fds, [], [], min(left, 0.05))
        else:
            time.sleep(min(left, 0.05))


@dataclass
class Pool:
    """The groups a serving worker keeps, least recently used first."""

    limit: int = field(default_factory=lambda: int(os.environ.get(RANKS_LIMIT_ENV) or DEFAULT_RANKS_LIMIT))
    groups: OrderedDict[GroupKey, Group] = field(default_factory=OrderedDict)
    last: dict[str, Any] = field(default_factory=dict)  # the last warm launch, for its evidence
    fork: bool = field(default_factory=forked.enabled)  # new groups' ranks forked from this worker
    fork_refused: str = ""  # why this worker cannot fork them (inenv.forked.prepare), once asked
    _fork_ready: bool = False

    def can_fork(self) -> bool:
        """Whether a new group's ranks are forked from this worker: torch is imported here when the first group
        starts, for every rank forked later, and before each fork the worker is checked again (a CUDA context
        or a thread made since would not survive it); once refused, never again."""
        if self.fork and not self.fork_refused:
            self.fork_refused = forked.prepare(() if self._fork_ready else forked.PRELOAD)
            self._fork_ready = not self.fork_refused
        return self.fork and self._fork_ready

    def pids(self) -> frozenset[int]:
        return frozenset(pid for g in self.groups.values() for pid in g.pids())

    def close(self) -> None:
        while self.groups:
            self.groups.popitem(last=False)[1].end()

    def launcher(self, module: ModuleType) -> worker.Launcher:
        """How ``module``'s variants get their ranks: kept ones, or fresh ones when the probe says so."""
        return worker.launch if getattr(module.SPEC, "fresh_ranks", False) else self.launch

    def _take(self, key: GroupKey) -> Group | None:
        group = self.groups.pop(key, None)
        if group is not None and not group.alive():
            group.end()
            return None
        return group

    def _keep(self, group: Group) -> None:
        self.groups[group.key] = group
        while len(self.groups) > 1 and sum(len(g.ranks) for g in self.groups.values()) > self.limit:
            self.groups.popitem(last=False)[1].end()

    def launch(self, location: ProbeLocation, variant: Variant, workdir: Path, gpus: int, timeout_s: float,
               grace_s: float = worker.DEFAULT_GRACE_S, peer_grace_s: float = worker.PEER_GRACE_S,
               failed_grace_s: float = worker.FAILED_PEER_GRACE_S, while_starting: Any = None,
               gate: gpugate.Gate | None = None) -> worker.LaunchResult:
        """:func:`inenv.worker.launch` on kept ranks: the same watch, collection and phases."""
        with worker.reserved_port() as port:
            try:
                return self._launch(location, variant, workdir, gpus, timeout_s, port, grace_s, peer_grace_s,
                                    failed_grace_s, while_starting, gate)
            finally:
                if gate is not None:
                    gate.close()

    def _launch(self, location: ProbeLocation, variant: Variant, workdir: Path, gpus: int, timeout_s: float,
                port: int, grace_s: float, peer_grace_s: float, failed_grace_s: float, while_starting: Any,
                gate: gpugate.Gate | None) -> worker.LaunchResult:
        devices = [worker.device_for(i, worker.placed_on(variant, gpus), variant.share_gpu)
                   for i in range(variant.ranks)]
        pycache = worker.bytecode_cache()
        envs = [worker.rank_env(dict(os.environ), variant, location, workdir, i, port, devices[i], pycache)
                for i in range(variant.ranks)]
        key = group_key(variant, devices)
        group = self._take(key)
        reused = group is not None
        if group is None:
            group = _spawn(key, envs, workdir, fork=self.can_fork())
            spawned = [r.spawned_at for r in group.ranks]
        else:
            spawned = [time.time()] * len(group.ranks)
        states = [worker.RankState(i, r.proc, spawned_at=spawned[i]) for i, r in enumerate(group.ranks)]
        try:
            for i, r in enumerate(group.ranks):
                r.begin()
                r.send(json.dumps({"env": envs[i], "log": str(rank.log_path(workdir, i)),
                                   "gated": gate is not None}) + "\n")
            if while_starting is not None:
                while_starting()
            if gate is not None:
                gate.start_wait()
                _wait_replies(group.ranks, lambda: all(r.ready for r in group.ranks) or not group.alive(),
                              gate.queue_s)
                if not gate.open():
                    raise worker.GpusBusy(f"another variant held this host's GPUs (lock {gate.path}) for the "
                                          f"whole {gate.queue_s:.0f} s this one could wait")
                for r in group.ranks:
                    r.send("go\n")
        except BaseException:
            worker._kill(states, "the launch did not go ahead")
            group.end(0.0)
            raise

        hang = worker._watch(states, workdir, timeout_s, peer_grace_s, failed_grace_s)
        if gate is not None:
            gate.release()
        pairs = list(zip(states, group.ranks, strict=True))

        def settled() -> bool:
            now = time.time()
            for s, r in pairs:
                if r.idle is not None and s.exited_at is None:
                    s.exited_at = now  # the rank's part is over: its teardown phase ends here
            worker._note_exits(states)
            return all(r.idle is not None or s.proc.poll() is not None for s, r in pairs)

        _wait_replies(group.ranks, settled, grace_s)
        worker._kill([s for s, r in pairs if r.idle is None],
                     f"still running {grace_s:.0f}s after reporting (exit hang)")
        whys = sorted({str(r.idle.get("why")) for r in group.ranks if r.idle and r.idle.get("why")})
        keep = not hang and group.alive() and all(r.idle and r.idle.get("reuse") for r in group.ranks)
        if not keep:
            group.end()
        finished = time.time()
        result = worker._collect(states, workdir, hang, finished, gate)
        group.runs += 1
        self.last = {"reused": reused, "run": group.runs, "pids": group.pids(),
                     "forked": any(isinstance(r.proc, forked.Forked) for r in group.ranks)}
        if self.fork_refused:
            self.last["fork_refused"] = self.fork_refused
        elif self.last["forked"]:
            self.last["worker_threads"] = forked.native_threads()  # a library's pool the forks went past
        if keep:
            self._keep(group)
        else:
            self.last["ended"] = "; ".join(whys) or "the variant did not end well"
        return result


def _spawn(key: GroupKey, envs: list[dict[str, str]], workdir: Path, fork: bool = False) -> Group:
    """A group's rank processes, started with the first variant's environment and logs; each waits for its
    first request. ``fork``: forked from this process (inenv.forked), which imported torch for them, instead of
    new interpreters."""
    ranks: list[WarmRank] = []
    try:
        for i, env in enumerate(envs):
            read, write = os.pipe()
            os.set_blocking(read, False)
            try:
                spawned = time.time()
                if fork:
                    proc: Any = forked.fork_rank(env, str(rank.log_path(workdir, i)), write)
                else:
                    with open(rank.log_path(workdir, i), "wb") as log:
                        proc = subprocess.Popen([sys.executable, "-m", "inenv.rank"],
                                                env={**env, rank.ENV_REPLY_FD: str(write)}, stdin=subprocess.PIPE,
                                                stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent,
                                                pass_fds=(write,))
            except BaseException:
                os.close(read)
                raise
            finally:
                os.close(write)
            ranks.append(WarmRank(proc, read, spawned))
    except BaseException:
        Group(key, ranks).end(0.0)
        raise
    return Group(key, ranks)


def serve(requests: BinaryIO) -> int:
    """Answer every request line until ``requests`` ends; 2 for a request that is not one (or names no probe),
    as ``inenv.worker`` exits 2 for such arguments."""
    pool = Pool()
    versions: dict[str, Any] = {}
    try:
        for line in iter(requests.readline, b""):
            try:
                request = json.loads(line)
                variant = Variant.from_json(request["variant"])
                gpus = None if request.get("gpus") is None else int(request["gpus"])
                timeout = None if request.get("timeout") is None else float(request["timeout"])
                queue = None if request.get("queue") is None else float(request["queue"])
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                print(f"inenv.warm: a request is not a variant request: {exc}", file=sys.stderr)
                return 2
            token = uuid.uuid4().hex
            os.environ[VARIANT_TOKEN_ENV] = token  # everything started for this variant inherits it
            pool.last = {}
            try:
                result = worker.run_variant(variant.probe_id, variant, gpus, timeout, queue_s=queue,
                                            launcher=pool.launcher, env_versions=versions)
            except ProbeNotFound as exc:
                print(f"inenv.worker: {exc}", file=sys.stderr)
                return 2
            except Exception as exc:  # the harness itself failed: still one parseable line for the host
                result = outcome("fail", note=f"harness error: {type(exc).__name__}: {exc}",
                                 reason_code="harness-error",
                                 evidence={"traceback": traceback.format_exc()[-rank.TRACEBACK_TAIL_CHARS:]})
            env = (result.get("evidence") or {}).get("env")
            if not versions and isinstance(env, dict):
                versions.update(env)
            leftovers = end_all_with_env(VARIANT_TOKEN_ENV, token, pool.pids())
            if leftovers:
                result[LEFTOVERS_KEY] = leftovers
                pool.close()  # a rank's child outlived the variant: no rank of it is trusted further
            if pool.last:
                result.setdefault("evidence", {})["warm"] = pool.last
            worker.emit(result)
    finally:
        pool.close()
    return 0


def main() -> int:
    return serve(sys.stdin.buffer)


if __name__ == "__main__":
    sys.exit(main())

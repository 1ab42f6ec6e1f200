"""The GPU gate (inenv.gpugate), for real: the lock between workers, ranks that start and preload while
another variant holds the GPUs and run only once they are theirs, a worker that never gets the GPUs, the
runner starting the next GPU variant ahead, and durations that leave out the wait."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from checks.run import classify
from checks.run.executor import LocalExecutor, for_run, hard_timeout, worker_args
from checks.run.isolate import ProcessOutcome
from checks.run.plan import CellTarget, Decided, WorkItem
from checks.run.runner import pick
from common import reasons
from inenv import gpugate, worker
from inenv.probe import ProbeSpec, Variant
from inenv.status import Status
from tests.checks_helpers import ROOT, pids_with_env, run_worker
from tests.test_worker_floor import FLOOR_FIXTURES, floor_env


def gate_env(tmp_path: Path, tag: str, hold_s: float, **extra: str) -> dict[str, str]:
    env = floor_env(STACKPROBE_TEST_GATE_LOG=str(tmp_path / "gate.log"), STACKPROBE_TEST_TAG=tag,
                    STACKPROBE_TEST_HOLD_S=str(hold_s), **extra)
    env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], str(FLOOR_FIXTURES / "preload")])
    return env


def events(log: Path) -> dict[tuple[str, str], list[float]]:
    """(tag, event) -> the times it was logged, one per rank."""
    out: dict[tuple[str, str], list[float]] = {}
    for line in log.read_text().splitlines():
        tag, event, _rank, stamp = line.split()
        out.setdefault((tag, event), []).append(float(stamp))
    return out


# --- the lock ---------------------------------------------------------------------------------------------------
def test_one_holder_at_a_time_and_a_bounded_wait(tmp_path: Path) -> None:
    lock = str(tmp_path / "gpu.lock")
    first, second = gpugate.Gate(lock), gpugate.Gate(lock, queue_s=0.3)
    assert first.open()  # no holder: it opens (the wait below is the second gate's alone)
    started = time.monotonic()
    assert not second.open()  # held all along: it gives up after its wait, while the holder still holds
    assert time.monotonic() - started >= 0.3 and second.waited_s >= 0.3
    first.release()
    assert second.open()
    second.close()


def test_variants_that_time_nothing_hold_the_lock_together_and_a_timed_one_alone(tmp_path: Path) -> None:
    """Two shared gates (variants that time nothing) hold the lock at once; an exclusive one (a variant that
    times) waits for both to let go, and while it holds the lock no shared gate gets it."""
    lock = str(tmp_path / "gpu.lock")
    a, b = gpugate.Gate(lock, shared=True), gpugate.Gate(lock, queue_s=0.2, shared=True)
    timed = gpugate.Gate(lock, queue_s=0.2)
    assert a.open() and b.open()
    assert not timed.open()  # held shared by two: the timed variant does not run beside them
    a.release()
    assert not timed.open()
    b.release()
    assert timed.open()
    late = gpugate.Gate(lock, queue_s=0.2, shared=True)
    assert not late.open()  # the timed one has the GPUs alone
    timed.release()
    assert late.open()
    for g in (a, b, timed, late):
        g.close()
    assert worker.gate_for(ProbeSpec("g", "g", "f"), 1, None, {gpugate.ENV: lock}, shared=True).shared
    alone = {gpugate.ENV: lock, gpugate.ALONE_ENV: "1"}  # --gpu-alone: exclusive whatever the variant
    assert not worker.gate_for(ProbeSpec("g", "g", "f"), 1, None, alone, shared=True).shared


def test_a_waiting_gate_goes_as_soon_as_the_holder_lets_go(tmp_path: Path) -> None:
    lock = str(tmp_path / "gpu.lock")
    holder, waiter = gpugate.Gate(lock), gpugate.Gate(lock, queue_s=10)
    assert holder.open()
    released: list[float] = []

    def release() -> None:
        released.append(time.monotonic())
        holder.release()

    started = time.monotonic()
    threading.Timer(0.4, release).start()
    assert waiter.open()
    opened = time.monotonic()
    assert released and released[0] <= opened < started + 10  # after the release, before its own 10 s ended
    waiter.close()


def test_a_lock_that_cannot_be_used_is_an_error_not_a_free_pass(tmp_path: Path) -> None:
    with pytest.raises(gpugate.GateError, match="cannot open the GPU lock"):
        gpugate.Gate(str(tmp_path / "missing-folder" / "gpu.lock")).open()


def test_ranks_hold_until_the_gate_opens_and_go_when_their_worker_dies(tmp_path: Path) -> None:
    for how in ("open", "die"):
        gate = gpugate.Gate(str(tmp_path / f"{how}.lock"))
        fd = gate.rank_fd()
        code = ("import os, time, sys; from inenv import gpugate; t = time.time(); "
                "gpugate.wait_for_go(dict(os.environ)); print(time.time() - t)")
        rank = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(ROOT),
                                gpugate.GO_FD_ENV: str(fd)}, pass_fds=(fd,), stdout=subprocess.PIPE, text=True)
        gate.close_rank_end()
        time.sleep(0.5)
        assert rank.poll() is None  # still held
        if how == "open":
            assert gate.open()
        gate.close()  # a worker that dies closes its write end too
        out, _ = rank.communicate(timeout=10)
        assert float(out) >= 0.3  # it waited (its own start-up took part of the 0.5 s)


# --- the worker ------------------------------------------------------------------------------------------------
def test_the_next_variant_starts_up_while_one_runs_and_runs_only_after_it(tmp_path: Path) -> None:
    lock = str(tmp_path / "gpu.lock")
    results: dict[str, dict] = {}

    def work(tag: str) -> None:
        env = gate_env(tmp_path, tag, 1.5, **{gpugate.ENV: lock})
        results[tag] = run_worker("t-gated", ranks=2, env=env, extra_args=["--gpus", "2", "--queue", "60"])[0]

    first = threading.Thread(target=work, args=("a",))
    first.start()
    time.sleep(0.3)
    work("b")
    first.join()
    ev = events(tmp_path / "gate.log")
    assert results["a"]["status"] == results["b"]["status"] == "pass"
    # b's ranks had imported their preload while a still ran, and ran only after a's ranks were done
    assert max(ev["b", "preload"]) < min(ev["a", "run-end"])
    assert min(ev["b", "run-start"]) >= max(ev["a", "run-end"])
    queued = results["b"]["evidence"]["phases"]["queued"]
    assert queued > 0.8 and results["b"]["evidence"]["phases"]["preload"] < queued
    assert results["b"]["duration_s"] < 1.5 + queued - 0.5  # the wait is not the variant's time


def test_a_variant_asks_for_the_gpus_only_once_its_ranks_are_ready(tmp_path: Path) -> None:
    """The lock is free, and the first worker's ranks still import (2 s): the second one, started after it
    but ready first, takes the GPUs, so they never wait on an import while a ready variant waits."""
    lock = str(tmp_path / "gpu.lock")
    results: dict[str, dict] = {}

    def work(tag: str, preload_s: float) -> None:
        env = gate_env(tmp_path, tag, 0.5, STACKPROBE_TEST_PRELOAD_S=str(preload_s), **{gpugate.ENV: lock})
        results[tag] = run_worker("t-gated", ranks=2, env=env, extra_args=["--gpus", "2", "--queue", "60"])[0]

    slow = threading.Thread(target=work, args=("slow", 2.0))
    slow.start()
    time.sleep(0.3)
    work("fast", 0.0)
    slow.join()
    ev = events(tmp_path / "gate.log")
    assert results["slow"]["status"] == results["fast"]["status"] == "pass", results
    assert max(ev["fast", "run-end"]) <= min(ev["slow", "run-start"])  # the ready one went first
    assert min(ev["slow", "run-start"]) >= max(ev["slow", "preload"])
    assert results["fast"]["evidence"]["phases"]["queued"] < 1.0  # it found the lock free


def test_a_rank_that_dies_in_its_preload_ends_the_ready_wait(tmp_path: Path) -> None:
    gate = gpugate.Gate(str(tmp_path / "gpu.lock"), queue_s=30)
    go, ready = gate.rank_fd(), gate.ready_fd()
    code = ("import os; from inenv import gpugate; env = dict(os.environ); "
            "gpugate.say_ready(env) if env.get('RANK') == '0' else os._exit(3)")
    ranks = [subprocess.Popen([sys.executable, "-c", code], pass_fds=(go, ready),
                              env={**os.environ, "PYTHONPATH": str(ROOT), "RANK": str(i),
                                   gpugate.GO_FD_ENV: str(go), gpugate.READY_FD_ENV: str(ready)}) for i in (0, 1)]
    gate.close_rank_end()
    started = time.monotonic()
    assert gate.await_ready(2) == 1  # one said ready, the other died: the pipe ended, no 30 s wait
    assert time.monotonic() - started < 30 and ranks[1].wait(timeout=30) == 3  # before its 30 s; that rank died
    assert gate.open()
    gate.close()
    for r in ranks:
        r.wait(timeout=10)


def test_ranks_join_the_rendezvous_while_they_wait_and_the_group_it_forms_is_whole(tmp_path: Path) -> None:
    lock = tmp_path / "gpu.lock"
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another variant has the GPUs for 8 s (the ranks' imports take 1-5)
        threading.Timer(8.0, lambda: fcntl.flock(held, fcntl.LOCK_UN)).start()
        gated, _ = run_worker("t-gated-dist", ranks=2, env=floor_env(**{gpugate.ENV: str(lock)}),
                              extra_args=["--gpus", "2", "--queue", "60"])
    assert gated["status"] == "pass", gated
    assert gated["evidence"]["sum"] == 3  # 1 + 2: every rank is in the group formed on the early store
    assert gated["evidence"]["joined_before"] == [True, True]
    assert gated["evidence"]["phases"]["total"] > 7.5, gated["evidence"]["phases"]  # it ran once the lock was free
    # not gated (no lock named): the probe joins at init_dist, as before, to the same group
    plain, _ = run_worker("t-gated-dist", ranks=2, env=floor_env(), extra_args=["--gpus", "2"])
    assert plain["status"] == "pass" and plain["evidence"]["sum"] == 3, plain
    assert plain["evidence"]["joined_before"] == [False, False]


def test_a_worker_that_never_gets_the_gpus_says_so_and_runs_nothing(tmp_path: Path) -> None:
    lock = tmp_path / "gpu.lock"
    with open(lock, "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        env = gate_env(tmp_path, "c", 0, **{gpugate.ENV: str(lock)})
        result, token = run_worker("t-gated", ranks=2, env=env, extra_args=["--gpus", "2", "--queue", "1"])
    assert result["status"] == "not-run" and result["reason_code"] == "gpus-busy"
    assert "whole 1 s" in result["note"]
    ev = events(tmp_path / "gate.log") if (tmp_path / "gate.log").exists() else {}
    assert ("c", "run-start") not in ev
    assert pids_with_env(token) == []  # its held ranks were ended


def test_without_a_lock_or_a_gpu_there_is_no_gate() -> None:
    gpu = ProbeSpec("g", "g", "f")
    lock = {gpugate.ENV: "/tmp/x.lock"}
    assert worker.gate_for(gpu, 2, None, lock) is not None
    assert worker.gate_for(gpu, 2, 5.0, lock).queue_s == 5.0
    assert worker.gate_for(gpu, 0, None, lock) is None
    assert worker.gate_for(ProbeSpec("c", "c", "f", needs_gpu=False), 2, None, lock) is None
    assert worker.gate_for(gpu, 2, None, {}) is None


# --- the host side ---------------------------------------------------------------------------------------------
def test_the_host_waits_for_the_gate_and_counts_only_the_variant() -> None:
    assert worker_args(Variant("g", 2), 2, 60.0, 90.0)[-2:] == ["--queue", "90"]
    assert "--queue" not in worker_args(Variant("g", 2), 2, 60.0)
    assert hard_timeout(60.0, 90.0) == hard_timeout(60.0) + 90.0
    result = {"status": "pass", "note": "", "reason_code": "", "evidence": {"phases": {"queued": 2.25}},
              "metrics": {}, "remediation": "", "duration_s": 1.0}
    p = ProcessOutcome(returncode=0, timed_out=False, result=result, result_error="", stdout_tail="",
                       stderr_tail="", duration_s=3.5, leftovers=[])
    assert classify.from_process(p, reasons.default(), 60).duration_s == 1.25


def test_pick_starts_the_next_gpu_variant_ahead_in_plan_order_only() -> None:
    cpu, gpu = ProbeSpec("c", "c", "f", needs_gpu=False), ProbeSpec("g", "g", "f", needs_gpu=True)
    a, b = CellTarget("cella", "resolved"), CellTarget("cellb", "resolved")
    g1, g2, g3 = (WorkItem(a, gpu, Variant("g", n), 60.0) for n in (1, 2, 3))
    c1, gb = WorkItem(a, cpu, Variant("c", 1), 60.0), WorkItem(b, gpu, Variant("g", 1), 60.0)
    assert pick([g2, g3], [g1], 1) is None  # without the gate: one GPU variant at a time, as before
    assert pick([g2, g3], [g1], 1, ahead=1) is g2  # same cell, beyond the job count: it waits at the gate
    assert pick([g3], [g1, g2], 4, ahead=1) is None  # one ahead at most
    assert pick([g3], [g1, g2], 4, ahead=2) is g3  # two ahead: both wait at the gate
    g4 = WorkItem(a, gpu, Variant("g", 4), 60.0)
    assert pick([g4], [g1, g2, g3], 4, ahead=2) is None
    assert pick([c1, g2], [g1], 4, ahead=2) is None  # the next in plan order is no GPU variant: it waits
    assert pick([gb], [g1], 1, ahead=1) is gb
    assert pick([g2], [g1], 1, ahead=1) is g2


def test_variants_decided_at_plan_time_are_recorded_first_in_one_write(tmp_path: Path) -> None:
    """A variant decided at plan time (ranks=4 on a 2-GPU host) never stands between two GPU variants: the
    run records every such variant before the first one starts, with one append for all of them."""
    from checks.results.provenance import Provenance
    from checks.results.store import RunStore, read_file
    from checks.run.runner import Hooks, Work, begin

    gpu = ProbeSpec("g", "g", "f", needs_gpu=True)
    a = CellTarget("cu130-torch2.11.0-sglnone-fi0.6.18", "resolved")
    g1, g2 = (WorkItem(a, gpu, Variant("g", n), 60.0) for n in (1, 2))
    decided = [WorkItem(a, gpu, Variant("g", n), 60.0, Decided(Status.SKIP, "too-few-gpus", f"needs {n} GPUs"))
               for n in (4, 8)]
    store = RunStore(tmp_path, "h200x2-0123abcd", "20261201T000000Z-abcd")
    writes: list[int] = []
    real = store.append_all
    store.append_all = lambda rs: (writes.append(len(rs)), real(rs))[1]  # type: ignore[method-assign]
    started: list[str] = []
    work = Work([g1, decided[0], g2, decided[1]], store, reasons.default(), 2,
                codes={"g": Provenance("0.1.0", "0" * 40, False, "0" * 16)})
    rec, pending = begin(False, "full", work,
                         Hooks(on_start=lambda it: started.append(it.variant.key)))
    assert pending == [g1, g2]
    assert started == ["ranks=4", "ranks=8"] and writes == [0, 2]  # nothing carried, both decided in one write
    assert [(r.variant, r.verdict.status, r.verdict.reason_code) for r in rec.report.results] == [
        ("ranks=4", Status.SKIP, "too-few-gpus"), ("ranks=8", Status.SKIP, "too-few-gpus")]
    assert [r.variant for r in read_file(store.results_path)[0]] == ["ranks=4", "ranks=8"]


def test_the_runner_starts_gpu_variants_ahead_and_they_take_turns(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from checks.results.provenance import checkout, probe_hashes
    from checks.results.store import RunStore
    from checks.run.options import RunOptions
    from checks.run.plan import plan_work
    from checks.run.runner import Work, execute
    from inenv.probe import HostView
    from inenv.registry import discover

    env = gate_env(tmp_path, "run", 1.0)
    for name in ("STACKPROBE_PROBE_PATH", "PYTHONPATH", "STACKPROBE_TEST_GATE_LOG", "STACKPROBE_TEST_TAG",
                 "STACKPROBE_TEST_HOLD_S"):
        monkeypatch.setenv(name, env[name])
    probes = {pid: mod for pid, (_, mod) in discover({"STACKPROBE_PROBE_PATH": env["STACKPROBE_PROBE_PATH"]}).items()
              if pid == "t-gated"}
    cells = [CellTarget(f"cu130-cell{i}", "resolved", image_status="built") for i in (1, 2, 3)]
    items = plan_work(cells, probes, HostView(gpu_count=2))
    executors = for_run({c.cell_id: LocalExecutor(sys.executable) for c in cells}, (), None, "host",
                        tmp_path / "gpu.lock")
    assert all(ex.gated for ex in executors.values())
    store = RunStore(tmp_path / "results", "host", "run")
    codes = {pid: checkout().for_probe(h) for pid, h in probe_hashes(probes).items()}
    report = execute(RunOptions(jobs=1), Work(items, store, reasons.default(), 2, codes, executors=executors))
    assert [r.verdict.status for r in report.results] == ["pass"] * 3
    ev = events(tmp_path / "gate.log")
    starts, ends = sorted(ev["run", "run-start"]), sorted(ev["run", "run-end"])
    assert len(starts) == len(ends) == 6
    spans = [(starts[i], ends[i + 1]) for i in range(0, 6, 2)]  # the two ranks of each variant
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))  # never two variants at once
    preloads = sorted(ev["run", "preload"])
    assert preloads[2] < spans[0][1] and preloads[4] < spans[1][1]  # each next one had started up meanwhile
    queued = [r.verdict.evidence["phases"]["queued"] for r in report.results]
    assert queued[0] < 0.5 and min(queued[1:]) > 0.5  # the later ones waited at the gate, their ranks started


def test_a_variant_that_times_nothing_says_it_took_the_gpus_shared(tmp_path: Path) -> None:
    """The worker takes the lock shared for a shallow variant (ranks sharing a GPU) and records it; a variant
    with a GPU per rank takes it exclusive and records nothing (the probe's own verdict is not the point here:
    this machine may have no GPU for it)."""
    import json

    from inenv.probe import RESULT_MARKER
    from tests.checks_helpers import fixture_env

    env = {**fixture_env(), gpugate.ENV: str(tmp_path / "gpu.lock")}

    def result(variant: dict, gpus: str) -> dict:
        proc = subprocess.run([sys.executable, "-m", "inenv.worker", "--probe", "t-gpu-shared", "--variant",
                               json.dumps(variant), "--gpus", gpus, "--timeout", "60"], capture_output=True,
                              text=True, env=env, cwd=ROOT, timeout=180)
        line = next(x for x in proc.stdout.splitlines() if x.startswith(RESULT_MARKER))
        return json.loads(line[len(RESULT_MARKER):])

    shared = result({"probe_id": "t-gpu-shared", "ranks": 2, "params": [], "share_gpu": True, "gpus": 1}, "1")
    assert shared["evidence"]["gpu_lock"] == "shared"
    own = result({"probe_id": "t-gpu-shared", "ranks": 2, "params": []}, "2")
    assert "gpu_lock" not in own["evidence"] and "queued" in own["evidence"]["phases"]


def test_a_probe_that_never_times_shares_the_gpus_whatever_its_placement() -> None:
    from inenv.probe import untimed
    from inenv.probes import ep_a2a, symm_mem

    assert untimed(ep_a2a.SPEC, Variant("ep-a2a", 1, (("mode", "sim"), ("ep", "8"))))
    assert untimed(ep_a2a.SPEC, Variant("ep-a2a", 2, (("mode", "gpus"),)))
    assert not untimed(symm_mem.SPEC, Variant("symm-mem", 2))  # times its ops at a GPU per rank
    assert untimed(symm_mem.SPEC, Variant("symm-mem", 2, share_gpu=True, gpus=1))
    assert untimed(symm_mem.SPEC, Variant("symm-mem", 3, (("depth", "setup"),)))


def test_loads_patterns_that_record_no_latency_share_the_gpus_and_replay_holds_them_alone() -> None:
    from inenv.probe import HostView, untimed
    from inenv.probes import load

    two = [v for v in load.variants(HostView(gpu_count=2, compute_capability="9.0")) if v.skip is None
           and not v.share_gpu]  # a GPU per rank (ranks sharing one GPU time nothing whatever the pattern)
    sharing = {(v.param("backend"), v.param("pattern")) for v in two if untimed(load.SPEC, v)}
    alone = {(v.param("backend"), v.param("pattern")) for v in two if not untimed(load.SPEC, v)}
    assert ("flashinfer-custom-ar", "two-streams") in sharing and ("nccl", "two-comms") in sharing
    assert {p for _, p in sharing} == {"two-streams", "two-comms"}
    assert {p for _, p in alone} == {"replay"} and ("nccl", "replay") in alone

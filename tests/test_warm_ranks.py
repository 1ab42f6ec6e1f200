"""Warm ranks (inenv.warm, checks.run.serving) with real processes on CPU (gloo): the stand-in suite gets the
same verdicts one-shot and warm, a variant that crashes, hangs or leaves state behind ends its group and the
next variant runs in fresh ranks with its own verdict, kept ranks really are kept, and nothing outlives a
run."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from checks.results.result import Verdict
from checks.results.store import read_file
from checks.run import isolate, serving
from checks.run.executor import LocalExecutor, for_run
from common import reasons
from inenv.probe import Variant
from inenv.registry import find
from inenv.status import Status
from tests.checks_helpers import FIXTURES, ROOT, TOKEN_VAR, fixture_env, pids_with_env
from tests.test_worker_floor import FLOOR_FIXTURES

CAT = reasons.default()
WARM_FIXTURES = ROOT / "tests" / "probes_fixtures_warm"


@pytest.fixture(autouse=True)
def _probe_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    env = fixture_env()
    for k, v in env.items():
        if k.startswith("STACKPROBE_") or k == "PYTHONPATH":
            monkeypatch.setenv(k, v)
    monkeypatch.setenv("STACKPROBE_PROBE_PATH", os.pathsep.join([str(FIXTURES), str(WARM_FIXTURES)]))
    yield env[TOKEN_VAR]
    assert not pids_with_env(f"{TOKEN_VAR}={env[TOKEN_VAR]}"), "a process of the test outlived it"


@pytest.fixture
def warm() -> Iterator[LocalExecutor]:
    ex = LocalExecutor().with_run_env((), warm=True)
    try:
        yield ex
    finally:
        ex.close()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return not f.read().rsplit(") ", 1)[1].startswith("Z")
    except OSError:
        return False


def pids(v: Verdict) -> list[int]:
    """The process that ran rank 0 of a t-warm-pid variant, as the probe itself reported it."""
    return [int(v.metrics["pid"])]


def run(ex: LocalExecutor, probe: str, ranks: int = 1, params: tuple[tuple[str, str], ...] = (),
        timeout: float | None = None) -> Verdict:
    """One variant as the runner runs it: with the probe's own timeout unless one is given."""
    return ex.run(Variant(probe, ranks, params), 0, timeout or find(probe)[1].SPEC.timeout_s, CAT)


# What each stand-in does is written in its docstring; these are the verdicts that behaviour must get.
SUITE: list[tuple[str, int, Status, str]] = [
    ("t-warm-pid", 2, Status.PASS, ""),
    ("t-trivial", 2, Status.PASS, ""),
    ("t-segv", 1, Status.CRASH, ""),
    ("t-trivial", 1, Status.PASS, ""),
    ("t-peer-crash", 2, Status.CRASH, ""),
    ("t-warm-pid", 2, Status.PASS, ""),
    ("t-hang", 2, Status.HANG, "hang"),
    ("t-trivial", 2, Status.PASS, ""),
    ("t-teardown-hang", 2, Status.PASS, ""),
    ("t-warm-pid", 2, Status.PASS, ""),
    ("t-harness-fail", 1, Status.NOT_RUN, "harness-error"),
    ("t-exit", 1, Status.FAIL, ""),
    ("t-raise", 1, Status.FAIL, ""),
    ("t-missing", 1, Status.SKIP, "missing-package"),
    ("t-abort", 1, Status.CRASH, ""),
    ("t-trivial", 1, Status.PASS, ""),
]


def test_the_stand_in_suite_gets_the_same_verdicts_one_shot_and_warm(warm: LocalExecutor,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    cold = LocalExecutor()
    spawned = LocalExecutor().with_run_env((), warm=True)  # its serving worker starts with forking off
    got: dict[str, list[tuple[str, str]]] = {"cold": [], "warm": [], "spawned": []}
    for name, ex in (("cold", cold), ("warm", warm), ("spawned", spawned)):
        monkeypatch.setenv("STACKPROBE_FORK_RANKS", "0" if name == "spawned" else "1")
        for probe, ranks, _, _ in SUITE:
            v = run(ex, probe, ranks)
            got[name].append((v.status.value, v.reason_code))
    spawned.close()
    assert got["cold"] == got["warm"] == got["spawned"]
    for (probe, _, status, code), (s, c) in zip(SUITE, got["warm"], strict=True):
        assert s == status.value, (probe, s, c)
        if code:
            assert c == code, (probe, c)


@pytest.mark.parametrize("fork", [True, False])
def test_kept_ranks_are_reused_and_import_torch_once(fork: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Forked from the serving worker, which imported torch for them, the ranks have torch before their first
    variant; started as new interpreters (STACKPROBE_FORK_RANKS=0), they import it in the first variant. Either
    way the second variant finds it imported in the same processes."""
    monkeypatch.setenv("STACKPROBE_FORK_RANKS", "1" if fork else "0")
    warm = LocalExecutor().with_run_env((), warm=True)
    try:
        first = run(warm, "t-warm-pid", 2)
        second = run(warm, "t-warm-pid", 2, (("env.STACKPROBE_LEVEL", "quick"),))  # read per call: same group
    finally:
        warm.close()
    assert first.status is second.status is Status.PASS
    assert pids(first) == pids(second)
    assert (first.metrics["runs_here"], second.metrics["runs_here"]) == (1, 2)
    assert (first.metrics["torch_before"], second.metrics["torch_before"]) == (fork, True)
    assert first.evidence["warm"]["forked"] is fork and "fork_refused" not in first.evidence["warm"]
    assert first.metrics["port"] != second.metrics["port"]  # each variant its own rendezvous
    assert second.evidence["warm"]["reused"] is True
    assert [r["exit"] for r in second.evidence["ranks"]] == ["kept", "kept"]
    assert {"probe", "report", "teardown", "total"} <= set(second.evidence["phases"])


@pytest.mark.parametrize("how", ["one-shot", "forked", "spawned"])
def test_a_multi_rank_variant_runs_one_cpu_thread_a_rank_unless_told_otherwise(
        how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """As torchrun does: the host runs up to a rank a core, so each rank of a multi-rank variant gets one torch CPU
    thread, also where torch was imported before the rank had its environment (forked from the serving worker); an
    OMP_NUM_THREADS the variant sets is kept."""
    monkeypatch.setenv("STACKPROBE_FORK_RANKS", "0" if how == "spawned" else "1")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    ex = LocalExecutor() if how == "one-shot" else LocalExecutor().with_run_env((), warm=True)
    try:
        default = run(ex, "t-warm-pid", 2)
        told = run(ex, "t-warm-pid", 2, (("env.OMP_NUM_THREADS", "2"),))
        again = run(ex, "t-warm-pid", 2)
    finally:
        ex.close()
    assert default.status is told.status is again.status is Status.PASS
    assert (default.metrics["cpu_threads"], told.metrics["cpu_threads"], again.metrics["cpu_threads"]) == (1, 2, 1)
    if how != "one-shot":
        assert again.evidence["warm"]["reused"] is True  # the group that ran the default before


def test_one_shot_ranks_are_fresh_every_time() -> None:
    cold = LocalExecutor()
    first, second = run(cold, "t-warm-pid", 2), run(cold, "t-warm-pid", 2)
    assert pids(first) != pids(second)
    assert first.metrics["runs_here"] == second.metrics["runs_here"] == 1
    assert "warm" not in second.evidence


def test_a_broken_variant_ends_its_group_and_the_next_runs_fresh(warm: LocalExecutor) -> None:
    before = run(warm, "t-warm-pid", 2)
    assert before.status is Status.PASS
    for breaker, status in (("t-peer-crash", Status.CRASH), ("t-hang", Status.HANG),
                            ("t-teardown-hang", Status.PASS), ("t-one-fails", Status.FAIL)):
        broken = run(warm, breaker, 2)
        after = run(warm, "t-warm-pid", 2)
        assert broken.status is status, (breaker, broken.note)
        assert broken.evidence["warm"]["reused"] is True, breaker  # it ran on the kept group...
        assert broken.evidence["warm"]["ended"], breaker  # ...which it ended
        assert after.status is Status.PASS, (breaker, after.note)
        assert pids(after) != pids(before), breaker
        assert after.metrics["runs_here"] == 1 and after.evidence["warm"]["reused"] is False, breaker
        assert not any(_alive(p) for p in before.evidence["warm"]["pids"]), breaker
        before = after


def test_env_params_key_the_groups(warm: LocalExecutor) -> None:
    a1 = run(warm, "t-warm-pid", 2, (("env.STACKPROBE_TEST_ENV", "a"),))
    b1 = run(warm, "t-warm-pid", 2, (("env.STACKPROBE_TEST_ENV", "b"),))
    a2 = run(warm, "t-warm-pid", 2, (("env.STACKPROBE_TEST_ENV", "a"),))
    assert (a1.metrics["env"], b1.metrics["env"], a2.metrics["env"]) == ("a", "b", "a")
    assert pids(a1) == pids(a2) != pids(b1)


def test_a_variant_that_changes_its_environment_is_not_followed_in_its_processes(warm: LocalExecutor) -> None:
    setenv = run(warm, "t-warm-setenv", 2)
    after = run(warm, "t-warm-setenv", 2)
    assert setenv.status is after.status is Status.PASS
    assert "NCCL_ALGO" in setenv.evidence["warm"]["ended"]
    assert setenv.metrics["pid"] != after.metrics["pid"]


def test_a_probe_that_declares_fresh_ranks_gets_them(warm: LocalExecutor) -> None:
    first, second = run(warm, "t-warm-fresh", 2), run(warm, "t-warm-fresh", 2)
    assert first.status is second.status is Status.PASS
    assert first.metrics["pid"] != second.metrics["pid"]
    assert "warm" not in second.evidence


def test_what_a_warm_variant_leaves_running_is_ended_with_it(warm: LocalExecutor, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    pidfile = tmp_path / "pid"
    monkeypatch.setenv("STACKPROBE_TEST_PIDFILE", str(pidfile))
    v = run(warm, "t-orphan", 1, timeout=30)
    assert v.status is Status.PASS
    assert v.evidence.get("leftover_processes_killed", 0) >= 1
    assert not _alive(int(pidfile.read_text()))  # before the run's end: the variant's own


def test_the_host_watchdog_kills_a_wedged_server_and_the_next_variant_gets_a_new_one(
        warm: LocalExecutor, _probe_path: str) -> None:
    p = warm._servers.run(Variant("t-zz-slow"), 0, 120, 0.0, limit_s=2.0)  # the worker's own 120 s never comes
    assert p.timed_out and p.result is None
    assert not pids_with_env(f"{TOKEN_VAR}={_probe_path}")  # the server, its ranks, the probe: all gone
    v = run(warm, "t-trivial", 1)
    assert v.status is Status.PASS and v.evidence["warm"]["reused"] is False


def test_ctrl_c_ends_the_running_server(warm: LocalExecutor) -> None:
    timer = threading.Timer(1.5, isolate.STOP.set)
    timer.start()
    started = time.monotonic()
    try:
        with pytest.raises(KeyboardInterrupt):
            run(warm, "t-zz-slow", 1, timeout=120)
    finally:
        timer.cancel()
        isolate.STOP.clear()
    assert time.monotonic() - started < 10


def test_a_gated_variant_on_kept_ranks_joins_its_store_before_the_gate(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STACKPROBE_PROBE_PATH", os.pathsep.join([str(FIXTURES), str(FLOOR_FIXTURES)]))
    ex = for_run({"c": LocalExecutor()}, (), None, gpu_lock=tmp_path / "gpu.lock", warm=True)["c"]
    try:
        assert ex.gated
        got = [ex.run(Variant("t-gated-dist", 2), 2, 60, CAT, queue_s=30) for _ in range(2)]
    finally:
        ex.close()
    for v in got:
        assert v.status is Status.PASS, v.note
        assert v.evidence["joined_before"] == [True, True] and v.evidence["sum"] == 3
        assert "queued" in v.evidence["phases"]
    assert got[1].evidence["warm"]["reused"] is True


def test_close_ends_every_server_and_rank(_probe_path: str) -> None:
    ex = LocalExecutor().with_run_env((), warm=True)
    v = run(ex, "t-warm-pid", 2)
    ranks = v.evidence["warm"]["pids"]
    assert all(_alive(p) for p in ranks)  # kept between variants
    ex.close()
    assert not any(_alive(p) for p in ranks)
    assert not pids_with_env(f"{TOKEN_VAR}={_probe_path}")



def test_checks_run_records_the_same_verdicts_warm_and_with_cold_ranks(tmp_path: Path) -> None:
    """The whole command, two variants at a time (--jobs 2): warm by default, one-shot with --cold-ranks."""
    probes = ("t-warm-pid", "t-segv", "t-trivial", "t-teardown-hang", "t-exit")
    got: dict[str, list[tuple[str, str, str, str]]] = {}
    for way, flags in (("warm", []), ("cold", ["--cold-ranks"])):
        out = tmp_path / way
        p = subprocess.run([sys.executable, "-m", "checks.cli", "run", "--backend", "local", "--level", "full",
                            "--jobs", "2", "--results", str(out), *[a for pr in probes for a in ("--probe", pr)],
                            *flags], capture_output=True, text=True, env=dict(os.environ), cwd=ROOT, timeout=600)
        assert p.returncode == 0, p.stderr
        [path] = sorted(out.glob("*/*.jsonl"))
        stored, warnings = read_file(path)
        assert warnings == []
        got[way] = sorted((r.probe_id, r.variant, r.verdict.status.value, r.verdict.reason_code) for r in stored)
        served = [r for r in stored if "warm" in r.verdict.evidence]
        assert bool(served) == (way == "warm")
    assert got["warm"] == got["cold"]
    assert [s for *_, s, _ in got["warm"]] == ["fail", "crash", "pass", "pass", "pass", "pass"]


def test_a_variant_that_imports_a_stateful_module_is_not_followed_in_its_processes(warm: LocalExecutor) -> None:
    symm = run(warm, "t-warm-symm", 2)
    after = run(warm, "t-warm-symm", 2)
    assert symm.status is after.status is Status.PASS
    assert "torch.distributed._symmetric_memory" in symm.evidence["warm"]["ended"]
    assert symm.metrics["pid"] != after.metrics["pid"]


def test_a_warm_variant_that_never_gets_the_gpus_is_gpus_busy_and_the_next_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STACKPROBE_PROBE_PATH", os.pathsep.join([str(FIXTURES), str(FLOOR_FIXTURES)]))
    lock = tmp_path / "gpu.lock"
    ex = for_run({"c": LocalExecutor()}, (), None, gpu_lock=lock, warm=True)["c"]
    holder = os.open(lock, os.O_RDONLY | os.O_CREAT, 0o644)
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)  # another variant holds the GPUs
        busy = ex.run(Variant("t-gated-dist", 2), 2, 60, CAT, queue_s=3)
        fcntl.flock(holder, fcntl.LOCK_UN)
        after = ex.run(Variant("t-gated-dist", 2), 2, 60, CAT, queue_s=30)
    finally:
        os.close(holder)
        ex.close()
    assert busy.status is Status.NOT_RUN and busy.reason_code == "gpus-busy"
    assert after.status is Status.PASS and after.evidence["warm"]["reused"] is False


def test_a_server_that_died_while_idle_is_replaced(warm: LocalExecutor) -> None:
    first = run(warm, "t-trivial", 2)
    [server] = [s for s in serving._IDLE if s.pool is warm._servers]
    server.proc.kill()
    server.proc.wait()
    second = run(warm, "t-trivial", 2)
    assert first.status is second.status is Status.PASS
    assert second.evidence["warm"]["reused"] is False
    assert not any(_alive(p) for p in first.evidence["warm"]["pids"])  # its ranks died with it


@pytest.mark.parametrize("gated", [False, True], ids=["no-gpu", "gpu-lock"])
def test_cells_taking_turns_keep_their_servers_only_where_they_hold_no_gpu(gated: bool, tmp_path: Path) -> None:
    """Five cells' variants in turn, twice: without a GPU lock (a host without GPUs) each cell's server waits for
    its next variant, so the second round reuses every one; with one (their ranks may hold GPU memory) at most
    three idle servers are kept in all, the least recently used ended: each cell of the second round finds its
    server ended by a later cell's, and the server it starts ends the next cell's."""
    lock = tmp_path / "gpu.lock" if gated else None
    cells = for_run({f"c{i}": LocalExecutor() for i in range(5)}, (), None, gpu_lock=lock, warm=True)
    try:
        rounds = [[ex.run(Variant("t-trivial", 1), 0, 60, CAT) for ex in cells.values()] for _ in range(2)]
    finally:
        for ex in cells.values():
            ex.close()
    assert all(v.status is Status.PASS for r in rounds for v in r)
    reused = [v.evidence["warm"]["reused"] for v in rounds[1]]
    assert reused == ([False] * 5 if gated else [True] * 5)

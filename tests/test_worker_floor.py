"""The per-variant floor of the worker and its ranks, run for real (subprocess ranks): bytecode kept outside the
environment, verdicts a probe decides before launch, the CUDA driver initialised while a rank imports, ranks
that exit once every rank reported, and the phases each launch records."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from inenv import rank, worker
from inenv.probe import RESULT_MARKER
from tests.checks_helpers import ROOT, fixture_env, pids_with_env, run_worker

FLOOR_FIXTURES = ROOT / "tests" / "probes_fixtures_floor"


def floor_env(**extra: str) -> dict[str, str]:
    env = fixture_env(**extra)
    env["STACKPROBE_PROBE_PATH"] = os.pathsep.join([env["STACKPROBE_PROBE_PATH"], str(FLOOR_FIXTURES)])
    return env


# --- bytecode ---------------------------------------------------------------------------------------------------
def test_bytecode_cache_is_a_folder_of_this_user_alone(tmp_path: Path) -> None:
    made = worker.bytecode_cache(tmp_path)
    assert made == str(tmp_path / f"stackprobe-pycache-{os.getuid()}")
    assert stat.S_IMODE(os.stat(made).st_mode) == 0o700
    assert worker.bytecode_cache(tmp_path) == made  # found again, not made anew
    os.chmod(made, 0o777)  # writable by anyone: bytecode planted there would run in every rank
    assert worker.bytecode_cache(tmp_path) is None
    (tmp_path / "x").mkdir()
    os.rmdir(made)
    os.symlink(tmp_path / "x", made)  # a link to a folder made by someone else
    assert worker.bytecode_cache(tmp_path) is None


def test_the_host_names_where_the_bytecode_goes_under_its_own_cache(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from checks.run.executor import run_env
    from common.caches import CACHE_ROOT

    named = dict(run_env("cell", (), None))[worker.PYCACHE_ENV]
    assert Path(named) == CACHE_ROOT / "bytecode"  # the folder the README promises, not the machine's /tmp
    monkeypatch.setenv(worker.PYCACHE_ENV, str(tmp_path / "cache" / "bytecode"))
    made = worker.bytecode_cache()
    assert made == str(tmp_path / "cache" / "bytecode" / f"stackprobe-pycache-{os.getuid()}")
    assert stat.S_IMODE(os.stat(made).st_mode) == 0o700


def test_rank_env_moves_bytecode_out_of_the_environment_unless_the_variant_says_otherwise() -> None:
    from inenv.probe import Variant
    from inenv.registry import ProbeLocation

    base = {"PYTHONDONTWRITEBYTECODE": "1"}
    loc = ProbeLocation("x", "m")
    env = worker.rank_env(base, Variant("x", 1), loc, ROOT, 0, 1, None, "/cache")
    assert env["PYTHONPYCACHEPREFIX"] == "/cache" and "PYTHONDONTWRITEBYTECODE" not in env
    assert worker.rank_env(base, Variant("x", 1), loc, ROOT, 0, 1, None)["PYTHONDONTWRITEBYTECODE"] == "1"
    own = worker.rank_env({**base, "PYTHONPYCACHEPREFIX": "/mine"}, Variant("x", 1), loc, ROOT, 0, 1, None, "/cache")
    assert own["PYTHONPYCACHEPREFIX"] == "/mine"  # the caller's own prefix is kept
    pinned = Variant("x", 1, (("env.PYTHONDONTWRITEBYTECODE", "1"),))
    assert worker.rank_env(base, pinned, loc, ROOT, 0, 1, None, "/cache")["PYTHONDONTWRITEBYTECODE"] == "1"


def test_ranks_keep_their_bytecode_in_the_private_folder_not_the_environment(tmp_path: Path) -> None:
    # As the runner starts workers: PYTHONDONTWRITEBYTECODE set. Before, every rank compiled torch and
    # flashinfer from source again (2-3 s per rank on 2x H200).
    env = floor_env(PYTHONDONTWRITEBYTECODE="1", TMPDIR=str(tmp_path))
    result, token = run_worker("t-env-report", env=env)
    prefix = tmp_path / f"stackprobe-pycache-{os.getuid()}"
    assert result["status"] == "pass", result
    assert result["evidence"]["pycache_prefix"] == str(prefix)
    assert result["evidence"]["dont_write_bytecode"] is False
    assert list(prefix.rglob("t_env_report*.pyc")), "the rank's bytecode was not kept"
    assert pids_with_env(token) == []


def test_inspect_keeps_its_bytecode_in_the_private_folder(tmp_path: Path) -> None:
    env = floor_env(PYTHONDONTWRITEBYTECODE="1", TMPDIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "inenv.worker", "--inspect"], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=120)
    assert proc.returncode == 0 and RESULT_MARKER in proc.stdout, proc.stderr
    assert list((tmp_path / f"stackprobe-pycache-{os.getuid()}").rglob("*.pyc"))


# --- verdicts decided before launch ------------------------------------------------------------------------------
def test_a_probe_preflight_verdict_launches_no_rank() -> None:
    decided, _ = run_worker("t-preflight", ranks=2, params=[["mode", "decided"]], env=floor_env())
    assert (decided["status"], decided["reason_code"]) == ("skip", "probe-api-unknown")
    assert decided["evidence"]["looked_for"] == ["x:y"]
    assert "ranks" not in decided["evidence"] and "phases" not in decided["evidence"]
    assert decided["evidence"]["env"]["python"]  # the environment's versions are still recorded


@pytest.mark.parametrize("mode", ["launch", "broken"])
def test_without_a_preflight_verdict_the_ranks_decide(mode: str) -> None:
    result, _ = run_worker("t-preflight", ranks=2, params=[["mode", mode]], env=floor_env())
    assert result["status"] == "pass", result
    assert [r["rank"] for r in result["evidence"]["ranks"]] == [0, 1]


# --- the CUDA driver, initialised while the rank imports -----------------------------------------------------------
def _fake_libcuda(folder: Path) -> Path:
    src = folder / "fake_cuda.c"
    src.write_text('#include <stdio.h>\n#include <stdlib.h>\n'
                   'int cuInit(unsigned int flags) {\n'
                   '  const char *p = getenv("STACKPROBE_TEST_CUINIT_MARK");\n'
                   '  if (p) { FILE *f = fopen(p, "w"); if (f) fclose(f); }\n'
                   '  return 0;\n}\n')
    lib = folder / "libcuda.so.1"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    return lib


def _run_with_fake_driver(tmp_path: Path, probe: str) -> tuple[dict, Path]:
    """The probe's one-rank variant on a one-GPU host whose libcuda.so.1 marks a file when cuInit is called."""
    _fake_libcuda(tmp_path)
    mark = tmp_path / "cuinit-called"
    env = floor_env(LD_LIBRARY_PATH=str(tmp_path), STACKPROBE_TEST_CUINIT_MARK=str(mark))
    result, _ = run_worker(probe, env=env, extra_args=["--gpus", "1"])
    return result, mark


def test_a_rank_with_a_gpu_initialises_the_driver_before_its_probe_runs(tmp_path: Path) -> None:
    result, _ = _run_with_fake_driver(tmp_path, "t-driver")  # t-driver passes only once the mark exists
    assert result["status"] == "pass", result
    assert result["evidence"]["device"] == 0


def test_a_rank_without_a_device_leaves_the_driver_alone(tmp_path: Path) -> None:
    result, mark = _run_with_fake_driver(tmp_path, "t-nodevice")
    assert result["status"] == "pass", result
    assert result["evidence"]["device"] is None and not mark.exists()


def test_warm_driver_without_a_cuda_library_is_harmless(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ctypes

    def no_library(name: str) -> None:
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", no_library)
    thread = rank.warm_driver()
    thread.join(5)
    assert not thread.is_alive()


# --- exit once every rank reported --------------------------------------------------------------------------------
def test_wait_for_peers_returns_when_every_outcome_is_written_or_at_the_limit(tmp_path: Path) -> None:
    rank.outcome_path(tmp_path, 0).write_text("{}")
    t0 = time.monotonic()
    assert rank.wait_for_peers(tmp_path, 2, 0.3) is False
    assert time.monotonic() - t0 >= 0.3
    rank.outcome_path(tmp_path, 1).write_text("{}")
    assert rank.wait_for_peers(tmp_path, 2, 30) is True


def test_ranks_exit_by_themselves_once_all_reported_and_say_where_the_time_went() -> None:
    result, token = run_worker("t-gloo-allreduce", ranks=2)
    assert result["status"] == "pass", result
    ranks = result["evidence"]["ranks"]
    assert [r["exit"] for r in ranks] == [0, 0] and not any("stopped" in r for r in ranks)
    phases = result["evidence"]["phases"]
    assert set(phases) == {"start", "probe", "report", "teardown", "total"}
    assert all(v >= 0 for v in phases.values())
    # each phase is its slowest rank's, and the slowest start and the slowest probe can be two ranks' (spawned
    # at different times), so only each phase alone is bounded by the launch's total
    assert phases["total"] >= max(phases["start"], phases["probe"], phases["report"], phases["teardown"])
    assert pids_with_env(token) == []


def test_a_rank_whose_peer_crashed_still_ends_and_the_verdict_is_crash() -> None:
    result, token = run_worker("t-peer-crash", ranks=2)
    assert result["status"] == "crash" and "rank 1" in result["note"]
    assert pids_with_env(token) == []


# --- phases (pure) ------------------------------------------------------------------------------------------------
def _state(i: int, spawned: float, clock: dict[str, float], reported: float | None, exited: float | None
           ) -> worker.RankState:
    return worker.RankState(i, None, spawned_at=spawned, clock=clock, reported_at=reported,  # type: ignore[arg-type]
                            exited_at=exited)


def test_phases_take_the_slowest_rank_of_each_phase() -> None:
    states = [_state(0, 100.0, {"main": 100.1, "probe_done": 103.0}, 103.05, 103.2),
              _state(1, 100.02, {"main": 100.5, "probe_done": 102.0}, 102.1, 103.6)]
    assert worker.phases(states, 103.7) == {"start": 0.48, "probe": 2.9, "report": 0.1, "teardown": 0.55,
                                            "total": 3.7}


def test_phases_leave_out_what_no_rank_reached() -> None:
    crashed = [_state(0, 10.0, {}, None, 11.0)]  # died before main(): no clock, no outcome
    assert worker.phases(crashed, 11.5) == {"total": 1.5}
    assert worker.phases([], 1.0) == {}


# --- the rendezvous port ------------------------------------------------------------------------------------------
def test_the_rendezvous_port_is_held_until_the_ranks_are_done_and_rank_0_can_still_bind_it() -> None:
    import datetime
    import socket

    torch_dist = pytest.importorskip("torch.distributed")
    with worker.reserved_port() as port:
        # Held: a plain bind (what any other program or a connect()'s source port would need) is refused ...
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))
        # ... while the rendezvous store of rank 0 binds and serves it (it sets SO_REUSEADDR, as torch's does).
        store = torch_dist.TCPStore("127.0.0.1", port, 1, True, timeout=datetime.timedelta(seconds=30))
        store.set("k", "v")
        assert store.get("k") == b"v"
        del store
    with socket.socket() as after:
        after.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        after.bind(("127.0.0.1", port))  # let go afterwards

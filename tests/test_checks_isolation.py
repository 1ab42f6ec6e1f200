"""Host-side isolation and classification with real processes: hangs, crashes, orphans, garbage, floods."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from checks.results.result import Verdict
from checks.run import classify, isolate
from checks.run.executor import LocalExecutor
from common import reasons
from inenv.probe import RESULT_MARKER, Variant
from inenv.status import Status
from tests.checks_helpers import fixture_env

CAT = reasons.default()


@pytest.fixture(autouse=True)
def _probe_path(monkeypatch: pytest.MonkeyPatch) -> None:
    for k, v in fixture_env().items():
        if k.startswith("STACKPROBE_") or k == "PYTHONPATH":
            monkeypatch.setenv(k, v)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return not f.read().rsplit(") ", 1)[1].startswith("Z")
    except OSError:
        return False


def _py(code: str, timeout: float = 30) -> tuple[isolate.ProcessOutcome, Verdict]:
    p = isolate.run_isolated([sys.executable, "-c", code], dict(os.environ), timeout)
    return p, classify.from_process(p, CAT, timeout)


def test_orphan_grandchild_in_own_session_is_killed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pidfile = tmp_path / "pid"
    monkeypatch.setenv("STACKPROBE_TEST_PIDFILE", str(pidfile))
    result = LocalExecutor().run(Variant("t-orphan"), 0, 30, CAT)
    assert result.status == "pass"
    pid = int(pidfile.read_text())
    assert result.evidence["leftover_processes_killed"] >= 1
    assert not _alive(pid)


def test_host_watchdog_kills_whole_group_as_hang() -> None:
    # The worker's soft timeout (60 s) is far beyond the host's hard one: the host must act alone.
    env = dict(os.environ)
    cmd = [sys.executable, "-m", "inenv.worker", "--probe", "t-hang", "--variant",
           '{"probe_id": "t-hang", "ranks": 2}', "--timeout", "60"]
    p = isolate.run_isolated(cmd, env, 4)
    result = classify.from_process(p, CAT, 4)
    assert p.timed_out and p.duration_s < 60  # ended by the host, before the worker's own 60 s ran out
    assert result.status == "hang" and result.reason_code == "hang"
    assert "host watchdog" in result.note
    assert result.remediation


def test_worker_level_hang_through_executor() -> None:
    result = LocalExecutor().run(Variant("t-hang", 2), 0, 2, CAT)
    assert result.status == "hang"
    assert "stack" in result.remediation


def test_fork_storm_in_new_sessions_is_swept() -> None:
    code = (
        "import os, time\n"
        "pids = []\n"
        "for i in range(30):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        os.setsid()\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(3600)\n"
        "        time.sleep(3600)\n"
        "    pids.append(pid)\n"
        "open(os.environ['PIDS'], 'w').write(' '.join(map(str, pids)))\n"
        f"print({RESULT_MARKER!r} + '{{\"status\": \"pass\"}}', flush=True)\n"
    )
    pids_file = Path(os.environ.get("TMPDIR", "/tmp")) / f"stackprobe-storm-{os.getpid()}"
    p = isolate.run_isolated([sys.executable, "-c", code], {**os.environ, "PIDS": str(pids_file)}, 30)
    pids = [int(x) for x in pids_file.read_text().split()]
    pids_file.unlink()
    assert p.result == {"status": "pass"}
    assert p.leftovers >= 60
    assert not any(_alive(pid) for pid in pids)


def test_segfault_of_the_worker_itself_is_crash_with_signal_name() -> None:
    _, result = _py("import ctypes; ctypes.string_at(0)")
    assert result.status == "crash"
    assert result.note == "worker killed by SIGSEGV"
    assert result.reason_code == "signal"


def test_sigkill_without_timeout_points_to_oom_killer() -> None:
    _, result = _py("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert result.status == "crash" and result.reason_code == "killed"
    assert "dmesg" in result.remediation


def test_abort_with_cuda_message_is_classified() -> None:
    code = ("import os, sys; sys.stderr.write(\"terminate called after throwing an instance of 'c10::Error'\\n"
            "  what():  CUDA error: an illegal memory access was encountered\\n\"); sys.stderr.flush(); os.abort()")
    _, result = _py(code)
    assert result.status == "crash"
    assert result.reason_code == "cuda-illegal-access"


def test_garbage_on_stdout_is_no_result() -> None:
    _, result = _py("print('hello, this is not a result'); print('@@ nope')")
    assert result.status == "fail" and result.reason_code == "no-result"
    assert "not a result" in result.evidence["stdout_tail"]


def test_broken_result_line_is_bad_result() -> None:
    _, result = _py(f"print({RESULT_MARKER!r} + '{{not json')")
    assert result.status == "fail" and result.reason_code == "bad-result"


def test_nonzero_exit_is_classified_from_stderr() -> None:
    code = ("import sys; sys.stderr.write('torch.distributed.DistBackendError: NCCL error in: x.cpp:1, invalid usage"
            " (run with NCCL_DEBUG=WARN for details), NCCL version 2.28.9\\nncclInvalidUsage: This usually reflects"
            " invalid usage of NCCL library.\\nLast error:\\nNo algorithm/protocol available for function AllGather"
            " with datatype ncclInt8. NCCL_ALGO was set to Tree.\\n'); sys.exit(3)")
    _, result = _py(code)
    assert result.status == "fail" and result.reason_code == "nccl-algo-unavailable"
    # no nccl-graphs result on this NCCL release has shown a per-collective setting passing: none is offered
    assert result.remediation.startswith("leave NCCL_ALGO unset, or name an algorithm for every collective")
    assert "allreduce:tree" not in result.remediation


def test_nonzero_exit_unknown_keeps_last_error_line() -> None:
    _, result = _py("import sys; sys.stderr.write('starting\\nValueError: the flux capacitor broke\\nbye\\n');"
                    " sys.exit(4)")
    assert result.reason_code == "nonzero-exit"
    assert result.note == "ValueError: the flux capacitor broke"


def test_hundreds_of_megabytes_on_stdout_and_stderr_do_not_block() -> None:
    code = ("import os\nblock = b'y' * (1 << 20)\nfor _ in range(150):\n    os.write(1, block + b'\\n')\n"
            "    os.write(2, block)\n"
            f"os.write(1, ({RESULT_MARKER!r} + '{{\"status\": \"pass\"}}\\n').encode())\n")
    p, result = _py(code, timeout=60)
    assert p.result == {"status": "pass"} and result.status == "pass"
    assert len(p.stdout_tail) <= isolate.TAIL_BYTES and len(p.stderr_tail) <= isolate.TAIL_BYTES


def test_noisy_probe_through_executor_passes() -> None:
    result = LocalExecutor().run(Variant("t-noisy", 2), 0, 60, CAT)
    assert result.status == "pass"


def test_probe_failure_gets_catalogue_reason_through_executor() -> None:
    result = LocalExecutor().run(Variant("t-raise"), 0, 30, CAT)
    assert result.status == "fail" and result.reason_code == "fi-arch-gate"
    assert "0.6.17" in result.remediation
    assert result.evidence["reason"].startswith("flashinfer")


def test_rank_crash_through_executor_is_signal_not_peer_died() -> None:
    result = LocalExecutor().run(Variant("t-peer-crash", 2), 0, 60, CAT)
    assert result.status == "crash" and result.reason_code == "signal"


def test_probe_reason_code_is_kept_and_filled() -> None:
    r = classify.annotate(Verdict(Status.SKIP, "too-few-gpus"), CAT)
    assert r.reason_code == "too-few-gpus" and r.remediation == "run on a host with more GPUs"
    r = classify.annotate(Verdict(Status.FAIL, "mine", "No algorithm/protocol available"), CAT)
    assert r.reason_code == "mine" and r.remediation == ""
    r = classify.annotate(Verdict(Status.PASS), CAT)
    assert r.reason_code == ""

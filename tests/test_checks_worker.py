"""The in-environment worker and rank launcher, run for real: subprocess ranks, gloo collectives."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from inenv.probe import RESULT_MARKER, Variant
from inenv.worker import device_for, module_available, rank_env
from tests.checks_helpers import ROOT, fixture_env, pids_with_env, run_worker


def test_gloo_allreduce_three_ranks_with_env_param() -> None:
    # Two-rank gloo runs in test_teardown_hang_keeps_the_correct_result; each torch import costs seconds.
    for ranks in (3,):
        # --gpus 1: a probe that needs no GPU must get no device even on a GPU host (found on the H200:
        # rank 1 was given device 1 of 1 and failed with "invalid device ordinal").
        result, token = run_worker("t-gloo-allreduce", ranks, params=[["env.STACKPROBE_TEST_ENV", "hello"]],
                                   extra_args=["--gpus", "1"])
        assert result["evidence"]["device"] is None
        assert result["status"] == "pass", result
        assert result["metrics"]["sum"] == ranks * (ranks + 1) / 2
        assert result["evidence"]["env_probe"] == "hello"  # variant env param reached the rank
        assert [r["status"] for r in result["evidence"]["ranks"]] == ["pass"] * ranks
        assert result["evidence"]["runtime"]["torch"].startswith("2.")
        assert result["evidence"]["env"]["python"] == sys.version.split()[0]
        assert pids_with_env(token) == []


def test_probe_exception_is_fail_with_traceback() -> None:
    result, _ = run_worker("t-raise")
    assert result["status"] == "fail"
    assert "No supported CUDA architectures found for major versions [9, 10]" in result["note"]
    assert "t_raise.py" in result["evidence"]["traceback"]


def test_segfault_is_crash_with_signal_and_python_stack() -> None:
    result, token = run_worker("t-segv")
    assert result["status"] == "crash"
    assert "SIGSEGV" in result["note"]
    assert "t_segv.py" in result["evidence"]["log_tail"]["rank0"]  # faulthandler's stack
    assert pids_with_env(token) == []


def test_abort_is_crash_and_keeps_the_runtime_message() -> None:
    result, _ = run_worker("t-abort")
    assert result["status"] == "crash" and "SIGABRT" in result["note"]
    assert "illegal memory access" in result["evidence"]["log_tail"]["rank0"]


def test_exit_without_report_is_fail_with_code() -> None:
    result, _ = run_worker("t-exit", ranks=2)
    assert result["status"] == "fail"
    assert "exited with code 7" in result["note"]


def test_a_rank_failing_in_its_own_code_is_the_harness_failure_not_the_features() -> None:
    """The probe passed; the rank could not write its outcome: not-run harness-error, never a fail."""
    result, _ = run_worker("t-harness-fail", ranks=2)
    assert result["status"] == "not-run" and result["reason_code"] == "harness-error", result
    assert "No space left on device" in result["note"]


def test_hang_fires_soft_watchdog_collects_stacks_and_kills_ranks() -> None:
    result, token = run_worker("t-hang", ranks=2, extra_args=["--timeout", "2"])
    assert result["status"] == "hang"
    assert result["duration_s"] < 10
    assert all("watchdog" in r["stopped"] for r in result["evidence"]["ranks"])
    assert "sleep_forever" in result["evidence"]["log_tail"]["rank1"]  # SIGUSR1 stack dump
    assert pids_with_env(token) == []


def test_teardown_hang_keeps_the_correct_result() -> None:
    # A rank exits once every rank reported, without tearing its group down: a teardown that would hang is
    # never reached, so the ranks end by themselves and the result stands.
    result, token = run_worker("t-teardown-hang", ranks=2)
    assert result["status"] == "pass"
    assert [r["exit"] for r in result["evidence"]["ranks"]] == [0, 0]
    assert not any("stopped" in r for r in result["evidence"]["ranks"])
    assert pids_with_env(token) == []


def test_peer_crash_is_crash_not_hang() -> None:
    result, token = run_worker("t-peer-crash", ranks=2)
    assert result["status"] == "crash" and "rank 1" in result["note"]
    assert pids_with_env(token) == []


def test_one_rank_failing_ends_the_waiting_others_as_fail() -> None:
    result, token = run_worker("t-one-fails", ranks=2)
    assert result["status"] == "fail" and "Connection refused" in result["note"]
    assert result["duration_s"] < 60
    ranks = result["evidence"]["ranks"]
    assert ranks[1]["note"].startswith("RuntimeError: Connection refused")
    assert "reported a failure" in ranks[0]["stopped"]
    assert pids_with_env(token) == []


def test_huge_output_does_not_block_and_is_not_kept() -> None:
    result, _ = run_worker("t-noisy", ranks=2)
    assert result["status"] == "pass"
    assert len(json.dumps(result)) < 20_000


def test_skips_without_launching() -> None:
    missing, _ = run_worker("t-missing")
    assert missing["status"] == "skip" and "stackprobe_no_such_module" in missing["note"]
    assert "ranks" not in missing["evidence"]
    gpu, _ = run_worker("t-gpu", extra_args=["--gpus", "0"])
    assert gpu["status"] == "skip" and gpu["note"] == "no GPU on this host"
    few, _ = run_worker("t-gpu", ranks=2, extra_args=["--gpus", "1"])
    assert few["status"] == "skip" and few["note"] == "needs 2 GPUs, host has 1"


def _worker_result(probe: str, variant: dict | None, *args: str) -> dict:
    cmd = [sys.executable, "-m", "inenv.worker", "--probe", probe, *args]
    if variant is not None:
        cmd += ["--variant", json.dumps(variant)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=fixture_env(), cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    line = next(ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_MARKER))
    return json.loads(line[len(RESULT_MARKER):])


def test_too_few_ranks_is_refused_not_passed() -> None:
    # Over one rank the gloo all_reduce returns its input, which equals the expected sum: it would pass.
    result, _ = run_worker("t-gloo-allreduce", ranks=1)
    assert (result["status"], result["reason_code"]) == ("skip", "too-few-ranks")
    assert "needs at least 2 ranks" in result["note"] and "this variant has 1" in result["note"]
    assert "ranks" not in result["evidence"]  # nothing was launched


def test_without_a_variant_the_worker_runs_the_smallest_default_world_size() -> None:
    result = _worker_result("t-gloo-allreduce", None)
    assert result["status"] == "pass"
    assert [r["rank"] for r in result["evidence"]["ranks"]] == [0, 1]


def test_ranks_sharing_a_gpu_are_refused_for_a_probe_that_needs_one_each() -> None:
    variant = {"probe_id": "t-gpu", "ranks": 2, "params": [], "share_gpu": True}
    result = _worker_result("t-gpu", variant, "--gpus", "1")
    assert (result["status"], result["reason_code"]) == ("skip", "not-applicable")
    assert result["note"] == "t-gpu needs a GPU per rank; this variant puts ranks on shared GPUs"
    assert "ranks" not in result["evidence"]
    shared = {"probe_id": "t-gpu-shared", "ranks": 2, "params": [], "share_gpu": True}
    assert _worker_result("t-gpu-shared", shared, "--gpus", "0")["reason_code"] == "no-gpu"  # allowed to share


def test_unknown_probe_suggests_and_exits_2() -> None:
    proc = subprocess.run([sys.executable, "-m", "inenv.worker", "--probe", "t-trival"], capture_output=True,
                          text=True, env=fixture_env(), cwd=ROOT)
    assert proc.returncode == 2
    assert "did you mean 't-trivial'" in proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


def test_a_broken_probe_module_does_not_stop_the_others(tmp_path) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "t_broken.py").write_text("import stackprobe_module_that_is_not_there\n")
    env = fixture_env()
    env["STACKPROBE_PROBE_PATH"] += ":" + str(tmp_path)
    result, _ = run_worker("t-trivial", env=env)
    assert result["status"] == "pass"
    proc = subprocess.run([sys.executable, "-m", "inenv.worker", "--probe", "t-nope"], capture_output=True,
                          text=True, env=env, cwd=ROOT)
    assert proc.returncode == 2 and "t_broken.py: cannot import probe module" in proc.stderr


def test_inspect_prints_versions() -> None:
    proc = subprocess.run([sys.executable, "-m", "inenv.worker", "--inspect"], capture_output=True, text=True,
                          env=fixture_env(), cwd=ROOT, timeout=120)
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_MARKER)]
    info = json.loads(line[0][len(RESULT_MARKER):])
    assert info["versions"]["torch"].startswith("2.11.0")
    assert info["versions"]["torch_cuda"]  # read from torch/version.py without importing
    assert info["gpus"] == [] and info["cuda_available"] is False


def test_device_assignment() -> None:
    assert [device_for(i, 2, False) for i in range(2)] == [0, 1]
    assert [device_for(i, 1, True) for i in range(3)] == [0, 0, 0]
    assert [device_for(i, 2, True) for i in range(4)] == [0, 1, 0, 1]
    assert device_for(0, 0, False) is None
    assert device_for(1, 1, False) is None  # never an ordinal that does not exist


def test_rank_env_exports_and_unsets_variant_env() -> None:
    from inenv.registry import ProbeLocation

    v = Variant("x", 2, params=(("env.NCCL_ALGO", "Tree"), ("env.NCCL_DEBUG", ""), ("mode", "graph")))
    env = rank_env({"NCCL_DEBUG": "INFO", "CUDA_VISIBLE_DEVICES": "0,1"}, v, ProbeLocation("x", "m"),
                   ROOT, 1, 1234, 1)
    assert env["NCCL_ALGO"] == "Tree" and "NCCL_DEBUG" not in env and "mode" not in env
    assert env["RANK"] == "1" and env["WORLD_SIZE"] == "2" and env["MASTER_PORT"] == "1234"
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1"  # never narrowed per rank
    assert env["STACKPROBE_DEVICE"] == "1"


@pytest.mark.parametrize(("name", "present"), [("json", True), ("json.decoder", True), ("json.nope", False),
                                                ("stackprobe_absent", False), ("torch.distributed", True)])
def test_module_available_without_import(name: str, present: bool) -> None:
    assert module_available(name) is present


# A rank's faulthandler dump recorded on the 2x H200 (flashinfer 0.6.18, fi-fusion): the watchdog fired while
# flashinfer was JIT-compiling trtllm_comm inside workspace creation.
_JIT_DUMP = '''Thread 0x00007ff9a1ffb6c0 (most recent call first):
  File "/usr/lib/python3.12/threading.py", line 359 in wait

Current thread 0x00007ffa59aeb140 (most recent call first):
  File "/usr/lib/python3.12/subprocess.py", line 1196 in communicate
  File "/usr/lib/python3.12/subprocess.py", line 550 in run
  File "/venv/lib/python3.12/site-packages/flashinfer/jit/cpp_ext.py", line 370 in run_ninja
  File "/venv/lib/python3.12/site-packages/flashinfer/jit/core.py", line 427 in build
  File "/venv/lib/python3.12/site-packages/flashinfer/jit/core.py", line 320 in build_and_load
  File "/venv/lib/python3.12/site-packages/flashinfer/comm/trtllm_ar.py", line 120 in get_trtllm_comm_module
  File "/work/main/checks/probes/fi_fusion.py", line 174 in run
'''
_KERNEL_DUMP = '''Current thread 0x00007ffa59aeb140 (most recent call first):
  File "/work/main/checks/probes/_device.py", line 28 in wait_device
  File "/work/main/checks/probes/fi_fusion.py", line 190 in run
'''


def test_a_watchdog_firing_inside_a_jit_build_is_not_run_not_hang() -> None:
    from types import SimpleNamespace

    from inenv.worker import LaunchResult, merge, ranks_in_jit_build

    assert ranks_in_jit_build({"rank0": _JIT_DUMP, "rank1": _KERNEL_DUMP}) == ["rank0"]
    assert ranks_in_jit_build({"rank0": "no stack dump at all"}) == []
    module = SimpleNamespace()
    ranks = [{"rank": 0, "exit": "SIGKILL"}, {"rank": 1, "exit": "SIGKILL"}]
    building = merge(module, LaunchResult([], complete=False, hang=True, ranks=ranks, log_tails={"rank0": _JIT_DUMP}))
    assert (building["status"], building["reason_code"]) == ("not-run", "jit-build-timeout")
    assert "rank0" in building["note"]
    stuck = merge(module, LaunchResult([], complete=False, hang=True, ranks=ranks, log_tails={"rank0": _KERNEL_DUMP}))
    assert (stuck["status"], stuck["reason_code"]) == ("hang", "hang")


# The refusals below are the notes the device run of 2026-12-05 recorded at 3 ranks sharing one H200
# (flashinfer 0.6.17 and 0.7.4, torch 2.11.0): torch's two-shot, flashinfer's custom allreduce, its fusion
# heuristics and its PCIe IPC workspace.
_REFUSALS_AT_3 = ("two_shot eager, two_shot graph: RuntimeError: Not implemented for world_size=3",
                  "rank 0: init failed: RuntimeError: Odd num gpus is not supported for now",
                  "rank 0: eager call failed: KeyError: 3",
                  "flashinfer-fusion: deepseek-v3 decode:1: KeyError: 3",
                  "flashinfer-pcie-ipc: ValueError: pcie ipc workspace failed while validating arguments: "
                  "{0: 'world size 3 unsupported; expected one of (2, 4, 8)'}")


@pytest.mark.parametrize("note", _REFUSALS_AT_3)
def test_a_feature_refusing_the_world_size_is_named_so(note: str) -> None:
    from types import SimpleNamespace

    from inenv.probe import outcome
    from inenv.worker import LaunchResult, merge, refuses_world_size

    assert refuses_world_size(note, 3)
    assert not refuses_world_size(note, 5 if "Odd" not in note else 4)
    ranks = [{"rank": i, "exit": 0, "status": "fail", "note": note} for i in range(3)]
    failed = [outcome("fail", note=note, reason_code="custom-ar-init-failed") for _ in range(3)]
    merged = merge(SimpleNamespace(), LaunchResult(failed, complete=True, hang=False, ranks=ranks))
    assert (merged["status"], merged["reason_code"]) == ("fail", "world-size-refused")
    assert merged["note"].startswith("refuses 3 ranks: ") and note in merged["note"]
    assert merged["evidence"]["probe_reason_code"] == "custom-ar-init-failed"


def test_other_failures_keep_the_probes_reason() -> None:
    from types import SimpleNamespace

    from inenv.probe import outcome
    from inenv.worker import LaunchResult, merge

    notes = ("rank 0: init failed: RuntimeError: CUDA error: invalid argument", "rank 1: KeyError: 'hidden'")
    ranks = [{"rank": i, "exit": 0, "status": "fail", "note": n} for i, n in enumerate(notes)]
    failed = [outcome("fail", note=n, reason_code="custom-ar-init-failed") for n in notes]
    merged = merge(SimpleNamespace(), LaunchResult(failed, complete=True, hang=False, ranks=ranks))
    assert merged["reason_code"] == "custom-ar-init-failed"
    # one refusing rank among others that failed for another reason is not a refusal of the size
    mixed = [{**ranks[0], "note": "Not implemented for world_size=2"}, ranks[1]]
    merged = merge(SimpleNamespace(), LaunchResult(failed, complete=True, hang=False, ranks=mixed))
    assert merged["reason_code"] == "custom-ar-init-failed"

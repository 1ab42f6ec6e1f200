"""A warm `provision build` does not start the kernel builder again for a module the last kernel stage could not
carry for a reason of the cell's own, when the cell and its arch list are unchanged; a builder failure is
retried, and so is anything after the cell was rebuilt or its list changed."""

from __future__ import annotations

from provision.kernels import Job, known_failure

JOB = Job("cu128-x", "trtllm_comm", ("9.0a", "12.0a"), "0.6.17", "cu128", 950.0)


def _rec(status: str = "skipped-unchanged", code: str = "fi-no-nvcc", archs: str = "9.0a 12.0a") -> dict:
    return {"status": status, "kernels": {"arch_list": archs, "modules": {
        "trtllm_comm": {"carried": False, "reason_code": code, "line": "nvcc: not found"},
        "vllm_comm": {"carried": True, "sass": ["sm_90a"], "bytes": 10}}}}


def test_an_unchanged_cells_own_failure_is_kept() -> None:
    got = known_failure(_rec(), JOB)
    assert got == {"ok": False, "reason_code": "fi-no-nvcc", "line": "nvcc: not found",
                   "from": "the cell's last kernel stage"}


def test_it_is_tried_again_when_anything_it_stood_on_changed() -> None:
    assert known_failure(_rec(status="built"), JOB) is None  # the cell was rebuilt
    assert known_failure(_rec(archs="9.0a"), JOB) is None  # another arch list
    assert known_failure(_rec(code="harness-error"), JOB) is None  # the builder's own failure
    assert known_failure(_rec(code="fi-jit-timeout"), JOB) is None
    assert known_failure({"status": "skipped-unchanged"}, JOB) is None  # no kernel stage recorded
    carried = Job("cu128-x", "vllm_comm", ("9.0a", "12.0a"), "0.6.17", "cu128", 14.0)
    assert known_failure(_rec(), carried) is None  # carried modules are the kernel set's to answer

"""The reason catalogue against failure signatures recorded from real runs, as the libraries printed them."""

from __future__ import annotations

from pathlib import Path

import pytest

from checks.results.result import Verdict
from checks.run.classify import annotate
from common import reasons
from inenv.status import Status

CAT = reasons.default()

RECORDED = [
    ("RuntimeError: No supported CUDA architectures found for major versions [9, 10].", "fi-arch-gate"),
    ('RuntimeError("SM 12.x requires CUDA >= 12.9")', "fi-nvcc-too-old"),
    ("WARNING Failed to get device capability: SM 12.x requires CUDA >= 12.9.", "fi-nvcc-too-old"),
    ("torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:3356, invalid usage\n"
     "Last error:\nNo algorithm/protocol available for function AllGather with datatype ncclBfloat16. "
     "NCCL_ALGO was set to Tree.", "nccl-algo-unavailable"),
    ("RuntimeError: CUDA error: operation not permitted when stream is capturing", "capture-not-permitted"),
    ("RuntimeError: CUDA error: operation failed due to a previous error during capture", "capture-not-permitted"),
    ("RuntimeError: multimem_all_reduce_: multicast support is required.", "multicast-required"),
    ("TorchSymmMemCommunicator: torch symmetric memory multicast operations are not supported.",
     "multicast-required"),
    ("RuntimeError: [SymmDeviceMemory] Device does not support multicasting.", "multicast-unsupported"),
    ("RuntimeError: buffer address 0x7f3a40000000 is not registered!", "car-unregistered-buffer"),
    ("AssertionError: custom allreduce only supports num gpus in (2, 4, 6, 8)", "car-world-size"),
    ("/usr/bin/ld: cannot find -lcuda: No such file or directory\ncollect2: error: ld returned 1 exit status",
     "fi-link-no-libcuda"),
    ("RuntimeError: CUDA error: no kernel image is available for execution on the device", "no-kernel-image"),
    ("UserWarning: NVIDIA RTX PRO 6000 Blackwell with CUDA capability sm_120 is not compatible with the current "
     "PyTorch installation.", "torch-arch-missing"),
    ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.88 GiB.", "cuda-oom"),
    ("RuntimeError: pidfd_getfd(pidfd=12, fd=40) failed with errno 1: Operation not permitted", "fd-exchange-failed"),
    ("nvcc fatal   : Unsupported gpu architecture 'compute_120f'", "nvcc-unsupported-arch"),
    ("Custom allreduce is disabled because it's not supported on more than two PCIe-only GPUs.",
     "car-disabled-pcie"),
    ("SKIPPED: MNNVL not supported on this system", "mnnvl-unsupported"),
    ("AssertionError: Flashinfer MoE A2A is only supported with flashinfer_cutlass moe runner backend",
     "fi-a2a-runner"),
    ("RuntimeError: cuda p2p access is not available", "p2p-unavailable"),
    ("KeyError: 12", "sglang-symm-no-cc"),
    ("ImportError: /venv/lib/python3.12/site-packages/sgl_kernel/common_ops.abi3.so: undefined symbol: "
     "_ZN3c104cuda9SetDeviceEa", "abi-mismatch"),
    ("torch.distributed.DistBackendError: NCCL error in: x.cpp:1, unhandled cuda error, ncclUnhandledCudaError",
     "nccl-error"),
    ("misc/shmutils.cc:72 NCCL WARN Error while creating shared memory segment /dev/shm/nccl-x (size 9637888)",
     "shm-too-small"),
    ("RuntimeError: The capture must call prepare() for shape (16, 2048) before capturing", "fi-prepare-required"),
]


@pytest.mark.parametrize(("text", "code"), RECORDED)
def test_recorded_signature(text: str, code: str) -> None:
    hit = CAT.match([text])
    assert hit is not None and hit.code == code


def test_unknown_failure_gets_generic_code_and_last_error_line() -> None:
    r = annotate(Verdict(Status.FAIL, evidence={"traceback": "Traceback ...\n  File x\nZeroDivisionError: boom\n\n"}),
                 CAT)
    assert r.reason_code == reasons.GENERIC
    assert r.note == "ZeroDivisionError: boom"
    assert r.remediation.startswith("read the log tail")


def test_every_code_has_message_and_remediation_and_unique_code() -> None:
    codes = [r.code for r in CAT.reasons]
    assert len(codes) == len(set(codes))
    assert all(r.message and r.remediation for r in CAT.reasons)


def test_specific_beats_generic_in_one_text() -> None:
    text = "NCCL error: invalid usage, ncclInvalidUsage ... No algorithm/protocol available for function X"
    assert CAT.match([text]).code == "nccl-algo-unavailable"  # type: ignore[union-attr]


@pytest.mark.parametrize(("body", "msg"), [
    ("- code: x\n  patterns: ['(']\n  message: m\n  remediation: r\n", "not a valid regex"),
    ("- code: Bad Code\n  message: m\n  remediation: r\n", "lowercase slug"),
    ("- code: a\n  message: m\n  remediation: r\n  colour: red\n", "unknown key"),
    ("- code: a\n  message: ''\n  remediation: r\n", "a.message"),
    ("{a: 1}", "expected a list"),
    ("- code: a\n  message: m\n  remediation: r\n- code: a\n  message: m\n  remediation: r\n", "defined twice"),
    ("- code: a\n  message: m\n  remediation: r\n", "unknown-error"),
    ("- [unclosed\n", "not valid YAML"),
])
def test_bad_catalogue_is_one_clear_error(tmp_path: Path, body: str, msg: str) -> None:
    f = tmp_path / "reasons.yaml"
    f.write_text(body)
    with pytest.raises(reasons.CatalogueError) as exc:
        reasons.load(f)
    assert msg in str(exc.value) and str(f) in str(exc.value)

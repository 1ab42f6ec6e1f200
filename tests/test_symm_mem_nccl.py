"""symm-mem backend=nccl without a GPU: which torch has the NCCL symmetric-memory backend (this project's own torch,
2.11.0+cu130, registers it; the refusal of a build without one is torch's real words), and the verdict that names
what failed: registration, a registration that registered nothing (NVIDIA/nccl#1963), a symmetric kernel, or
registration during CUDA-graph capture (vllm-project/vllm#54626), with NCCL's own words."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from inenv.kit import _nccl
from inenv.probes import symm_mem
from tests.checks_helpers import ROOT

OK = {"verdict": "ok"}
REGISTER_ERROR = ("DistBackendError: NCCL error in: NCCLSymmetricMemory.cu:95, unhandled cuda error (run with "
                  "NCCL_DEBUG=INFO for details), NCCL version 2.29.7\nncclUnhandledCudaError: Call to CUDA function "
                  "failed.\nLast error:\nFailed to window register segment with ptr 0x7f, size 4194304 on rank 0")
WORDS = ["NCCL WARN Cuda failure 'operation not permitted when stream is capturing'"]


def facts(**over: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "registration": OK, "registered": True, "p2p_read": OK,
        "ops": {op: {"eager": OK, "graph": OK} for op in ("one_shot", "two_shot", "nccl_all_reduce")},
        "windows": {"nccl": 23206, "eager": OK, "capture": OK}, "nccl_words": [],
    }
    base.update(over)
    return base


def test_the_backend_is_chosen_where_torch_has_it_and_skipped_where_not() -> None:
    """In a fresh interpreter (the backend is process-wide): this project's torch registers NCCL; a build without a
    backend refuses in torch's words, which is a skip; torch without set_backend is a skip too."""
    code = ("import json, torch.distributed._symmetric_memory as s\n"
            "from inenv.probes import symm_mem\n"
            "print(json.dumps(symm_mem.backend_choice(s)), s.get_backend('cuda'))\n"
            "class Bogus:\n"
            "    def set_backend(self, name): s.set_backend('BOGUS')\n"
            "print(json.dumps(symm_mem.backend_choice(Bogus())))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    lines = out.stdout.splitlines()
    assert lines[0] == "null NCCL", out.stderr[-500:]
    assert '"status": "skip"' in lines[1] and "symm-mem-nccl-absent" in lines[1]
    assert "SymmetricMemory does not find allocation backend BOGUS" in lines[1]
    old = symm_mem.backend_choice(SimpleNamespace())
    assert old is not None and (old["status"], old["reason_code"]) == ("skip", "symm-mem-nccl-absent")


def test_a_rendezvous_without_peer_pointers_registered_nothing() -> None:
    assert symm_mem.registered_nothing([], 2)
    assert symm_mem.registered_nothing([0x7F0000000000, 0], 2)
    assert symm_mem.registered_nothing([0x7F0000000000], 2)
    assert not symm_mem.registered_nothing([0x7F0000000000, 0x7E0000000000], 2)


def test_each_failure_is_named() -> None:
    passed = symm_mem.nccl_backend_verdict(facts())
    assert passed["status"] == "pass" and passed["metrics"] == {"ops_exact": 6, "ops_total": 6}
    reg = symm_mem.nccl_backend_verdict(facts(registration={"verdict": "error", "error": REGISTER_ERROR},
                                              nccl_words=WORDS))
    assert (reg["status"], reg["reason_code"]) == ("fail", "symm-mem-nccl-register-failed")
    assert reg["note"].startswith("registration through torch's NCCL backend (ncclMemAlloc, ncclCommWindowRegister) "
                                  "failed: DistBackendError: NCCL error in: NCCLSymmetricMemory.cu:95, unhandled cuda")
    assert "NCCL said: NCCL WARN Cuda failure 'operation not permitted when stream is capturing'" in reg["note"]
    nothing = symm_mem.nccl_backend_verdict(facts(registered=False, nothing_on="rank 1: 1 of 2 peer pointers null"))
    assert (nothing["status"], nothing["reason_code"]) == ("fail", "symm-mem-nccl-registered-nothing")
    assert nothing["note"].endswith("registered nothing: rank 1: 1 of 2 peer pointers null")
    captured = facts()
    captured["ops"]["nccl_all_reduce"] = {"eager": OK, "graph": {"verdict": "error", "error": "capture invalidated"}}
    kernel = symm_mem.nccl_backend_verdict(captured)
    assert (kernel["status"], kernel["reason_code"]) == ("fail", "symm-mem-nccl-kernel-failed")
    assert kernel["note"].startswith("symmetric kernel nccl_all_reduce graph (eager works: only when captured)")
    wrong = facts()
    wrong["ops"]["two_shot"] = {"eager": {"verdict": "no-op", "detail": "output equals its own input"}, "graph": OK}
    assert symm_mem.nccl_backend_verdict(wrong)["reason_code"] == "symm-mem-wrong-result"


def test_the_engine_paths_windows_name_registration_in_capture() -> None:
    in_capture = facts(windows={"nccl": 22907, "eager": OK, "capture": {"verdict": "error", "error": (
        "RuntimeError: ncclCommWindowRegister returned 1: unhandled cuda error (run with NCCL_DEBUG=INFO for "
        "details)")}}, nccl_words=WORDS)
    r = symm_mem.nccl_backend_verdict(in_capture)
    assert (r["status"], r["reason_code"]) == ("fail", "symm-mem-nccl-capture-register-failed")
    assert r["note"].startswith("registering a window during CUDA-graph capture failed, where registering it before "
                                "capture works: error RuntimeError: ncclCommWindowRegister returned 1: unhandled cuda")
    silent = symm_mem.nccl_backend_verdict(facts(windows={"eager": {"verdict": "nothing"}}))
    assert silent["reason_code"] == "symm-mem-nccl-registered-nothing" and "eagerly" in silent["note"]
    hung = symm_mem.nccl_backend_verdict(facts(windows={"eager": OK, "capture": {
        "verdict": "hang", "error": "window capture: not finished after 60 s"}}))
    assert hung["reason_code"] == "symm-mem-nccl-capture-register-failed" and "hang" in hung["note"]
    old = symm_mem.nccl_backend_verdict(facts(windows={"verdict": "missing", "error": "NCCL 22703 has no "
                                                       "ncclCommWindowRegister"}))
    assert (old["status"], old["reason_code"]) == ("partial", "symm-mem-op-missing")


def test_the_window_calls_are_the_ones_the_installed_nccl_declares_and_exports() -> None:
    """The engine path calls NCCL through ctypes: the flag and the signatures it assumes are those of the nccl.h
    of the NCCL wheel installed here, and its libnccl.so.2 exports every call (read without a GPU)."""
    import ctypes
    import importlib.util
    import re

    spec = importlib.util.find_spec("nvidia.nccl")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("no NCCL wheel in this environment")
    root = Path(next(iter(spec.submodule_search_locations)))
    header = (root / "include" / "nccl.h").read_text()
    flag = re.search(r"#define NCCL_WIN_COLL_SYMMETRIC (0x[0-9a-fA-F]+|\d+)", header)
    assert flag is not None and int(flag.group(1), 0) == _nccl.WIN_COLL_SYMMETRIC
    assert "ncclResult_t  ncclCommWindowRegister(ncclComm_t comm, void* buff, size_t size, ncclWindow_t* win, " \
           "int winFlags);" in header
    assert "ncclResult_t  ncclMemAlloc(void** ptr, size_t size);" in header
    lib = ctypes.CDLL(str(root / "lib" / "libnccl.so.2"))
    assert [name for name in _nccl.WINDOW_CALLS if not hasattr(lib, name)] == []


def test_the_nccl_backend_variant_times_nothing_and_shares_the_gpu() -> None:
    """backend=nccl registers windows and checks results exactly; a sustained variant times its calls."""
    from checks.run import runner
    from checks.run.plan import CellTarget, WorkItem
    from inenv.probe import Variant, untimed

    nccl = Variant("symm-mem", 1, (("backend", "nccl"),))
    sustained = Variant("symm-mem", 2, (("load", "sustained"),))
    assert untimed(symm_mem.SPEC, nccl) and not untimed(symm_mem.SPEC, sustained)
    assert runner.shares_gpu(WorkItem(CellTarget("c", "resolved"), symm_mem.SPEC, nccl, 180.0))

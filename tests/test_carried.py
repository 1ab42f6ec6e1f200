"""Carried kernels: the kernel-set reader (inenv.kit._carried), the builder's judgement of a build
(inenv.carry.judge) and provision's kernel stage (provision.kernels: plan, reuse, install), on small
libraries nvcc makes here and hand-written records."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

import pytest

from inenv import carry as _fi_carry
from inenv.kit import _carried
from provision import kernels
from tests.elf_helpers import build_so

NVCC = "/usr/local/cuda/bin/nvcc"
needs_nvcc = pytest.mark.skipif(not os.access(NVCC, os.X_OK), reason="needs nvcc at /usr/local/cuda")


def _so(folder: Path, name: str, *gencode: str) -> Path:
    """A shared library holding SASS for exactly the given -gencode flags."""
    folder.mkdir(parents=True, exist_ok=True)
    src = folder / "k.cu"
    src.write_text("__global__ void k(int* p) { *p = 7; }\n")
    out = folder / f"{name}.so"
    subprocess.run([NVCC, "-shared", "-Xcompiler", "-fPIC", *gencode, str(src), "-o", str(out)], check=True,
                   capture_output=True)
    return out


_LIBS: dict[tuple[str, str], bytes] = {}


def module_library(module: str, marker: str = "", entries: tuple[str, ...] | None = None) -> bytes:
    """The bytes of a real shared object (g++) exporting ``module``'s tvm-ffi entry points, as flashinfer's
    build of that module does (``entries`` instead, to leave them out), with ``marker`` in its data."""
    names = _carried.ENTRY_POINTS[module] if entries is None else entries
    key = (module, marker + "|" + ",".join(names))
    if key not in _LIBS:
        with tempfile.TemporaryDirectory() as d:
            body = "".join(f'extern "C" int __tvm_ffi_{n}(void*, const void*, int, void*) {{ return 0; }}\n'
                           for n in names)
            body += f'extern "C" const char marker[] = "{marker}";\n'
            _LIBS[key] = build_so(Path(d) / "m.so", body).read_bytes()
    return _LIBS[key]


def _carry(kset: Path, module: str, name: str, sass: list[str], library: bytes | str | None = None,
           **extra: object) -> None:
    folder = kset / name
    folder.mkdir(parents=True, exist_ok=True)
    data = library if isinstance(library, bytes) else module_library(module, library or "")
    (folder / f"{name}.so").write_bytes(data)
    rec = {"schema": 1, "module": module, "name": name, "sass": sass, "arch_list": "9.0a", "flashinfer": "0.7.4",
           "torch": "2.11.0", **extra}
    (folder / "stackprobe-kernel.json").write_text(json.dumps(rec))


def test_kernel_set_reads_records_and_skips_what_is_not_one(tmp_path: Path) -> None:
    kset = tmp_path / "aot"
    _carry(kset, "vllm_comm", "vllm_comm", ["sm_90a"])
    _carry(kset, "moe_a2a", "moe_alltoall", ["sm_90a", "sm_120f"])
    (kset / "broken").mkdir()
    (kset / "broken" / "stackprobe-kernel.json").write_text("{not json")
    (kset / "broken" / "broken.so").write_bytes(b"x")
    _carry(kset, "pcie_ipc", "renamed", ["sm_90a"])
    json_path = kset / "renamed" / "stackprobe-kernel.json"
    json_path.write_text(json.dumps({**json.loads(json_path.read_text()), "name": "other"}))  # name != folder
    _carry(kset, "trtllm_comm", "trtllm_comm", ["sm_90a"], schema=99)  # another schema
    _carry(kset, "pcie_ipc_ag_rs", "nolib", ["sm_90a"])
    (kset / "nolib" / "nolib.so").unlink()  # a record without its library
    (kset / "foreign").mkdir()
    (kset / "foreign" / "foreign.so").write_bytes(b"x")  # flashinfer's own AOT module: no record, not ours
    got = _carried.kernel_set(kset)
    assert sorted(got) == ["moe_a2a", "vllm_comm"]
    assert got["moe_a2a"].name == "moe_alltoall" and got["moe_a2a"].library == kset / "moe_alltoall" / "moe_alltoall.so"
    assert _carried.kernel_set(tmp_path / "missing") == {} and _carried.kernel_set(None) == {}


def test_a_huge_record_is_not_read(tmp_path: Path) -> None:
    kset = tmp_path / "aot"
    _carry(kset, "vllm_comm", "vllm_comm", ["sm_90a"], pad="x" * (2 << 20))
    assert _carried.kernel_set(kset) == {}


def test_runs_on_by_the_recorded_sass(tmp_path: Path) -> None:
    kset = tmp_path / "aot"
    _carry(kset, "vllm_comm", "vllm_comm", ["sm_90a"])
    _carry(kset, "pcie_ipc", "pcie_ipc_comm", ["sm_120a", "sm_120f"])
    got = _carried.kernel_set(kset)
    assert got["vllm_comm"].runs_on("9.0") and not got["vllm_comm"].runs_on("12.0")
    assert got["pcie_ipc"].runs_on("12.0") and not got["pcie_ipc"].runs_on("9.0")


def test_fitting_folder_links_only_what_runs_here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.test_kernel_identity import this_cell

    facts = this_cell(tmp_path, monkeypatch)
    kset = tmp_path / "aot"
    _carry(kset, "vllm_comm", "vllm_comm", ["sm_90a"], **facts)
    _carry(kset, "pcie_ipc", "pcie_ipc_comm", ["sm_120a"], **facts)
    built_here = tmp_path / "published" / "pcie_ipc_comm.so"
    built_here.parent.mkdir()
    built_here.write_bytes(b"local")
    folder = _carried.fitting_folder(kset, "9.0", tmp_path / "scratch", {"pcie_ipc_comm": built_here})
    assert folder is not None
    assert sorted(p.parent.name for p in folder.glob("*/*.so")) == ["pcie_ipc_comm", "vllm_comm"]
    assert (folder / "vllm_comm" / "vllm_comm.so").resolve() == (kset / "vllm_comm" / "vllm_comm.so").resolve()
    assert (folder / "pcie_ipc_comm" / "pcie_ipc_comm.so").read_bytes() == b"local"
    only = _carried.fitting_folder(kset, "12.0", tmp_path / "scratch2")
    assert only is not None and [p.parent.name for p in only.glob("*/*.so")] == ["pcie_ipc_comm"]
    both = tmp_path / "both"
    _carry(both, "vllm_comm", "vllm_comm", ["sm_90a", "sm_120a"], **facts)
    assert _carried.fitting_folder(both, "9.0", tmp_path / "scratch3") is None  # the set itself serves


@needs_nvcc
def test_judge_carries_only_a_library_with_every_listed_arch(tmp_path: Path) -> None:
    lib = _so(tmp_path / "a", "vllm_comm", "-gencode=arch=compute_90a,code=sm_90a")
    ok = {"stage": "done", "ok": True, "name": "vllm_comm", "library": str(lib), "flashinfer": "0.7.4",
          "needed": ["libcudart.so.13"], "unresolved_driver_calls": []}
    got = _fi_carry.judge("vllm_comm", ["9.0a"], ok)
    assert (got["ok"], got["sass"], got["library_bytes"]) == (True, ["sm_90a"], lib.stat().st_size)
    short = _fi_carry.judge("vllm_comm", ["9.0a", "12.0a"], ok)
    assert (short["ok"], short["reason_code"]) == (False, "fi-wrong-arch")
    assert "nothing for 12.0a" in short["line"]
    unresolved = _fi_carry.judge("vllm_comm", ["9.0a"], {**ok, "unresolved_driver_calls": ["cuPointerGetAttribute"]})
    assert (unresolved["ok"], unresolved["reason_code"]) == (False, "fi-link-unresolved")
    # fail-closed: a result without linkage facts is not carried, and says why
    unread = {k: v for k, v in ok.items() if k not in ("needed", "unresolved_driver_calls")}
    got = _fi_carry.judge("vllm_comm", ["9.0a"], {**unread, "linkage_error": "32-bit ELF"})
    assert (got["ok"], got["reason_code"]) == (False, "fi-link-unread") and "32-bit ELF" in got["line"]
    assert _fi_carry.judge("vllm_comm", ["9.0a"], unread)["reason_code"] == "fi-link-unread"


def test_judge_says_why_nothing_is_carried() -> None:
    absent = _fi_carry.judge("pcie_ipc", ["9.0a"], {"stage": "absent", "ok": False, "flashinfer": "0.6.8"})
    assert (absent["ok"], absent["reason_code"]) == (False, "fi-module-absent")
    failed = _fi_carry.judge("vllm_comm", ["9.0a"], {"stage": "compile", "ok": False,
                                                      "error": "sh: 1: /opt/cuda/bin/nvcc: not found"})
    assert (failed["ok"], failed["reason_code"]) == (False, "fi-no-nvcc")
    gone = _fi_carry.judge("vllm_comm", ["9.0a"], {"stage": "done", "ok": True, "library": "/nonexistent.so"})
    assert gone["ok"] is False


def test_plan_groups_one_build_across_cells_longest_first() -> None:
    cells = [
        {"cell_id": "a", "flashinfer": "0.7.4", "torch_cuda": "13.0", "archs": ("9.0a", "12.0f")},
        {"cell_id": "b", "flashinfer": "0.7.4", "torch_cuda": "13.0", "archs": ("9.0a", "12.0f")},
        {"cell_id": "c", "flashinfer": "0.6.17", "torch_cuda": "13.0", "archs": ("9.0a",)},
        {"cell_id": "d", "flashinfer": "none", "torch_cuda": "13.0", "archs": ("9.0a",)},
        {"cell_id": "e", "flashinfer": "0.7.4", "torch_cuda": "13.0", "archs": ()},
    ]
    groups = kernels.plan(cells, ("vllm_comm", "trtllm_comm"))
    got = [[(j.cell_id, j.module) for j in g] for g in groups]
    # trtllm_comm (950 s a target) before vllm_comm (14 s); two targets before one; a and b share each build
    assert got == [[("a", "trtllm_comm"), ("b", "trtllm_comm")], [("c", "trtllm_comm")],
                   [("a", "vllm_comm"), ("b", "vllm_comm")], [("c", "vllm_comm")]]


IDENTITY = {"flashinfer": "0.7.4", "torch": "2.11.0+cu130", "torch_cuda": "13.0", "nvcc": "13.0.88",
            _carried.TVM_FFI: "0.1.15.post2", "source_hash": {"vllm_comm": "abc"}}


def test_a_kernel_set_is_current_only_when_every_fact_of_its_bytes_matches(tmp_path: Path) -> None:
    kset = tmp_path / "k"
    _carry(kset, "vllm_comm", "vllm_comm", ["sm_90a", "sm_120f"], arch_list="9.0a 12.0f", declared="9.0a 12.0f",
           torch="2.11.0+cu130", torch_cuda="13.0", nvcc="13.0.88", source_hash="abc",
           **{_carried.TVM_FFI: "0.1.15.post2"})
    job = kernels.Job("c", "vllm_comm", ("9.0a", "12.0f"), "0.7.4", "13.0", 1.0)
    have, why = kernels.current(kset, job, IDENTITY)
    assert have is not None and why == ""
    for fact, value in (("torch", "2.11.0+cu128"), ("torch_cuda", "12.8"), ("nvcc", "12.8.93"),
                        (_carried.TVM_FFI, "0.1.11")):
        have, why = kernels.current(kset, job, {**IDENTITY, fact: value})
        assert have is None and why.startswith(f"{fact}: {value} wanted")
    have, why = kernels.current(kset, job, {**IDENTITY, "source_hash": {"vllm_comm": "def"}})
    assert have is None and why.startswith("source_hash: def wanted, abc in the record")
    assert kernels.current(kset, kernels.Job("c", "vllm_comm", ("9.0a",), "0.7.4", "13.0", 1.0),
                           IDENTITY)[1].startswith("declared: 9.0a wanted")
    assert kernels.current(kset, kernels.Job("c", "vllm_comm", ("9.0a", "12.0f"), "0.7.3", "13.0", 1.0),
                           IDENTITY)[1].startswith("flashinfer: 0.7.3 wanted")
    assert kernels.current(kset, job, None)[0] is None  # the cell's facts unread: nothing is current
    assert kernels.current(kset, kernels.Job("c", "moe_a2a", ("9.0a", "12.0f"), "0.7.4", "13.0", 1.0),
                           IDENTITY)[0] is None


def test_a_record_without_a_fact_is_not_current(tmp_path: Path) -> None:
    kset = tmp_path / "k"  # a record of the earlier layout: no nvcc, no source hash
    _carry(kset, "vllm_comm", "vllm_comm", ["sm_90a"], arch_list="9.0a", torch="2.11.0+cu130", torch_cuda="13.0")
    have, why = kernels.current(kset, kernels.Job("c", "vllm_comm", ("9.0a",), "0.7.4", "13.0", 1.0), IDENTITY)
    assert have is None and why == "nvcc: 13.0.88 wanted, none in the record"


def test_install_tree_makes_the_carried_modules_exactly_the_set(tmp_path: Path) -> None:
    kset, aot = tmp_path / "k", tmp_path / "aot"
    _carry(kset, "vllm_comm", "vllm_comm", ["sm_90a"], library="new")
    _carry(aot, "vllm_comm", "vllm_comm", ["sm_90a"], library="old")
    _carry(aot, "moe_a2a", "moe_alltoall", ["sm_90a"])  # carried before, not in the set any more
    (aot / "foreign").mkdir()
    (aot / "foreign" / "foreign.so").write_bytes(b"theirs")
    kernels.install_tree(kset, aot)
    assert (aot / "vllm_comm" / "vllm_comm.so").read_bytes() == module_library("vllm_comm", "new")
    assert not (aot / "moe_alltoall").exists()
    assert (aot / "foreign" / "foreign.so").read_bytes() == b"theirs"
    assert sorted(_carried.kernel_set(aot)) == ["vllm_comm"]


def test_parse_result_of_a_builder_that_said_nothing() -> None:
    got = kernels.parse_result("garbage\n@@FI-CARRY@@ {bad", 1, "Traceback\nKeyError: x")
    assert (got["ok"], got["reason_code"]) == (False, "harness-error")
    assert "exited 1" in got["line"] and "KeyError: x" in got["line"]
    assert kernels.parse_result('@@FI-CARRY@@ {"ok": true, "name": "m"}\n', 0, "") == {"ok": True, "name": "m"}


def test_a_build_record_says_what_its_cell_carries_when_installed() -> None:
    from common.build.buildrecord import BuildRecord

    def carried(data: dict) -> dict:
        return dict(BuildRecord.from_json(data).carried)

    rec = {"kernels": {"installed": True, "modules": {
        "vllm_comm": {"carried": True, "sass": ["sm_90a"]},
        "trtllm_comm": {"carried": False, "reason_code": "fi-no-nvcc"},
        "moe_a2a": {"carried": True, "sass": "sm_90a"},  # not a list: not trusted
    }}}
    assert carried(rec) == {"vllm_comm": ("sm_90a",)}
    assert carried({"kernels": {**rec["kernels"], "installed": False}}) == {}
    assert carried({"kernels": "yes"}) == {} and carried({}) == {}


def test_quick_pass_defers_only_gpu_variants_that_would_compile_in_their_turn() -> None:
    from checks.run.plan import CellTarget, WorkItem, deferred
    from inenv.probe import ProbeSpec, Variant

    gpu = ProbeSpec("ar-latency", "g", "f", needs_gpu=True)
    fusion = ProbeSpec("fi-fusion", "g", "f", needs_gpu=True)
    cell = CellTarget("cella", "resolved", versions={"flashinfer": "0.7.4"})
    nccl = WorkItem(cell, gpu, Variant("ar-latency", 2, (("backend", "nccl"),)), 60.0)
    custom = WorkItem(cell, gpu, Variant("ar-latency", 2, (("backend", "flashinfer-custom-ar"),)), 60.0)
    fused = WorkItem(cell, fusion, Variant("fi-fusion", 2), 60.0)
    every = lambda item, modules: list(modules)  # noqa: E731  (nothing published here)
    carries = {"cella": {"vllm_comm": ("sm_90a",), "trtllm_comm": ("sm_120a",)}}
    got = deferred([nccl, custom, fused], carries, "9.0", every)
    assert [it.decided for it in got[:2]] == [None, None]  # NCCL loads nothing; vllm_comm is carried for 9.0
    assert got[2].decided is not None and got[2].decided.reason_code == "deferred-compile"
    assert "trtllm_comm" in got[2].decided.note and "9.0" in got[2].decided.note
    on_blackwell = deferred([custom, fused], carries, "12.0", every)
    assert on_blackwell[0].decided is not None and on_blackwell[1].decided is None
    published = deferred([fused], {}, "9.0", lambda item, modules: [])  # fi-jit built it here: it runs
    assert published[0].decided is None


def test_quick_pass_runs_each_multi_rank_variant_at_its_smallest_world_size() -> None:
    from checks.run.plan import CellTarget, Decided, WorkItem, deferred_sizes
    from inenv.probe import ProbeSpec, Variant
    from inenv.status import Status

    step = ProbeSpec("step", "s", "f", needs_gpu=True)
    jit = ProbeSpec("fi-jit", "b", "f", needs_gpu=False)
    cell = CellTarget("cella", "resolved", versions={"flashinfer": "0.7.4"})
    symm = (("backend", "symm-mem-one-shot"),)
    fused = (("backend", "flashinfer-fusion"),)
    items = [WorkItem(cell, step, Variant("step", n, p, share_gpu=True, gpus=1), 60.0)
             for p in (symm, fused) for n in (2, 3, 4, 8)]
    # the fusion backend's 2 ranks were decided in advance (as a skip): its smallest runnable size is 3
    items[4] = WorkItem(cell, step, items[4].variant, 60.0, decided=Decided(Status.SKIP, "too-few-gpus", "x"))
    items.append(WorkItem(cell, jit, Variant("fi-jit", 1, (("module", "vllm_comm"),)), 60.0))
    got = deferred_sizes(items)
    ran = [(it.variant.ranks, dict(it.variant.params).get("backend")) for it in got if it.decided is None]
    assert ran == [(2, "symm-mem-one-shot"), (3, "flashinfer-fusion"), (1, None)]
    later = [it for it in got if it.decided is not None and it.decided.reason_code == "deferred-world-size"]
    assert sorted((it.variant.ranks, dict(it.variant.params)["backend"]) for it in later) == [
        (3, "symm-mem-one-shot"), (4, "flashinfer-fusion"), (4, "symm-mem-one-shot"), (8, "flashinfer-fusion"),
        (8, "symm-mem-one-shot")]
    assert later[0].decided.status is Status.NOT_RUN and "at 2 ranks only" in later[0].decided.note


def test_a_quick_compile_variant_is_told_the_level_and_keeps_its_key() -> None:
    from checks.run.plan import CellTarget, WorkItem
    from checks.run.runner import level_variant
    from inenv.probe import ProbeSpec, Variant

    build = ProbeSpec("fi-jit", "b", "f", needs_gpu=False, build_param="module")
    plain = ProbeSpec("inventory", "i", "f", needs_gpu=False)
    cell = CellTarget("cella", "resolved")
    item = WorkItem(cell, build, Variant("fi-jit", 1, (("module", "vllm_comm"), ("arch", "local"))), 60.0)
    told = level_variant(item, "quick")
    assert ("env.STACKPROBE_LEVEL", "quick") in told.params and item.key[2] == "ranks=1,module=vllm_comm,arch=local"
    assert level_variant(item, "full") == item.variant
    other = WorkItem(cell, plain, Variant("inventory", 1), 60.0)
    assert level_variant(other, "quick") == other.variant


GATE = "RuntimeError: No supported CUDA architectures found for major versions [9, 10]."


@needs_nvcc
def test_a_build_flashinfers_gate_made_for_part_of_the_list_is_carried_for_that_part(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """flashinfer 0.6.16 builds trtllm_comm for SM9x only: asked for 9.0a and 12.0a it returns a library with
    sm_90a alone. That library is carried for 9.0a, and 12.0a is recorded with flashinfer's own refusal of a
    build for it alone (fi-arch-gate, the name fi-jit gives the same refusal). The builder and flashinfer's
    spec are stood in for: the library is real (nvcc), the rest is what flashinfer 0.6.16 answers."""
    lib = _so(tmp_path / "lib", "trtllm_comm", "-gencode=arch=compute_90a,code=sm_90a")
    built: list[str] = []

    def build(module: str, env: dict[str, str], timeout_s: float, **kw: object) -> dict[str, object]:
        built.append(env["FLASHINFER_CUDA_ARCH_LIST"])
        return {"stage": "done", "ok": True, "name": "trtllm_comm", "library": str(lib), "flashinfer": "0.6.16",
                "needed": ["libcuda.so.1"], "unresolved_driver_calls": [], "toolkit": {"version": "13.0"}}

    monkeypatch.setattr(_fi_carry._fi_build, "run_build_subprocess", build)
    monkeypatch.setattr(_fi_carry, "spec_refusal", lambda module, arch, env: GATE if arch == "12.0a" else "")
    got = _fi_carry.carry("trtllm_comm", ["9.0a", "12.0a"], tmp_path / "out", 60.0)
    assert built == ["9.0a 12.0a"]  # compiled once; nothing of it thrown away
    assert (got["ok"], got["arch_list"], got["declared"]) == (True, "9.0a", "9.0a 12.0a")
    assert got["refused"] == {"12.0a": {"reason_code": "fi-arch-gate", "line": GATE}}
    rec = json.loads((tmp_path / "out" / "trtllm_comm" / "stackprobe-kernel.json").read_text())
    assert (rec["arch_list"], rec["declared"], rec["refused"]) == ("9.0a", "9.0a 12.0a", got["refused"])
    assert rec["nvcc"] == "13.0" and rec["torch"] == _fi_carry.torch_version()
    # flashinfer accepts 12.0a alone, yet the library lacks it: carried for 9.0a, 12.0a recorded as fi-wrong-arch
    monkeypatch.setattr(_fi_carry, "spec_refusal", lambda module, arch, env: "")
    other = _fi_carry.carry("trtllm_comm", ["9.0a", "12.0a"], tmp_path / "out2", 60.0)
    assert other["ok"] and other["refused"]["12.0a"]["reason_code"] == "fi-wrong-arch"


def test_a_builder_that_stopped_without_a_verdict_is_a_harness_failure() -> None:
    timeout = _fi_carry.judge("trtllm_comm", ["9.0a"], {"stage": "timeout", "ok": False, "error": "no result in 60 s"})
    crash = _fi_carry.judge("trtllm_comm", ["9.0a"], {"stage": "crash", "ok": False, "error": "builder exited -9"})
    assert (timeout["reason_code"], crash["reason_code"]) == ("kernel-build-timeout", "harness-error")
    assert kernels.retried(timeout["reason_code"]) and kernels.retried(crash["reason_code"])


def test_a_variant_loading_a_carried_module_is_not_said_to_compile(tmp_path: Path) -> None:
    from checks.run.plan import CellTarget, WorkItem
    from checks.run.runprogress import compile_note
    from inenv.probe import ProbeSpec, Variant

    fusion = ProbeSpec("fi-fusion", "g", "f", needs_gpu=True)
    item = WorkItem(CellTarget("cella", "resolved", versions={"flashinfer": "0.7.4"}), fusion,
                    Variant("fi-fusion", 2), 60.0)
    empty_cache = tmp_path / "compile"  # fi-jit published nothing here
    assert "compiles trtllm_comm in its turn" in compile_note(empty_cache)(item)
    carried = {"cella": {"trtllm_comm": ("sm_90a",)}}
    assert compile_note(empty_cache, carried, "9.0")(item) == ""
    assert "compiles trtllm_comm" in compile_note(empty_cache, carried, "12.0")(item)  # not for this GPU

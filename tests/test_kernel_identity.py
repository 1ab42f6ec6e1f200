"""Same code, same cell, for carried kernels: a kernel set is current only when every fact that decides its bytes
is the cell's (provision.kernels), the kernel-set reader follows no link and accepts only flashinfer's module
(inenv.kit._carried), linkage is judged fail-closed (inenv.kit._elf), a target flashinfer's gate refuses is a
record field that causes no rebuild, and the harness flag of the reason catalogue decides what is retried.

The kernel stage runs here with a stand-in for the builder inside a cell (the test environment has no cell with
flashinfer and nvcc; the real builder is covered by tests/test_probes_flashinfer.py): it writes a real shared
object and the record `inenv.carry` writes, and counts the compiles it was asked for."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml

from common.build import backend
from inenv import carry as _fi_carry
from inenv.kit import _carried, _compile_cache, _elf
from inenv.probes import fi_jit
from provision import kernels
from provision.buildsession import kernels_line
from tests.checks_helpers import ROOT
from tests.test_carried import module_library

TVM_FFI = "0.1.15.post2"  # the apache-tvm-ffi release the cells of these tests have
CU130 = {"flashinfer": "0.7.4", "torch": "2.11.0+cu130", "torch_cuda": "13.0", "nvcc": "13.0",
         _carried.TVM_FFI: TVM_FFI, "source_hash": {"vllm_comm": "src1", "trtllm_comm": "src2"}}
GATE = "RuntimeError: No supported CUDA architectures found for major versions [9, 10]."


class StandInCell:
    """The builder of one cell, as `provision build` drives it: compile writes what `inenv.carry.carry` writes
    for a build flashinfer's gate made for part of the list (``gated``: target -> refused), identity answers
    the cell's facts; both count their calls."""

    def __init__(self, facts: Mapping[str, Any], gated: Mapping[str, str] = {}, readable: bool = True) -> None:
        self.facts, self.gated, self.readable = facts, dict(gated), readable
        self.compiles: list[tuple[str, tuple[str, ...]]] = []
        self.identities = 0
        self.installed: list[Path] = []

    def compile(self, job: kernels.Job, out_dir: Path) -> dict[str, Any]:
        self.compiles.append((job.module, job.archs))
        kept = [a for a in job.archs if a not in self.gated]
        refused = {a: {"reason_code": "fi-arch-gate", "line": GATE} for a in job.archs if a in self.gated}
        folder = out_dir / job.module
        folder.mkdir(parents=True, exist_ok=True)
        library = folder / f"{job.module}.so"
        library.write_bytes(module_library(job.module, "built"))
        sass = [f"sm_{a.replace('.', '')}" for a in kept]
        record = {"schema": 1, "module": job.module, "name": job.module, "sass": sass, "arch_list": " ".join(kept),
                  "declared": " ".join(job.archs), "refused": refused, "flashinfer": job.flashinfer,
                  "torch": self.facts["torch"], "torch_cuda": self.facts["torch_cuda"], "nvcc": self.facts["nvcc"],
                  _carried.TVM_FFI: self.facts[_carried.TVM_FFI], "source_hash": self.facts["source_hash"][job.module],
                  "built_at": "2026-12-04T00:00:00Z"}
        (folder / _carried.RECORD).write_text(json.dumps(record))
        return {"ok": True, "name": job.module, "sass": sass, "arch_list": " ".join(kept), "refused": refused,
                "library_bytes": library.stat().st_size, "compile_cpu_s": 12.0}

    def running_cpu_s(self) -> float | None:
        return 0.0

    def identity(self, kernel_dir: Path) -> dict[str, Any] | None:
        self.identities += 1
        return dict(self.facts) if self.readable else None

    def install(self, kernel_dir: Path, rec: Mapping[str, Any]) -> dict[str, Any]:
        self.installed.append(kernel_dir)
        return {}


def _cell(envs: Path, cid: str, status: str = "built") -> dict[str, Any]:
    (envs / cid).mkdir(parents=True, exist_ok=True)
    return {"cell_id": cid, "status": status, "backend": backend.VENV,
            "versions": {"flashinfer": "0.7.4", "torch": "2.11.0+cu130", "torch_cuda": "13.0"}}


def _stage(rec: dict[str, Any], cell: StandInCell, tmp: Path, archs: tuple[str, ...], modules: tuple[str, ...],
           lines: list[str]) -> dict[str, Any]:
    got = kernels.carry([rec], {rec["cell_id"]: archs}, 1, tmp / "envs", lambda cid, msg: lines.append(msg),
                        kernels_root=tmp / "kernels", cache=tmp / "cache", modules=modules,
                        carriers={rec["cell_id"]: cell})
    return got[0]


def test_a_cu128_kernel_set_offered_to_a_cu130_cell_is_rebuilt_naming_the_fact(tmp_path: Path) -> None:
    cid = "cu130-torch2.11.0-sglnone-fi0.7.4"
    kset = tmp_path / "kernels" / cid / "vllm_comm"
    kset.mkdir(parents=True)
    (kset / "vllm_comm.so").write_bytes(module_library("vllm_comm", "cu128"))
    (kset / _carried.RECORD).write_text(json.dumps({
        "schema": 1, "module": "vllm_comm", "name": "vllm_comm", "sass": ["sm_90a"], "arch_list": "9.0a",
        "declared": "9.0a", "flashinfer": "0.7.4", "torch": "2.11.0+cu128", "torch_cuda": "12.8", "nvcc": "13.0",
        _carried.TVM_FFI: TVM_FFI, "source_hash": "src1", "cell": "cu128-torch2.11.0-sglnone-fi0.7.4"}))
    cell, lines = StandInCell(CU130), []
    rec = _stage(_cell(tmp_path / "envs", cid), cell, tmp_path, ("9.0a",), ("vllm_comm",), lines)
    assert cell.compiles == [("vllm_comm", ("9.0a",))]
    assert ("kernels: vllm_comm in the kernel set is not this cell's (torch: 2.11.0+cu130 wanted, 2.11.0+cu128 in "
            "the record): removed, built again") in lines
    assert json.loads((kset / _carried.RECORD).read_text())["torch"] == "2.11.0+cu130"
    assert rec["kernels"]["modules"]["vllm_comm"]["carried"] is True and rec["kernels"]["installed"] is True


def test_a_relock_that_moves_only_apache_tvm_ffi_rebuilds_naming_it(tmp_path: Path) -> None:
    """flashinfer inlines apache-tvm-ffi's headers into every module it builds: the same flashinfer, torch, nvcc
    and sources beside another tvm-ffi release is not the cell's build, and the stage says which fact moved."""
    cid = "cu130-torch2.11.0-sglnone-fi0.7.4"
    first, lines = StandInCell(CU130), []
    _stage(_cell(tmp_path / "envs", cid), first, tmp_path, ("9.0a",), ("vllm_comm",), lines)
    assert first.compiles == [("vllm_comm", ("9.0a",))]
    same = StandInCell(CU130)
    _stage(_cell(tmp_path / "envs", cid), same, tmp_path, ("9.0a",), ("vllm_comm",), lines)
    assert same.compiles == []  # the control: nothing moved, nothing is built
    relocked = StandInCell({**CU130, _carried.TVM_FFI: "0.1.16"})
    lines.clear()
    _stage(_cell(tmp_path / "envs", cid), relocked, tmp_path, ("9.0a",), ("vllm_comm",), lines)
    assert relocked.compiles == [("vllm_comm", ("9.0a",))]
    assert ("kernels: vllm_comm in the kernel set is not this cell's (apache-tvm-ffi: 0.1.16 wanted, 0.1.15.post2 in "
            "the record): removed, built again") in lines
    record = json.loads((tmp_path / "kernels" / cid / "vllm_comm" / _carried.RECORD).read_text())
    assert record[_carried.TVM_FFI] == "0.1.16"


def test_a_record_without_the_tvm_ffi_release_is_not_current(tmp_path: Path) -> None:
    """A record written before the release was recorded says nothing of the headers it was built with."""
    kset = tmp_path / "kernels" / "c"
    StandInCell(CU130).compile(kernels.Job("c", "vllm_comm", ("9.0a",), "0.7.4", "13.0", 1.0), kset)
    path = kset / "vllm_comm" / _carried.RECORD
    path.write_text(json.dumps({k: v for k, v in json.loads(path.read_text()).items() if k != _carried.TVM_FFI}))
    have, why = kernels.current(kset, kernels.Job("c", "vllm_comm", ("9.0a",), "0.7.4", "13.0", 1.0), CU130)
    assert have is None and why == "apache-tvm-ffi: 0.1.15.post2 wanted, none in the record"


def test_unread_cell_facts_build_rather_than_trust(tmp_path: Path) -> None:
    cid = "cellx"
    first, lines = StandInCell(CU130), []
    _stage(_cell(tmp_path / "envs", cid), first, tmp_path, ("9.0a",), ("vllm_comm",), lines)
    assert first.compiles == [("vllm_comm", ("9.0a",))]
    blind = StandInCell(CU130, readable=False)  # the same set, but the cell's facts cannot be read
    _stage(_cell(tmp_path / "envs", cid), blind, tmp_path, ("9.0a",), ("vllm_comm",), lines)
    assert blind.compiles == [("vllm_comm", ("9.0a",))]
    assert any("identity (torch, nvcc, sources) could not be read" in line for line in lines)


def test_a_refused_target_is_recorded_and_a_second_build_does_nothing_for_that_module(tmp_path: Path) -> None:
    cid = "cu130-torch2.11.0-sglnone-fi0.6.16"
    cell, lines = StandInCell(CU130, gated={"12.0a": GATE}), []
    rec = _stage(_cell(tmp_path / "envs", cid), cell, tmp_path, ("9.0a", "12.0a"), ("trtllm_comm",), lines)
    assert cell.compiles == [("trtllm_comm", ("9.0a", "12.0a"))]
    row = rec["kernels"]["modules"]["trtllm_comm"]
    assert row["carried"] is True and row["arch_list"] == "9.0a"
    assert row["refused"] == {"12.0a": {"reason_code": "fi-arch-gate", "line": GATE}}
    assert "trtllm_comm for 9.0a only, 12.0a refused: fi-arch-gate" in kernels_line(rec["kernels"])
    carried = _carried.kernel_set(tmp_path / "kernels" / cid)["trtllm_comm"]
    assert carried.refused == {"12.0a": {"reason_code": "fi-arch-gate", "line": GATE}}
    # the next `provision build`: the cell unchanged, so its record says skipped-unchanged
    again = StandInCell(CU130, gated={"12.0a": GATE})
    later = _stage({**rec, "status": "skipped-unchanged"}, again, tmp_path, ("9.0a", "12.0a"), ("trtllm_comm",),
                   lines)
    assert again.compiles == [] and again.identities == 0  # nothing compiled, nothing asked of the cell
    assert later["kernels"]["modules"]["trtllm_comm"]["refused"]["12.0a"]["reason_code"] == "fi-arch-gate"


def test_the_retry_rule_is_the_catalogues_harness_flag() -> None:
    entries = yaml.safe_load((ROOT / "common" / "reasons.yaml").read_text())
    harness = {e["code"] for e in entries if e.get("harness")}
    assert {"harness-error", "kernel-build-timeout"} <= harness
    for entry in entries:
        assert kernels.retried(entry["code"]) is (entry["code"] in harness), entry["code"]
    assert kernels.retried("not-a-catalogued-code")
    job = kernels.Job("c", "trtllm_comm", ("9.0a",), "0.7.4", "13.0", 1.0)

    def rec(code: str) -> dict[str, Any]:
        return {"status": "skipped-unchanged", "kernels": {"arch_list": "9.0a", "modules": {
            "trtllm_comm": {"carried": False, "reason_code": code, "line": "x"}}}}

    assert kernels.known_failure(rec("kernel-build-timeout"), job) is None
    assert kernels.known_failure(rec("fi-arch-gate"), job) is not None


def test_fitting_folder_for_cell_b_links_none_of_cell_as_modules(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    facts = this_cell(tmp_path, monkeypatch)
    a, b, scratch = tmp_path / "a", tmp_path / "b", tmp_path / "scratch"
    for kset, module in ((a, "vllm_comm"), (a, "pcie_ipc"), (b, "pcie_ipc")):
        folder = kset / module
        folder.mkdir(parents=True)
        (folder / f"{module}.so").write_bytes(module_library(module, kset.name))
        sass = ["sm_90a"] if module == "vllm_comm" else ["sm_120a"]
        (folder / _carried.RECORD).write_text(json.dumps({"schema": 1, "module": module, "name": module,
                                                          "sass": sass, **facts}))
    extra = tmp_path / "local.so"
    extra.write_bytes(module_library("trtllm_comm"))
    first = _carried.fitting_folder(a, "9.0", scratch, {"trtllm_comm": extra})
    assert first is not None
    assert sorted(p.parent.name for p in first.glob("*/*.so")) == ["trtllm_comm", "vllm_comm"]
    second = _carried.fitting_folder(b, "9.0", scratch, {"trtllm_comm": extra})
    assert second is not None and second != first
    assert sorted(p.parent.name for p in second.glob("*/*.so")) == ["trtllm_comm"]
    assert not first.exists() and extra.exists()  # this process's earlier folder is gone, never what it linked
    assert all(not str(p.resolve()).startswith(str(a)) for p in second.glob("*/*.so"))


def test_a_linked_library_in_a_kernel_set_is_refused_and_its_target_never_copied(tmp_path: Path) -> None:
    secret = tmp_path / "private" / "id_ed25519"
    secret.parent.mkdir()
    secret.write_bytes(module_library("vllm_comm", "SECRET-KEY-BYTES"))  # even a library that would pass
    kset, aot = tmp_path / "k", tmp_path / "aot"
    folder = kset / "vllm_comm"
    folder.mkdir(parents=True)
    (folder / "vllm_comm.so").symlink_to(secret)
    (folder / _carried.RECORD).write_text(json.dumps({"schema": 1, "module": "vllm_comm", "name": "vllm_comm",
                                                      "sass": ["sm_90a"]}))
    linked_dir = kset / "pcie_ipc_comm"  # a whole module folder that is a link
    real = tmp_path / "elsewhere" / "pcie_ipc_comm"
    real.mkdir(parents=True)
    (real / "pcie_ipc_comm.so").write_bytes(module_library("pcie_ipc", "SECRET-KEY-BYTES"))
    (real / _carried.RECORD).write_text(json.dumps({"schema": 1, "module": "pcie_ipc", "name": "pcie_ipc_comm",
                                                    "sass": ["sm_90a"]}))
    linked_dir.symlink_to(real, target_is_directory=True)
    found, refused = _carried.scan(kset)
    assert found == {}
    assert "link" in refused["vllm_comm"] and "link" in refused["pcie_ipc_comm"]
    kernels.install_tree(kset, aot)
    copied = [p.read_bytes() for p in aot.rglob("*") if p.is_file()] if aot.exists() else []
    assert not any(b"SECRET-KEY-BYTES" in data for data in copied)
    ctx = tmp_path / "layer"  # a Docker cell's kernel layer: its build context holds nothing of the links
    kernels.layer_context(kset, ctx, "sha256:base", "/opt/venv/aot")
    assert [p.name for p in (ctx / "kernels").iterdir()] == []
    assert not any(b"SECRET-KEY-BYTES" in p.read_bytes() for p in ctx.rglob("*") if p.is_file())
    assert not any(p.is_symlink() for p in ctx.rglob("*"))
    record_link = tmp_path / "k2" / "vllm_comm"
    record_link.mkdir(parents=True)
    (record_link / "vllm_comm.so").write_bytes(module_library("vllm_comm"))
    (record_link / _carried.RECORD).symlink_to(folder / _carried.RECORD)
    assert _carried.kernel_set(tmp_path / "k2") == {}  # a record read through a link is no record


def test_a_library_without_the_modules_entry_points_is_refused(tmp_path: Path) -> None:
    kset = tmp_path / "k"
    cases = {
        "vllm_comm": module_library("vllm_comm", entries=()),  # a shared object, but not that module
        "trtllm_comm": module_library("vllm_comm"),  # another module's library under this name
        "pcie_ipc": module_library("pcie_ipc")[:200],  # a truncated one
    }
    for module, data in cases.items():
        (kset / module).mkdir(parents=True)
        (kset / module / f"{module}.so").write_bytes(data)
        (kset / module / _carried.RECORD).write_text(json.dumps({"schema": 1, "module": module, "name": module,
                                                                 "sass": ["sm_90a"]}))
    found, refused = _carried.scan(kset)
    assert found == {}
    assert "__tvm_ffi_init_custom_ar" in refused["vllm_comm"]
    assert "__tvm_ffi_trtllm_allreduce_fusion" in refused["trtllm_comm"]
    assert "not a readable shared object" in refused["pcie_ipc"]
    ok = tmp_path / "ok" / "vllm_comm"
    ok.mkdir(parents=True)
    (ok / "vllm_comm.so").write_bytes(module_library("vllm_comm"))
    (ok / _carried.RECORD).write_text(json.dumps({"schema": 1, "module": "vllm_comm", "name": "vllm_comm"}))
    assert list(_carried.kernel_set(ok.parent)) == ["vllm_comm"]  # the control: the same layout, the module


def test_elf_that_is_not_64_bit_little_endian_is_refused_by_name(tmp_path: Path) -> None:
    good = tmp_path / "good.so"
    good.write_bytes(module_library("vllm_comm"))
    assert _elf.unread(str(good)) == "" and _elf.linkage(str(good)) is not None
    for offset, value, words in ((4, 1, "32-bit ELF"), (5, 2, "big-endian ELF")):
        data = bytearray(good.read_bytes())
        data[offset] = value
        bad = tmp_path / f"bad{offset}.so"
        bad.write_bytes(bytes(data))
        assert _elf.linkage(str(bad)) is None and _elf.unread(str(bad)).startswith(words)
        assert "not a readable shared object: " + words in _carried.library_refusal("vllm_comm", bad)
    text = tmp_path / "t.so"
    text.write_text("hello")
    assert _elf.unread(str(text)) == "not an ELF file"


def _site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A minimal installed flashinfer 0.7.4 (its package, one source file and its dist-info) and apache-tvm-ffi
    0.1.15.post2 (its dist-info) first on sys.path."""
    site = tmp_path / "site"
    (site / "flashinfer" / "data" / "csrc").mkdir(parents=True)
    (site / "flashinfer" / "__init__.py").write_text("")
    (site / "flashinfer" / "data" / "csrc" / "vllm_custom_all_reduce.cu").write_text("// the module's source\n")
    dist = site / "flashinfer_python-0.7.4.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: flashinfer-python\nVersion: 0.7.4\n")
    ffi = site / "apache_tvm_ffi-0.1.15.post2.dist-info"
    ffi.mkdir()
    (ffi / "METADATA").write_text(f"Metadata-Version: 2.1\nName: apache-tvm-ffi\nVersion: {TVM_FFI}\n")
    monkeypatch.syspath_prepend(str(site))
    for name in [m for m in sys.modules if m == "flashinfer" or m.startswith("flashinfer.")]:
        monkeypatch.delitem(sys.modules, name)
    return site


def this_cell(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The record facts of a module built in this environment (with the minimal flashinfer of :func:`_site`)."""
    site = _site(tmp_path, monkeypatch)
    here = _carried.cell_facts({})
    return {"flashinfer": "0.7.4", "torch": here["torch"], "torch_cuda": here["torch_cuda"], "nvcc": here["nvcc"],
            _carried.TVM_FFI: TVM_FFI, "sources": [], "source_hash": _compile_cache.source_hash([], str(site))}


def test_at_run_time_a_record_of_another_torch_cuda_build_is_refused(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    site = _site(tmp_path, monkeypatch)
    here = _fi_carry.identity({})
    if not here["torch"] or "+" not in str(here["torch"]):
        pytest.skip("this environment's torch has no CUDA build label")
    names = ["$SITE/flashinfer/data/csrc/vllm_custom_all_reduce.cu"]
    source = _compile_cache.source_hash(names, str(site))
    folder = site / "flashinfer" / "data" / "aot" / "vllm_comm"
    folder.mkdir(parents=True)
    (folder / "vllm_comm.so").write_bytes(module_library("vllm_comm"))
    base = {"schema": 1, "module": "vllm_comm", "name": "vllm_comm", "sass": ["sm_90a"], "arch_list": "9.0a",
            "flashinfer": "0.7.4", "torch": here["torch"], "torch_cuda": here["torch_cuda"], "nvcc": here["nvcc"],
            _carried.TVM_FFI: TVM_FFI, "sources": names, "source_hash": source}
    (folder / _carried.RECORD).write_text(json.dumps(base))
    assert _carried.aot_dir() == site / "flashinfer" / "data" / "aot"
    carried, why = fi_jit.carried_for_cell("vllm_comm")
    assert carried is not None and why == ""  # the control: this cell's own record
    other = str(here["torch"]).split("+")[0] + "+cu128" if "cu128" not in str(here["torch"]) else "2.11.0+cu130"
    (folder / _carried.RECORD).write_text(json.dumps({**base, "torch": other, "torch_cuda": "12.8"}))
    carried, why = fi_jit.carried_for_cell("vllm_comm")
    assert carried is None
    assert why.startswith(f"the kernel set left out vllm_comm: its record is not this cell's (torch: {here['torch']} "
                          "wanted")
    (folder / _carried.RECORD).write_text(json.dumps(base))
    (site / "flashinfer" / "data" / "csrc" / "vllm_custom_all_reduce.cu").write_text("// patched here\n")
    _compile_cache._FILE_DIGESTS.clear()
    carried, why = fi_jit.carried_for_cell("vllm_comm")
    assert carried is None and "source_hash" in why


def test_at_run_time_a_record_of_another_tvm_ffi_release_is_refused(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """In the cell: this environment's apache-tvm-ffi is read from its metadata (the dist-info :func:`_site`
    installs), and a carried module recorded with another release is left out of what flashinfer loads."""
    facts = this_cell(tmp_path, monkeypatch)
    assert _carried.cell_facts({})[_carried.TVM_FFI] == TVM_FFI
    kset = tmp_path / "aot"
    for module, ffi in (("vllm_comm", TVM_FFI), ("pcie_ipc", "0.1.11")):
        (kset / module).mkdir(parents=True)
        (kset / module / f"{module}.so").write_bytes(module_library(module))
        (kset / module / _carried.RECORD).write_text(json.dumps({"schema": 1, "module": module, "name": module,
                                                                 "sass": ["sm_90a"], **facts, _carried.TVM_FFI: ffi}))
    usable, refused = _carried.usable(kset)
    assert list(usable) == ["vllm_comm"]
    assert refused == {"pcie_ipc": "its record is not this cell's (apache-tvm-ffi: 0.1.15.post2 wanted, 0.1.11 in "
                                   "the record)"}


def test_record_free_text_reaches_a_note_escaped() -> None:
    result = {"cached": True, "cached_by": "carried", "cached_from": {
        "name": "vllm_comm", "built_at": "2026\x1b[31m\u202eevil\x07", "nvcc": "13.0\u2066", "arch_list": "9.0a"}}
    note = fi_jit.cached_note(result)
    assert not any(c in note for c in ("\x1b", "\u202e", "\x07", "\u2066"))
    assert "\\x1b" in note and "\\u202e" in note and "\\x07" in note and "\\u2066" in note


def test_install_never_writes_through_a_link_in_the_target(tmp_path: Path) -> None:
    kset, aot = tmp_path / "k", tmp_path / "aot"
    (kset / "vllm_comm").mkdir(parents=True)
    (kset / "vllm_comm" / "vllm_comm.so").write_bytes(module_library("vllm_comm", "new"))
    (kset / "vllm_comm" / _carried.RECORD).write_text(json.dumps({"schema": 1, "module": "vllm_comm",
                                                                  "name": "vllm_comm", "sass": ["sm_90a"]}))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    aot.mkdir()
    (aot / "vllm_comm").symlink_to(elsewhere, target_is_directory=True)  # the module's folder is a link
    kernels.install_tree(kset, aot)
    assert (aot / "vllm_comm" / "vllm_comm.so").read_bytes() == module_library("vllm_comm", "new")
    assert not os.path.islink(aot / "vllm_comm") and not os.path.islink(aot / "vllm_comm" / "vllm_comm.so")
    assert list(elsewhere.iterdir()) == []  # nothing written through the link


def test_a_module_of_another_cell_in_the_aot_folder_is_hidden_from_flashinfer(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    facts = this_cell(tmp_path, monkeypatch)
    kset = tmp_path / "aot"
    for module, torch in (("vllm_comm", facts["torch"]), ("pcie_ipc", "2.11.0+cu128")):
        (kset / module).mkdir(parents=True)
        (kset / module / f"{module}.so").write_bytes(module_library(module))
        (kset / module / _carried.RECORD).write_text(json.dumps({"schema": 1, "module": module, "name": module,
                                                                 "sass": ["sm_90a"], **facts, "torch": torch}))
    linked = _carried.fitting_folder(kset, "9.0", tmp_path / "scratch")
    assert linked is not None  # everything runs on 9.0, yet the folder itself would load pcie_ipc
    assert [p.parent.name for p in linked.glob("*/*.so")] == ["vllm_comm"]


def test_a_copied_in_module_of_another_cell_is_never_installed_by_the_part_that_does_not_build_it(
        tmp_path: Path) -> None:
    cid = "cu130-torch2.11.0-sglnone-fi0.7.4"
    kset = tmp_path / "kernels" / cid / "trtllm_comm"
    kset.mkdir(parents=True)
    (kset / "trtllm_comm.so").write_bytes(module_library("trtllm_comm", "cu128"))
    (kset / _carried.RECORD).write_text(json.dumps({
        "schema": 1, "module": "trtllm_comm", "name": "trtllm_comm", "sass": ["sm_90a"], "arch_list": "9.0a",
        "declared": "9.0a", "flashinfer": "0.7.4", "torch": "2.11.0+cu128", "torch_cuda": "12.8", "nvcc": "13.0",
        "source_hash": "src2"}))
    cell, lines = StandInCell(CU130), []
    rec = _stage(_cell(tmp_path / "envs", cid), cell, tmp_path, ("9.0a",), ("vllm_comm",), lines)  # the quick part
    assert cell.compiles == [("vllm_comm", ("9.0a",))]
    assert sorted(_carried.kernel_set(tmp_path / "kernels" / cid)) == ["vllm_comm"]  # what was installed
    assert any(line.startswith("kernels: trtllm_comm in the kernel set is not this cell's (torch:") for line in lines)
    assert rec["kernels"]["installed"] is True


def test_a_cell_whose_set_answers_every_long_module_records_them_in_the_command_and_starts_no_stage(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU host receiving a cell built elsewhere: its kernel set holds every module, its fresh build record
    none. `provision build` records the long modules as carried in the command itself (so `checks run`'s quick
    pass loads them rather than deferring them) and compiles nothing, starting no stage."""
    from types import SimpleNamespace

    from common.build import kernelstage
    from provision import buildsession

    facts = {**CU130, "source_hash": {m: f"src-{m}" for m in kernels.COMM_MODULES}}
    cid = "cu130-torch2.11.0-sglnone-fi0.7.4"
    elsewhere = StandInCell(facts)
    _stage(_cell(tmp_path / "envs-cpu", cid), elsewhere, tmp_path, ("9.0a",), kernels.COMM_MODULES, [])
    assert len(elsewhere.compiles) == len(kernels.COMM_MODULES)

    here = StandInCell(facts)
    monkeypatch.setitem(kernels.CARRIERS, backend.VENV, lambda rec, cache, docker: here)
    monkeypatch.setattr(kernels.jobs, "KERNELS", tmp_path / "kernels")
    monkeypatch.setattr(kernelstage, "wait", lambda say, *a, **k: False)

    def no_stage(*a: object, **k: object) -> None:
        raise AssertionError("a stage was started for modules the set already answers")

    monkeypatch.setattr(kernels, "start", no_stage)
    monkeypatch.setattr(buildsession, "kernel_archs", lambda cells, opts: {cid: ("9.0a",)})
    opts = SimpleNamespace(json=True, envs=tmp_path / "envs-gpu", wait_kernels=False,
                           kernel_archs=("9.0a",), kernel_parallel=lambda cpus, mem: 1)
    fresh = _cell(tmp_path / "envs-gpu", cid)
    out = buildsession.carry_kernels([], [fresh], opts, None)  # type: ignore[arg-type]
    assert here.compiles == []
    rows = out[0]["kernels"]["modules"]
    assert {m for m, r in rows.items() if r.get("carried")} == set(kernels.COMM_MODULES), rows
    # a rebuild of the same cell, its record now naming every module: the long modules are not gone over again
    long_passes: list[object] = []
    carry = kernels.carry

    def counted(records: Any, archs: Any, *a: Any, modules: tuple[str, ...] = kernels.COMM_MODULES,
                **k: Any) -> Any:
        if modules == kernels.LONG_MODULES:
            long_passes.append(archs)
        return carry(records, archs, *a, modules=modules, **k)

    monkeypatch.setattr(kernels, "carry", counted)
    buildsession.carry_kernels([], out, opts, None)  # type: ignore[arg-type]
    assert long_passes == [] and here.compiles == []


def test_a_cell_without_nvcc_starts_no_build_and_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The identity query reads where flashinfer would find nvcc; a cell with none (CUDA_HOME naming a folder
    without it, as a registry CUDA 12 image's) answers every module fi-no-nvcc without a build, and a cell with
    one, or with an unknown identity, is built as before."""
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no-toolkit"))
    facts = _carried.cell_facts({})
    assert facts["nvcc"] is None and "no-toolkit" in facts["nvcc_error"]
    job = kernels.Job("cu128-torch2.9.1-sgl0.4.1-fi0.6.17", "moe_a2a", ("9.0a",), "0.6.17", "12.8", 680.0)
    answer, _ = kernels.ready_answer(tmp_path / "set", job, {}, facts)
    assert answer is not None and answer["ok"] is False and answer["reason_code"] == "fi-no-nvcc"
    assert answer["line"].startswith("no nvcc in this cell (") and "no build was started" in answer["line"]
    assert kernels.no_nvcc({**facts, "nvcc": "13.0", "nvcc_error": ""}) is None
    assert kernels.no_nvcc(None) is None
    assert kernels.no_nvcc({"nvcc": None}) is None  # an identity from before the error was read: built as before


@pytest.mark.parametrize(("sass", "refused", "rebuilt"), [
    (["sm_75"], {}, True),  # the record's facts are the cell's, but its code runs on none of the targets
    (["sm_90a", "sm_120a"], {}, True),  # 12.0f answered by neither
    (["sm_90a", "sm_120a", "sm_120f"], {}, False),
    (["sm_90a"], {"12.0a": {"reason_code": "fi-arch-gate", "line": GATE},
                  "12.0f": {"reason_code": "fi-arch-gate", "line": GATE}}, False),  # what the gate refused
])
def test_a_kernel_set_is_reused_only_where_its_sass_answers_every_declared_target(
        tmp_path: Path, sass: list[str], refused: dict, rebuilt: bool) -> None:
    cid = "cu130-torch2.11.0-sglnone-fi0.7.4"
    archs = ("9.0a", "12.0a", "12.0f")
    kset = tmp_path / "kernels" / cid / "vllm_comm"
    kset.mkdir(parents=True)
    (kset / "vllm_comm.so").write_bytes(module_library("vllm_comm", "copied in"))
    (kset / _carried.RECORD).write_text(json.dumps({
        "schema": 1, "module": "vllm_comm", "name": "vllm_comm", "sass": sass, "arch_list": " ".join(archs),
        "declared": " ".join(archs), "refused": refused, "flashinfer": "0.7.4", "torch": CU130["torch"],
        "torch_cuda": CU130["torch_cuda"], "nvcc": CU130["nvcc"],
            _carried.TVM_FFI: TVM_FFI, "source_hash": "src1"}))
    cell, lines = StandInCell(CU130), []
    _stage(_cell(tmp_path / "envs", cid), cell, tmp_path, archs, ("vllm_comm",), lines)
    assert cell.compiles == ([("vllm_comm", archs)] if rebuilt else [])
    if sass == ["sm_75"]:
        assert ("kernels: vllm_comm in the kernel set is not this cell's (sass: sm_90a wanted for 9.0a, sm_75 in "
                "the record): removed, built again") in lines


class SetOnlyCell(StandInCell):
    """A cell whose identity query hashes the sources of the modules its kernel set holds only, as the real one
    (inenv.carry's ``--identity``, given the set's recorded source names) does: before a build, no source hash."""

    def identity(self, kernel_dir: Path) -> dict[str, Any] | None:
        got = super().identity(kernel_dir)
        if got is not None:
            held = _carried.kernel_set(kernel_dir)
            got["source_hash"] = {m: h for m, h in got["source_hash"].items() if m in held}
        return got


def test_a_twin_cell_of_the_same_build_inputs_copies_the_build_and_compiles_nothing(tmp_path: Path) -> None:
    """Two cells that differ only in what no module is compiled from (an NCCL release) share each module's build:
    the first compiles, the second copies it, judged current in its own set; a cell of another torch builds."""
    base, twin, other = ("cu132-torch2.15.0-sglnone-fi0.7.4", "cu132-torch2.15.0-sglnone-fi0.7.4-nccl2.32.6",
                         "cu132-torch2.16.0-sglnone-fi0.7.4")
    cells = {base: SetOnlyCell(CU130), twin: SetOnlyCell(CU130),
             other: SetOnlyCell({**CU130, "torch": "2.16.0+cu130"})}
    envs, lines = tmp_path / "envs", []
    recs = [_cell(envs, cid) for cid in cells]
    got = kernels.carry(recs, {cid: ("9.0a", "12.0a") for cid in cells}, 1, envs,
                        lambda cid, msg: lines.append(f"{cid} {msg}"), kernels_root=tmp_path / "kernels",
                        cache=tmp_path / "cache", modules=("vllm_comm",), carriers=cells)
    compiled = {cid: c.compiles for cid, c in cells.items()}
    assert sorted(cid for cid, c in compiled.items() if c) == sorted([base, other])  # one of the twins compiled
    copier = twin if compiled[base] else base
    assert compiled[copier] == []
    assert lines[0].startswith(" kernels: 2 module build(s) in 2 cell(s) and 1 copied from a twin cell's build")
    source = base if copier == twin else twin
    assert any(line.startswith(f"{copier} kernels: [") and f"vllm_comm for 9.0a 12.0a copied from {source}'s build"
               in line for line in lines), lines
    by_id = {r["cell_id"]: r for r in got}
    row = by_id[copier]["kernels"]["modules"]["vllm_comm"]
    assert row["carried"] is True and "compile_cpu_s" not in row  # a copy is no compile: estimates learn nothing
    assert by_id[copier]["kernels"]["installed"] is True
    lib = tmp_path / "kernels" / copier / "vllm_comm" / "vllm_comm.so"
    assert lib.read_bytes() == (tmp_path / "kernels" / source / "vllm_comm" / "vllm_comm.so").read_bytes()
    assert not list((tmp_path / "kernels" / copier).glob(".*part"))  # the copy lands whole or not at all
    # the copy's record names the sources its new cell hashes: the next stage finds it current, builds nothing
    again = {cid: SetOnlyCell(c.facts) for cid, c in cells.items()}
    kernels.carry(got, {cid: ("9.0a", "12.0a") for cid in cells}, 1, envs, lambda cid, msg: None,
                  kernels_root=tmp_path / "kernels", cache=tmp_path / "cache", modules=("vllm_comm",), carriers=again)
    assert all(c.compiles == [] for c in again.values())


def test_a_copy_whose_sources_differ_in_its_new_cell_is_dropped_and_built(tmp_path: Path) -> None:
    """A twin as far as the facts before a build tell, whose flashinfer sources hash otherwise (a patched file):
    the copy is judged in its new cell by the hash read there, refused, and the module is built."""
    a, b = "cu132-torch2.15.0-sglnone-fi0.7.4", "cu132-torch2.15.0-sglnone-fi0.7.4-nccl2.32.6"
    cells = {a: SetOnlyCell(CU130), b: SetOnlyCell({**CU130, "source_hash": {"vllm_comm": "patched"}})}
    envs, lines = tmp_path / "envs", []
    recs = [_cell(envs, cid) for cid in cells]
    kernels.carry(recs, {cid: ("9.0a",) for cid in cells}, 1, envs, lambda cid, msg: lines.append(f"{cid} {msg}"),
                  kernels_root=tmp_path / "kernels", cache=tmp_path / "cache", modules=("vllm_comm",), carriers=cells)
    assert sum(len(c.compiles) for c in cells.values()) == 2
    assert any("is not this cell's (source_hash: patched wanted, src1 in the record): built" in line
               for line in lines), lines


def test_a_twin_is_planned_free_and_a_failed_build_leaves_the_twin_to_build(tmp_path: Path) -> None:
    class Fails(StandInCell):
        def compile(self, job: kernels.Job, out_dir: Path) -> dict[str, Any]:
            self.compiles.append((job.module, job.archs))
            return {"ok": False, "reason_code": "fi-jit-error", "line": "nvcc died"}

    a, b = "cu132-torch2.15.0-sglnone-fi0.7.4", "cu132-torch2.15.0-sglnone-fi0.7.4-nccl2.32.6"
    cells = {a: Fails(CU130), b: Fails(CU130)}  # the facts of every module known: a twin from the start
    envs: Path = tmp_path / "envs"
    recs = [_cell(envs, cid) for cid in cells]
    kernels.carry(recs, {cid: ("9.0a",) for cid in cells}, 1, envs, lambda cid, msg: None,
                  kernels_root=tmp_path / "kernels", cache=tmp_path / "cache", modules=("vllm_comm",), carriers=cells)
    assert cells[a].compiles == [("vllm_comm", ("9.0a",))] and cells[b].compiles == [("vllm_comm", ("9.0a",))]

"""No repeated compiler work: objects of a build that failed at the link, the nvcc thread flag outside the
key, longest-first side builds, and the local build published where the GPU probes point flashinfer.

The link-only rebuild runs the real ninja and gcc on a small C build whose link fails as a toolkit without
a libcuda stub fails (``cannot find -lcuda``)."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pytest

from inenv.kit import _compile_cache as cc
from inenv.kit import _fi_build
from inenv.kit import _flashinfer as fi
from inenv.probes import fi_jit, fiprebuild
from tests.test_compile_cache import NINJA, _key, _site


# --- the thread flag is no part of the key ----------------------------------------------------------------
def test_the_nvcc_thread_flag_is_not_in_the_key(tmp_path: Path) -> None:
    site = _site(tmp_path)
    build = str(tmp_path / "ws/build")
    plain = _key(tmp_path, site, build)
    assert _key(tmp_path, site, build, env={"NVCC_APPEND_FLAGS": "--threads 2"}) == plain
    threaded = NINJA.replace("-O3", "-O3 --threads=4")
    assert _key(tmp_path, site, build, text=threaded) == plain
    # another flag in the same variable still changes the key
    assert _key(tmp_path, site, build, env={"NVCC_APPEND_FLAGS": "--threads 2 -lineinfo"}) != plain


def test_a_combined_build_gets_one_nvcc_thread_per_target(tmp_path: Path) -> None:
    env = fi_jit.build_env("12.0a 12.0f", str(tmp_path))
    assert env[_fi_build.THREADS_ENV] == "2" and env["FLASHINFER_NVCC_THREADS"] == "2"
    one = fi_jit.build_env("12.0a", str(tmp_path))
    assert _fi_build.THREADS_ENV not in one or one[_fi_build.THREADS_ENV] != "1"


# --- objects of a failed link ------------------------------------------------------------------------------
def _objects_entry(tmp_path: Path) -> tuple[Path, str, Path]:
    build = tmp_path / "build"
    build.mkdir()
    (build / "a.o").write_bytes(b"object a")
    (build / "b.cuda.o").write_bytes(b"object b")
    store = tmp_path / "store"
    header = tmp_path / "k.h"
    header.write_text("#define K 1\n")
    items = {str(header): cc.file_digest(str(header))}
    assert cc.store_objects(store, "k1", str(build), ["a.o", "b.cuda.o"], {"module": "m"}, items)
    return store, "k1", header


def test_stored_objects_are_never_a_cached_library(tmp_path: Path) -> None:
    store, key, _ = _objects_entry(tmp_path)
    hit, misses = cc.lookup(store, key)
    assert hit is None and misses == []  # a failed link is never shown as a cached pass
    found = cc.lookup_objects(store, key, ["a.o", "b.cuda.o"])
    assert found is not None
    folder, record = found
    assert record["kind"] == "objects" and record["objects"] == ["a.o", "b.cuda.o"]
    out = tmp_path / "again"
    out.mkdir()
    cc.restore_objects(folder, ["a.o", "b.cuda.o"], str(out))
    assert (out / "b.cuda.o").read_bytes() == b"object b"


def test_stored_objects_miss_when_a_header_they_read_changed(tmp_path: Path) -> None:
    store, key, header = _objects_entry(tmp_path)
    cc._FILE_DIGESTS.clear()
    header.write_text("#define K 2\n")
    assert cc.lookup_objects(store, key, ["a.o", "b.cuda.o"]) is None
    assert cc.lookup_objects(store, key, ["a.o", "c.o"]) is None  # another object list is another build


NINJA_C = """rule compile
  command = gcc -c $in -o $out
rule link
  command = gcc -shared $in -o $out -lcuda_stackprobe_absent
build k.o: compile {src}
build m.so: link k.o
"""


@pytest.mark.skipif(not (shutil.which("ninja") and shutil.which("gcc")), reason="needs ninja and gcc")
def test_a_link_from_kept_objects_compiles_nothing_and_fails_the_same_way(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STACKPROBE_NINJA", shutil.which("ninja") or "ninja")
    src = tmp_path / "k.c"
    src.write_text("int k(void) { return 1; }\n")
    first, second = tmp_path / "first", tmp_path / "second"
    for d in (first, second):
        d.mkdir()
        (d / "build.ninja").write_text(NINJA_C.format(src=src))
    out: dict = {"flashinfer": "0.7.4", "toolkit": {}, "gencode": []}
    stopped = _fi_build._ninja_build(out, "m", str(first), ["k.o"], ["m.so"], 0.0)
    assert stopped is not None and stopped["stage"] == "link"
    assert "cannot find -lcuda_stackprobe_absent" in stopped["error"]
    store = tmp_path / "store"
    assert cc.store_objects(store, "key", str(first), ["k.o"], {"module": "m", "built_at": "T"})
    kept = cc.lookup_objects(store, "key", ["k.o"])
    assert kept is not None
    src.write_text("this is not C\n")  # a compile now would fail: the link-only build must not compile
    again: dict = {}
    stopped = _fi_build._link_kept(again, kept, str(second), ["k.o"], ["m.so"], 0.0)
    assert stopped is not None and stopped["stage"] == "link"
    assert "cannot find -lcuda_stackprobe_absent" in stopped["error"]
    assert again["objects_cached"] and again["compile_cpu_s"] == 0.0
    assert (second / "k.o").read_bytes() == (first / "k.o").read_bytes()
    assert not again.get("cached")  # a failed link is not a cached pass
    v = fi_jit.verdict("m", "12.0a", {**stopped, "objects_from": {"built_at": "T", "cell": "c1"}}, ["sm_120a"])
    assert v["status"] == "fail"  # not the libcuda-stub wording: this library name is not -lcuda
    v = fi_jit.verdict("m", "12.0a", {**stopped, "error": "ld: cannot find -lcuda", "objects_from":
                                      {"built_at": "T", "cell": "c1"}}, ["sm_120a"])
    assert v["status"] == "partial" and v["reason_code"] == "fi-link-no-libcuda"
    assert "objects from the compile cache, compiled T by c1" in v["note"]


# --- longest first ------------------------------------------------------------------------------------------
def test_side_builds_start_longest_first() -> None:
    order = fiprebuild.longest_first(["vllm_comm", "trtllm_comm", "moe_a2a", "pcie_ipc"],
                                       {"vllm_comm": 15.0, "moe_a2a": 143.0, "trtllm_comm": None, "pcie_ipc": None},
                                       {"trtllm_comm": 300_000, "pcie_ipc": 20_000, "vllm_comm": 1, "moe_a2a": 1})
    assert order == ["moe_a2a", "vllm_comm", "trtllm_comm", "pcie_ipc"]


def test_without_a_recorded_time_the_measured_order_decides_before_source_bytes() -> None:
    """On a 1x H100 moe_a2a's sources (about 190 KB) outweighed trtllm_comm's (24 KB) while its build took a
    quarter of the time: bytes chose moe_a2a's variant to start the side builds, and it waited 311 s for
    trtllm_comm's."""
    none = {m: None for m in fi.COMM_MODULES}
    order = fiprebuild.longest_first(["pcie_ipc", "vllm_comm", "moe_a2a", "trtllm_comm"], none,
                                     {"moe_a2a": 190_000, "trtllm_comm": 24_000, "pcie_ipc": 30_000})
    assert order == ["trtllm_comm", "moe_a2a", "vllm_comm", "pcie_ipc"]
    # a module the measured order does not name comes after it, by bytes; a recorded time comes before both
    assert fiprebuild.longest_first(["new_b", "pcie_ipc", "new_a"], none, {"new_a": 5, "new_b": 9}) == \
        ["pcie_ipc", "new_b", "new_a"]
    assert fiprebuild.longest_first(["trtllm_comm", "pcie_ipc"], {"trtllm_comm": None, "pcie_ipc": 1.0},
                                    {"trtllm_comm": 10**6})[0] == "pcie_ipc"


def test_only_the_longest_builds_variant_starts_the_side_builds(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A short module's variant must not start them: it would wait for the long build before it ends, and every
    GPU probe loading the short module would wait with it."""
    monkeypatch.setenv(cc.ENV, str(tmp_path / "cache"))
    monkeypatch.setenv(cc.CELL_ENV, "cu130-fi0.7.4")
    monkeypatch.setattr(fi, "version", lambda: "0.7.4")
    monkeypatch.setattr(fiprebuild, "source_bytes", lambda m: 0)
    started: list[list[str]] = []
    monkeypatch.setattr(fiprebuild, "start", lambda modules, env: started.append(list(modules)) or None)
    monkeypatch.setattr(fi_jit._fi_existing, "might_have", lambda *a, **k: False)

    class Ctx:
        def log(self, text: str) -> None:
            pass

    assert fi_jit._prebuild_others(Ctx(), "pcie_ipc", str(tmp_path / "jit"), "9.0") is None
    assert started == []
    fi_jit._prebuild_others(Ctx(), "trtllm_comm", str(tmp_path / "jit"), "9.0")
    assert started and "trtllm_comm" not in started[0] and "pcie_ipc" in started[0]


def test_recorded_compile_times_come_from_the_store(tmp_path: Path) -> None:
    lib = tmp_path / "m.so"
    lib.write_bytes(b"lib")
    cc.store(tmp_path / "store", "k1", str(lib), {"module": "trtllm_comm", "arch_list": "local", "compile_s": 290.8})
    cc.store(tmp_path / "store", "k2", str(lib), {"module": "trtllm_comm", "arch_list": "12.0a", "compile_s": 900.0})
    assert fiprebuild.recorded_s(tmp_path / "store", "trtllm_comm", "local") == 290.8
    assert fiprebuild.recorded_s(tmp_path / "store", "moe_a2a", "local") is None


def test_side_builds_run_side_by_side_load_and_publish_what_loaded(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A quick run's fi-jit variant builds one module; the side builds are what give the GPU probes the
    others, so each one that loaded is published (and marked for the host) as it finishes."""
    monkeypatch.setenv(cc.ENV, str(tmp_path / "cache"))
    monkeypatch.setenv(cc.CELL_ENV, "cu130-fi0.7.4")
    together = threading.Barrier(3, timeout=20)  # passes only when all three builds are running at once
    calls: list[tuple[str, bool]] = []

    def build(module: str, env: dict[str, str], timeout_s: float, python: str | None = None,
              load: bool = False) -> dict:
        calls.append((module, load))
        together.wait()
        lib = tmp_path / f"{module}.built.so"
        lib.write_bytes(b"\x7fELF " + module.encode())
        result = {"module": module, "name": module, "library": str(lib), "flashinfer": "0.7.4", "arch_dir": "90a",
                  "ok": True, "loaded": load}
        if module == "moe_a2a":  # compiled, then failed to load on the GPU: nothing a probe could use
            result.update(ok=False, loaded=False, stage="load")
        return result

    monkeypatch.setattr(_fi_build, "run_build_subprocess", build)
    published = fiprebuild.build_and_publish(["trtllm_comm", "moe_a2a", "pcie_ipc"], dict(os.environ))
    assert sorted(calls) == [("moe_a2a", True), ("pcie_ipc", True), ("trtllm_comm", True)]
    base = tmp_path / "cache/prebuilt/cu130-fi0.7.4/0.7.4/90a"
    assert published == {"trtllm_comm": str(base / "trtllm_comm/trtllm_comm.so"), "moe_a2a": None,
                         "pcie_ipc": str(base / "pcie_ipc/pcie_ipc.so")}
    assert (base / "trtllm_comm/trtllm_comm.so").read_bytes() == b"\x7fELF trtllm_comm"
    # what the host reads to tell a GPU variant that will compile from one that will not
    env = {cc.ENV: str(tmp_path / "cache"), cc.CELL_ENV: "cu130-fi0.7.4"}
    assert fi.unpublished(["trtllm_comm", "moe_a2a", "pcie_ipc"], "0.7.4", env) == ["moe_a2a"]


def test_only_a_build_that_finished_and_loaded_is_published(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cc.ENV, str(tmp_path / "cache"))
    monkeypatch.setenv(cc.CELL_ENV, "c")
    lib = tmp_path / "m.so"
    lib.write_bytes(b"\x7fELF")
    done = {"ok": True, "library": str(lib), "flashinfer": "0.7.4", "arch_dir": "90a"}
    assert fiprebuild.publish_loaded("vllm_comm", done) is None  # built without a GPU load
    assert fiprebuild.publish_loaded("vllm_comm", {**done, "ok": False, "loaded": True}) is None
    assert fiprebuild.publish_loaded("vllm_comm", {**done, "loaded": True, "library": ""}) is None
    assert not any((tmp_path / "cache").rglob("*.so"))
    where = fiprebuild.publish_loaded("vllm_comm", {**done, "loaded": True})
    assert where == str(tmp_path / "cache/prebuilt/c/0.7.4/90a/vllm_comm/vllm_comm.so")
    assert fi.unpublished(["vllm_comm"], "0.7.4", {cc.ENV: str(tmp_path / "cache"), cc.CELL_ENV: "c"}) == []


# --- published for the GPU probes ----------------------------------------------------------------------------
def test_the_prebuilt_folder_is_per_cell_under_the_compile_cache(tmp_path: Path) -> None:
    env = {cc.ENV: str(tmp_path), cc.CELL_ENV: "cu130-x"}
    assert fi.prebuilt_root(env) == tmp_path / "prebuilt" / "cu130-x"
    assert fi.prebuilt_root({cc.ENV: str(tmp_path)}) is None  # no cell: nothing shared
    assert fi.prebuilt_root({**env, fi.PREBUILT_ENV: "/elsewhere"}) == Path("/elsewhere")
    # a cell id is untrusted: it never leaves the folder
    assert fi.prebuilt_root({cc.ENV: str(tmp_path), cc.CELL_ENV: "../.."}) is None
    assert fi.prebuilt_root({cc.ENV: str(tmp_path), cc.CELL_ENV: "a/../b"}) == tmp_path / "prebuilt" / "a_.._b"


def test_a_published_library_is_where_flashinfer_reads_aot_modules(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cc.ENV, str(tmp_path / "cache"))
    monkeypatch.setenv(cc.CELL_ENV, "cell-a")
    lib = tmp_path / "built.so"
    lib.write_bytes(b"\x7fELF built")
    where = fi.publish("trtllm_comm", str(lib), "0.7.4", "90a")
    # flashinfer's JitSpec.aot_path: FLASHINFER_AOT_DIR / name / f"{name}.so"
    assert where == str(tmp_path / "cache/prebuilt/cell-a/0.7.4/90a/trtllm_comm/trtllm_comm.so")
    assert Path(where).read_bytes() == lib.read_bytes()
    assert fi.published("trtllm_comm", "0.7.4", "90a") and not fi.published("trtllm_comm", "0.7.4", "100a")
    assert fi.publish("vllm_comm", str(tmp_path / "missing.so"), "0.7.4", "90a") is None


def test_a_gpu_variant_that_will_compile_says_so_when_it_starts(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from checks.run import runprogress
    from checks.run.plan import CellTarget, WorkItem
    from inenv.probe import Variant
    from inenv.probes import fi_fusion, pcie_ipc

    cell = CellTarget("cu130-fi0.7.4", "resolved", versions={"flashinfer": "0.7.4"})
    fusion = WorkItem(cell, fi_fusion.SPEC, Variant("fi-fusion", 2, (("placement", "1gpu"),), True), 60.0)
    gather = WorkItem(cell, pcie_ipc.SPEC, Variant("pcie-ipc", 2, (("op", "all-gather"),)), 60.0)
    view = runprogress.RunView([fusion, gather], {}, compile_note=runprogress.compile_note(tmp_path))
    assert view.start_line(fusion).endswith(
        "; compiles trtllm_comm in its turn: fi-jit has not built it for this GPU here")
    # what fi-jit's local variant does once trtllm_comm passed and loaded, in the cell's environment
    monkeypatch.setenv(cc.ENV, str(tmp_path))
    monkeypatch.setenv(cc.CELL_ENV, cell.cell_id)
    lib = tmp_path / "trtllm_comm.so"
    lib.write_bytes(b"\x7fELF")
    fi.mark_published("trtllm_comm", fi.publish("trtllm_comm", str(lib), "0.7.4", "90a") or "")
    assert "compiles" not in view.start_line(fusion)
    assert view.start_line(gather).endswith("; compiles pcie_ipc_ag_rs in its turn: fi-jit has not built it "
                                            "for this GPU here")

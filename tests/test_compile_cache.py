"""The shared compile cache: what its key covers, writes that never leave half an entry, two builders of one
key at once, and how every executor reaches it (the docker executor's mount, the local executor's
environment, `provision prune --compile-cache`). The builds themselves, through the worker with a stand-in
flashinfer and the real nvcc, are in tests/test_fi_jit.py."""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path

import pytest

from checks.run.container import COMPILE_CACHE_MOUNT, DockerExecutor
from checks.run.executor import LocalExecutor, for_run, run_env
from common.caches import DEFAULT_COMPILE_CACHE, compile_cache_dir
from inenv.kit import _compile_cache as cc
from provision import prune

NINJA = """ninja_required_version = 1.3
name = vllm_comm
cuda_home = /usr/local/cuda
cxx = c++
nvcc = $cuda_home/bin/nvcc
common_cflags = -I{site}/flashinfer/data/include $
    -isystem $cuda_home/include $
    -isystem {site}/flashinfer/data/csrc
cuda_cflags = $common_cflags -gencode=arch=compute_120a,code=sm_120a -O3
rule cuda_compile
  command = $nvcc $cuda_cflags -c $in -o $out
rule link
  command = $cxx $in -shared -o $out
build {build}/k.cuda.o: cuda_compile {site}/flashinfer/data/csrc/k.cu
build {build}/vllm_comm.so: link {build}/k.cuda.o
"""


def _site(root: Path, header: str = "#define K 1\n") -> Path:
    data = root / "site-packages" / "flashinfer" / "data"
    (data / "include").mkdir(parents=True)
    (data / "csrc").mkdir()
    (data / "include" / "k.h").write_text(header)
    (data / "csrc" / "k.cu").write_text('#include "k.h"\n__global__ void k(int* p) { *p = K; }\n')
    return root / "site-packages"


def _key(root: Path, site: Path, build: str, text: str = NINJA, env: dict[str, str] | None = None) -> str:
    cc._FILE_DIGESTS.clear()
    cc._TREE_DIGESTS.clear()
    ninja = text.format(site=site, build=build)
    places = {"$BUILD": build, "$SITE": str(site), "$WORKSPACE": str(root / "ws")}
    return cc.key_of(cc.recipe("vllm_comm", ninja, places, env or {}))


# --- the key ----------------------------------------------------------------------------------------------
def test_where_a_build_happens_is_not_in_its_key(tmp_path: Path) -> None:
    a = _key(tmp_path / "a", _site(tmp_path / "a"), str(tmp_path / "a/ws/.cache/flashinfer/0.6.17/120a/vllm_comm"))
    b = _key(tmp_path / "b", _site(tmp_path / "b"), str(tmp_path / "b/ws/.cache/flashinfer/0.6.18/120a/vllm_comm"))
    assert a == b  # other cell, other flashinfer release in the path, same bytes and flags


def test_what_decides_the_output_is_in_its_key(tmp_path: Path) -> None:
    site = _site(tmp_path / "a")
    build = str(tmp_path / "a/ws/b/vllm_comm")
    base = _key(tmp_path / "a", site, build)
    assert _key(tmp_path / "a", site, build, NINJA.replace("-O3", "-O2")) != base  # a flag
    assert _key(tmp_path / "a", site, build, NINJA.replace("120a", "120f")) != base  # the target
    assert _key(tmp_path / "a", site, build, env={"NVCC_APPEND_FLAGS": "-I/stub"}) != base  # flags from the env
    (site / "flashinfer" / "data" / "csrc" / "k.cu").write_text("__global__ void k(int* p) { *p = 2; }\n")
    assert _key(tmp_path / "a", site, build) != base  # one source byte
    # headers are not in the key: the manifest of each stored build says which ones it read
    (site / "flashinfer" / "data" / "include" / "k.h").write_text("#define K 2\n")
    kernel = '#include "k.h"\n__global__ void k(int* p) { *p = K; }\n'
    (site / "flashinfer" / "data" / "csrc" / "k.cu").write_text(kernel)
    assert _key(tmp_path / "a", site, build) == base


def _places(site: Path) -> dict[str, str]:
    return {"$SITE": str(site), "$BUILD": "/nowhere/build"}


def test_a_manifest_matches_only_the_same_bytes_where_it_read_them(tmp_path: Path) -> None:
    site = _site(tmp_path / "a")
    header = site / "flashinfer" / "data" / "include" / "k.h"
    places = _places(site)
    source = str(site / "flashinfer/data/csrc/k.cu")
    items = cc.manifest([str(header), source], [source], places)
    assert list(items) == ["$SITE/flashinfer/data/include/k.h"]  # the source itself is in the key, not here
    order = [str(site / "flashinfer/data/csrc"), str(site / "flashinfer/data/include")]
    assert cc.mismatch(items, places, order) is None
    (site / "flashinfer" / "data" / "include" / "unrelated.cuh").write_text("#define X 1\n")
    cc._FILE_DIGESTS.clear()
    assert cc.mismatch(items, places, order) is None  # a header nobody read changes nothing
    other = _site(tmp_path / "b")  # the same bytes in another environment's site-packages
    assert cc.mismatch(items, _places(other), order) is None
    header.write_text("#define K 2\n")
    cc._FILE_DIGESTS.clear()
    assert cc.mismatch(items, places, order) == "$SITE/flashinfer/data/include/k.h differs"
    header.unlink()
    cc._FILE_DIGESTS.clear()
    assert cc.mismatch(items, places, order) == "$SITE/flashinfer/data/include/k.h is missing"


def test_a_header_earlier_on_the_search_path_is_a_miss(tmp_path: Path) -> None:
    site = _site(tmp_path)
    places = _places(site)
    header = site / "flashinfer" / "data" / "include" / "k.h"
    items = cc.manifest([str(header)], [], places)
    order = [str(site / "flashinfer/data/csrc"), str(site / "flashinfer/data/include")]
    (site / "flashinfer" / "data" / "csrc" / "k.h").write_text("#define K 1\n")
    why = cc.mismatch(items, places, order)
    assert why is not None and why.endswith("csrc/k.h would be read instead of $SITE/flashinfer/data/include/k.h")
    assert cc.search_order(NINJA.format(site=site, build="/b")) == [
        f"{site}/flashinfer/data/csrc", f"{site}/flashinfer/data/include", "/usr/local/cuda/include"]


def test_headers_come_from_ninjas_deps_listing() -> None:
    listing = ("/b/k.cuda.o: #deps 3, deps mtime 1764500000 (VALID)\n    /s/csrc/k.cu\n    /s/include/k.h\n"
               "    /usr/local/cuda/include/cuda_runtime.h\n\n/b/j.cuda.o: #deps 1, deps mtime 1 (VALID)\n"
               "    /s/include/k.h\n\n")
    assert cc.ninja_deps(listing) == ["/s/csrc/k.cu", "/s/include/k.h", "/usr/local/cuda/include/cuda_runtime.h"]


def test_without_a_header_list_the_manifest_is_every_include_folder(tmp_path: Path) -> None:
    site = _site(tmp_path)
    text = NINJA.format(site=site, build="/b")
    items = cc.tree_manifest(text, _places(site))
    assert sorted(items) == ["tree:$SITE/flashinfer/data/csrc", "tree:$SITE/flashinfer/data/include"]
    assert cc.mismatch(items, _places(site), []) is None
    (site / "flashinfer" / "data" / "include" / "unrelated.cuh").write_text("#define X 1\n")
    cc._TREE_DIGESTS.clear()
    cc._FILE_DIGESTS.clear()
    assert cc.mismatch(items, _places(site), []) == "$SITE/flashinfer/data/include differs"


def test_the_order_nvcc_targets_are_listed_in_is_not_in_the_key(tmp_path: Path) -> None:
    site = _site(tmp_path)
    two = "-gencode=arch=compute_120a,code=sm_120a -gencode=arch=compute_120f,code=sm_120f"
    swapped = "-gencode=arch=compute_120f,code=sm_120f -gencode=arch=compute_120a,code=sm_120a"
    a = _key(tmp_path, site, str(tmp_path / "b"), NINJA.replace("-gencode=arch=compute_120a,code=sm_120a", two))
    b = _key(tmp_path, site, str(tmp_path / "b"), NINJA.replace("-gencode=arch=compute_120a,code=sm_120a", swapped))
    assert a == b != _key(tmp_path, site, str(tmp_path / "b"))


def test_another_nvcc_is_another_key(tmp_path: Path) -> None:
    site = _site(tmp_path)
    keys = []
    for release in ("13.0, V13.0.88", "13.0, V13.0.48"):
        home = tmp_path / release.split()[-1] / "bin"
        home.mkdir(parents=True)
        (home / "nvcc").write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}'\n")
        (home / "nvcc").chmod(0o755)
        keys.append(_key(tmp_path, site, str(tmp_path / "b"), NINJA.replace("/usr/local/cuda", str(home.parent))))
    assert keys[0] != keys[1]


def _cell_toolkit(venvs: Path, cell: str, release: str = "13.0, V13.0.88") -> Path:
    """A venv cell's own CUDA_HOME (``<venv>/cuda``) with an nvcc that prints ``release``."""
    home = venvs / cell / "cuda"
    (home / "bin").mkdir(parents=True)
    (home / "include").mkdir()
    (home / "bin" / "nvcc").write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}'\n")
    (home / "bin" / "nvcc").chmod(0o755)
    return home


def _cell_recipe(root: Path, site: Path, home: Path, text: str = NINJA) -> dict[str, object]:
    cc._FILE_DIGESTS.clear()
    build = str(root / "ws/.cache/flashinfer/0.6.17/120a_120f/cached_ops/vllm_comm")
    ninja = text.format(site=site, build=build).replace("/usr/local/cuda", str(home))
    places = {"$BUILD": build, "$SITE": str(site), "$WORKSPACE": str(root / "ws"), "$CUDA": str(home)}
    return cc.recipe("vllm_comm", ninja, places, {})


def test_the_cells_own_toolkit_folder_is_not_in_its_key(tmp_path: Path) -> None:
    site = _site(tmp_path)
    old = _cell_recipe(tmp_path, site, _cell_toolkit(tmp_path / "venvs", "cu130-torch2.14.1-sgl0.4.10-fi0.6.16"))
    new = _cell_recipe(tmp_path, site, _cell_toolkit(tmp_path / "venvs", "cu130-torch2.14.1-sgl0.4.10-fi0.6.17"))
    assert cc.key_of(old) == cc.key_of(new)  # two cells' toolkits, the same nvcc: one key
    assert "cuda_home = $CUDA\n" in str(old["ninja"])
    assert old["tools"]["nvcc"] == "$CUDA/bin/nvcc exit 0: Cuda compilation tools, release 13.0, V13.0.88"


def test_beside_the_toolkit_folder_a_flag_or_another_nvcc_is_still_another_key(tmp_path: Path) -> None:
    site = _site(tmp_path)
    venvs = tmp_path / "venvs"
    base = cc.key_of(_cell_recipe(tmp_path, site, _cell_toolkit(venvs, "fi0.6.16")))
    flag = _cell_recipe(tmp_path, site, _cell_toolkit(venvs, "fi0.6.17"), NINJA.replace("-O3", "-O2"))
    assert cc.key_of(flag) != base
    nvcc = _cell_recipe(tmp_path, site, _cell_toolkit(venvs, "fi0.6.18", "13.0, V13.0.48"))
    assert cc.key_of(nvcc) != base


def test_a_place_is_replaced_only_where_its_folder_name_ends() -> None:
    places = {"$CUDA": "/v/cell/cuda", "$SITE": "/v/cell/lib/python3.11/site-packages"}
    text = "-I/v/cell/cuda/include -L/v/cell/cuda-wheels/lib -I/v/cell/cuda.old -isystem /v/cell/cuda"
    assert cc.normalise(text, places) == "-I$CUDA/include -L/v/cell/cuda-wheels/lib -I/v/cell/cuda.old -isystem $CUDA"


def test_a_toolkit_header_is_checked_in_this_cells_own_toolkit(tmp_path: Path) -> None:
    mine = _cell_toolkit(tmp_path, "fi0.6.16")
    other = _cell_toolkit(tmp_path, "fi0.6.17")
    for home in (mine, other):
        (home / "include" / "cuda_runtime.h").write_text("#define CUDART 13000\n")
    cc._FILE_DIGESTS.clear()
    items = cc.manifest([str(mine / "bin" / ".." / "include" / "cuda_runtime.h")], [], {"$CUDA": str(mine)})
    assert list(items) == ["$CUDA/include/cuda_runtime.h"]
    assert cc.mismatch(items, {"$CUDA": str(other)}, []) is None
    (other / "include" / "cuda_runtime.h").write_text("#define CUDART 13001\n")
    cc._FILE_DIGESTS.clear()
    assert cc.mismatch(items, {"$CUDA": str(other)}, []) == "$CUDA/include/cuda_runtime.h differs"


def test_the_places_of_a_build_name_the_toolkits_folder_unless_it_is_a_system_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from inenv.kit import _fi_build

    monkeypatch.setattr(_fi_build, "_site_root", lambda: "/v/cell/lib/python3.11/site-packages")
    monkeypatch.setenv("FLASHINFER_WORKSPACE_BASE", "/jit")
    monkeypatch.setenv("CUDA_HOME", "/v/cell/cuda")
    assert _fi_build._places("/jit/b") == {"$BUILD": "/jit/b", "$SITE": "/v/cell/lib/python3.11/site-packages",
                                           "$WORKSPACE": "/jit", "$CUDA": "/v/cell/cuda"}
    monkeypatch.setenv("CUDA_HOME", "/usr")
    assert _fi_build._places("/jit/b")["$CUDA"] == ""


def test_include_dirs_expand_ninja_variables() -> None:
    text = "cuda_home = /opt/cuda\nflags = -I/a/inc $\n    -isystem $cuda_home/include -I/a/inc\n"
    assert cc.include_dirs(text) == ["/a/inc", "/opt/cuda/include"]


# --- the store --------------------------------------------------------------------------------------------
def _library(folder: Path, body: bytes) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vllm_comm.so").write_bytes(body)
    return str(folder / "vllm_comm.so")


def test_an_entry_is_read_back_with_its_record(tmp_path: Path) -> None:
    store = tmp_path / "store"
    site = _site(tmp_path / "s")
    items = cc.manifest([str(site / "flashinfer/data/include/k.h")], [], _places(site))
    entry, wrote = cc.store(store, "k1", _library(tmp_path / "b", b"ELF"), {"flashinfer": "0.6.18"}, items)
    assert wrote and Path(entry.library).read_bytes() == b"ELF" and entry.record["flashinfer"] == "0.6.18"
    assert entry.record["manifest"] == items
    assert cc.lookup(store, "k1", _places(site)) == (entry, []) and cc.lookup(store, "k2") == (None, [])
    (store / "k3" / "m").mkdir(parents=True)  # a folder without its record is no entry
    assert cc.lookup(store, "k3") == (None, [])
    # another environment whose k.h differs: no hit, and the miss says why
    other = _site(tmp_path / "o", header="#define K 9\n")
    cc._FILE_DIGESTS.clear()
    found, misses = cc.lookup(store, "k1", _places(other))
    assert found is None and misses == [f"{cc.manifest_id(items)}: $SITE/flashinfer/data/include/k.h differs"]
    # its own build goes beside the first under the same key, and each environment finds its own
    mine, wrote = cc.store(store, "k1", _library(tmp_path / "c", b"ELF2"), {"flashinfer": "0.7.0"},
                           cc.manifest([str(other / "flashinfer/data/include/k.h")], [], _places(other)))
    assert wrote and len(os.listdir(store / "k1")) == 2
    assert cc.lookup(store, "k1", _places(other))[0] == mine and cc.lookup(store, "k1", _places(site))[0] == entry


def _store_at(store: str, key: str, body: bytes, barrier: object, out: object) -> None:
    lib = _library(Path(store).parent / f"build-{body.decode()}", body)
    barrier.wait()  # type: ignore[attr-defined]
    entry, wrote = cc.store(Path(store), key, lib, {"by": body.decode()})
    out.put((wrote, Path(entry.library).read_bytes(), entry.record["by"]))  # type: ignore[attr-defined]


def test_concurrent_stores_of_one_key_both_succeed_and_the_first_rename_wins(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    for round_ in range(5):
        store = tmp_path / f"store{round_}"
        barrier, out = ctx.Barrier(4), ctx.Queue()
        procs = [ctx.Process(target=_store_at, args=(str(store), "k", f"w{i}".encode(), barrier, out))
                 for i in range(4)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
        assert all(p.exitcode == 0 for p in procs)
        got = [out.get(timeout=5) for _ in procs]
        assert sum(wrote for wrote, _, _ in got) == 1
        assert len({(body, by) for _, body, by in got}) == 1  # every builder reads the one winning entry
        body, by = got[0][1:]
        assert body == by.encode() and os.listdir(store) == ["k"]
        assert os.listdir(store / "k") == [cc.manifest_id({})]  # no temporary folder left


def _hold(store: str, held: object) -> None:
    with cc.building(Path(store), "k"):
        held.set()  # type: ignore[attr-defined]
        time.sleep(1.5)


def test_a_second_builder_of_one_key_waits_for_the_first(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    held = ctx.Event()
    p = ctx.Process(target=_hold, args=(str(tmp_path), held))
    p.start()
    assert held.wait(30)
    with cc.building(tmp_path, "k") as waited_held:
        assert waited_held >= 0.8
    p.join(30)
    with cc.building(tmp_path, "other") as waited:
        assert waited < waited_held  # another key: nobody holds it, so less than the held key's wait


# --- how executors reach it -------------------------------------------------------------------------------
def test_the_docker_executor_mounts_the_host_cache_read_write(tmp_path: Path) -> None:
    env = run_env("cu130-x", ("12.0a", "12.0f"), tmp_path / "compile", "h200x2")
    cfg = DockerExecutor(image="stackprobe/x:1", run_env=env)._config(["true"])
    assert cfg["volumes"][str(tmp_path / "compile")] == {"bind": COMPILE_CACHE_MOUNT, "mode": "rw"}
    e = cfg["environment"]
    assert (e[cc.ENV], e["STACKPROBE_FI_JIT_ARCHS"], e[cc.CELL_ENV], e[cc.HOST_ENV]) == \
        (COMPILE_CACHE_MOUNT, "12.0a 12.0f", "cu130-x", "h200x2")
    off = DockerExecutor(image="stackprobe/x:1", run_env=run_env("cu130-x", ("12.0a",), None))._config(["true"])
    assert cc.ENV not in off["environment"] and COMPILE_CACHE_MOUNT not in str(off["volumes"])


def test_the_local_executor_sets_and_unsets_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cc.ENV, "/somewhere/else")
    ex = LocalExecutor()
    assert ex.env()[cc.ENV] == "/somewhere/else"  # no run settings: the environment as it is
    [on] = for_run({"c": ex}, ("12.0a",), tmp_path / "compile", "host").values()
    assert on.env()[cc.ENV] == str(tmp_path / "compile") and (tmp_path / "compile").is_dir()
    [off] = for_run({"c": ex}, ("12.0a",), None).values()
    assert cc.ENV not in off.env() and off.env()[cc.CELL_ENV] == "c"


def test_the_cache_folder_by_flag_environment_or_default(tmp_path: Path) -> None:
    assert compile_cache_dir(None, True, {cc.ENV: str(tmp_path)}) is None
    assert compile_cache_dir(tmp_path / "x", False, {cc.ENV: "/y"}) == tmp_path / "x"
    assert compile_cache_dir(None, False, {cc.ENV: str(tmp_path)}) == tmp_path
    assert compile_cache_dir(None, False, {}) == DEFAULT_COMPILE_CACHE


def test_prune_removes_the_compile_cache_when_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = tmp_path / "compile"
    cc.store(store, "k", _library(tmp_path / "b", b"x" * 3_000_000), {})
    monkeypatch.setenv(cc.ENV, str(store))
    assert prune.gather([], tmp_path / "envs", tmp_path / "venvs", None, False) == []
    [r] = prune.gather([], tmp_path / "envs", tmp_path / "venvs", None, False, compile_cache=True)
    assert (r.kind, r.target) == (prune.COMPILE_CACHE, str(store)) and r.size >= 3_000_000
    assert prune.apply([r], "docker") == [] and not store.exists()

"""`provision abi`: export and import indexes read from wheels, the grid's verdicts, the plan's warning, the
page's agreement with the committed inventory results.

The binaries are small shared objects the tests compile (tests/elf_helpers.py), put in wheels served by a
local index that answers byte ranges, so every expected verdict follows from what the test built: a stand-in
torch 2.1.0 exporting c10::foo and c10::Tensor::size, a torch 2.2.0 that also exports c10::bar and a stable
C ABI function, an extension needing c10::bar (declared for torch 2.1.0), one needing a CUDA 12 runtime, and
one built on the stable C ABI alone. One test reads a real torch wheel, only when uv's cache already has it.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import io
import json
import random
import shutil
import subprocess
import sys
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from checks.report import abigrid
from checks.report.report import generate
from common import abi
from common.api import plan
from common.catalog import CATALOG_PATH
from common.catalog import parse as parse_catalog
from inenv.kit import _elf
from provision import registry
from provision.abi import command, wheels
from provision.abi.index import Want, torch_index
from provision.cli import abi_warnings
from tests.checks_helpers import ROOT
from tests.elf_helpers import BAR, FOO, SIZE, build_so, build_stub
from tests.test_checks_report import CURRENT, _layout
from tests.test_provision_catalog_check import _Index, _wheel

STABLE = "aoti_torch_new_thing"
TORCH_21 = TORCH_SRC = """
namespace c10 { void foo() {} struct Tensor { int size() const; }; int Tensor::size() const { return 1; } }
"""
TORCH_22 = TORCH_SRC + 'namespace c10 { void bar() {} }\nextern "C" void aoti_torch_new_thing() {}\n'
USES_BAR = "namespace c10 { void foo(); void bar(); }\nint entry() { c10::foo(); c10::bar(); return 0; }\n"
USES_FOO = "namespace c10 { void foo(); }\nint entry() { c10::foo(); return 0; }\n"
USES_STABLE = 'extern "C" void aoti_torch_new_thing();\nint entry() { aoti_torch_new_thing(); return 0; }\n'


def _padded(source: str, size: int) -> str:
    """The source with an incompressible constant of ``size`` bytes: a read-only segment the streaming reader
    must skip when it is larger than its window."""
    noise = ",".join(str(b) for b in random.Random(1).randbytes(size))
    return source + f"__attribute__((used)) static const unsigned char pad[] = {{{noise}}};\n"


def _torch_wheel(tmp: Path, version: str, source: str, variant: str = "cu130") -> bytes:
    lib = build_so(tmp / f"libc10-{version}-{variant}.so", source)
    cuda = f"{variant[2:-1]}.{variant[-1]}"
    return _wheel({"torch/lib/libc10.so": lib.read_bytes(),
                   "torch/version.py": f"__version__ = '{version}+{variant}'\ncuda = '{cuda}'\n".encode(),
                   "torch/big.bin": random.Random(2).randbytes(1 << 20),  # a member never read
                   f"torch-{version}.dist-info/METADATA": f"Name: torch\nVersion: {version}\n".encode()})


def _ext_wheel(tmp: Path, dist: str, module: str, version: str, source: str, pin: str | None,
               link: tuple[str, ...] = ()) -> bytes:
    lib = build_so(tmp / f"{dist}-{version}.so", source, "-Wl,--no-as-needed", *link)
    meta = f"Name: {dist}\nVersion: {version}\n" + (f"Requires-Dist: torch{pin}\n" if pin else "")
    return _wheel({f"{module}/ops.abi3.so": lib.read_bytes(), f"{module}/__init__.py": b"",
                   f"{dist.replace('-', '_')}-{version}.dist-info/METADATA": meta.encode()})


def _pages(tmp_path: Path) -> dict[str, list[tuple[str, bytes, bool]]]:
    cuda12 = build_stub(tmp_path / "stubs", "libcudart.so.12")
    return {
        "torch": [(f"torch-{v}-cp312-cp312-manylinux_2_28_x86_64.whl", _torch_wheel(tmp_path, v, src), False)
                  for v, src in (("2.1.0", TORCH_21), ("2.2.0", TORCH_22))],
        "sglang-kernel": [
            ("sglang_kernel-0.9.0-cp310-abi3-manylinux2014_x86_64.whl",
             _ext_wheel(tmp_path, "sglang-kernel", "sgl_kernel", "0.9.0", USES_BAR, "==2.1.0"), False),
            ("sglang_kernel-0.9.1-cp310-abi3-manylinux2014_x86_64.whl",
             _ext_wheel(tmp_path, "sglang-kernel", "sgl_kernel", "0.9.1", USES_FOO, None,
                        (f"-L{cuda12.parent}", f"-l:{cuda12.name}")), False)],
        "vllm": [("vllm-0.99.0-cp38-abi3-manylinux_2_28_x86_64.whl",
                  _ext_wheel(tmp_path, "vllm", "vllm", "0.99.0", USES_STABLE, ">=2.1"), False)],
    }


@pytest.fixture
def index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("UV_CACHE_DIR", str(tmp_path / "no-uv-cache"))
    monkeypatch.setattr(registry, "default_store", lambda: registry.Store(tmp_path / "store"))
    served = _Index(_pages(tmp_path))
    yield served
    served.close()


def _catalog(tmp: Path):
    raw = yaml.safe_load(CATALOG_PATH.read_text())
    raw["torch"]["releases"] = {v: {"variants": ["cu130"], "registry": "cu130", "source": "test"}
                                for v in ("2.1.0", "2.2.0")}
    raw["sgl_kernel"]["releases"] = {v: {"package": "sglang-kernel", "registry_cuda": "13.0", "torch": "2.1.0",
                                         "variants": [], "source": "test"} for v in ("0.9.0", "0.9.1")}
    raw["sglang"]["releases"] = {}
    raw["vllm"]["releases"] = {"0.99.0": {"torch": "2.2.0", "flashinfer": "none", "platform": "manylinux_2_28"}}
    return parse_catalog(raw)


def _run(tmp: Path, index: _Index, capsys: pytest.CaptureFixture[str]) -> dict:
    opts = command.AbiOptions(_catalog(tmp), json=True, index_url=index.url, root=tmp / "abi",
                              page_data=tmp / "grid.json")
    assert command.run(opts) == 0
    return json.loads(capsys.readouterr().out)


def test_the_grid_from_streamed_wheels_then_warm_without_the_network(
        tmp_path: Path, index: _Index, capsys: pytest.CaptureFixture[str]) -> None:
    out = _run(tmp_path, index, capsys)
    cells = {(c["extension"], c["torch"]): c for c in out["cells"]}
    bar_21 = cells[("sglang-kernel 0.9.0", "2.1.0+cu130")]
    assert (bar_21["fit"], bar_21["undefined"], bar_21["undefined_first"]) == ("undefined-symbols", 1, [BAR])
    assert bar_21["finding"] == "pin-yes-binary-no"  # declares torch==2.1.0, cannot load beside it
    bar_22 = cells[("sglang-kernel 0.9.0", "2.2.0+cu130")]
    assert bar_22["loads"] and bar_22["finding"] == "pin-no-binary-yes"
    for torch in ("2.1.0+cu130", "2.2.0+cu130"):  # links libcudart.so.12; both torches are CUDA 13
        c = cells[("sglang-kernel 0.9.1", torch)]
        assert (c["fit"], c["cuda_libraries"], c["finding"]) == ("cuda-major-mismatch", ["libcudart.so.12"], None)
    stable = cells[("vllm 0.99.0", "2.1.0+cu130")]
    assert (stable["fit"], stable["needs_torch"], stable["undefined_first"]) == (
        "stable-abi-needs-newer-torch", "2.2.0", [STABLE])
    assert stable["finding"] == "pin-yes-binary-no"  # declares torch>=2.1
    assert cells[("vllm 0.99.0", "2.2.0+cu130")]["loads"]
    assert {t["label"]: t["exports"] for t in out["torch"]} == {"2.1.0+cu130": 2, "2.2.0+cu130": 4}
    assert not any(path.endswith("big.bin") for path, _ in index.requests)
    assert json.loads((tmp_path / "grid.json").read_text())["cells"] == out["cells"]

    asked = len(index.requests)
    again = _run(tmp_path, index, capsys)
    assert len(index.requests) == asked  # warm: every index from .cache/abi, the registry not asked
    assert again["cells"] == out["cells"]


def test_a_member_is_streamed_without_its_large_segments(tmp_path: Path, index: _Index,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """With a window smaller than the library's read-only data, that data is never written, and the tables
    read from the sparse image equal those of the whole file."""
    lib = build_so(tmp_path / "padded.so", _padded(TORCH_22, 300_000))
    monkeypatch.setattr(wheels, "WINDOW", 1 << 12)
    data = lib.read_bytes()
    out = tmp_path / "image.so"
    kept = wheels.sparse_image((data[i : i + 4096] for i in range(0, len(data), 4096)), len(data), out)
    assert kept is not None and len({i for a, b in kept for i in range(a, b)}) < len(data) - 250_000
    assert wheels.tables_inside(str(out), kept)
    assert _elf.linkage(str(out)) == _elf.linkage(str(lib))
    served = _Index({"torch": [("torch-2.2.0-cp312-cp312-manylinux_2_28_x86_64.whl",
                                _wheel({"torch/lib/libc10.so": data}), False)]})
    try:
        url = f"{served.url.removesuffix('/simple')}/files/torch-2.2.0-cp312-cp312-manylinux_2_28_x86_64.whl"
        link = wheels.RemoteWheel("torch-2.2.0-cp312-cp312-manylinux_2_28_x86_64.whl", url).linkage(
            "torch/lib/libc10.so")
    finally:
        served.close()
    assert link is not None and {FOO, SIZE, BAR, STABLE} <= link.defined


def test_not_elf_gives_nothing_and_reads_only_its_head(tmp_path: Path) -> None:
    chunks = iter([b"not an ELF file" * 10_000, b"never read"])
    assert wheels.sparse_image(chunks, 150_010, tmp_path / "x") is None
    assert next(chunks) == b"never read"


def test_plan_warns_with_the_symbol(tmp_path: Path) -> None:
    """Indexes made by the test say sglang-kernel 0.4.10 imports c10::bar, which torch 2.14.1 lacks: every
    resolved default cell with that kernel is warned about, naming the symbol; the others are not."""
    root = tmp_path / "abi"
    torch = abi.TorchIndex("2.14.1", "cu130", 13, "torch.whl", "sha256-" + "1" * 64, frozenset({FOO}))
    ext = abi.ExtensionIndex("sglang-kernel", "0.4.10", "k.whl", "sha256-" + "2" * 64, "2.14.1",
                             frozenset({FOO, BAR}), frozenset(), ("libcudart.so.13",), ("sgl_kernel/x.so",))
    abi.save(torch, root)
    abi.save(ext, root)
    abi.save_manifest({"torch 2.14.1": torch.key, "sglang-kernel 0.4.10": ext.key}, root)
    cells = plan(offline=True)
    kernel_cells = {r.cell_id for r in cells if r.status == "resolved" and r.versions.get("sgl_kernel") == "0.4.10"}
    warned = abi_warnings(cells, root)
    assert kernel_cells and {w.split(":")[0] for w in warned} == kernel_cells
    assert all(BAR in w and "will not load beside torch 2.14.1+cu130" in w for w in warned)


def test_the_committed_cells_agree_with_the_kept_grid() -> None:
    """Every committed inventory verdict on an extension read from its binaries is predicted by the grid in
    docs/abi-grid.json, and the same; a contrary observation is caught."""
    section = abigrid.section(ROOT / "results", ROOT / "docs" / "abi-grid.json")
    assert section is not None
    assert section["disagree"] == [] and section["unpredicted"] == []
    assert section["agree"] >= 5
    data = abi.load_grid_data(ROOT / "docs" / "abi-grid.json")
    wrong = abi.Observed("h/c", "sgl_kernel", "0.4.10", "2.14.1+cu130", False, "1 imported torch symbol(s) missing")
    assert [c.agrees for c in abi.compare(data, [wrong])] == [False]


def test_judge_orders_symbols_before_cuda_and_names_both() -> None:
    torch = abi.TorchIndex("2.1.0", "cu130", 13, "w", "k", frozenset({FOO}))
    ext = abi.ExtensionIndex("e", "1", "w", "k", None, frozenset({FOO, BAR}), frozenset(), ("libcudart.so.12",), ())
    cell = abi.judge(ext, torch)
    assert cell.fit is abi.Fit.UNDEFINED and cell.cuda_libs == ("libcudart.so.12",)
    assert cell.short() == "x1+cuda" and cell.finding == ""


def test_a_real_torch_wheel_from_uv_cache() -> None:
    """torch 2.11.0 as uv's cache holds it (the project environment's torch): its index has the c10 and stable
    C ABI symbols every extension of that era imports, and the CUDA major the catalogue records for its
    registry build (cu130)."""
    cache = wheels.uv_cache_dir()
    records = sorted(cache.glob("wheels-v*/*/torch/2.11.0-*manylinux*x86_64.http")) if cache else []
    roots = [r.with_suffix("") for r in records if r.with_suffix("").is_dir()]
    if not roots:
        pytest.skip("uv's cache holds no torch 2.11.0 wheel")
    idx = torch_index(wheels.CachedWheel("torch-2.11.0.whl", "sha256-local", roots[0].resolve()))
    assert idx.version == "2.11.0" and idx.cuda_major == 13 and idx.variant == "cu130"
    assert {"_ZN3c1019UndefinedTensorImpl10_singletonE", "aoti_torch_empty_strided",
            "_ZN3c104cuda20getCurrentCUDAStreamEa"} <= idx.exports
    assert len(idx.exports) > 20_000
    assert Want("torch", "2.11.0") != Want("torch", "2.11.1")


def test_the_page_shows_the_grid_kept_beside_it_escaped(tmp_path: Path) -> None:
    """`checks report` reads abi-grid.json from the page's folder; its strings are untrusted and escaped."""
    results, out = _layout(tmp_path)
    hostile = "sglang-kernel <script>x</script>|1"
    data = {"torch": [{"label": "2.1.0+cu130", "version": "2.1.0", "variant": "cu130"}],
            "extensions": [{"label": hostile, "package": "sglang-kernel", "version": "9", "torch_pin": "2.1.0"}],
            "cells": [{"extension": hostile, "torch": "2.1.0+cu130", "fit": "undefined-symbols", "undefined": 2,
                       "says": "2 undefined symbol(s): <b>", "finding": "pin-yes-binary-no", "pin": "2.1.0"}]}
    out.parent.mkdir(parents=True, exist_ok=True)
    (out.parent / "abi-grid.json").write_text(json.dumps(data))
    assert generate(results, out, None, check=False, current=CURRENT) == 0
    md, page = out.read_text(), out.with_suffix(".html").read_text()
    assert "| sglang-kernel &lt;script&gt;x&lt;/script&gt;\\|1 | ==2.1.0 | x2\\! |" in md
    assert "<script>x" not in page and "sglang-kernel &lt;script&gt;x&lt;/script&gt;|1" in page
    assert "declares torch==2.1.0 but does not load beside its 2.1.0+cu130" in md


def test_inventory_names_the_nccl_library_torch_loaded() -> None:
    """In this project's environment (torch with the NCCL wheel it pins): after `import torch` the inventory
    finds the mapped libnccl, the release it reports, and the wheel that holds it, as the metadata says."""
    code = ("import json, torch\nfrom inenv.probes.inventory import loaded_nccl\nprint(json.dumps(loaded_nccl()))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    if proc.returncode != 0 and "No module named 'torch'" in proc.stderr:
        pytest.skip("no torch in this environment")
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    dists = [d for d in md.distributions() if (d.metadata["Name"] or "").startswith("nvidia-nccl")]
    if not dists:
        pytest.skip("no NCCL wheel in this environment")
    assert found["package"] == dists[0].metadata["Name"] and found["version"] == dists[0].version
    assert found["path"].endswith("libnccl.so.2") and "/nvidia/nccl/lib/" in found["path"]


def test_plan_warns_for_an_engine_cell_too(tmp_path: Path) -> None:
    """An engine cell's engine is judged like its sgl-kernel: a vLLM 0.33.0 index importing a stable-ABI
    function the test's torch 2.14.0 index lacks makes its cell's warning name it."""
    root = tmp_path / "abi"
    torch = abi.TorchIndex("2.14.0", "cu130", 13, "t.whl", "sha256-" + "3" * 64, frozenset({FOO}))
    vllm = abi.ExtensionIndex("vllm", "0.33.0", "v.whl", "sha256-" + "4" * 64, "2.14.0", frozenset(),
                              frozenset({STABLE}), (), ("vllm/_C.abi3.so",))
    for index in (torch, vllm):
        abi.save(index, root)
    abi.save_manifest({"torch 2.14.0": torch.key, "vllm 0.33.0": vllm.key}, root)
    warned = abi_warnings(plan(ROOT / "matrices" / "engines.yaml", offline=True), root)
    assert warned == ["cu130-torch2.14.0-sglnone-fi0.7.2.post1-vllm0.33.0: vllm 0.33.0 will not load beside torch "
                      f"2.14.0+cu130: stable ABI only: no indexed torch exports all it needs (1 undefined: {STABLE})"]


def test_cached_on_an_incomplete_cache_leaves_the_page_grid_alone(
        tmp_path: Path, index: _Index, capsys: pytest.CaptureFixture[str]) -> None:
    """One torch indexed, the rest not: `--cached` judges what it has, asks the index nothing, and does not
    replace the page's grid with a partial one."""
    root, page = tmp_path / "abi", tmp_path / "grid.json"
    page.write_text("{}")
    catalog = _catalog(tmp_path)
    command.run(command.AbiOptions(catalog, ("vllm",), json=True, index_url=index.url, root=root, page_data=page))
    capsys.readouterr()
    asked = len(index.requests)
    assert command.run(command.AbiOptions(catalog, json=True, offline=True, root=root, page_data=page)) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(index.requests) == asked and page.read_text() == "{}"
    assert [c["extension"] for c in out["cells"]] == ["vllm 0.99.0", "vllm 0.99.0"]
    assert set(out["not_indexed"]) == {"sglang-kernel 0.9.0", "sglang-kernel 0.9.1"}


def test_variants_adds_the_pytorch_index_builds(tmp_path: Path, index: _Index,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """With variants, torch 2.1.0's CUDA 12.6 build comes from its own index: beside it the extension that
    needs libcudart.so.12 loads, where beside the CUDA 13 build of the same release it does not."""
    pytorch = _Index({"torch": [("torch-2.1.0+cu126-cp312-cp312-manylinux_2_28_x86_64.whl",
                                 _torch_wheel(tmp_path, "2.1.0", TORCH_21, "cu126"), False)]})
    try:
        catalog = replace(_catalog(tmp_path), torch_stable_index=pytorch.url)
        catalog.torch["2.1.0"] = replace(catalog.torch["2.1.0"], variants=("cu126", "cu130"))
        opts = command.AbiOptions(catalog, ("sglang-kernel",), json=True, variants=True, index_url=index.url,
                                  root=tmp_path / "abi", page_data=None)
        assert command.run(opts) == 0
    finally:
        pytorch.close()
    cells = {(c["extension"], c["torch"]): c for c in json.loads(capsys.readouterr().out)["cells"]}
    assert cells[("sglang-kernel 0.9.1", "2.1.0+cu126")]["loads"]
    assert cells[("sglang-kernel 0.9.1", "2.1.0+cu130")]["fit"] == "cuda-major-mismatch"


# --- the cache is only a cache ------------------------------------------------------------------------------
def test_a_cache_key_that_is_no_sha256_hex_names_no_file(tmp_path: Path) -> None:
    """A manifest entry like ``../../x`` would read outside .cache/abi: no key but a sha256 hex names a file."""
    root = tmp_path / "cache" / "abi"
    planted = abi.TorchIndex("2.1.0", "cu130", 13, "t.whl", "sha256-" + "1" * 64, frozenset({FOO}))
    body = {"format": abi.FORMAT, "wheel": "t.whl", "key": "../../x", "version": "2.1.0", "variant": "cu130",
            "cuda_major": 13, "exports": [FOO]}
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "x.json.gz").write_bytes(__import__("gzip").compress(json.dumps(body).encode()))
    abi.save(planted, root)
    abi.save_manifest({"torch 2.1.0": "../../x"}, root)
    assert abi.load_torch("../../x", root) is None
    assert abi.cached([("torch", "2.1.0")], root) == ([], [])
    with pytest.raises(ValueError):
        abi.save(replace(planted, key="../../x"), root)


def test_an_index_naming_another_release_is_not_used_for_the_one_asked(
        tmp_path: Path, index: _Index, capsys: pytest.CaptureFixture[str]) -> None:
    """The manifest's entries for torch 2.1.0 and 2.2.0 swapped: each file names the other torch, so neither is
    used for the release it is filed under; the next run makes them again and the grid is what it was."""
    first = _run(tmp_path, index, capsys)
    root = tmp_path / "abi"
    entries = abi.load_manifest(root)
    entries["torch 2.1.0"], entries["torch 2.2.0"] = entries["torch 2.2.0"], entries["torch 2.1.0"]
    abi.save_manifest(entries, root)
    assert abi.cached([("torch", "2.1.0"), ("torch", "2.2.0")], root) == ([], [])
    asked = len(index.requests)
    again = _run(tmp_path, index, capsys)
    assert len(index.requests) > asked  # the listings asked again; the files under the right keys reused
    assert again["cells"] == first["cells"] and again["torch"] == first["torch"]
    assert [t.version for t in abi.cached([("torch", "2.1.0"), ("torch", "2.2.0")], root)[0]] == ["2.1.0", "2.2.0"]


def test_links_in_the_cache_are_refused(tmp_path: Path) -> None:
    root = tmp_path / "abi"
    t = abi.TorchIndex("2.1.0", "cu130", 13, "t.whl", "sha256-" + "1" * 64, frozenset({FOO}))
    elsewhere = tmp_path / "elsewhere"
    abi.save(t, elsewhere)
    abi.save_manifest({"torch 2.1.0": t.key}, elsewhere)
    assert abi.cached([("torch", "2.1.0")], elsewhere)[0] == [t]
    # the index file a link to a good index: not followed
    (root / "torch").mkdir(parents=True)
    (root / "torch" / f"{t.key}.json.gz").symlink_to(elsewhere / "torch" / f"{t.key}.json.gz")
    (root / "releases.json").symlink_to(elsewhere / "releases.json")
    assert abi.load_torch(t.key, root) is None and abi.load_manifest(root) == {}
    abi.save_manifest({"torch 2.1.0": t.key}, root)  # the link replaced by a file, the other untouched
    assert not (root / "releases.json").is_symlink() and abi.load_manifest(elsewhere) == {"torch 2.1.0": t.key}
    assert abi.cached([("torch", "2.1.0")], root) == ([], [])
    # its folder a link: nothing read through it, nothing written through it (one line naming it)
    shutil.rmtree(root / "torch")
    (root / "torch").symlink_to(elsewhere / "torch")
    assert abi.load_torch(t.key, root) is None
    with pytest.raises(abi.CacheError) as caught:
        abi.save(t, root)
    assert str(root / "torch") in str(caught.value) and "\n" not in str(caught.value)


class _ShaIndex(_Index):
    """The test index with each file's real sha256 in its link, as a real registry gives."""

    def _page(self, project: str) -> bytes:
        links = "".join(f'<a href="../../files/{n}#sha256={hashlib.sha256(d).hexdigest()}">{n}</a>\n'
                        for n, d, _ in self.pages[project])
        return f"<html><body>{links}</body></html>".encode()


def test_the_kept_grid_is_the_same_bytes_whatever_uvs_cache_holds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """torch 2.1.0 is listed as a CPython 3.12 and a 3.11 wheel (the 3.11 one built with other exports); uv's
    cache holds only the 3.11 one. The grid still comes from the wheel the listing picks (3.12), byte for byte
    the grid of a machine whose uv cache is empty."""
    pages = _pages(tmp_path)
    (tmp_path / "cp311").mkdir()
    cp311 = _torch_wheel(tmp_path / "cp311", "2.1.0", TORCH_22)
    pages["torch"].append(("torch-2.1.0-cp311-cp311-manylinux_2_28_x86_64.whl", cp311, False))
    uv = tmp_path / "uv"
    unpacked = uv / "wheels-v5" / "pypi" / "torch" / "2.1.0-cp311-cp311-manylinux_2_28_x86_64"
    unpacked.mkdir(parents=True)
    with zipfile.ZipFile(io.BytesIO(cp311)) as zf:
        zf.extractall(unpacked)
    record = unpacked.parent / f"{unpacked.name}.http"
    record.write_bytes(b"record sha256=" + hashlib.sha256(cp311).hexdigest().encode())
    monkeypatch.setattr(registry, "default_store", lambda: registry.Store(tmp_path / "store"))
    served = _ShaIndex(pages)
    pages_kept = {}
    try:
        for name, cache in (("empty", tmp_path / "no-uv-cache"), ("cp311", uv)):
            monkeypatch.setenv("UV_CACHE_DIR", str(cache))
            page = tmp_path / f"grid-{name}.json"
            assert command.run(command.AbiOptions(_catalog(tmp_path), index_url=served.url,
                                                  root=tmp_path / f"abi-{name}", page_data=page)) == 0
            pages_kept[name] = page.read_bytes()
    finally:
        served.close()
    kept = json.loads(pages_kept["cp311"])
    assert kept["torch"][0]["wheel"] == "torch-2.1.0-cp312-cp312-manylinux_2_28_x86_64.whl"
    assert pages_kept["cp311"] == pages_kept["empty"]


def test_an_empty_or_unknown_package_selector_is_refused_in_one_line(tmp_path: Path) -> None:
    from common.errors import InputError
    from provision.abi.index import wants

    catalog = _catalog(tmp_path)
    with pytest.raises(InputError, match="^--package '': an empty selector selects nothing"):
        wants(catalog, ("",))
    with pytest.raises(InputError, match="^--package 'sglang-kernl' is no extension the catalogue lists "
                                         r"\(did you mean 'sglang-kernel'\?\)"):
        wants(catalog, ("sglang-kernl",))
    assert {w.package for w in wants(catalog, ("Sglang_Kernel",))} == {"torch", "sglang-kernel"}

"""`provision catalog check`: the pure comparison, the readers of what an index returns, and the network edge
against a local PEP 503 index (HTML pages, byte-range file server, wheels built here with real ELF objects).
The same edge against the real registry is in test_provision_catalog_registry.py."""

from __future__ import annotations

import io
import json
import random
import re
import shutil
import subprocess
import threading
import zipfile
from collections.abc import Iterator
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from common.catalog import CATALOG_PATH, KernelRelease, Preset, TorchRelease
from common.catalog import load as load_catalog
from provision import catalogcheck as cc
from provision import registry
from provision.catalogcheck import KernelSeen, Readings, Seen, Wants
from provision.cli import main

# Recorded from the registry's sglang 0.5.23 wheel METADATA (2026-11-30), a subset with markers and extras.
SGLANG_0523_METADATA = """Metadata-Version: 2.4
Name: sglang
Version: 0.5.23
Requires-Python: >=3.11
Requires-Dist: cuda-python>=13.0
Requires-Dist: flashinfer_python[cu13]==0.7.2
Requires-Dist: sglang-kernel==0.4.10
Requires-Dist: torch==2.14.1
Requires-Dist: torchaudio==2.11.0
Requires-Dist: torchcodec==0.17.0; sys_platform != "linux" or (sys_platform == "linux" \
and platform_machine != "aarch64" and platform_machine != "arm64" and platform_machine != "armv7l")
Requires-Dist: torchvision
Requires-Dist: st_attn==0.0.7; (platform_machine != "aarch64" and platform_machine != "arm64") and extra == "diffusion"
Requires-Dist: sgl-eval==0.1.3; extra == "test"
"""
# Recorded from the registry wheels torch-2.15.0 and torch-2.7.1 (cp312 manylinux_2_28_x86_64).
TORCH_2150_VERSION_PY = """from typing import Optional

__all__ = ['__version__', 'debug', 'cuda', 'git_version', 'hip', 'rocm', 'xpu']
__version__ = '2.15.0+cu132'
debug = False
cuda: Optional[str] = '13.2'
git_version = 'd0f2af8b66b20da4baa50644c0cd3f887a2eae2e'
hip: Optional[str] = None
rocm: Optional[str] = None
xpu: Optional[str] = None
"""
# Bytes around the ptxas producer note in sgl-kernel shared objects: sgl_kernel 0.3.21's spatial_ops (plain
# text, CUDA 12.9) and sglang_kernel 0.4.10's sm90/common_ops (compressed fatbin: only part of it survives).
BANNER_0321 = (b"Corp\x00\x81\x00\x00\x00\x00\x00\x00\x00\x01\x00\x00\x00\x07\x00\x00\x006\x00\x00\x00`\x00\x00"
               b"\x00\x00ptxas\x00Cuda compilation tools, release 12.9, V12.9.86\x00Build cud")
BANNER_0410 = (b"\x05\xb8\xc8 \x08l\x88\x07\x94\xf0\x00\xf8\x04X\t\x06`\x90\xd0NVIDIA Corp\x076`\x00ptxas\x00"
               b"Cuda ilation tools, release 13.0, V.88\x00Build c_r/er.")


# ---- pure readers ---------------------------------------------------------------------------------


def test_pins_reads_the_base_install_on_linux_x86_64() -> None:
    got = registry.pins(SGLANG_0523_METADATA)
    assert got["torch"] == "2.14.1" and got["sglang-kernel"] == "0.4.10"
    assert got["flashinfer-python"] == "0.7.2"  # flashinfer_python[cu13]: name canonicalised, extra kept out
    assert got["cuda-python"] == ">=13.0" and got["torchvision"] == ""
    assert got["torchcodec"] == "0.17.0"  # its marker holds on Linux x86-64
    assert "st-attn" not in got and "sgl-eval" not in got  # behind extras


def test_torch_variant_from_version_py() -> None:
    assert registry.torch_variant(TORCH_2150_VERSION_PY) == "cu132"
    no_label = TORCH_2150_VERSION_PY.replace("'2.15.0+cu132'", "'2.15.0'")
    assert registry.torch_variant(no_label) == "cu132"  # from `cuda = '13.2'`
    assert registry.torch_variant(no_label.replace("'13.2'", "None")) == "cpu"
    assert registry.torch_variant("nothing here") is None


def test_nvcc_release_from_plain_and_compressed_banners() -> None:
    assert registry.nvcc_releases(BANNER_0321) == {"12.9"}
    assert registry.nvcc_releases(BANNER_0410) == {"13.0"}
    assert registry.nvcc_releases(b"release 13.0 without the producer note") == set()


def test_newest_release_ignores_pre_dev_and_local_versions() -> None:
    names = ["torch-2.15.0-cp312-cp312-manylinux_2_28_x86_64.whl", "torch-2.16.0rc1-cp312-cp312-win_amd64.whl",
             "torch-2.16.0.dev20261101-cp312-cp312-manylinux_2_28_x86_64.whl",
             "torch-2.17.0+cpu-cp312-cp312-manylinux_2_28_x86_64.whl", "torch-2.14.1.tar.gz", "README"]
    assert registry.newest_release(names) == "2.15.0"
    assert registry.newest_release(["README"]) is None


def test_pick_wheel_takes_exact_version_linux_x86_64_cp312_highest_build() -> None:
    names = ["torch-2.13.0+cpu-cp312-cp312-manylinux_2_28_x86_64.whl",
             "torch-2.13.0-cp312-cp312-manylinux_2_28_aarch64.whl", "torch-2.13.0-cp312-cp312-win_amd64.whl",
             "torch-2.13.0-cp311-cp311-manylinux_2_28_x86_64.whl",
             "torch-2.13.0-cp312-cp312-manylinux_2_28_x86_64.whl",
             "torch-2.13.0-3-cp312-cp312-manylinux_2_28_x86_64.whl"]
    assert registry.pick_wheel(names, "2.13.0") == "torch-2.13.0-3-cp312-cp312-manylinux_2_28_x86_64.whl"
    assert registry.pick_wheel(names[:3], "2.13.0") is None  # +cpu is another version; no Linux x86-64 wheel
    assert registry.pick_wheel(["sglang-0.5.6-py3-none-any.whl"], "0.5.6") == "sglang-0.5.6-py3-none-any.whl"


# ---- the comparison -------------------------------------------------------------------------------


def small_catalog():  # type: ignore[no-untyped-def]
    cat = load_catalog()
    return replace(
        cat,
        newest={"torch": "2.15.0", "sglang": "0.5.23"},
        presets={"sglang-0.5.23": Preset("sglang-0.5.23", "2.14.1", "0.4.10", "0.7.2", "0.5.23",
                                          platform="manylinux_2_34"),
                 "sglang-0.5.10": Preset("sglang-0.5.10", "2.9.1", "0.4.1", "0.6.7.post2", "0.5.10")},
        kernels={"0.4.10": KernelRelease("0.4.10", "sglang-kernel", "13.0", "2.14.1", (), "k10 source"),
                 "0.4.1": KernelRelease("0.4.1", "sglang-kernel", "12.9", "2.9.1", ("cu130",), "k1 source"),
                 "0.3.20": KernelRelease("0.3.20", "sgl-kernel", "12.9", "2.9.1", ("cu130",), "k0 source")},
        torch={"2.15.0": TorchRelease("2.15.0", ("cu126", "cu130", "cu132"), "cu132", "t15 source")},
    )


def readings(**over: object) -> Readings:
    meta = "sglang-0.5.23 METADATA Requires-Dist"
    base = dict(
        index="http://index.test/simple",
        newest={"torch": Seen("2.15.0", "torch release list"), "sglang": Seen("0.5.23", "sglang release list")},
        sglang={"0.5.23": {"torch": Seen("2.14.1", meta), "sgl_kernel": Seen("0.4.10", meta),
                           "flashinfer": Seen("0.7.2", meta)},
                "0.5.10": {"torch": Seen("2.9.1", "m10"), "sgl_kernel": Seen("0.4.1", "m10"),
                           "flashinfer": Seen("0.6.7.post2", "m10")}},
        kernels={"0.4.10": KernelSeen(Seen("0.4.10", "on index"), Seen("2.14.1", "k10 Requires-Dist"),
                                      Seen("13.0", "k10 banner")),
                 "0.4.1": KernelSeen(Seen("0.4.1", "on index"), Seen(None, "k1 Requires-Dist"), Seen("12.9", "b")),
                 "0.3.20": KernelSeen(Seen("0.3.20", "on index"), Seen(None, "k0 Requires-Dist"), Seen("12", "ld"))},
        torch={"2.15.0": Seen("cu132", "torch-2.15.0 torch/version.py")},
    )
    base.update(over)
    return Readings(**base)  # type: ignore[arg-type]


def test_wants_names_every_checkable_fact_of_the_catalog() -> None:
    w = cc.wants(small_catalog())
    assert w == Wants(("torch", "sglang"), ("0.5.23", "0.5.10"),
                      (("sglang-kernel", "0.4.10"), ("sglang-kernel", "0.4.1"), ("sgl-kernel", "0.3.20")), ("2.15.0",))


def test_matching_readings_give_no_drift_and_count_each_fact() -> None:
    out = cc.compare(small_catalog(), readings())
    assert out.drift == ()
    # 2 newest + 2x3 pins + 3 kernel CUDA + 2 kernel torch (0.4.10 from its wheel, 0.4.1 through sglang 0.5.10)
    # + 1 torch registry build; 0.3.20's torch cannot be confirmed (no pin, no catalogued release uses it).
    assert out.checked == 14
    assert out.unchecked == ("sgl_kernel.releases[0.3.20].torch: the wheel declares no torch and no catalogued "
                             "SGLang release pins sgl-kernel 0.3.20",)


def test_each_kind_of_fact_drifts() -> None:
    r = readings()
    r.sglang["0.5.23"]["flashinfer"] = Seen("0.7.3", "sglang-0.5.23 METADATA Requires-Dist")
    r.sglang["0.5.10"]["torch"] = Seen("2.9.0", "m10")  # also moves the torch the index ties kernel 0.4.1 to
    r.kernels["0.4.10"] = KernelSeen(Seen("0.4.10", "on index"), Seen("2.15.0", "k10"), Seen("12.9", "k10 banner"))
    r.kernels["0.3.20"] = KernelSeen(Seen("0.3.20", "on index"), Seen(None, "k0"), Seen("13", "libcudart.so.13"))
    r.torch["2.15.0"] = Seen("cu130", "torch-2.15.0 torch/version.py")
    r.newest["torch"] = Seen("2.16.0", "torch release list")
    out = cc.compare(small_catalog(), r)
    got = {d.key: (d.recorded, d.registry) for d in out.drift}
    assert got == {
        "newest.torch": ("2.15.0", "2.16.0"),
        "sglang.releases[0.5.23].flashinfer": ("0.7.2", "0.7.3"),
        "sglang.releases[0.5.10].torch": ("2.9.1", "2.9.0"),
        "sgl_kernel.releases[0.4.10].registry_cuda": ("13.0", "12.9"),
        "sgl_kernel.releases[0.4.10].torch": ("2.14.1", "2.15.0"),
        "sgl_kernel.releases[0.4.1].torch": ("2.9.1", "2.9.0"),
        "sgl_kernel.releases[0.3.20].registry_cuda": ("12.9", "13"),  # major-only reading, other major
        "torch.releases[2.15.0].registry": ("cu132", "cu130"),
    }
    k1 = next(d for d in out.drift if d.key == "sgl_kernel.releases[0.4.1].torch")
    assert k1.evidence == "the wheel declares no torch; sglang 0.5.10 pin it with torch 2.9.0"
    assert k1.source == "k1 source"


def test_unpublished_releases_drift_with_no_registry_value() -> None:
    r = readings()
    r.sglang["0.5.23"] = {"release": Seen(None, "sglang 0.5.23 has no Linux x86-64 wheel on the index")}
    r.kernels["0.4.10"] = KernelSeen(*[Seen(None, "sglang-kernel is not on the index")] * 3)
    out = cc.compare(small_catalog(), r)
    assert [(d.key, d.recorded, d.registry) for d in out.drift] == [
        ("sglang.releases[0.5.23]", "0.5.23", None), ("sgl_kernel.releases[0.4.10].package", "sglang-kernel", None)]
    line = cc.drift_line(out.drift[1])
    assert line == ("sgl_kernel.releases[0.4.10].package: catalog sglang-kernel, registry none "
                    "(sglang-kernel is not on the index) [catalog source: k10 source]")


def test_outcome_lines_and_json() -> None:
    r = readings()
    r.torch["2.15.0"] = Seen("cu130", "torch-2.15.0-cp312-cp312-manylinux_2_28_x86_64.whl torch/version.py")
    out = cc.compare(small_catalog(), r)
    lines = cc.outcome_lines(out)
    assert lines[0] == ("torch.releases[2.15.0].registry: catalog cu132, registry cu130 "
                        "(torch-2.15.0-cp312-cp312-manylinux_2_28_x86_64.whl torch/version.py) "
                        "[catalog source: t15 source]")
    assert lines[1].startswith("unchecked sgl_kernel.releases[0.3.20].torch")
    assert lines[-1] == "catalog check: 14 facts against http://index.test/simple: 1 drifted"
    data = json.loads(json.dumps(cc.outcome_json(out)))
    assert data["drift"] == [{"key": "torch.releases[2.15.0].registry", "recorded": "cu132", "registry": "cu130",
                              "evidence": "torch-2.15.0-cp312-cp312-manylinux_2_28_x86_64.whl torch/version.py",
                              "source": "t15 source"}]
    assert data["checked"] == 14 and len(data["unchecked"]) == 1


# ---- the edge against a local index ---------------------------------------------------------------


def _wheel(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return buf.getvalue()


def _kernel_objects(tmp: Path) -> tuple[bytes, bytes]:
    """Two real shared objects as in a CUDA 13 sgl-kernel wheel: a small one that links libcudart.so.13 and
    carries no nvcc banner, and a larger one whose data holds the (compressed-fatbin) banner."""
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc")
    (tmp / "rt.c").write_text("int cudaGetDeviceCount(int *n) { *n = 0; return 0; }\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libcudart.so.13", "-o", str(tmp / "libcudart.so.13"),
                    str(tmp / "rt.c")], check=True)
    (tmp / "small.c").write_text("int cudaGetDeviceCount(int *n);\nint count(void) { int n; "
                                 "cudaGetDeviceCount(&n); return n; }\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(tmp / "small.so"), str(tmp / "small.c"),
                    str(tmp / "libcudart.so.13")], check=True)
    blob = ", ".join(str(b) for b in BANNER_0410)
    noise = ", ".join(str(b) for b in random.Random(0).randbytes(40000))  # incompressible: sorts after small.so
    (tmp / "big.c").write_text(f"__attribute__((used)) static const unsigned char note[] = {{{blob}}};\n"
                               f"__attribute__((used)) static const unsigned char pad[] = {{{noise}}};\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(tmp / "big.so"), str(tmp / "big.c")], check=True)
    return (tmp / "small.so").read_bytes(), (tmp / "big.so").read_bytes()


class _Index:
    """A PEP 503 (HTML) index on 127.0.0.1 whose file server answers Range requests unless told not to."""

    def __init__(self, pages: dict[str, list[tuple[str, bytes, bool]]], ranges: bool = True) -> None:
        self.pages = pages
        self.ranges = ranges
        self.requests: list[tuple[str, str | None]] = []  # (path, Range header)
        index = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802
                index.requests.append((self.path, self.headers.get("Range")))
                m = re.fullmatch(r"/simple/([^/]+)/", self.path)
                if m and m.group(1) in index.pages:
                    return self._send(200, index._page(m.group(1)), "text/html")
                m = re.fullmatch(r"/files/(.+)", self.path)
                files = {name: data for entries in index.pages.values() for name, data, _ in entries}
                if not m or m.group(1) not in files:
                    return self._send(404, b"not found", "text/plain")
                data = files[m.group(1)]
                rng = self.headers.get("Range")
                if not (index.ranges and rng):
                    return self._send(200, data, "application/octet-stream")
                a, b = rng.removeprefix("bytes=").split("-")
                start, end = (len(data) - int(b), len(data) - 1) if a == "" else (int(a), min(int(b), len(data) - 1))
                start = max(start, 0)
                self._send(206, data[start : end + 1], "application/octet-stream",
                           {"Content-Range": f"bytes {start}-{end}/{len(data)}"})

            def _send(self, code: int, body: bytes, ctype: str, extra: dict[str, str] | None = None) -> None:
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                for k, v in (extra or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/simple"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _page(self, project: str) -> bytes:
        links = "".join(f'<a href="../../files/{n}#sha256=00"{" data-yanked" if y else ""}>{n}</a>\n'
                        for n, _, y in self.pages[project])
        return f"<html><body>{links}</body></html>".encode()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _pages(tmp: Path) -> dict[str, list[tuple[str, bytes, bool]]]:
    small, big = _kernel_objects(tmp)
    kernel_meta = b"Metadata-Version: 2.1\nName: sglang-kernel\nVersion: 0.4.10\nRequires-Dist: torch==2.14.1\n"
    cpu_py = TORCH_2150_VERSION_PY.replace("+cu132", "+cpu").replace("'13.2'", "None").encode()
    return {
        "sglang": [("sglang-0.5.23-cp312-cp312-manylinux_2_34_x86_64.whl", _wheel({
            "sglang/__init__.py": b"", "sglang-0.5.23.dist-info/METADATA": SGLANG_0523_METADATA.encode()}), False)],
        "sglang-kernel": [("sglang_kernel-0.4.10-cp310-abi3-manylinux2014_x86_64.whl", _wheel({
            "sgl_kernel/big_ops.abi3.so": big, "sgl_kernel/spatial_ops.abi3.so": small,
            "sglang_kernel-0.4.10.dist-info/METADATA": kernel_meta}), False)],
        "torch": [("torch-2.15.0-cp312-cp312-manylinux_2_28_x86_64.whl", _wheel({
                      "torch/version.py": TORCH_2150_VERSION_PY.encode(),
                      "torch-2.15.0.dist-info/METADATA": b"Name: torch\nVersion: 2.15.0\n"}), False),
                  ("torch-2.15.0+cpu-cp312-cp312-manylinux_2_28_x86_64.whl",
                   _wheel({"torch/version.py": cpu_py}), False),
                  ("torch-2.16.0-cp312-cp312-manylinux_2_28_x86_64.whl", b"yanked", True)],
    }


_PRODUCTION_STORE = registry.default_store


@pytest.fixture(autouse=True)
def _store_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reads of the throwaway local indexes below are kept in the test's folder, not the checkout's cache."""
    monkeypatch.setattr(registry, "default_store", lambda: registry.Store(tmp_path / "store-wheels"))


@pytest.fixture
def local_index(tmp_path: Path) -> Iterator[_Index]:
    idx = _Index(_pages(tmp_path))
    yield idx
    idx.close()


def _local_catalog():  # type: ignore[no-untyped-def]
    cat = small_catalog()
    return replace(cat, presets={"sglang-0.5.23": cat.presets["sglang-0.5.23"]},
                   kernels={"0.4.10": cat.kernels["0.4.10"]}, newest={"torch": "2.15.0"})


def test_read_a_local_html_index_by_byte_ranges(local_index: _Index) -> None:
    cat = _local_catalog()
    r = registry.read(cc.wants(cat), local_index.url)
    assert r.newest["torch"] == Seen("2.15.0", "torch release list")  # yanked 2.16.0 and the +cpu build ignored
    assert r.sglang["0.5.23"]["flashinfer"].value == "0.7.2"
    assert r.sglang["0.5.23"]["sgl_kernel"].value == "0.4.10"
    k = r.kernels["0.4.10"]
    assert k.torch.value == "2.14.1"
    assert k.cuda == Seen("13.0", "sglang_kernel-0.4.10-cp310-abi3-manylinux2014_x86_64.whl: nvcc release in "
                                  "spatial_ops.abi3.so, big_ops.abi3.so; DT_NEEDED libcudart.so.13")
    assert r.torch["2.15.0"] == Seen("cu132", "torch-2.15.0-cp312-cp312-manylinux_2_28_x86_64.whl torch/version.py")
    assert cc.compare(cat, r).drift == ()
    wheel_reads = [rng for path, rng in local_index.requests if path.startswith("/files/")]
    assert wheel_reads and all(wheel_reads)  # every wheel read asked for a byte range, none for the whole file


def test_index_without_byte_ranges_is_one_clear_error(tmp_path: Path) -> None:
    idx = _Index(_pages(tmp_path), ranges=False)
    try:
        with pytest.raises(registry.RegistryError, match="does not serve byte ranges"):
            registry.read(cc.wants(_local_catalog()), idx.url)
    finally:
        idx.close()


def _catalog_file(tmp_path: Path, name: str, edit) -> Path:  # type: ignore[no-untyped-def]
    raw = yaml.safe_load(CATALOG_PATH.read_text())
    raw["sglang"]["releases"] = {"0.5.23": raw["sglang"]["releases"]["0.5.23"]}
    raw["sgl_kernel"]["releases"] = {"0.4.10": raw["sgl_kernel"]["releases"]["0.4.10"]}
    raw["torch"]["releases"] = {"2.15.0": raw["torch"]["releases"]["2.15.0"]}
    raw["newest"]["releases"] = {"torch": "2.15.0"}
    raw["vllm"]["releases"] = {}
    edit(raw)
    path = tmp_path / name  # one name per content: catalog.load is cached by path
    path.write_text(yaml.safe_dump(raw))
    return path


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main(argv)
    out, err = capsys.readouterr()
    return int(e.value.code or 0), out, err


def test_cli_exit_codes_against_a_local_index(local_index: _Index, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    clean = _catalog_file(tmp_path, "clean.yaml", lambda raw: None)
    code, out, _ = _cli(["catalog", "check", "--catalog", str(clean), "--index", local_index.url], capsys)
    assert code == 0 and out.strip() == f"catalog check: 8 facts against {local_index.url}: no drift"

    def drift(raw: dict) -> None:
        raw["sglang"]["releases"]["0.5.23"]["flashinfer"] = "0.7.1"

    drifted = _catalog_file(tmp_path, "drifted.yaml", drift)
    code, out, _ = _cli(["catalog", "check", "--catalog", str(drifted), "--index", local_index.url], capsys)
    assert code == 1
    assert out.splitlines()[0] == (
        "sglang.releases[0.5.23].flashinfer: catalog 0.7.1, registry 0.7.2 ("
        "sglang-0.5.23-cp312-cp312-manylinux_2_34_x86_64.whl "
        "METADATA Requires-Dist) [catalog source: registry metadata of each sglang release (Requires-Dist); "
        "all confirmed by `provision catalog check` on 2026-11-30]")
    code, out, _ = _cli(["catalog", "check", "--json", "--catalog", str(drifted), "--index", local_index.url], capsys)
    assert code == 1 and [d["key"] for d in json.loads(out)["drift"]] == ["sglang.releases[0.5.23].flashinfer"]


def test_cli_unreachable_index_and_bad_catalog_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    clean = _catalog_file(tmp_path, "clean.yaml", lambda raw: None)
    code, out, err = _cli(["catalog", "check", "--catalog", str(clean), "--index", f"http://127.0.0.1:{port}/simple"],
                          capsys)
    assert code == 2 and out == ""
    assert err.startswith(f"provision: index unreachable: http://127.0.0.1:{port}/simple/") and err.count("\n") == 1
    (tmp_path / "bad.yaml").write_text("cuda: {}\n")
    code, _, err = _cli(["catalog", "check", "--catalog", str(tmp_path / "bad.yaml")], capsys)
    assert code == 2 and "cannot read the catalog: KeyError" in err and err.count("\n") == 1


def test_configured_index_is_the_one_uv_uses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UV_INDEX_URL", "https://index.example.test/simple")
    monkeypatch.delenv("UV_DEFAULT_INDEX", raising=False)
    assert registry.configured_index() == "https://index.example.test/simple"


# ---- the store of what was read ----------------------------------------------------------------------


def _entries(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file())


def test_a_second_read_takes_wheel_bytes_from_the_store_and_pages_live(local_index: _Index, tmp_path: Path) -> None:
    cat = _local_catalog()
    store = registry.Store(tmp_path / "wheels")
    first = registry.read(cc.wants(cat), local_index.url, store=store)
    wheel_reads = [r for r in local_index.requests if r[0].startswith("/files/")]
    assert wheel_reads and _entries(tmp_path / "wheels")
    local_index.requests.clear()
    before = registry.received_bytes()
    second = registry.read(cc.wants(cat), local_index.url, store=store)
    assert second == first
    assert sorted(path for path, _ in local_index.requests) == ["/simple/sglang-kernel/", "/simple/sglang/",
                                                                "/simple/torch/"]
    pages = sum(len(local_index._page(p)) for p in ("sglang", "sglang-kernel", "torch"))
    assert registry.received_bytes() - before == pages  # the pages again, no wheel byte


def test_pages_are_read_live_so_a_new_release_is_seen(local_index: _Index, tmp_path: Path) -> None:
    cat = _local_catalog()
    store = replace(_PRODUCTION_STORE(), wheels=tmp_path / "wheels")  # what `provision catalog check` keeps
    assert registry.read(cc.wants(cat), local_index.url, store=store).newest["torch"].value == "2.15.0"
    local_index.pages["torch"].append(("torch-2.17.0-cp312-cp312-manylinux_2_28_x86_64.whl", b"new", False))
    assert registry.read(cc.wants(cat), local_index.url, store=store).newest["torch"].value == "2.17.0"


def test_a_store_with_pages_makes_no_request_the_second_time(local_index: _Index, tmp_path: Path) -> None:
    cat = _local_catalog()
    store = registry.Store(tmp_path / "wheels", tmp_path / "pages")
    first = registry.read(cc.wants(cat), local_index.url, store=store)
    local_index.requests.clear()
    before = registry.received_bytes()
    assert registry.read(cc.wants(cat), local_index.url, store=store) == first
    assert local_index.requests == [] and registry.received_bytes() == before


def test_a_cut_or_changed_entry_is_read_again(local_index: _Index, tmp_path: Path) -> None:
    cat = _local_catalog()
    store = registry.Store(tmp_path / "wheels", tmp_path / "pages")
    first = registry.read(cc.wants(cat), local_index.url, store=store)
    entries = _entries(tmp_path / "wheels")
    cut, changed = entries[0], entries[-1]
    good = {p: p.read_bytes() for p in (cut, changed)}
    cut.write_bytes(good[cut][: len(good[cut]) // 2])
    flipped = bytearray(good[changed])
    flipped[-1] ^= 0xFF
    changed.write_bytes(bytes(flipped))
    local_index.requests.clear()
    assert registry.read(cc.wants(cat), local_index.url, store=store) == first
    asked = sorted(rng or "" for _, rng in local_index.requests)
    names = sorted(f"bytes={p.name.replace('tail-', '-')}" for p in (cut, changed))
    assert asked == names  # exactly the two damaged ranges, fetched again
    assert {p: p.read_bytes() for p in (cut, changed)} == good  # and stored whole again


def test_a_hit_serves_the_same_bytes_without_a_request(tmp_path: Path) -> None:
    store = registry.Store(tmp_path / "wheels")
    calls: list[str] = []
    data = random.Random(1).randbytes(1000)

    def fetch() -> tuple[int, bytes]:
        calls.append("fetch")
        return 5000, data

    url = "https://index.test/files/a-1.0-py3-none-any.whl"
    assert store.range(url, "100-1099", fetch, lambda size: 1000) == (5000, data)
    assert store.range(url, "100-1099", fetch, lambda size: 1000) == (5000, data)
    assert calls == ["fetch"]
    short = registry.Store(tmp_path / "short")  # a fetch that came back short is not kept
    short.range(url, "0-9", lambda: (5000, b"abc"), lambda size: 10)
    assert _entries(tmp_path / "short") == []


def test_the_key_has_no_credentials_and_follows_the_sha256() -> None:
    sha = "ab" * 32
    assert registry.wheel_key(f"https://a.test/x/w-1-py3-none-any.whl#sha256={sha}") == f"sha256-{sha}"
    assert registry.wheel_key(f"https://b.test/y/w-1-py3-none-any.whl#sha256={sha.upper()}") == f"sha256-{sha}"
    plain = registry.wheel_key("https://a.test/x/w-1-py3-none-any.whl")
    assert plain.startswith("url-") and "a.test" not in plain
    assert registry.wheel_key("https://alice:s3cret@a.test/x/w-1-py3-none-any.whl?token=t0ken") == plain
    assert registry.wheel_key("https://a.test/x/w-2-py3-none-any.whl") != plain


def test_no_credentials_reach_the_store(local_index: _Index, tmp_path: Path) -> None:
    """URLs with a user, a password and a query token: nothing under the store names them."""
    store = registry.Store(tmp_path / "wheels", tmp_path / "pages")
    url = "http://alice:s3cret@127.0.0.1:1/files/a-1.0-py3-none-any.whl?token=t0ken"
    store.range(url, "0-2", lambda: (10, b"abc"), lambda size: 3)
    page = "https://alice:s3cret@index.test/simple/a/?token=t0ken"
    store.page(page, lambda: registry._Response(200, b"<a>x</a>", "text/html", "", page))
    assert store.page(page, lambda: None) is not None  # kept, and served from the store
    for p in [*_entries(tmp_path)]:
        for secret in ("alice", "s3cret", "t0ken"):
            assert secret not in str(p.relative_to(tmp_path)) and secret.encode() not in p.read_bytes()


def test_json_pages_carry_the_sha256_into_the_wheel_url(tmp_path: Path) -> None:
    sha = "cd" * 32
    body = json.dumps({"files": [{"filename": "a-1.0-py3-none-any.whl", "url": "../../f/a-1.0-py3-none-any.whl",
                                  "hashes": {"sha256": sha}},
                                 {"filename": "a-0.9-py3-none-any.whl", "url": "../../f/a-0.9-py3-none-any.whl",
                                  "hashes": {}}]}).encode()
    store = registry.Store(None, tmp_path / "pages")
    url = "https://index.test/simple/a/"
    store.page(url, lambda: registry._Response(200, body, "application/vnd.pypi.simple.v1+json", "", url))
    got = registry.files("https://index.test/simple", "a", store)
    assert got == {"a-1.0-py3-none-any.whl": f"https://index.test/f/a-1.0-py3-none-any.whl#sha256={sha}",
                   "a-0.9-py3-none-any.whl": "https://index.test/f/a-0.9-py3-none-any.whl"}


def test_a_newer_nccl_or_cuda_toolkit_wheel_than_the_catalog_knows_is_drift() -> None:
    """The catalogue tracks the NCCL wheels (both CUDA majors) and cuda-toolkit in `newest`; a newer release
    on the index is reported under its key, the ones it knows are not."""
    catalog = replace(load_catalog(), presets={}, kernels={}, torch={})
    assert {"nvidia-nccl-cu12", "nvidia-nccl-cu13", "cuda-toolkit"} <= set(catalog.newest)
    newer = {"nvidia-nccl-cu13": "2.33.1", "cuda-toolkit": "13.6.0"}
    seen = {p: Seen(newer.get(p, v), f"{p} release list") for p, v in catalog.newest.items()}
    out = cc.compare(catalog, Readings(index="test", newest=seen, sglang={}, kernels={}, torch={}))
    assert {(d.key, d.registry) for d in out.drift} == {("newest.nvidia-nccl-cu13", "2.33.1"),
                                                        ("newest.cuda-toolkit", "13.6.0")}


def test_the_catalogue_tracks_apache_tvm_ffi_as_it_tracks_nccl() -> None:
    """flashinfer's modules inline apache-tvm-ffi's headers (a carried module is current only with the release it
    was built with): the catalogue's `newest` names it, and a newer release on the index is drift under its key."""
    catalog = replace(load_catalog(), presets={}, kernels={}, torch={})
    assert catalog.newest["apache-tvm-ffi"] == "0.1.15.post2"
    seen = {p: Seen(v, f"{p} release list") for p, v in catalog.newest.items()}
    same = cc.compare(catalog, Readings(index="test", newest=seen, sglang={}, kernels={}, torch={}))
    assert same.drift == ()
    seen["apache-tvm-ffi"] = Seen("0.1.16", "apache-tvm-ffi release list")
    out = cc.compare(catalog, Readings(index="test", newest=seen, sglang={}, kernels={}, torch={}))
    assert [(d.key, d.recorded, d.registry) for d in out.drift] == [("newest.apache-tvm-ffi", "0.1.15.post2", "0.1.16")]

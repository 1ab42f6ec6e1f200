"""The catalog: publication facts (which builds exist where), loaded once from catalog.yaml."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from packaging.version import Version

from common import yamlsrc

CATALOG_PATH = Path(__file__).with_name("catalog.yaml")


@dataclass(frozen=True)
class CudaFact:
    version: str
    variant: str  # wheel label, e.g. cu130
    toolkit: str  # registry cuda-toolkit release for a registry-free CUDA_HOME
    sm120: bool
    source: str
    wheel_nvcc: bool = True  # the registry's nvcc wheel of that release has the nvcc driver

    @property
    def major(self) -> int:
        return int(self.version.split(".")[0])


@dataclass(frozen=True)
class TorchRelease:
    version: str
    variants: tuple[str, ...]
    registry: str  # CUDA variant of the registry's default wheel
    source: str


@dataclass(frozen=True)
class KernelRelease:
    version: str
    package: str
    registry_cuda: str
    torch: str  # torch release whose C++ ABI the wheel links
    variants: tuple[str, ...]
    source: str


@dataclass(frozen=True)
class JitCacheRange:
    until: Version
    variants: tuple[str, ...]
    source: str


@dataclass(frozen=True)
class Preset:
    name: str
    torch: str
    sgl_kernel: str
    flashinfer: str
    version: str = ""  # the engine's release
    engine: str = "sglang"  # sglang | vllm
    platform: str = ""  # the manylinux tag of the release's wheel ("": pure Python, no glibc floor)
    unserved: str = ""  # why the registry alone cannot install the release ("": it can)


def glibc_floor(platform: str) -> tuple[int, int] | None:
    """(2, 34) for ``manylinux_2_34``; None for a tag without a glibc floor."""
    parts = platform.split("_")
    if len(parts) == 3 and parts[0] == "manylinux" and parts[1].isdigit() and parts[2].isdigit():
        return int(parts[1]), int(parts[2])
    return None


@dataclass(frozen=True)
class Catalog:
    cuda: dict[str, CudaFact]
    torch_stable_index: str
    torch_nightly_index: str
    torch_index_source: str
    torch_latest_stable: str  # the newest torch release (newest.releases.torch)
    nightly_variants: tuple[str, ...]
    nightly_series: str
    nightly_source: str
    torch: dict[str, TorchRelease]
    kernel_github_wheel: str
    kernel_github_source: str
    kernels: dict[str, KernelRelease]
    flashinfer_package: str
    flashinfer_first_wheel: Version
    flashinfer_first_wheel_source: str
    jit_cache_index: str
    jit_cache: tuple[JitCacheRange, ...]
    presets: dict[str, Preset]
    presets_source: str
    vllm_source: str
    newest: dict[str, str]  # package -> newest release when the catalog was last checked
    newest_source: str

    @property
    def sglang_pins(self) -> dict[str, str]:
        """SGLang release -> the sgl-kernel it pins (the SGLang presets only)."""
        return {p.version: p.sgl_kernel for p in self.presets.values() if p.engine == "sglang"}

    def engine_presets(self, engine: str) -> list[Preset]:
        return [p for p in self.presets.values() if p.engine == engine]

    def cuda_by_variant(self, variant: str) -> CudaFact | None:
        return next((c for c in self.cuda.values() if c.variant == variant), None)


def parse(raw: dict) -> Catalog:
    t, k, f, s = raw["torch"], raw["sgl_kernel"], raw["flashinfer"], raw["sglang"]
    return Catalog(
        cuda={
            v: CudaFact(v, d["variant"], d["toolkit"], bool(d["sm120"]), d["source"], bool(d["wheel_nvcc"]))
            for v, d in raw["cuda"].items()
        },
        torch_stable_index=t["stable_index"],
        torch_nightly_index=t["nightly_index"],
        torch_index_source=t["index_source"],
        torch_latest_stable=raw["newest"]["releases"]["torch"],
        nightly_variants=tuple(t["nightly"]["variants"]),
        nightly_series=t["nightly"]["series"],
        nightly_source=t["nightly"]["source"],
        torch={v: TorchRelease(v, tuple(d["variants"]), d["registry"], d["source"]) for v, d in t["releases"].items()},
        kernel_github_wheel=k["github_wheel"],
        kernel_github_source=k["github_source"],
        kernels={
            v: KernelRelease(v, d["package"], d["registry_cuda"], d["torch"], tuple(d["variants"]), d["source"])
            for v, d in k["releases"].items()
        },
        flashinfer_package=f["package"],
        flashinfer_first_wheel=Version(f["first_wheel"]),
        flashinfer_first_wheel_source=f["first_wheel_source"],
        jit_cache_index=f["jit_cache_index"],
        jit_cache=tuple(JitCacheRange(Version(r["until"]), tuple(r["variants"]), r["source"]) for r in f["jit_cache"]),
        presets={
            **{f"sglang-{v}": Preset(f"sglang-{v}", d["torch"], d["sgl_kernel"], d["flashinfer"], v,
                                     platform=_sglang_platform(raw, v))
               for v, d in s["releases"].items()},
            **{f"vllm-{v}": Preset(f"vllm-{v}", d["torch"], "none", d["flashinfer"], v, "vllm",
                                   str(d.get("platform", "")), str(d.get("unserved", "")))
               for v, d in raw["vllm"]["releases"].items()},
        },
        presets_source=s["source"],
        vllm_source=raw["vllm"]["source"],
        newest=dict(raw["newest"]["releases"]),
        newest_source=raw["newest"]["source"],
    )


def _sglang_platform(raw: dict, version: str) -> str:
    """The manylinux tag of an SGLang release's wheel: that of the newest listed release not after it."""
    found = [(Version(v), tag) for v, tag in raw["sglang_platform"]["from"].items() if Version(v) <= Version(version)]
    return str(max(found)[1]) if found else ""


@functools.cache
def load(path: Path = CATALOG_PATH) -> Catalog:
    return parse(yamlsrc.plain(path.read_text()))

"""Resolution: a cell plus the catalog gives exact versions and their sources, or the reason it cannot exist.

Pure: index reachability comes in as a function, so the same cell resolves the same way in tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlparse

from packaging.version import Version

from common.catalog import Catalog
from common.cellid import CellId
from common.matrix import NCCL_PINNED, Cell

RESOLVED, UNAVAILABLE, UNREACHABLE = "resolved", "unavailable", "unreachable"

# host -> None if reachable, else why not
Reach = Callable[[str], str | None]


@dataclass(frozen=True)
class Source:
    package: str
    requirement: str  # a line of requirements.in
    where: str  # "registry" or the index / wheel URL
    note: str = ""


@dataclass(frozen=True)
class Resolved:
    cell: Cell
    cell_id: str
    status: str
    reason: str
    versions: dict[str, str] = field(default_factory=dict)
    sources: tuple[Source, ...] = ()
    indexes: tuple[str, ...] = ()  # extra indexes, highest priority first
    prerelease: bool = False
    toolkit: str = ""  # registry cuda-toolkit version for the registry-free base
    notes: tuple[str, ...] = ()
    # What a probe is expected to find, from known facts: shown to people, never a status.
    expect: tuple[str, ...] = ()
    # Requirement lines that replace every declared requirement on their package when locking (how a
    # package installed with --no-deps keeps its own pins out of the resolution).
    overrides: tuple[str, ...] = ()

    @property
    def cuda(self) -> str:
        return self.cell.cuda


class _Unavailable(Exception):
    pass


def stable_torch(cell: Cell, catalog: Catalog) -> str:
    """What 'stable' means for a cell: the release its sgl-kernel links (the SGLang pairing); with no
    sgl-kernel, the newest stable release."""
    kernel = catalog.kernels.get(cell.sgl_kernel)
    return kernel.torch if kernel else catalog.torch_latest_stable


def torch_label(cell: Cell, catalog: Catalog) -> str:
    if cell.torch == "nightly":
        return "nightly"
    return stable_torch(cell, catalog) if cell.torch == "stable" else cell.torch


def engine_label(cell: Cell, catalog: Catalog) -> str:
    """``vllm0.33.0`` for a cell that carries its preset's engine; "" otherwise."""
    preset = catalog.presets.get(cell.preset or "")
    return f"{preset.engine}{preset.version}" if cell.engine and preset is not None else ""


def cell_id(cell: Cell, catalog: Catalog) -> str:
    variant = catalog.cuda[cell.cuda].variant
    return str(CellId(variant, torch_label(cell, catalog), cell.sgl_kernel, cell.flashinfer, cell.jit_cache,
                      engine=engine_label(cell, catalog), nccl="" if cell.nccl == NCCL_PINNED else cell.nccl))


def nccl_package(cuda_major: int) -> str:
    """The registry's NCCL wheel for a CUDA major (torch's CUDA 12 and 13 builds pin these)."""
    return f"nvidia-nccl-cu{cuda_major}"


def _nccl(cell: Cell, catalog: Catalog) -> Source | None:
    """Another NCCL wheel than torch pins, beside the same torch: its requirement (and an override, below, so
    torch's own pin gives way)."""
    if cell.nccl == NCCL_PINNED:
        return None
    package = nccl_package(catalog.cuda[cell.cuda].major)
    known = catalog.newest.get(package)
    note = "in place of the NCCL torch pins"
    if known and Version(cell.nccl) > Version(known):
        note += f"; newer than the newest the catalogue knows ({known})"
    return Source(package, f"{package}=={cell.nccl}", "registry", note)


def _engine(cell: Cell, catalog: Catalog) -> Source | None:
    """The serving engine itself, at the preset's release: its own pins are the cell's other axes."""
    preset = catalog.presets.get(cell.preset or "")
    if not cell.engine or preset is None:
        return None
    return Source(preset.engine, f"{preset.engine}=={preset.version}", "registry",
                  f"the {preset.engine} {preset.version} release itself, with every requirement it declares")


def _torch(cell: Cell, catalog: Catalog) -> tuple[Source, str]:
    cuda = catalog.cuda[cell.cuda]
    if cell.torch == "nightly":
        if cuda.variant not in catalog.nightly_variants:
            raise _Unavailable(
                f"torch nightly has no {cuda.variant} builds "
                f"(nightly variants: {', '.join(catalog.nightly_variants)}); "
                f"use a CUDA 13 cell for nightly [{catalog.nightly_source}]")
        url = catalog.torch_nightly_index.format(variant=cuda.variant)
        return Source("torch", "torch", url, f"newest {catalog.nightly_series}* nightly, pinned at lock"), "nightly"
    version = torch_label(cell, catalog)
    rel = catalog.torch.get(version)
    if rel is None:
        raise _Unavailable(f"torch {version} is not in the catalog (known: {', '.join(catalog.torch)}); "
                           "add its builds with a source to common/catalog.yaml")
    if rel.registry == cuda.variant:
        return Source("torch", f"torch=={version}", "registry", f"registry default build is {cuda.variant}"), version
    if cuda.variant in rel.variants:
        url = catalog.torch_stable_index.format(variant=cuda.variant)
        return Source("torch", f"torch=={version}+{cuda.variant}", url), version
    with_variant = [v for v, r in catalog.torch.items() if cuda.variant in r.variants]
    hint = f"; newest release with {cuda.variant}: {with_variant[-1]}" if with_variant else ""
    raise _Unavailable(f"torch {version} has no CUDA {cell.cuda} build (its builds: {', '.join(rel.variants)}){hint} "
                       f"[{rel.source}]")


def kernel_expectation(package: str, version: str, torch: str, source: str, cell_torch: str = "nightly") -> str:
    return (f"expect `import sgl_kernel` to fail: {package} {version} links torch {torch}'s C++ ABI "
            f"(libc10/libtorch) and this cell has torch {cell_torch}; the inventory probe checks it [{source}]")


def _kernel(cell: Cell, catalog: Catalog, torch_version: str) -> tuple[Source | None, tuple[str, ...]]:
    """The kernel's source and what the probes are expected to find about it."""
    if cell.sgl_kernel == "none":
        return None, ()
    k = catalog.kernels.get(cell.sgl_kernel)
    if k is None:
        raise _Unavailable(f"sgl-kernel {cell.sgl_kernel} is not in the catalog (known: {', '.join(catalog.kernels)}); "
                           "add its CUDA build and torch pairing to common/catalog.yaml")
    expect: tuple[str, ...] = ()
    if torch_version != k.torch:
        # Installable (the kernel goes in with --no-deps, torch pinned by the cell); whether it loads with
        # another torch's C++ ABI is a probe's finding, so the known pairing is only an expectation.
        expect = (kernel_expectation(k.package, k.version, k.torch, k.source, torch_version),)
    cuda = catalog.cuda[cell.cuda]
    reg = catalog.cuda[k.registry_cuda]
    if reg.major == cuda.major:
        note = "" if reg.version == cuda.version else f"registry wheel is a CUDA {reg.version} build (same major)"
        return Source(k.package, f"{k.package}=={k.version}", "registry", note), expect
    same_major = [v for v in k.variants if (c := catalog.cuda_by_variant(v)) and c.major == cuda.major]
    if not same_major:
        raise _Unavailable(f"{k.package} {k.version} is published only as a CUDA {k.registry_cuda} build; "
                           f"a CUDA {cell.cuda} cell cannot load it (CUDA major differs) [{k.source}]")
    variant = cuda.variant if cuda.variant in same_major else same_major[0]
    dist = k.package.replace("-", "_")
    url = catalog.kernel_github_wheel.format(version=k.version, dist=dist, variant=variant)
    return Source(k.package, f"{k.package} @ {url}", url, f"+{variant} wheel [{catalog.kernel_github_source}]"), expect


def _flashinfer(cell: Cell, catalog: Catalog) -> list[Source]:
    if cell.flashinfer == "none":
        if cell.jit_cache:
            raise _Unavailable("jit_cache needs a flashinfer version, the cell has flashinfer: none")
        return []
    v = Version(cell.flashinfer)
    if v < catalog.flashinfer_first_wheel:
        raise _Unavailable(f"flashinfer-python {v} has no installable wheel on the registry (wheels start at "
                           f"{catalog.flashinfer_first_wheel}) [{catalog.flashinfer_first_wheel_source}]")
    out = [Source(catalog.flashinfer_package, f"{catalog.flashinfer_package}=={v}", "registry")]
    if cell.jit_cache:
        cuda = catalog.cuda[cell.cuda]
        rng = next(r for r in catalog.jit_cache if v < r.until)
        labels = [lab for lab in rng.variants if (c := catalog.cuda_by_variant(lab)) and c.major == cuda.major
                  and Version(c.version) <= Version(cuda.version)]
        if not labels:
            raise _Unavailable(f"flashinfer-jit-cache {v} is not published for {cuda.variant} (its CUDA labels: "
                               f"{', '.join(rng.variants)}); drop jit_cache or use another CUDA [{rng.source}]")
        label = labels[-1]
        out.append(Source("flashinfer-jit-cache", f"flashinfer-jit-cache=={v}+{label}",
                          catalog.jit_cache_index.format(variant=label)))
    return out


def resolve(cell: Cell, catalog: Catalog, reach: Reach | None = None) -> Resolved:
    cid = cell_id(cell, catalog)
    cuda = catalog.cuda[cell.cuda]
    asked = {"cuda": cell.cuda, "torch": torch_label(cell, catalog), "sgl_kernel": cell.sgl_kernel,
             "flashinfer": cell.flashinfer}
    try:
        preset = catalog.presets.get(cell.preset or "")
        if preset is not None and preset.unserved:
            raise _Unavailable(f"{preset.engine} {preset.version} pins what the registry does not serve: "
                               f"{preset.unserved}; use another {preset.engine} release or give the wheel "
                               f"[{catalog.vllm_source if preset.engine == 'vllm' else catalog.presets_source}]")
        if not cuda.sm120:
            raise _Unavailable(f"CUDA {cell.cuda} builds stop at sm_90 (no SM120 code); use CUDA 12.8 or newer "
                               f"[{cuda.source}]")
        torch_src, torch_version = _torch(cell, catalog)
        kernel, expect = _kernel(cell, catalog, torch_version)
        fi = _flashinfer(cell, catalog)
    except _Unavailable as e:
        return Resolved(cell, cid, UNAVAILABLE, str(e), asked)
    engine = _engine(cell, catalog)
    if engine is not None:
        asked["engine"] = engine.requirement.replace("==", " ")
    nccl = _nccl(cell, catalog)
    if nccl is not None:
        asked["nccl"] = cell.nccl
    sources = tuple(s for s in (torch_src, kernel, *fi, engine, nccl) if s is not None)
    versions = dict(asked, torch_cuda=cuda.variant)
    indexes = tuple(dict.fromkeys(s.where for s in sources if s.where != "registry" and " @ " not in s.requirement))
    notes = tuple(f"{s.package}: {s.note}" for s in sources if s.note)
    # A kernel pinned to a torch release (0.4.7+ declare torch==X) must not veto the cell's torch.
    overrides = (("torch",) if expect else ()) + ((nccl.requirement,) if nccl is not None else ())
    base = Resolved(cell, cid, RESOLVED, "", versions, sources, indexes, cell.torch == "nightly", cuda.toolkit, notes,
                    expect, overrides)
    if reach is None:
        return base
    for s in sources:
        if s.where == "registry":
            continue
        host = urlparse(s.where).hostname or s.where
        why = reach(host)
        if why is not None:
            return Resolved(cell, cid, UNREACHABLE,
                            f"{s.package} comes from {s.where}, which this machine cannot reach ({why}); "
                            "it is published there, so build this cell where that host is reachable",
                            versions, sources, indexes, base.prerelease, cuda.toolkit, notes, expect, overrides)
    return base

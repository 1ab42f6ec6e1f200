"""Catalog facts against what the package index says today: which recorded facts drifted.

Pure: `wants` says what to ask the index, provision/registry.py asks it, and `compare` turns the catalog and
those readings into drift. Facts the index can confirm: each SGLang release's pins (its Requires-Dist), each
sgl-kernel release's torch pin and CUDA build (its wheel), the CUDA variant of each torch release's default
wheel, and the newest release of each package.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from packaging.version import InvalidVersion, Version

from common.catalog import Catalog


@dataclass(frozen=True)
class Seen:
    """One reading from the index: value None means not published (or not declared); evidence says where."""

    value: str | None
    evidence: str


@dataclass(frozen=True)
class KernelSeen:
    release: Seen  # value: the version when it is published under the catalog's package name
    torch: Seen  # the wheel's Requires-Dist torch pin, None when it declares none
    cuda: Seen  # "13.0" from the nvcc banner, or "13" from DT_NEEDED libcudart.so.13 alone


@dataclass(frozen=True)
class Wants:
    newest: tuple[str, ...]  # package names
    sglang: tuple[str, ...]  # versions
    kernels: tuple[tuple[str, str], ...]  # (package, version)
    torch: tuple[str, ...]  # versions
    vllm: tuple[str, ...] = ()  # versions


@dataclass(frozen=True)
class Readings:
    index: str
    newest: dict[str, Seen]
    # version -> {"torch"|"sgl_kernel"|"flashinfer"|"platform": Seen}, or {"release": Seen}
    sglang: dict[str, dict[str, Seen]]
    kernels: dict[str, KernelSeen]
    torch: dict[str, Seen]
    # version -> {"torch"|"flashinfer"|"platform"|"unserved": Seen}, or {"release": Seen}; unserved's value is
    # the pins the index does not serve ("" when it serves them all)
    vllm: dict[str, dict[str, Seen]] = field(default_factory=dict)


@dataclass(frozen=True)
class Drift:
    key: str  # where the fact lives in catalog.yaml
    recorded: str
    registry: str | None
    evidence: str  # where the index says so
    source: str  # the source the catalog gives for the recorded value


@dataclass(frozen=True)
class Outcome:
    index: str
    checked: int
    drift: tuple[Drift, ...]
    unchecked: tuple[str, ...]  # "key: why the index cannot confirm it"


def wants(catalog: Catalog) -> Wants:
    return Wants(
        newest=tuple(catalog.newest),
        sglang=tuple(p.version for p in catalog.engine_presets("sglang")),
        kernels=tuple((k.package, k.version) for k in catalog.kernels.values()),
        torch=tuple(catalog.torch),
        vllm=tuple(p.version for p in catalog.engine_presets("vllm")),
    )


def same(recorded: str, seen: str | None) -> bool:
    """Equal as versions where both are versions ("13.0" and "13" are not: a major-only reading is handled
    by the caller), else as text."""
    if seen is None:
        return False
    try:
        return Version(recorded) == Version(seen)
    except InvalidVersion:
        return recorded == seen


def _same_text(recorded: str, seen: str | None) -> bool:
    return seen is not None and recorded == seen


def _cuda_matches(recorded: str, seen: str | None) -> bool:
    if seen is not None and "." not in seen:  # only the major is readable from this wheel
        return recorded.split(".")[0] == seen
    return same(recorded, seen)


def _kernel_torch(catalog: Catalog, readings: Readings, version: str) -> Seen | None:
    """The torch release the index ties a kernel to: its wheel's pin, else the torch pin of the catalogued
    SGLang releases that the index shows pinning this kernel (older kernels declare no dependencies)."""
    ks = readings.kernels[version]
    if ks.torch.value is not None:
        return ks.torch
    tied = sorted({(pins["torch"].value, v) for v, pins in readings.sglang.items()
                   if "sgl_kernel" in pins and same(version, pins["sgl_kernel"].value) and pins["torch"].value})
    if not tied:
        return None
    torches = sorted({t for t, _ in tied if t})
    names = ", ".join(f"sglang {v}" for _, v in tied)
    return Seen("+".join(torches), f"the wheel declares no torch; {names} pin it with torch {'/'.join(torches)}")


def compare(catalog: Catalog, readings: Readings) -> Outcome:
    drift: list[Drift] = []
    unchecked: list[str] = []
    checked = 0

    def check(key: str, recorded: str, seen: Seen, source: str, match=same) -> None:  # type: ignore[no-untyped-def]
        nonlocal checked
        checked += 1
        if not match(recorded, seen.value):
            drift.append(Drift(key, recorded, seen.value, seen.evidence, source))

    for pkg, version in catalog.newest.items():
        check(f"newest.{pkg}", version, readings.newest[pkg], catalog.newest_source)

    for preset in catalog.engine_presets("sglang"):
        base = f"sglang.releases[{preset.version}]"
        seen = readings.sglang[preset.version]
        if "release" in seen:
            check(base, preset.version, seen["release"], catalog.presets_source)
            continue
        for axis in ("torch", "sgl_kernel", "flashinfer"):
            check(f"{base}.{axis}", getattr(preset, axis), seen[axis], catalog.presets_source)
        if "platform" in seen:
            check(f"sglang_platform (sglang {preset.version})", preset.platform or "none", seen["platform"],
                  catalog.presets_source, _same_text)

    for preset in catalog.engine_presets("vllm"):
        base = f"vllm.releases[{preset.version}]"
        seen = readings.vllm.get(preset.version, {"release": Seen(None, "not read")})
        if "release" in seen:
            check(base, preset.version, seen["release"], catalog.vllm_source)
            continue
        for axis in ("torch", "flashinfer"):
            check(f"{base}.{axis}", getattr(preset, axis), seen[axis], catalog.vllm_source)
        check(f"{base}.platform", preset.platform or "none", seen["platform"], catalog.vllm_source, _same_text)
        served = Seen("unserved" if seen["unserved"].value else "served", seen["unserved"].evidence
                      + (f": {seen['unserved'].value}" if seen["unserved"].value else ""))
        check(f"{base}.unserved", "unserved" if preset.unserved else "served", served, catalog.vllm_source,
              _same_text)

    for k in catalog.kernels.values():
        base = f"sgl_kernel.releases[{k.version}]"
        ks = readings.kernels[k.version]
        if ks.release.value is None:
            check(f"{base}.package", k.package, ks.release, k.source)
            continue
        check(f"{base}.registry_cuda", k.registry_cuda, ks.cuda, k.source, _cuda_matches)
        torch = _kernel_torch(catalog, readings, k.version)
        if torch is None:
            unchecked.append(f"{base}.torch: the wheel declares no torch and no catalogued SGLang release pins "
                             f"{k.package} {k.version}")
        else:
            check(f"{base}.torch", k.torch, torch, k.source)

    for rel in catalog.torch.values():
        check(f"torch.releases[{rel.version}].registry", rel.registry, readings.torch[rel.version], rel.source)

    return Outcome(readings.index, checked, tuple(drift), tuple(unchecked))


def drift_line(d: Drift) -> str:
    registry = d.registry if d.registry is not None else "none"
    return f"{d.key}: catalog {d.recorded}, registry {registry} ({d.evidence}) [catalog source: {d.source}]"


def outcome_lines(o: Outcome) -> list[str]:
    lines = [drift_line(d) for d in o.drift]
    lines += [f"unchecked {u}" for u in o.unchecked]
    verdict = f"{len(o.drift)} drifted" if o.drift else "no drift"
    lines.append(f"catalog check: {o.checked} facts against {o.index}: {verdict}")
    return lines


def outcome_json(o: Outcome) -> dict[str, Any]:
    return {"index": o.index, "checked": o.checked, "drift": [asdict(d) for d in o.drift],
            "unchecked": list(o.unchecked)}

"""`provision abi` shown: the grid extension release x torch build as text for people, JSON for tooling,
and the plan's warnings for cells whose extension will not load. Pure.

Package names, versions, variants and symbol names come from wheels and the indexes made of them: every one is
escaped for the terminal (common.escape) before it is measured or printed, so no byte of a wheel's metadata
moves the cursor or reorders a line."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from common import abi, escape
from common.catalog import Catalog
from common.resolve import Resolved

if TYPE_CHECKING:  # the registry reader behind it is not needed for the plan's warnings
    from provision.abi.index import Made

_MIB = 1 << 20


def grid_lines(g: abi.Grid, detail: bool = False) -> list[str]:
    if not g.torches or not g.extensions:
        return ["no extension or torch build is indexed"]
    shown = escape.terminal
    width = max(len(shown(e.label)) for e in g.extensions) + 2
    col = max(7, *(len(shown(t.version)) + 1 for t in g.torches), *(len(shown(c.short())) + 1 for c in g.cells))
    lines = [" " * width + "".join(f"{shown(t.version):<{col}}" for t in g.torches),
             " " * width + "".join(f"{shown(t.variant):<{col}}" for t in g.torches)]
    for e in g.extensions:
        cells = [g.cell(e.label, t.label) for t in g.torches]
        lines.append(f"{shown(e.label):<{width}}" + "".join(f"{shown(c.short()) if c else '-':<{col}}" for c in cells))
    lines.append(abi.LEGEND)
    found = abi.finding_lines(c.as_dict() for c in g.cells)
    if found:
        lines.append("declared torch pin and binary disagree:")
        lines += [f"  {shown(line)}" for line in found]
    if detail:
        lines.append("every cell:")
        lines += [f"  {shown(c.extension)} beside torch {shown(c.torch)}: {shown(c.says())}" for c in g.cells]
    return lines


def summary(made: Sequence[Made], seconds: float, cold: dict[str, Any] | None) -> list[str]:
    """The closing note: what was indexed and from where, what is missing and why, the time taken."""
    new = [m for m in made if m.index is not None and m.origin != "cache"]
    gone: dict[tuple[str, str], list[str]] = {}
    for m in made:
        if m.index is None:
            gone.setdefault((m.want.package, m.why), []).append(m.want.wanted_version)
    lines = [escape.terminal(f"  not indexed: {package} {', '.join(versions)}: {why}")
             for (package, why), versions in gone.items()]
    streamed = sum(m.read_bytes for m in new)
    now = (f"made {len(new)} now ({sum(m.origin == 'uv cache' for m in new)} from uv's cache, "
           f"{sum(m.origin == 'registry' for m in new)} streamed from the registry: {streamed / _MIB:.0f} MiB "
           "of compressed members)" if new else "every one from .cache/abi (warm)")
    lines.append(f"{sum(m.index is not None for m in made)} indexes: {now}; took {seconds:.1f} s")
    if not new and cold:
        lines.append(f"cold: the last run that made indexes made {cold.get('made', 0)} in "
                     f"{cold.get('seconds', 0):.0f} s, streaming {int(cold.get('streamed', 0)) / _MIB:.0f} MiB")
    return lines


def extensions_of(r: Resolved, catalog: Catalog) -> list[tuple[str, str]]:
    """(distribution, release) of the compiled extensions a cell installs beside torch: its sgl-kernel, and the
    serving engine it carries."""
    out = []
    kernel = catalog.kernels.get(r.versions.get("sgl_kernel", ""))
    if kernel is not None:
        out.append((kernel.package, kernel.version))
    preset = catalog.presets.get(r.cell.preset or "")
    if r.cell.engine and preset is not None:
        out.append((preset.engine, preset.version))
    return out


def cell_warnings(cells: Sequence[Resolved], catalog: Catalog, torches: Sequence[abi.TorchIndex],
                  exts: Sequence[abi.ExtensionIndex]) -> list[str]:
    """One line per resolved cell and extension (its sgl-kernel, the engine it carries) that will not load
    beside its torch, judged from the indexes at hand. The symbols come from the indexed build of the cell's
    torch release (the release's builds for other CUDA versions export the same torch symbols); the CUDA
    major is the cell's."""
    by_release = {t.version: t for t in sorted(torches, key=lambda t: t.label, reverse=True)}
    by_build = {t.label: t for t in torches}
    by_ext = {(e.package, e.version): e for e in exts}
    out = []
    for r in cells:
        release, variant = r.versions.get("torch", ""), r.versions.get("torch_cuda", "")
        torch = by_build.get(f"{release}+{variant}") or by_release.get(release)
        if r.status != "resolved" or torch is None:
            continue
        variant = variant or torch.variant
        cuda = catalog.cuda_by_variant(variant)
        build = replace(torch, variant=variant, cuda_major=cuda.major if cuda else torch.cuda_major)
        for ext in (by_ext[pair] for pair in extensions_of(r, catalog) if pair in by_ext):
            cell = abi.judge(ext, build, abi.stable_floor(ext, torches))
            if not cell.loads:
                read = "" if variant == torch.variant else f" (symbols read from the {torch.label} wheel)"
                out.append(escape.terminal(f"{r.cell_id}: {ext.label} will not load beside torch {build.label}: "
                                           f"{cell.says()}{read}"))
    return out

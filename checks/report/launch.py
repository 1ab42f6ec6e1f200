"""Launch settings: the server flags and environment variables that select the paths `checks advise` names, per
serving-engine release, from ``launch_flags.yaml`` (read from each release's own source; pure but for reading it).

A cell runs the SGLang release(s) whose sgl-kernel pin (provision's catalog) is the cell's sgl-kernel; a cell
without sgl-kernel runs none, and then every SGLang release the data file covers is shown, saying so. No cell
pins vLLM, so its covered releases are always shown as such. A path a release cannot select is reported as
unsupported with the reason from its source; a path the release would turn off on this host (no multicast, too
many ranks without NVLink) is reported as unavailable here.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packaging.version import InvalidVersion, Version

from checks.report.advise import BASELINE, UNTIMED, CellAdvice, human_bytes
from common import cellid, yamlsrc

FLAGS = Path(__file__).with_name("launch_flags.yaml")
# Engines call NCCL through their own ctypes wrapper on the capturing stream: what nccl-direct measures.
ALIASES = {BASELINE: "nccl-direct"}


@dataclass(frozen=True)
class EnginePath:
    backend: str
    engine: str
    releases: tuple[str, ...]
    supported: bool = True
    settings: tuple[str, ...] = ()
    off: tuple[str, ...] = ()
    kernel: str = ""
    world_sizes: tuple[int, ...] = ()
    max_bytes: int | None = None
    needs: tuple[str, ...] = ()
    order: str = ""
    why: str = ""  # for an unsupported path: what the source shows instead
    source: tuple[str, ...] = ()


@dataclass(frozen=True)
class Engines:
    names: Mapping[str, str]  # engine -> display name
    releases: Mapping[str, Mapping[str, str]]  # engine -> release -> where it was read
    paths: tuple[EnginePath, ...]


def parse(raw: Mapping[str, Any]) -> Engines:
    engines = raw["engines"]
    paths = tuple(EnginePath(
        p["backend"], p["engine"], tuple(str(v) for v in p["releases"]), bool(p.get("supported", True)),
        tuple(p.get("settings") or ()), tuple(p.get("turn_off") or ()), str(p.get("kernel", "")),
        tuple(int(n) for n in p.get("world_sizes") or ()), p.get("max_bytes"), tuple(p.get("needs") or ()),
        str(p.get("order", "")), str(p.get("why", "")), tuple(p.get("source") or ())) for p in raw["paths"])
    return Engines({k: v["name"] for k, v in engines.items()},
                   {k: {str(r): s for r, s in v["releases"].items()} for k, v in engines.items()}, paths)


@functools.cache
def load(path: Path = FLAGS) -> Engines:
    return parse(yamlsrc.plain(path.read_text()))


def _version_key(v: str) -> tuple[int, Version | str]:
    try:
        return (1, Version(v))
    except InvalidVersion:
        return (0, v)


def cell_sglang(cell_id: str, pins: Mapping[str, str]) -> tuple[str, ...]:
    """The SGLang releases a cell's stack is: those pinning its sgl-kernel (``pins``: release -> sgl-kernel)."""
    parsed = cellid.parse(cell_id)
    if parsed is None or parsed.sgl_kernel == cellid.NONE:
        return ()
    return tuple(sorted((v for v, k in pins.items() if k == parsed.sgl_kernel), key=_version_key))


@dataclass(frozen=True)
class Setting:
    engine: str  # display name
    release: str
    backend: str
    sizes: str  # where the advice uses the path ("" for an untimed feature)
    state: str  # set | default | unavailable-here | unsupported | not-covered
    settings: tuple[str, ...]
    note: str
    source: tuple[str, ...]


@dataclass(frozen=True)
class Launch:
    scope: tuple[str, ...]  # which releases are shown, and why
    settings: tuple[Setting, ...]


def _span(sizes: Sequence[int]) -> str:
    if not sizes:
        return ""
    lo, hi = min(sizes), max(sizes)
    return human_bytes(lo) if lo == hi else f"{human_bytes(lo)}–{human_bytes(hi)}"


def judge(p: EnginePath, advice: CellAdvice, sizes: Sequence[int]) -> tuple[str, str]:
    """(state, note) of one release's path for this host, rank count and the sizes advice gives it."""
    if not p.supported:
        return "unsupported", p.why
    notes = [p.kernel] if p.kernel else []
    if p.world_sizes and advice.ranks not in p.world_sizes:
        return "unavailable-here", (f"the release uses this path at {', '.join(map(str, p.world_sizes))} ranks, "
                                    f"not {advice.ranks}")
    if "multicast" in p.needs:
        if advice.multicast is False:
            return "unavailable-here", ("the release turns this path off without multicast, and these GPUs have "
                                        "none (symm-mem device attribute / host facts)")
        if advice.multicast is None:
            notes.append("needs multicast, which no result here records")
    if "nvlink-above-2" in p.needs and advice.ranks > 2 and advice.full_nvlink is False:
        return "unavailable-here", ("above 2 ranks the release needs NVLink between every pair of GPUs; custom-ar "
                                    "read from NVML that this host lacks it")
    if p.max_bytes and sizes and max(sizes) > p.max_bytes:
        notes.append(f"calls above {human_bytes(p.max_bytes)} go to the next path")
    curve = advice.curve(p.backend)
    slow = sorted(n for n, x in (curve.ratio_vs_nccl.items() if curve else ())
                  if x > 1 + advice.spread.tie(p.backend, n) and (p.max_bytes is None or n <= p.max_bytes))
    if slow:
        # Advice cannot route these sizes elsewhere if the release sends them to the path.
        at = ", ".join(f"{human_bytes(n)} ({curve.ratio_vs_nccl[n]:.2f}×)" for n in slow)  # type: ignore[union-attr]
        limit = f", sizes this release still sends it (its limit is {human_bytes(p.max_bytes)})" if p.max_bytes else ""
        notes.append(f"measured slower than NCCL at {at}{limit}")
    if p.order:
        notes.append(f"order: {p.order}")
    if not p.settings and p.off:
        notes.insert(0, f"on by default (off: {' '.join(p.off)})")
    return ("set" if p.settings else "default"), "; ".join(notes)


def releases_shown(cell_id: str, engines: Engines, sglang_pins: Mapping[str, str]
                   ) -> tuple[tuple[str, ...], dict[str, tuple[str, ...]]]:
    """(scope notes, engine -> releases to show) for a cell: its own SGLang release(s) when the data file covers
    them, every covered SGLang release when the cell has none, and every covered release of other engines."""
    in_cell = cell_sglang(cell_id, sglang_pins)
    covered = engines.releases.get("sglang", {})
    scope = []
    shown: dict[str, tuple[str, ...]] = {}
    if in_cell:
        shown["sglang"] = tuple(v for v in in_cell if v in covered)
        lacking = [v for v in in_cell if v not in covered]
        if lacking:
            scope.append(f"SGLang {', '.join(lacking)} (this cell's sgl-kernel) is not covered by launch_flags.yaml, "
                         f"which was read from SGLang {', '.join(covered)}")
    else:
        shown["sglang"] = tuple(covered)
        scope.append(f"this cell has no SGLang release (no sgl-kernel, or one no release pins): settings for every "
                     f"SGLang release read ({', '.join(covered)})")
    for engine, releases in engines.releases.items():
        if engine != "sglang":
            shown[engine] = tuple(releases)
            scope.append(f"no cell pins {engines.names[engine]}: settings for {engines.names[engine]} "
                         f"{', '.join(releases)}")
    return tuple(scope), shown


def settings_for(backend: str, sizes: Sequence[int], advice: CellAdvice, engines: Engines,
                 shown: Mapping[str, Sequence[str]]) -> list[Setting]:
    key = ALIASES.get(backend, backend)
    out = []
    for engine, releases in shown.items():
        for release in releases:
            p = next((p for p in engines.paths if p.backend == key and p.engine == engine and release in p.releases),
                     None)
            if p is None:
                out.append(Setting(engines.names[engine], release, backend, _span(sizes), "not-covered", (),
                                   "launch_flags.yaml has no entry for this path in this release", ()))
                continue
            state, note = judge(p, advice, sizes)
            out.append(Setting(engines.names[engine], release, backend, _span(sizes), state,
                               p.settings if state in USABLE else (), note, p.source))
    return out


USABLE = frozenset({"set", "default"})


def plan(advice: CellAdvice, engines: Engines, sglang_pins: Mapping[str, str]) -> Launch:
    """The settings for every path the advice uses (plus untimed features that are exact here)."""
    scope, shown = releases_shown(advice.cell_id, engines, sglang_pins)
    wanted = [(b, [s.nbytes for s in advice.sizes if s.use == b]) for b in advice.used]
    wanted += [(u.feature, []) for u in advice.untimed if u.feature in UNTIMED]
    out = [x for backend, sizes in wanted for x in settings_for(backend, sizes, advice, engines, shown)]
    return Launch(scope if out else (), tuple(out))


def usable(backend: str, advice: CellAdvice, engines: Engines, sglang_pins: Mapping[str, str]) -> bool:
    """Whether some shown engine release can use the path on this host at this rank count."""
    _, shown = releases_shown(advice.cell_id, engines, sglang_pins)
    return any(s.state in USABLE for s in settings_for(backend, [], advice, engines, shown))

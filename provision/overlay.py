"""Which entries of a cell's lock a venv cell installs, and which it takes from a base environment (pure).

A full venv cell installs every lock entry that applies to its interpreter. An overlay cell sits on an
existing environment whose torch stack (torch and everything torch needs, as the cell's torch.lock lists
it: CUDA libraries, NCCL, triton) is used as installed, whatever its versions: the self-check then says
whether that torch is the cell's. The cell's own packages (flashinfer, sgl-kernel: what the matrix names)
go into the overlay at the locked version (from the base only when no wheel can be had and the base
has that exact version). An NCCL release the cell names (matrix ``nccl``: a version, not ``pinned``)
makes the NCCL wheel one of the cell's own packages: it goes into the overlay at that release (the base's
serves only when it is that very release), and a ``.pth`` file of the overlay loads that library before
anything imports torch (``nccl_pth_text``), as torch's libtorch_cuda.so would otherwise find the base's
through its RPATH. Every other entry comes from the base when the base has that exact version, else into
the overlay when a wheel can be had, else from the base at the version it
has (recorded beside the version the lock wanted), else it is absent, and the record says so.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from packaging.markers import InvalidMarker, UndefinedComparison, UndefinedEnvironmentName
from packaging.requirements import InvalidRequirement, Requirement

from provision.interp import norm
from provision.lock import parse_blocks

_HASH = re.compile(r"--hash=sha256:([0-9a-f]{64})")
_URL_VERSION = re.compile(r"-(\d[^-/]*)-(?:cp|py)\d")


@dataclass(frozen=True)
class Entry:
    """One entry of a uv requirements lock: ``text`` is the entry as written, hashes included."""

    name: str
    version: str
    marker: str  # "" when the entry applies everywhere
    hashes: frozenset[str]
    text: str

    def applies(self, markers: Mapping[str, str]) -> bool:
        if not self.marker:
            return True
        try:
            return Requirement(f"x; {self.marker}").marker.evaluate(dict(markers))  # type: ignore[union-attr]
        except (InvalidMarker, InvalidRequirement, UndefinedComparison, UndefinedEnvironmentName):
            return True  # an unreadable marker: let the installer judge it

    def pin(self) -> str:
        return f"{self.name}=={self.version}"


@dataclass(frozen=True)
class Pick:
    name: str
    version: str  # what the lock pins
    base_version: str | None = None  # what the base has, when it has the package


@dataclass(frozen=True)
class OverlayPlan:
    install: tuple[Entry, ...]
    from_base: tuple[Pick, ...]
    absent: tuple[Pick, ...]

    def base_json(self) -> dict[str, str]:
        return {p.name: str(p.base_version) for p in self.from_base}

    def differs_json(self) -> dict[str, dict[str, str]]:
        """Packages taken from the base at another version than the lock's."""
        return {p.name: {"base": str(p.base_version), "lock": p.version} for p in self.from_base
                if p.base_version != p.version}


def entries(lock: str) -> list[Entry]:
    out = []
    for _name, text, _via in parse_blocks(lock):
        head = text.splitlines()[0].rstrip().rstrip("\\").strip()
        try:
            req = Requirement(head)
        except InvalidRequirement:
            continue
        pins = [s.version for s in req.specifier if s.operator in ("==", "===")]
        m = _URL_VERSION.search(req.url or "")
        version = pins[0] if pins else (m.group(1) if m else "")
        out.append(Entry(norm(req.name), version, str(req.marker or ""), frozenset(_HASH.findall(text)), text))
    return out


NCCL_WHEEL = "nvidia-nccl-"  # the start of the name of the registry's NCCL wheel of every CUDA major
NCCL_LIB = ("nvidia", "nccl", "lib", "libnccl.so.2")  # where that wheel puts its library, under site-packages
# Sorts before provision.venvbuild.PTH: NCCL is loaded before any .pth file of the base runs (one may import torch).
NCCL_PTH = "_stackprobe_0nccl.pth"


def own(sources: Iterable[str]) -> frozenset[str]:
    """The cell's own packages: what its sources name (flashinfer, sgl-kernel, an engine, the NCCL wheel of an
    NCCL release it names), torch aside: torch's stack is the base's."""
    return frozenset(norm(p) for p in sources) - {"torch"}


def nccl_release(cell: Mapping[str, object]) -> str:
    """The NCCL release a cell (its cell.json) names, its lock's pin of that wheel; "" when it keeps torch's."""
    sources = cell.get("sources")
    expected = cell.get("expected")
    if not isinstance(sources, Mapping) or not isinstance(expected, Mapping):
        return ""
    named = any(norm(str(p)).startswith(NCCL_WHEEL) for p in sources)
    return str(expected.get("nccl") or "") if named else ""


def nccl_pth_text(lib: str) -> str:
    """A ``.pth`` file that loads the NCCL library ``lib`` (an absolute path) into every interpreter of the
    overlay, RTLD_GLOBAL, when the file is there: torch's libtorch_cuda.so then takes this already-loaded
    libnccl.so.2 (glibc matches a needed soname to a loaded object) instead of the one its RPATH points at in
    the base. A library that does not load is reported by site on stderr and the interpreter goes on; the
    build's self-check then names the NCCL that torch loaded."""
    head = "# provision build: this overlay's NCCL, loaded before torch is imported\n"
    return head + (f"import ctypes, os; p = {lib!r}; "
                   "os.path.exists(p) and ctypes.CDLL(p, mode=ctypes.RTLD_GLOBAL)\n")


def names(lock: str) -> frozenset[str]:
    return frozenset(e.name for e in entries(lock))


def plan(lock: Iterable[Entry], markers: Mapping[str, str], base: Mapping[str, str] | None,
         base_stack: frozenset[str], own: frozenset[str], installable: Callable[[Entry], bool]) -> OverlayPlan:
    """``base``: the base's distributions (None: a full cell, no base); ``base_stack``: names always taken
    from the base (torch's closure); ``own``: the cell's named packages; ``installable``: whether a wheel of
    that exact entry can be had (from the index, or the wheels folder)."""
    install: list[Entry] = []
    from_base: list[Pick] = []
    absent: list[Pick] = []
    for e in lock:
        if not e.applies(markers):
            continue
        have = None if base is None else base.get(e.name)
        if base is not None and e.name in base_stack and e.name not in own:
            (from_base if have is not None else absent).append(Pick(e.name, e.version, have))
        elif e.name not in own and have == e.version:
            from_base.append(Pick(e.name, e.version, have))
        elif installable(e):
            install.append(e)
        elif have is not None and (e.name not in own or have == e.version):
            from_base.append(Pick(e.name, e.version, have))
        else:
            absent.append(Pick(e.name, e.version, have))
    return OverlayPlan(tuple(install), tuple(from_base), tuple(absent))


def summary(from_base: Iterable[str], limit: int = 4) -> str:
    """A short list for a table: the GPU stack first (NVIDIA's CUDA library wheels as ``nvidia-*``,
    cuda-python's parts as ``cuda-*``), then the other names while the list stays within ``limit`` entries,
    else their count: ``torch, triton, nvidia-*, cuda-* +12 others``."""
    picked = set(from_base)
    shown = [n for n in ("torch", "triton") if n in picked]
    shown += [f"{prefix}*" for prefix in ("nvidia-", "cuda-") if any(n.startswith(prefix) for n in picked)]
    others = sorted(n for n in picked if n not in ("torch", "triton") and not n.startswith(("nvidia-", "cuda-")))
    if len(shown) + len(others) <= limit:
        return ", ".join(shown + others)
    if not shown:
        return f"{len(others)} packages"
    return ", ".join(shown) + f" +{len(others)} other{'s' if len(others) > 1 else ''}"

"""Will a compiled extension load beside a torch build? Judged from indexes of their binaries, no cell needed.

Two kinds of index, each read once from a wheel by `provision abi` and kept under ``.cache/abi/`` by the
wheel's sha256 (a released wheel never changes):

- a torch build's exports: every dynamic symbol its ``torch/lib/*.so`` define in torch's C++ namespaces
  (c10::, at::, torch::, caffe2::) or its stable C ABI (``aoti_torch_*``, ``torch_*``), and its CUDA major;
- an extension release's imports: the same kinds of symbol its shared objects leave undefined (C++ and
  stable C apart), the CUDA libraries it needs (DT_NEEDED sonames that carry the CUDA major), and the torch
  requirement its wheel metadata declares.

`judge` compares one of each (pure): the loader refuses the extension when a symbol it imports is exported
by none of torch's libraries (``undefined symbol``) or when it needs another CUDA major's runtime. An
extension built against the stable C ABI alone loads on every torch from the first that exports all it
imports. The declared pin is set beside the binary's answer; where they disagree, that is a finding.
Reading and writing the indexes is at the edges of this module (`load_*`, `save`); the grid is pure.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import stat
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from common.errors import InputError
from common.home import CACHE_ROOT, WORK_ROOT
from inenv import atomic

ABI_CACHE = CACHE_ROOT / "abi"
GRID_DATA = WORK_ROOT / "docs" / "abi-grid.json"  # the grid `provision abi` keeps for the page
FORMAT = 1  # the layout of an index file; another number is read as absent (made again)
SHOWN = 3  # missing symbols named in a cell
LEGEND = ("ok: loads; xN: N imported torch symbols this torch does not export (the import fails with undefined "
          "symbol); cuda: needs another CUDA major's libraries (+cuda: that too); >=X: built on torch's stable C "
          "ABI alone, loads from torch X; !: the wheel's declared torch requirement says the opposite")


@dataclass(frozen=True)
class TorchIndex:
    version: str  # public release, "2.14.1"
    variant: str  # CUDA label of the build, "cu130"
    cuda_major: int | None  # None for a CPU build
    wheel: str  # file name of the wheel it was read from
    key: str  # "sha256-<hex>" of that wheel
    exports: frozenset[str]

    @property
    def label(self) -> str:
        return f"{self.version}+{self.variant}"


@dataclass(frozen=True)
class ExtensionIndex:
    package: str  # distribution name, "sglang-kernel"
    version: str
    wheel: str
    key: str
    torch_pin: str | None  # the wheel's Requires-Dist specifier on torch ("==2.14.1"); None: declares none
    cxx: frozenset[str]  # imported symbols of torch's C++ namespaces
    stable: frozenset[str]  # imported symbols of torch's stable C ABI
    cuda_libs: tuple[str, ...]  # DT_NEEDED sonames whose major is the CUDA major (libcudart.so.13), sorted
    libraries: tuple[str, ...]  # the shared objects read, paths inside the wheel

    @property
    def label(self) -> str:
        return f"{self.package} {self.version}"

    @property
    def cuda_majors(self) -> frozenset[int]:
        return frozenset(m for lib in self.cuda_libs if (m := soname_major(lib)) is not None)

    @property
    def links_torch(self) -> bool:
        return bool(self.cxx or self.stable)


class Fit(StrEnum):
    LOADS = "loads"
    UNDEFINED = "undefined-symbols"
    CUDA = "cuda-major-mismatch"
    STABLE = "stable-abi-needs-newer-torch"


@dataclass(frozen=True)
class Cell:
    """The static verdict of one extension release beside one torch build."""

    extension: str  # ExtensionIndex.label
    torch: str  # TorchIndex.label
    fit: Fit
    missing: tuple[str, ...] = ()  # imported symbols no library of the torch exports, sorted
    cuda_libs: tuple[str, ...] = ()  # with CUDA: the extension's libraries of another major
    needs_torch: str | None = None  # with STABLE: the oldest indexed torch exporting all it imports
    pin: str | None = None  # the extension's declared torch requirement
    pin_allows: bool | None = None  # whether that requirement admits this torch release (None: no pin)

    @property
    def loads(self) -> bool:
        return self.fit is Fit.LOADS

    @property
    def finding(self) -> str:
        """"" when the pin and the binary agree (or there is no pin); else which says yes."""
        if self.pin_allows is None or self.pin_allows == self.loads:
            return ""
        return "pin-yes-binary-no" if self.pin_allows else "pin-no-binary-yes"

    def says(self) -> str:
        """The verdict in a few words."""
        if self.fit is Fit.LOADS:
            return "loads"
        if self.fit is Fit.CUDA:
            return f"CUDA major mismatch: needs {', '.join(self.cuda_libs)}"
        named = ", ".join(self.missing[:SHOWN]) + (", ..." if len(self.missing) > SHOWN else "")
        also = f"; also needs {', '.join(self.cuda_libs)} (another CUDA major)" if self.cuda_libs else ""
        if self.fit is Fit.STABLE:
            floor = (f"needs torch >= {self.needs_torch}" if self.needs_torch
                     else "no indexed torch exports all it needs")
            return f"stable ABI only: {floor} ({len(self.missing)} undefined: {named}){also}"
        return f"{len(self.missing)} undefined symbol(s): {named}{also}"

    def short(self) -> str:
        """A grid cell: ok, x<N> (N undefined symbols), cuda, >=X; '+cuda' where the CUDA major differs too,
        '!' where the declared pin disagrees."""
        return short(self.as_dict())

    def as_dict(self) -> dict[str, Any]:
        return {"extension": self.extension, "torch": self.torch, "fit": self.fit.value, "loads": self.loads,
                "undefined": len(self.missing), "undefined_first": list(self.missing[:SHOWN]),
                "cuda_libraries": list(self.cuda_libs), "needs_torch": self.needs_torch, "pin": self.pin,
                "pin_allows": self.pin_allows, "finding": self.finding or None, "says": self.says()}


def short(cell: dict[str, Any]) -> str:
    """A cell of the grid as `Cell.as_dict` writes it, in a few characters (the page reads the kept JSON)."""
    fit, floor = cell.get("fit"), cell.get("needs_torch")
    text = {"loads": "ok", "cuda-major-mismatch": "cuda"}.get(str(fit))
    if text is None:
        text = f">={floor}" if fit == Fit.STABLE.value and floor else f"x{cell.get('undefined')}"
        text += "+cuda" if cell.get("cuda_libraries") else ""
    return text + ("!" if cell.get("finding") else "")


def finding_lines(cells: Iterable[dict[str, Any]]) -> list[str]:
    """Where the declared torch pin and the binary disagree, from cells as `Cell.as_dict` writes them: each
    pin-says-yes-binary-says-no pair on its own line; the releases a binary loads on beyond its pin, one line
    per extension."""
    cells = [c for c in cells if c.get("finding")]
    lines = [f"{c.get('extension')}: declares torch{spec_text(c.get('pin'))} but does not load beside its "
             f"{c.get('torch')}: {c.get('says')}" for c in cells if c.get("finding") == "pin-yes-binary-no"]
    wider: dict[str, list[dict[str, Any]]] = {}
    for c in cells:
        if c.get("finding") == "pin-no-binary-yes":
            wider.setdefault(str(c.get("extension")), []).append(c)
    lines += [f"{ext}: declares torch{spec_text(cs[0].get('pin'))} yet its binary loads beside "
              f"{', '.join(str(c.get('torch')) for c in cs)} too" for ext, cs in wider.items()]
    return lines


def spec_text(pin: Any) -> str:
    """A declared torch requirement as text: "==2.14.1" for the bare version `registry.pins` gives."""
    text = str(pin or "")
    return text if text[:1] in ("=", "<", ">", "!", "~") else f"=={text}" if text else " (none)"


def soname_major(soname: str) -> int | None:
    """13 for libcudart.so.13."""
    tail = soname.rsplit(".so.", 1)[-1] if ".so." in soname else ""
    return int(tail) if tail.isdigit() else None


def pin_allows(pin: str | None, version: str) -> bool | None:
    """Whether a Requires-Dist specifier on torch admits a torch release; None without a usable pin."""
    if not pin:
        return None
    text = pin if pin[0] in "=<>!~" else f"=={pin}"
    try:
        return SpecifierSet(text).contains(Version(version).public, prereleases=True)
    except (InvalidSpecifier, InvalidVersion):
        return None


def _version_key(label: str) -> tuple[Version, str]:
    version, _, variant = label.partition("+")
    try:
        return Version(version), variant
    except InvalidVersion:
        return Version("0"), label


def stable_floor(ext: ExtensionIndex, torches: Iterable[TorchIndex]) -> str | None:
    """The oldest torch release among ``torches`` whose exports hold every stable-ABI symbol ``ext`` imports."""
    fits = sorted({t.version for t in torches if ext.stable <= t.exports}, key=lambda v: _version_key(v))
    return fits[0] if fits else None


def judge(ext: ExtensionIndex, torch: TorchIndex, floor: str | None = None) -> Cell:
    """The verdict on ``ext`` beside ``torch``. ``floor``: `stable_floor` of the extension, for the stable-ABI
    verdict. Symbols decide first (the loader's own error); libraries of another CUDA major are named either way."""
    pin, allows = ext.torch_pin, pin_allows(ext.torch_pin, torch.version)
    other = tuple(lib for lib in ext.cuda_libs if torch.cuda_major is not None
                  and soname_major(lib) not in (None, torch.cuda_major))
    missing = tuple(sorted((ext.cxx | ext.stable) - torch.exports))
    if missing:
        fit = Fit.STABLE if not ext.cxx else Fit.UNDEFINED
        return Cell(ext.label, torch.label, fit, missing, other, needs_torch=floor if fit is Fit.STABLE else None,
                    pin=pin, pin_allows=allows)
    return Cell(ext.label, torch.label, Fit.CUDA if other else Fit.LOADS, cuda_libs=other, pin=pin,
                pin_allows=allows)


@dataclass(frozen=True)
class Grid:
    torches: tuple[TorchIndex, ...]  # columns, oldest first
    extensions: tuple[ExtensionIndex, ...]  # rows
    cells: tuple[Cell, ...]

    def cell(self, extension: str, torch: str) -> Cell | None:
        return next((c for c in self.cells if c.extension == extension and c.torch == torch), None)

    def findings(self) -> tuple[Cell, ...]:
        return tuple(c for c in self.cells if c.finding)


def grid(torches: Iterable[TorchIndex], extensions: Iterable[ExtensionIndex]) -> Grid:
    """Every extension that links torch against every torch build (pure)."""
    cols = tuple(sorted(torches, key=lambda t: _version_key(t.label)))
    rows = tuple(e for e in extensions if e.links_torch or e.cuda_libs)
    cells = tuple(judge(e, t, stable_floor(e, cols) if e.stable and not e.cxx else None) for e in rows for t in cols)
    return Grid(cols, rows, cells)


def grid_json(g: Grid) -> dict[str, Any]:
    return {
        "torch": [{"label": t.label, "version": t.version, "variant": t.variant, "cuda_major": t.cuda_major,
                   "wheel": t.wheel, "key": t.key, "exports": len(t.exports)} for t in g.torches],
        "extensions": [{"label": e.label, "package": e.package, "version": e.version, "wheel": e.wheel,
                        "key": e.key, "torch_pin": e.torch_pin, "cxx_imports": len(e.cxx),
                        "stable_imports": len(e.stable), "cuda_libraries": list(e.cuda_libs),
                        "libraries": list(e.libraries)} for e in g.extensions],
        "cells": [c.as_dict() for c in g.cells],
    }


# ---- the edges: index files under .cache/abi/ -------------------------------------------------------------
# A cache is only a cache: an index is used only when its file is a regular file (no link is followed, the
# folders on the way neither), named by a key of the form KEY (the wheel's sha256, or a hash of its URL where
# the index gives no sha256: nothing else can name a path), holding that key, and naming the release it is
# filed under (``names``); anything else is absent, and made again.
KEY = re.compile(r"(?:sha256|url)-[0-9a-f]{64}")
MAX_INDEX_BYTES = 256 << 20  # one index, uncompressed (torch's exports are a few MiB)
MANIFEST_FORMAT = 2  # releases.json: {"format": 2, "releases": {release: key}}, each key the pinned wheel's


class CacheError(InputError):
    """A folder of the ABI cache that is a link or not a folder: nothing is written through it."""


def valid_key(key: object) -> bool:
    return isinstance(key, str) and KEY.fullmatch(key) is not None


def _path(root: Path, kind: str, key: str) -> Path:
    if not valid_key(key):
        raise ValueError(f"not an index key: {key[:80]!r}")
    return root / kind / f"{key}.json.gz"


def _plain_folder(folder: Path) -> bool:
    """Whether ``folder`` is absent or a real folder (not a link to one)."""
    try:
        return stat.S_ISDIR(os.lstat(folder).st_mode)
    except FileNotFoundError:
        return True


def _plain_bytes(path: Path, folders: Sequence[Path], limit: int) -> bytes | None:
    """The bytes of ``path`` when it and each of ``folders`` (the cache's folders above it) are no link and
    it is a regular file of at most ``limit`` bytes; else None."""
    try:
        if not all(stat.S_ISDIR(os.lstat(f).st_mode) for f in folders):
            return None
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return None
        data = f.read(limit + 1)
    return data if len(data) <= limit else None


def _writable(root: Path, kind: str | None = None) -> None:
    """CacheError when the cache folder (or its ``kind`` folder) is a link or not a folder."""
    for folder in (root, *((root / kind,) if kind else ())):
        if not _plain_folder(folder):
            raise CacheError(f"{folder}: a symbolic link or not a folder; the ABI cache follows no link: remove it "
                             "(`provision abi` makes it again)")


def save(index: TorchIndex | ExtensionIndex, root: Path = ABI_CACHE) -> Path:
    """Write one index, gzip'd JSON, atomically."""
    if isinstance(index, TorchIndex):
        kind = "torch"
        body: dict[str, Any] = {"version": index.version, "variant": index.variant, "cuda_major": index.cuda_major,
                                "exports": sorted(index.exports)}
    else:
        kind = "ext"
        body = {"package": index.package, "version": index.version, "torch_pin": index.torch_pin,
                "cxx": sorted(index.cxx), "stable": sorted(index.stable), "cuda_libs": list(index.cuda_libs),
                "libraries": list(index.libraries)}
    _writable(root, kind)
    path = _path(root, kind, index.key)
    data = json.dumps({"format": FORMAT, "wheel": index.wheel, "key": index.key, **body}, separators=(",", ":"))
    atomic.write_bytes(path, gzip.compress(data.encode(), compresslevel=6, mtime=0))
    return path


def _read(root: Path, kind: str, key: str) -> dict[str, Any] | None:
    """One index file's JSON when it may be used (see above: a plain file under plain folders, of this key)."""
    if not valid_key(key):
        return None
    data = _plain_bytes(_path(root, kind, key), (root, root / kind), MAX_INDEX_BYTES)
    if data is None:
        return None
    try:
        unzip = zlib.decompressobj(wbits=31)
        text = unzip.decompress(data, MAX_INDEX_BYTES)
        if unzip.unconsumed_tail:
            return None
        raw = json.loads(text)
    except (zlib.error, ValueError):
        return None
    ok = isinstance(raw, dict) and raw.get("format") == FORMAT and raw.get("key") == key
    return raw if ok else None


def load_torch(key: str, root: Path = ABI_CACHE) -> TorchIndex | None:
    """One torch build's index, None when absent or unreadable (then it is made again)."""
    raw = _read(root, "torch", key)
    try:
        return None if raw is None else TorchIndex(
            str(raw["version"]), str(raw["variant"]), None if raw["cuda_major"] is None else int(raw["cuda_major"]),
            str(raw["wheel"]), str(raw["key"]), frozenset(map(str, raw["exports"])))
    except (KeyError, TypeError, ValueError):
        return None


def load_extension(key: str, root: Path = ABI_CACHE) -> ExtensionIndex | None:
    raw = _read(root, "ext", key)
    try:
        return None if raw is None else ExtensionIndex(
            str(raw["package"]), str(raw["version"]), str(raw["wheel"]), str(raw["key"]),
            None if raw["torch_pin"] is None else str(raw["torch_pin"]), frozenset(map(str, raw["cxx"])),
            frozenset(map(str, raw["stable"])), tuple(map(str, raw["cuda_libs"])), tuple(map(str, raw["libraries"])))
    except (KeyError, TypeError, ValueError):
        return None


def names(index: TorchIndex | ExtensionIndex, package: str, version: str) -> bool:
    """Whether an index's own fields name the release it is filed under: ``package`` at ``version`` (torch:
    ``2.14.1``, or ``2.14.1+cu126`` for one CUDA build). A file that names another release is not used for it."""
    if isinstance(index, TorchIndex):
        public, _, variant = version.partition("+")
        return package == "torch" and index.version == public and (not variant or index.variant == variant)
    return canonicalize_name(index.package) == canonicalize_name(package) and index.version == version


def load(package: str, version: str, key: str, root: Path = ABI_CACHE) -> TorchIndex | ExtensionIndex | None:
    """The index of ``package`` ``version`` kept under ``key``, None unless it is there, usable and names that
    release."""
    found = load_torch(key, root) if package == "torch" else load_extension(key, root)
    return found if found is not None and names(found, package, version) else None


# The releases each index was made for: "torch 2.14.1" / "sglang-kernel 0.4.10" -> the key of the wheel the
# registry's listing picks for it (provision.registry.pick_wheel), so a warm run finds its indexes without
# asking the registry. A manifest of another format (made before the pick was pinned) is read as empty.
def manifest_path(root: Path = ABI_CACHE) -> Path:
    return root / "releases.json"


def load_manifest(root: Path = ABI_CACHE) -> dict[str, str]:
    data = _plain_bytes(manifest_path(root), (root,), MAX_INDEX_BYTES)
    try:
        raw = json.loads(data) if data is not None else None
    except ValueError:
        return {}
    if not isinstance(raw, dict) or raw.get("format") != MANIFEST_FORMAT or not isinstance(raw.get("releases"), dict):
        return {}
    return {k: v for k, v in raw["releases"].items() if isinstance(k, str) and isinstance(v, str)}


def save_manifest(entries: dict[str, str], root: Path = ABI_CACHE) -> None:
    _writable(root)
    atomic.write_json(manifest_path(root), {"format": MANIFEST_FORMAT, "releases": dict(sorted(entries.items()))})


def release_key(package: str, version: str) -> str:
    return f"{package} {version}"


def cached(packages: Sequence[tuple[str, str]], root: Path = ABI_CACHE
           ) -> tuple[list[TorchIndex], list[ExtensionIndex]]:
    """The indexes already made for (package, version) pairs; torch's under the name "torch". No network."""
    keys = load_manifest(root)
    torches: list[TorchIndex] = []
    exts: list[ExtensionIndex] = []
    for package, version in packages:
        key = keys.get(release_key(package, version))
        found = load(package, version, key, root) if key is not None else None
        if isinstance(found, TorchIndex):
            torches.append(found)
        elif isinstance(found, ExtensionIndex):
            exts.append(found)
    return torches, exts


def save_grid_data(data: dict[str, Any], path: Path = GRID_DATA) -> None:
    """The grid as the page publishes it; rewritten only when its content changed."""
    text = json.dumps(data, indent=1, sort_keys=True) + "\n"
    try:
        if path.read_text() == text:
            return
    except OSError:
        pass
    atomic.write_text(path, text)


def load_grid_data(path: Path = GRID_DATA) -> dict[str, Any] | None:
    """The kept grid, None when absent or not a grid (untrusted: the page escapes every string)."""
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(raw, dict) or not isinstance(raw.get("cells"), list) or not isinstance(raw.get("torch"), list):
        return None
    return raw


# ---- checked against reality: the inventory probe's verdict in a built cell --------------------------------

# The import name the inventory probe records an extension under -> the distributions it comes from.
MODULE_PACKAGES = {"sgl_kernel": ("sgl-kernel", "sglang-kernel"), "vllm": ("vllm",), "sglang": ("sglang",)}


@dataclass(frozen=True)
class Observed:
    """What a built cell's inventory said about one extension beside its torch."""

    where: str  # "<host>/<cell>"
    module: str  # import name: sgl_kernel, vllm, sglang
    version: str  # the extension's release
    torch: str  # the torch build, "2.14.1+cu130"
    loads: bool
    said: str  # why, in the inventory's terms


@dataclass(frozen=True)
class Comparison:
    seen: Observed
    predicted: dict[str, Any] | None  # the grid's cell, None when the grid has no such pair

    @property
    def agrees(self) -> bool | None:
        return None if self.predicted is None else bool(self.predicted.get("loads")) == self.seen.loads


def observed(where: str, evidence: dict[str, Any], engine_versions: dict[str, str]) -> list[Observed]:
    """The extensions an inventory result judged from their binaries (``<module>_abi`` evidence): loads when
    no imported torch symbol is missing and every CUDA library they need is of torch's CUDA major.
    ``engine_versions``: module -> release for engines whose version the result does not list (from the
    cell id). Untrusted input: anything of the wrong type is left out."""
    versions = evidence.get("versions") if isinstance(evidence.get("versions"), dict) else {}
    torch = versions.get("torch_runtime")
    out = []
    for module in MODULE_PACKAGES:
        fit = evidence.get(f"{module}_abi")
        version = versions.get(module) or engine_versions.get(module)
        if not isinstance(fit, dict) or not isinstance(version, str) or not isinstance(torch, str):
            continue
        missing = fit.get("torch_symbols_missing")
        cuda = str(fit.get("torch_cuda") or "").split(".")[0]
        libs = [x for x in fit.get("cuda_libraries_needed") or [] if isinstance(x, str)]
        other = [x for x in libs if cuda.isdigit() and soname_major(x) not in (None, int(cuda))]
        if not isinstance(missing, int):
            continue
        said = (f"{missing} imported torch symbol(s) missing" if missing else
                f"needs {', '.join(other)} beside CUDA {cuda}" if other else "every imported torch symbol exported")
        out.append(Observed(where, module, version, torch, missing == 0 and not other, said))
    return out


def compare(data: dict[str, Any], seen: Iterable[Observed]) -> list[Comparison]:
    """Each observation beside the grid's prediction for the same extension release and torch build."""
    labels = {(m, e.get("version")): e.get("label") for e in data.get("extensions") or [] if isinstance(e, dict)
              for m, pkgs in MODULE_PACKAGES.items() if e.get("package") in pkgs}
    cells = {(c.get("extension"), c.get("torch")): c for c in data.get("cells") or [] if isinstance(c, dict)}
    return [Comparison(s, cells.get((labels.get((s.module, s.version)), s.torch))) for s in seen]

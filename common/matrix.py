"""matrix.yaml: validation into a frozen model, and expansion into cells (GitHub Actions semantics)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from packaging.version import InvalidVersion, Version

from common.catalog import Catalog
from common.catalog import load as load_catalog
from common.errors import InputError, suggest
from common.yamlsrc import Path_, Source
from common.yamlsrc import load as load_yaml
from inenv.gpuarch import TargetError, parse_target

AXES: tuple[str, ...] = ("cuda", "torch", "sgl_kernel", "flashinfer")
# Axes a matrix may leave out, with the value every cell then has. nccl: "pinned" keeps the NCCL wheel torch
# pins; a version puts that release of the NCCL wheel of the cell's CUDA major beside the same torch.
OPTIONAL_AXES: dict[str, tuple[str, ...]] = {"nccl": ("pinned",)}
ALL_AXES: tuple[str, ...] = AXES + tuple(OPTIONAL_AXES)
NCCL_PINNED = "pinned"
EXTRA_KEYS: tuple[str, ...] = ("jit_cache", "kernel_archs", "engine")  # keys an include entry may attach to cells
TOP_KEYS = ("matrix", "description", "kernel_archs")
# The GPU architectures a cell's carried flashinfer comm modules are compiled for when the matrix names none:
# Hopper (9.0a: the H200 hosts the table has) and the Blackwell targets fi-jit cross-compiles (12.0a, 12.0f:
# RTX PRO 6000 / RTX 5090 class). `provision build` compiles each module once for the whole list.
DEFAULT_KERNEL_ARCHS: tuple[str, ...] = ("9.0a", "12.0a", "12.0f")
MATRIX_KEYS = ALL_AXES + ("include", "exclude")
TORCH_CHANNELS = ("stable", "nightly")
# Values end up in file names, image tags and shell lines: letters, digits and . + _ - only.
SAFE_VALUE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.+_-]{0,63}$")


@dataclass(frozen=True)
class Cell:
    """One combination as the matrix names it (torch may still be a channel)."""

    cuda: str
    torch: str  # "stable", "nightly" or an exact version
    sgl_kernel: str  # version or "none"
    flashinfer: str  # version or "none"
    jit_cache: bool = False  # also install flashinfer-jit-cache
    preset: str | None = None
    engine: bool = False  # also install the preset's serving engine itself (vllm / sglang at its release)
    nccl: str = NCCL_PINNED  # "pinned" (torch's own NCCL wheel) or the NCCL release put beside torch instead
    # what `provision build` compiles the cell's comm modules for; not part of what the cell is
    kernel_archs: tuple[str, ...] = field(default=DEFAULT_KERNEL_ARCHS, compare=False)

    def axis(self, name: str) -> str:
        return str(getattr(self, name))


@dataclass(frozen=True)
class Matrix:
    file: str
    axes: dict[str, tuple[str, ...]]
    exclude: tuple[tuple[tuple[str, str], ...], ...]
    include: tuple[tuple[tuple[str, Any], ...], ...]
    description: str = ""
    cells: tuple[Cell, ...] = field(default=())
    kernel_archs: tuple[str, ...] = DEFAULT_KERNEL_ARCHS


def _scalar_str(src: Source, path: Path_, value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise src.error(path, f"expected a version string, got {type(value).__name__}: quote it, e.g. \"13.0\"")
    text = value if isinstance(value, str) else repr(value)
    written = src.raw.get(path)
    if isinstance(value, float) and written is not None and written != text:
        raise src.error(path, f"{written} reads as the number {text}; quote it to keep it as written: \"{written}\"")
    if not SAFE_VALUE.match(text):
        raise src.error(path, f"'{text}' has characters other than letters, digits, '.', '+', '_', '-'")
    return text


def _version(src: Source, path: Path_, text: str, what: str) -> str:
    try:
        Version(text)
    except InvalidVersion:
        raise src.error(path, f"'{text}' is not a {what} version (PEP 440, e.g. 0.6.8.post1)") from None
    return text


def _axis_value(src: Source, path: Path_, axis: str, value: Any, catalog: Catalog) -> str:
    text = _scalar_str(src, path, value)
    if axis == "cuda":
        if text not in catalog.cuda:
            allowed = ", ".join(catalog.cuda)
            raise src.error(path, f"unknown CUDA version '{text}'; allowed: {allowed}{suggest(text, catalog.cuda)}")
        return text
    if axis == "nccl":
        return text if text == NCCL_PINNED else _version(src, path, text, "NCCL (or pinned: torch's own)")
    if axis == "torch":
        if text in TORCH_CHANNELS:
            return text
        if text.isalpha():
            raise src.error(path, f"unknown torch channel '{text}'; use stable, nightly or an exact version"
                            + suggest(text, TORCH_CHANNELS))
        return _version(src, path, text, "torch")
    if text == "none":
        return text
    return _version(src, path, text, axis.replace("_", "-"))


def kernel_archs(src: Source, path: Path_, value: Any) -> tuple[str, ...]:
    """A list of GPU architectures (``["9.0a", "12.0f"]``), or ``none`` / ``[]`` for no carried kernels."""
    if value == "none" or value == []:
        return ()
    if not isinstance(value, list):
        raise src.error(path, 'expected a list of GPU architectures such as ["9.0a", "12.0a"], or none')
    out: list[str] = []
    for i, v in enumerate(value):
        if not isinstance(v, str | int | float) or isinstance(v, bool):
            raise src.error(path + (i,), 'expected an architecture string such as "9.0a"')
        try:
            name = str(parse_target(str(v)))
        except TargetError as exc:
            raise src.error(path + (i,), str(exc)) from None
        if name not in out:
            out.append(name)
    return tuple(out)


def _mapping(src: Source, path: Path_, value: Any, allowed: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise src.error(path, f"expected a mapping with keys {', '.join(allowed)}")
    for k in value:
        if k not in allowed:
            raise src.error(path + (k,), f"unknown key '{k}'; allowed: {', '.join(allowed)}{suggest(k, allowed)}")
    return value


def _entry(src: Source, path: Path_, raw: Any, catalog: Catalog, allowed: tuple[str, ...]) -> dict[str, Any]:
    entry = _mapping(src, path, raw, allowed)
    if not entry:
        raise src.error(path, "empty entry: give at least one of " + ", ".join(allowed))
    out: dict[str, Any] = {}
    if "preset" in entry:
        name = _scalar_str(src, path + ("preset",), entry["preset"])
        preset = catalog.presets.get(name)
        if preset is None:
            raise src.error(path + ("preset",), f"unknown preset '{name}'; known: {', '.join(catalog.presets)}"
                            + suggest(name, catalog.presets))
        out.update(torch=preset.torch, sgl_kernel=preset.sgl_kernel, flashinfer=preset.flashinfer, preset=name)
    for k, v in entry.items():
        if k in ALL_AXES:
            out[k] = _axis_value(src, path + (k,), k, v, catalog)
        elif k in ("jit_cache", "engine"):
            if not isinstance(v, bool):
                raise src.error(path + (k,), "expected true or false")
            out[k] = v
        elif k == "kernel_archs":
            out[k] = kernel_archs(src, path + (k,), v)
    if out.get("engine") and "preset" in out:
        # an engine cell is exactly what serving that release installs: an axis the entry sets otherwise would
        # replace one of the engine's own pins without a word (without engine: true a preset is a starting point
        # whose axes an entry may replace, and the cell id shows every version)
        pinned = catalog.presets[out["preset"]]
        for k in ("torch", "sgl_kernel", "flashinfer"):
            if k in entry and out[k] != getattr(pinned, k):
                raise src.error(path + (k,), f"{out['preset']} with engine: true pins {k} {getattr(pinned, k)}; "
                                f"this entry's {k} {out[k]} would replace the engine's own pin: drop {k} here, or "
                                "engine: true")
    if out.get("engine") and "preset" not in out:
        raise src.error(path + ("engine",), "engine: true installs a preset's engine release; add "
                        "preset: vllm-<version> or sglang-<version> to this entry")
    return out


def parse(src: Source, catalog: Catalog) -> Matrix:
    top = src.data
    if top is None:
        raise src.error((), "the file is empty; it needs a 'matrix:' mapping with cuda, torch, sgl_kernel, flashinfer")
    top = _mapping(src, (), top, TOP_KEYS)
    if "matrix" not in top:
        raise src.error((), "missing key 'matrix' (a mapping of axes cuda, torch, sgl_kernel, flashinfer)")
    m = _mapping(src, ("matrix",), top["matrix"], MATRIX_KEYS)
    axes: dict[str, tuple[str, ...]] = {}
    for axis in ALL_AXES:
        path = ("matrix", axis)
        if axis not in m and axis in OPTIONAL_AXES:
            axes[axis] = OPTIONAL_AXES[axis]
            continue
        if axis not in m:
            raise src.error(("matrix",), f"missing axis '{axis}' (a list of values)")
        values = m[axis]
        if not isinstance(values, list):
            values = [values]
        if not values:
            raise src.error(path, "empty list: give at least one value")
        seen: list[str] = []
        for i, v in enumerate(values):
            text = _axis_value(src, path + (i,), axis, v, catalog)
            if text in seen:
                raise src.error(path + (i,), f"duplicate value '{text}'")
            seen.append(text)
        axes[axis] = tuple(seen)
    exclude = []
    for i, raw in enumerate(_list(src, ("matrix", "exclude"), m.get("exclude"))):
        path = ("matrix", "exclude", i)
        e = _entry(src, path, raw, catalog, ALL_AXES)
        for k, v in e.items():
            if v not in axes[k]:
                raise src.error(path + (k,), f"'{v}' is not a value of the {k} axis ({', '.join(axes[k])}), "
                                "so this exclude matches nothing")
        exclude.append(tuple(sorted(e.items())))
    include = []
    for i, raw in enumerate(_list(src, ("matrix", "include"), m.get("include"))):
        entry = _entry(src, ("matrix", "include", i), raw, catalog, ALL_AXES + EXTRA_KEYS + ("preset",))
        include.append(tuple(entry.items()))
    description = top.get("description", "")
    if not isinstance(description, str):
        raise src.error(("description",), "expected a string")
    archs = kernel_archs(src, ("kernel_archs",), top["kernel_archs"]) if "kernel_archs" in top \
        else DEFAULT_KERNEL_ARCHS
    matrix = Matrix(src.file, axes, tuple(exclude), tuple(include), description, kernel_archs=archs)
    cells = expand(matrix)
    for i, (entry, cell) in enumerate(zip(include, cells.new_from_include, strict=True)):
        if cell is None:
            continue
        missing = [a for a in AXES if a not in dict(entry)]
        if missing:
            raise src.error(("matrix", "include", i), "this entry matches no cell, so it adds one, but it lacks "
                            f"{', '.join(missing)} (give them, or a preset)")
    return Matrix(src.file, axes, tuple(exclude), tuple(include), description, cells.cells, archs)


def _list(src: Source, path: Path_, value: Any) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise src.error(path, "expected a list of mappings")
    return value


@dataclass(frozen=True)
class Expansion:
    cells: tuple[Cell, ...]
    new_from_include: tuple[bool | None, ...]  # per include entry: True if it added a cell, None otherwise


def expand(matrix: Matrix) -> Expansion:
    """Cartesian product, minus excludes, then includes: an include entry attaches its extra keys to
    every original combination whose axis values it matches; one that matches none adds a cell."""
    combos: list[dict[str, Any]] = [{}]
    for axis in ALL_AXES:
        combos = [dict(c, **{axis: v}) for c in combos for v in matrix.axes.get(axis, OPTIONAL_AXES.get(axis, ()))]
    combos = [c for c in combos if not any(all(c[k] == v for k, v in ex) for ex in matrix.exclude)]
    originals = list(combos)
    added: list[bool | None] = []
    for entry in matrix.include:
        e = dict(entry)
        axis_items = {k: v for k, v in e.items() if k in ALL_AXES}
        extras = {k: v for k, v in e.items() if k not in ALL_AXES}
        matched = [c for c in originals if all(c[k] == v for k, v in axis_items.items())]
        for c in matched:
            c.update(extras)
        if matched:
            added.append(None)
        else:
            added.append(True)
            if all(a in e for a in AXES):
                combos.append({**{a: OPTIONAL_AXES[a][0] for a in OPTIONAL_AXES}, **e})
    cells: list[Cell] = []
    seen: set[Cell] = set()
    for c in combos:
        cell = Cell(c["cuda"], c["torch"], c["sgl_kernel"], c["flashinfer"], bool(c.get("jit_cache", False)),
                    c.get("preset"), bool(c.get("engine", False)), c.get("nccl", NCCL_PINNED),
                    tuple(c.get("kernel_archs", matrix.kernel_archs)))
        if cell not in seen:
            seen.add(cell)
            cells.append(cell)
    return Expansion(tuple(cells), tuple(added))


def load(path: str | Path, catalog: Catalog | None = None) -> Matrix:
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise InputError("file not found: give an existing matrix file with --matrix", file=str(path)) from None
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read: {e}", file=str(path)) from None
    try:
        return parse(load_yaml(text, str(path)), catalog or load_catalog())
    except RecursionError:
        raise InputError("nesting too deep (recursive YAML aliases?)", file=str(path)) from None

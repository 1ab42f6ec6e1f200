"""Whether the pages `checks report` would write are already on disk: a fingerprint of everything they are made
from, kept beside the hashes of the pages written from it.

The pages are a pure function of the results folder, the matrices the checkout declares, the ABI grid beside
the page, stackprobe's own code and data (probes, reason catalogue, templates), the probes added through
``STACKPROBE_PROBE_PATH`` (their source decides which verdicts are stale) and the versions of the two rendering
libraries. The fingerprint covers each of them by path, size and modification time (results and
code) or version string (libraries), so a run that records nothing new, followed by the report, costs a walk
of those folders instead of parsing every run again. Any change to an input, and any page edited, removed or
added by hand, makes the stamp stale and the report is written again.

The stamp lives in stackprobe's cache folder (common.home.CACHE_ROOT), not beside the pages: whoever can write
the results folder could otherwise claim any page current. Read defensively: a stamp that does not parse is
no stamp.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Collection, Iterable, Mapping
from importlib import metadata
from pathlib import Path

from common import home
from inenv import atomic, registry

FORMAT = 1
CODE_PACKAGES = ("checks", "common", "inenv")  # stackprobe's packages: code, templates, catalogues, priors
LIBRARIES = ("jinja2", "markupsafe")  # what renders the pages


def _tree(root: Path, skip: Collection[str] = ()) -> Iterable[str]:
    """One line per file under ``root`` (path relative to it, size, modification time), in a fixed order; the
    interpreter's bytecode folders are skipped (they follow the sources), and so is every path in ``skip``
    (absolute, resolved: the pages themselves, where they are written inside the results folder)."""
    base = root.resolve()
    for folder, dirs, files in os.walk(base):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__" and os.path.join(folder, d) not in skip)
        for name in sorted(files):
            p = os.path.join(folder, name)
            if p in skip:
                continue
            try:
                st = os.lstat(p)
            except OSError:
                continue
            yield f"{os.path.relpath(p, base)}\0{st.st_size}\0{st.st_mtime_ns}"


def _one(path: Path) -> str:
    try:
        st = os.lstat(path)
    except OSError:
        return f"{path}\0absent"
    return f"{path}\0{st.st_size}\0{st.st_mtime_ns}"


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"


def fingerprint(results_dir: Path, out: Path, html: Path, grid: Path, written: Collection[Path]) -> str:
    """The hash of every input of the pages written to ``out`` and ``html`` from ``results_dir``; ``written``:
    the files and folders the report writes, left out where they lie inside the results folder."""
    h = hashlib.sha256(f"stamp {FORMAT}\0{results_dir.resolve()}\0{out.resolve()}\0{html.resolve()}\n".encode())
    for line in _tree(results_dir, {str(p.resolve()) for p in written}):
        h.update(f"r\0{line}\n".encode())
    for pkg in CODE_PACKAGES:
        for line in _tree(home.CODE_ROOT / pkg):
            h.update(f"c\0{pkg}\0{line}\n".encode())
    for extra in registry.extra_dirs():  # probes added through STACKPROBE_PROBE_PATH judge freshness too
        for line in _tree(extra):
            h.update(f"p\0{extra.resolve()}\0{line}\n".encode())
    for path in (home.DATA_ROOT / "matrix.yaml", grid):
        h.update(f"d\0{_one(path)}\n".encode())
    for line in _tree(home.DATA_ROOT / "matrices"):
        h.update(f"m\0{line}\n".encode())
    for lib in LIBRARIES:
        h.update(f"l\0{lib}\0{_version(lib)}\n".encode())
    return h.hexdigest()


def _digest(path: Path) -> str | None:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def where(out: Path, cache_root: Path | None = None) -> Path:
    """The stamp of the pages whose table is ``out``."""
    key = hashlib.sha256(str(out.resolve()).encode()).hexdigest()[:20]
    return (cache_root or home.CACHE_ROOT) / "report-stamps" / f"{key}.json"


def current(stamp: Path, fp: str, pages_dir: Path) -> bool:
    """Whether the stamp says the pages were written from inputs of fingerprint ``fp`` and every page it lists
    still has the bytes written then, with no other host page beside them in ``pages_dir``."""
    try:
        data = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("fingerprint") != fp:
        return False
    pages = data.get("pages")
    if not isinstance(pages, dict) or not pages or not all(isinstance(v, str) for v in pages.values()):
        return False
    listed = {Path(p) for p in pages}
    present = set(pages_dir.glob("*.md")) if pages_dir.is_dir() else set()
    if not present <= listed:
        return False
    return all(_digest(Path(p)) == digest for p, digest in pages.items())


def record(stamp: Path, fp: str, files: Mapping[Path, str]) -> None:
    """Keep the fingerprint with the hash of each page as written; a stamp that cannot be written is no loss
    (the next report writes the pages again)."""
    pages = {str(p): hashlib.sha256(text.encode()).hexdigest() for p, text in files.items()}
    with contextlib.suppress(OSError):
        stamp.parent.mkdir(parents=True, exist_ok=True)
        atomic.write_text(stamp, json.dumps({"format": FORMAT, "fingerprint": fp, "pages": pages}, sort_keys=True))


def forget(stamp: Path) -> None:
    with contextlib.suppress(OSError):
        stamp.unlink()

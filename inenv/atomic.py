"""Replace a file or a folder so that no reader, and no crash, ever sees it half-written (standard library only).

The content goes to a temporary file in the target's own directory, is flushed and fsynced, and is renamed
over the target; a rename within one file system is atomic, so the target holds the old content or the new,
never a mix, even when the writer is killed with SIGKILL mid-write (a ``write`` can stop part-way, a rename
cannot). The directory is fsynced afterwards so the rename itself survives a power cut.

Both sides use it: the host (results store, report, provision's locks, build records and Dockerfiles) and
the ranks inside cell environments (their outcome files), which is why it imports nothing else.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


def umask() -> int:
    """This process's umask, read without changing it where Linux says it (/proc/self/status)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def new_file_mode() -> int:
    """What a plain open() gives a new file under the umask (mkstemp alone would give 0600)."""
    return 0o666 & ~umask()


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data``; a file that existed keeps its permission bits."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = path.stat().st_mode & 0o777
    except FileNotFoundError:
        mode = new_file_mode()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def write_text(path: Path, text: str) -> None:
    write_bytes(path, text.encode())


def write_json(path: Path, data: Any, indent: int | None = 2) -> None:
    """JSON with sorted keys and a final newline (values JSON does not know are written as str)."""
    write_text(path, json.dumps(data, indent=indent, sort_keys=True, default=str) + "\n")


def replace_dir(target: Path, files: Mapping[str, str], keep: Sequence[str] = ()) -> None:
    """Replace folder ``target`` with exactly ``files`` (name -> text) plus the ``keep`` files it already has.

    The new folder is filled beside the old one and swapped in by two renames; a reader can find the folder
    missing for that instant, but never holding a mix of old and new files."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    tmp.chmod(0o777 & ~umask())
    try:
        for name, text in files.items():
            with open(tmp / name, "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
        for name in keep:
            if (target / name).exists():
                shutil.copy2(target / name, tmp / name)
        old = None
        if target.exists():
            old = target.with_name(f".{target.name}.old-{os.getpid()}")
            os.replace(target, old)
        os.replace(tmp, target)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_dir(target.parent)


def set_aside(path: Path) -> Path | None:
    """Move whatever stands at ``path`` (a folder, a file, a link, followed or not) to a name of this process
    beside it by one rename, so ``path`` is free for a :func:`publish_dir`; that name, or None when nothing
    stood there."""
    if not os.path.lexists(path):
        return None
    aside = path.with_name(f".stale-{path.name}-{os.getpid()}")
    os.replace(path, aside)
    return aside


def publish_dir(staging: Path, target: Path) -> bool:
    """Put the filled folder ``staging`` at ``target`` by one rename, so a reader sees all of it or none; False
    when ``target`` was already there (another writer published the same content first: ``staging`` is left for
    the caller to remove)."""
    try:
        os.replace(staging, target)
    except OSError:
        if not target.is_dir():
            raise
        return False
    _fsync_dir(target.parent)
    return True

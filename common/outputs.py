"""Paths a user names for a command to write (`checks report --out/--html`, `checks run --report`, `checks
share --out`): the file is replaced whole by a rename, so the path must be a new name or a regular file.
A directory, FIFO, socket or device file there, or a symbolic link (whose target the rename would not
write), is refused before anything runs. Pure apart from reading the path's status.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from pathlib import Path

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def first_problem(paths: Iterable[tuple[Path, str]]) -> str | None:
    """The first of ``problem(path, what)`` over (path, what) pairs that is not None."""
    return next((why for path, what in paths if (why := problem(path, what)) is not None), None)


def problem(path: Path, what: str) -> str | None:
    """One line saying why ``path`` may not be written as ``what`` (e.g. ``--out``), or None."""
    shown = ascii(str(path))[1:-1]
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        parent = path.parent
        if parent.exists() and not parent.is_dir():
            return f"{what} {shown}: {ascii(str(parent))[1:-1]} is not a directory; name a path in a directory"
        return None
    except NotADirectoryError:
        return f"{what} {shown}: a folder on its path is not a directory; name a path in a directory"
    except OSError as exc:
        return f"{what} {shown}: cannot be read ({exc.strerror or exc}); name a new or regular file"
    if stat.S_ISLNK(st.st_mode):
        return f"{what} {shown} is a symbolic link; name the file itself (nothing written)"
    for test, kind in _KINDS:
        if test(st.st_mode):
            return f"{what} {shown} is {kind}, not a regular file; name a new or regular file (nothing written)"
    return None

"""Where stackprobe's files are: its code, the data it ships (the default matrix, the Dockerfile templates) and
the working folder that receives what it writes (results, tables, build records, caches).

Two ways to have stackprobe, one rule each:

- **a checkout** (the folder holding the packages also holds ``pyproject.toml`` and ``matrix.yaml``): data and
  writes are the checkout's own, so the README's commands write ``results/`` and ``docs/`` of the repository;
- **an installed wheel** (``uvx --from stackprobe-*.whl checks ...``): the data is the copy packaged under
  ``common/packaged/``, results and build records go under the current folder, never into the install folder,
  and the caches whose content runs under the user's cache folder (``~/.cache/stackprobe``), never under a
  current folder that anyone may have filled.

The choice is made once, when this module is imported. Standard library only.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path

from inenv import atomic

CODE_ROOT = Path(__file__).resolve().parent.parent  # the folder that holds the packages (checkout or site-packages)
PACKAGED = Path(__file__).resolve().parent / "packaged"  # in a wheel: matrix.yaml, matrices/, dockerfiles/
IN_ENV_PACKAGE = "inenv"  # what the probes' processes import from stackprobe: standard library only


def is_checkout(root: Path = CODE_ROOT) -> bool:
    """Whether ``root`` is a source checkout (it holds the project file and the default matrix) rather than the
    site-packages folder of an installed wheel (which holds neither at its top)."""
    return (root / "pyproject.toml").is_file() and (root / "matrix.yaml").is_file()


CHECKOUT = is_checkout()
# Where the default matrix, matrices/ and dockerfiles/ are read from.
DATA_ROOT = CODE_ROOT if CHECKOUT else PACKAGED


class CacheError(OSError):
    """A cache folder stackprobe would run code from is not the user's alone, or holds a link where the code
    goes: one line (:meth:`line`) naming the folder and what to do."""

    def __init__(self, folder: Path, problem: str, remedy: str):
        self.folder, self.problem, self.remedy = folder, problem, remedy
        super().__init__(self.line())

    def line(self) -> str:
        return f"{folder_shown(self.folder)}: {self.problem}; {self.remedy}"

    def __str__(self) -> str:
        return self.line()


def folder_shown(folder: Path) -> str:
    return str(folder).replace(str(Path.home()), "~", 1) if str(folder).startswith(str(Path.home())) else str(folder)


def user_cache_root(env: Mapping[str, str] | None = None) -> Path:
    """The installed wheel's cache folder: ``$XDG_CACHE_HOME/stackprobe`` (an absolute XDG_CACHE_HOME only, as the
    XDG rules say), else ``~/.cache/stackprobe``."""
    base = (os.environ if env is None else env).get("XDG_CACHE_HOME", "")
    return (Path(base) if os.path.isabs(base) else Path.home() / ".cache") / "stackprobe"


# Where results/, docs/, envs/ and .cache/ go by default: the checkout, or the folder the command started in.
WORK_ROOT = CODE_ROOT if CHECKOUT else Path.cwd().resolve()
# What the working folder keeps of ours: the probes' code copy (checked file by file before each use, see
# in_env_root) and the Slurm jobs' folders, both read by compute nodes through the shared file system.
WORK_CACHE = WORK_ROOT / ".cache"
# Every cache whose content runs or is loaded (built kernels, JIT libraries, bytecode, venv cells, wheels): a
# checkout keeps them in itself, as trusted as its code; an installed wheel in a folder of the user's alone
# (user_cache_root, checked by check_private at each command's start), never in the folder a command starts in,
# which anyone may have filled (a shared folder, a cloned repository that carries a .cache/).
CACHE_ROOT = WORK_CACHE if CHECKOUT else user_cache_root()


def private_problem(folder: Path, uid: int | None = None) -> str | None:
    """Why ``folder`` is not a folder of this user's alone (a link, not a folder, another user's, writable by
    the group or others, or under a folder others may rename it in); None when it is (or does not exist yet)."""
    uid = os.getuid() if uid is None else uid
    try:
        st = folder.lstat()
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    if stat.S_ISLNK(st.st_mode):
        return "is a link"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a folder"
    if st.st_uid != uid:
        return f"belongs to another user (uid {st.st_uid})"
    if st.st_mode & 0o022:
        return f"others may write it (mode {stat.S_IMODE(st.st_mode):o})"
    try:
        up = folder.parent.stat()
    except OSError as exc:
        return f"its parent cannot be read ({exc.strerror})"
    # the parent: the user's or root's, and not open to every user (a group-writable ~/.cache of a user's own
    # group, as umask 002 makes it, is common and stays accepted)
    if up.st_uid not in (uid, 0) or (up.st_mode & 0o002 and not up.st_mode & stat.S_ISVTX):
        return "its parent folder lets others rename it"
    return None


def check_private(root: Path = CACHE_ROOT, checkout: bool = CHECKOUT) -> str | None:
    """For an installed wheel: make the cache folder (mode 0700) and say in one line why it cannot be used, or
    None. A checkout's caches are its own (None)."""
    if checkout:
        return None
    why = private_problem(root)
    if why is None:
        try:
            root.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            return f"{folder_shown(root)}: the cache folder cannot be made ({exc.strerror}); set XDG_CACHE_HOME " \
                   "to a folder of yours"
        why = private_problem(root)
    if why:
        return f"{folder_shown(root)}: {why}; stackprobe runs code it keeps there only from a folder of this " \
               "user's alone: remove it, or set XDG_CACHE_HOME to a folder of yours (mode 700)"
    return None


# --- the probes' copy of the in-environment package (an installed wheel) --------------------------------------
def _package_files(source: Path) -> dict[str, bytes]:
    """Every file of the in-environment package as installed (relative path -> bytes), bytecode left out."""
    return {p.relative_to(source).as_posix(): p.read_bytes()
            for p in sorted(source.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}


def _digest(files: Mapping[str, bytes]) -> str:
    h = hashlib.sha256()
    for rel, data in sorted(files.items()):
        h.update(rel.encode() + b"\0" + hashlib.sha256(data).digest() + b"\0")
    return h.hexdigest()


def copy_problem(folder: Path, files: Mapping[str, bytes]) -> str | None:
    """Why ``folder/inenv`` is not exactly ``files``: the first entry that is a link or neither a folder nor a
    regular file, a file whose content digest differs, one missing, or one more (a module, a ``__pycache__``);
    None when it is. Nothing is followed: every entry is looked at with lstat and read with O_NOFOLLOW."""
    wanted = {rel: hashlib.sha256(data).hexdigest() for rel, data in files.items()}
    dirs = {"/".join(rel.split("/")[:i]) for rel in wanted for i in range(1, rel.count("/") + 1)}
    seen: set[str] = set()
    for top in (folder, folder / IN_ENV_PACKAGE):
        try:
            st = top.lstat()
        except OSError:
            return f"{top.name} is missing"
        if not stat.S_ISDIR(st.st_mode):
            return f"{top.name} is a link or not a folder"
    stack = [""]
    while stack:
        rel_dir = stack.pop()
        here = folder / IN_ENV_PACKAGE / rel_dir
        try:
            entries = list(os.scandir(here))
        except OSError as exc:
            return f"{rel_dir or '.'}: cannot be listed ({exc.strerror})"
        for e in entries:
            rel = f"{rel_dir}/{e.name}" if rel_dir else e.name
            if e.is_symlink():
                return f"{rel} is a link"
            if e.is_dir(follow_symlinks=False):
                if rel not in dirs:
                    return f"{rel} is not in the package"
                stack.append(rel)
            elif e.is_file(follow_symlinks=False):
                if rel not in wanted:
                    return f"{rel} is not in the package"
                if _file_digest(Path(e.path)) != wanted[rel]:
                    return f"{rel} differs from the package"
                seen.add(rel)
            else:
                return f"{rel} is not a regular file"
    missing = sorted(set(wanted) - seen)
    return f"{missing[0]} is missing" if missing else None


def _file_digest(path: Path) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return None
        return hashlib.sha256(f.read()).hexdigest()


def _write_copy(folder: Path, files: Mapping[str, bytes]) -> None:
    """Put a fresh copy of ``files`` at ``folder`` by renames: whatever stood there (a link, a changed copy) is
    moved aside first and removed after, so a reader sees the old entry, none, or the whole new copy."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".partial-", dir=folder.parent))
    try:
        for rel, data in files.items():
            dest = staging / IN_ENV_PACKAGE / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(data)
            dest.chmod(0o444)  # a copy the probes only read
        aside = atomic.set_aside(folder)
        if not atomic.publish_dir(staging, folder):
            return  # a concurrent run published one first: the caller checks it
        if aside is not None:
            if aside.is_symlink() or not aside.is_dir():
                aside.unlink()
            else:
                shutil.rmtree(aside, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def in_env_root(code_root: Path = CODE_ROOT, cache_root: Path = WORK_CACHE, checkout: bool = CHECKOUT) -> Path:
    """The folder to put on a probe process's PYTHONPATH so it imports ``inenv``.

    In a checkout, the checkout itself (as always). Installed, the site-packages folder would also put every
    host-side dependency of stackprobe (jinja2, rich, requests...) ahead of the target interpreter's own
    packages, changing the environment under test; so the ``inenv`` package alone is copied to
    ``.cache/code/<digest>/inenv`` under the working folder (where Slurm's compute nodes read it too), and that
    folder is what the processes see. Nothing is installed into the target interpreter.

    The working folder may be anyone's (a shared folder, a cloned repository carrying a ``.cache/``), so the
    folder's name is never taken for its content: before each use every file of the copy is compared by content
    digest with the installed package, with no link followed or accepted and no file more (a module, a
    ``__pycache__``), and a copy that differs is written again and swapped in whole. A ``.cache`` or
    ``.cache/code`` that is a link is refused (CacheError): a copy there could be changed after the check."""
    if checkout:
        return code_root
    files = _package_files(code_root / IN_ENV_PACKAGE)
    for parent in (cache_root, cache_root / "code"):
        if parent.is_symlink():
            raise CacheError(parent, "is a link", "stackprobe keeps the probes' code copy only in a folder of the "
                             "working folder itself: remove the link")
    folder = cache_root / "code" / _digest(files)[:16]
    for _ in range(3):
        if copy_problem(folder, files) is None:
            return folder
        _write_copy(folder, files)
    why = copy_problem(folder, files)
    if why is None:
        return folder
    raise CacheError(folder, f"the probes' code copy changes while it is written ({why})",
                     "run where no other process writes the working folder's .cache/")

"""Where stackprobe's files are: its code, the data it ships (the default matrix, the Dockerfile templates) and
the working folder that receives what it writes (results, tables, build records, caches).

Two ways to have stackprobe, one rule each:

- **a checkout** (the folder holding the packages also holds ``pyproject.toml`` and ``matrix.yaml``): data and
  writes are the checkout's own, so the README's commands write ``results/`` and ``docs/`` of the repository;
- **an installed wheel** (``uvx --from stackprobe-*.whl checks ...``): the data is the copy packaged under
  ``common/packaged/`` and everything written goes under the current folder, never into the install folder.

The choice is made once, when this module is imported. Standard library only.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
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
# Where results/, docs/, envs/ and .cache/ go by default: the checkout, or the folder the command started in.
WORK_ROOT = CODE_ROOT if CHECKOUT else Path.cwd().resolve()
CACHE_ROOT = WORK_ROOT / ".cache"


def in_env_root(code_root: Path = CODE_ROOT, cache_root: Path = CACHE_ROOT, checkout: bool = CHECKOUT) -> Path:
    """The folder to put on a probe process's PYTHONPATH so it imports ``inenv``.

    In a checkout, the checkout itself (as always). Installed, the site-packages folder would also put every
    host-side dependency of stackprobe (jinja2, rich, requests...) ahead of the target interpreter's own
    packages, changing the environment under test; so the ``inenv`` package alone is copied, once per content,
    to ``.cache/code/<digest>/inenv`` under the working folder, and that folder is what the processes see.
    Nothing is installed into the target interpreter."""
    if checkout:
        return code_root
    source = code_root / IN_ENV_PACKAGE
    files = sorted(p for p in source.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    h = hashlib.sha256()
    for p in files:
        h.update(p.relative_to(source).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    folder = cache_root / "code" / h.hexdigest()[:16]
    if (folder / IN_ENV_PACKAGE).is_dir():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".partial-", dir=folder.parent))
    try:
        shutil.copytree(source, staging / IN_ENV_PACKAGE, ignore=shutil.ignore_patterns("__pycache__"))
        for p in (staging / IN_ENV_PACKAGE).rglob("*.py"):  # a copy the probes only read
            p.chmod(0o444)
        atomic.publish_dir(staging, folder)  # whole or not at all; a concurrent run may have put it there first
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder

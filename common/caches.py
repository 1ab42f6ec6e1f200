"""Where runs keep what later runs reuse, on the host: the shared compile cache and the docker executor's
per-image bytecode folders. `checks run` writes them; `provision prune` measures and removes them."""

from __future__ import annotations

import errno
import os
from collections.abc import Mapping
from pathlib import Path

from common.home import CACHE_ROOT, CODE_ROOT
from inenv.kit import COMPILE_CACHE_ENV

__all__ = ["BYTECODE_ROOT", "CODE_ROOT", "DEFAULT_COMPILE_CACHE", "HOST_BYTECODE_ROOT", "bytecode_key",
           "compile_cache_dir"]
# Builds every cell and run share (the compile cache of inenv.kit); outside every image, kept between runs.
# Under the checkout, or under the current folder for an installed wheel (common.home).
DEFAULT_COMPILE_CACHE = CACHE_ROOT / "compile"
BYTECODE_ROOT = CACHE_ROOT / "pycache"  # per image: the bytecode its ranks compiled
HOST_BYTECODE_ROOT = CACHE_ROOT / "bytecode"  # the bytecode the ranks of local, venv and Slurm cells compiled


def bytecode_key(image_id: str) -> str:
    """The name of an image's folder under BYTECODE_ROOT (`provision prune` reads it back to find stale ones)."""
    return image_id.removeprefix("sha256:")[:16]


def compile_cache_dir(given: Path | None, off: bool, env: Mapping[str, str] | None = None) -> Path | None:
    """The host folder of the shared compile cache: ``--compile-cache``, else STACKPROBE_COMPILE_CACHE,
    else .cache/compile of the checkout (of the current folder for an installed wheel); None with
    ``--no-compile-cache``."""
    if off:
        return None
    named = (os.environ if env is None else env).get(COMPILE_CACHE_ENV)
    folder = (given or (Path(named) if named else DEFAULT_COMPILE_CACHE)).resolve()
    if folder.exists() and not folder.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "the compile cache is not a folder; give --compile-cache a folder "
                                 "(or --no-compile-cache)", str(folder))
    return folder

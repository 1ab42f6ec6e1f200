"""A `uv` for tests that reads the uv cache first: each call runs with UV_OFFLINE=1 and, when that fails, again
online, so only a success comes from the cache. (An offline miss does not always say so: with part of a
resolution's pages in the cache, uv reports an ordinary "No solution found".) uv revalidates every index page on every
resolve when the index gives pages no freshness lifetime, so without this a second run of a test that resolves
against the index downloads every page again; with it, a run whose pages and metadata are all in uv's cache
asks the index nothing. A call that fails for real (a test that expects uv to refuse) asks the index each
time. The pages a success resolves against are as old as the run that fetched them; where UV_OFFLINE is set
already (`UV_OFFLINE=0 uv run pytest ...`), that setting stands and nothing is tried from the cache first."""

from __future__ import annotations

import sys
from pathlib import Path

_SHIM = '''#!{python}
import os, subprocess, sys
REAL = {real!r}
argv = [REAL, *sys.argv[1:]]
if "UV_OFFLINE" in os.environ:
    os.execv(REAL, argv)
data = sys.stdin.buffer.read() if "-" in sys.argv[1:] else None
first = subprocess.run(argv, input=data, capture_output=True, env={{**os.environ, "UV_OFFLINE": "1"}})
if first.returncode != 0:
    sys.exit(subprocess.run(argv, input=data, env={{**os.environ, "UV_OFFLINE": "0"}}).returncode)
sys.stdout.buffer.write(first.stdout)
sys.stderr.buffer.write(first.stderr)
sys.exit(first.returncode)
'''


def cache_first_uv(folder: Path, real: str) -> Path:
    """An executable `uv` in `folder` that runs `real` cache first, as described above."""
    folder.mkdir(parents=True, exist_ok=True)
    shim = folder / "uv"
    shim.write_text(_SHIM.format(python=sys.executable, real=real))
    shim.chmod(0o755)
    return shim

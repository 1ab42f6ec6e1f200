"""The host tools under an interpreter that lacks the `uv` package (a GPU host's own Python, where uv is only a
binary on PATH): they start, and find uv on PATH."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# `import uv` raises ImportError when sys.modules maps the name to None, as on an interpreter without it.
NO_UV = "import sys, runpy; sys.modules['uv'] = None; "


def _python(code: str, path: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": path, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", NO_UV + code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


def test_provision_starts_without_the_uv_package(tmp_path: Path) -> None:
    proc = _python("sys.argv = ['provision', '--help']; runpy.run_module('provision.cli', run_name='__main__')",
                   os.environ.get("PATH", ""))
    assert proc.returncode == 0, proc.stderr
    assert "usage" in proc.stdout.lower()
    assert "Traceback" not in proc.stderr


def test_uv_is_taken_from_path_without_the_uv_package(tmp_path: Path) -> None:
    fake = tmp_path / "bin" / "uv"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'uv 0.0.1'\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    proc = _python("from provision import lock; print(lock.uv_bin()); print(lock.uv_version())", str(fake.parent))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [str(fake), "0.0.1"]
    # Neither on PATH nor importable: the bare name, so the call that runs it says uv is missing.
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = _python("from provision import lock; print(lock.uv_bin())", str(empty))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["uv"]

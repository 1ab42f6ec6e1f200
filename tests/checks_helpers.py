"""Helpers shared by the checks tests: run the real worker, find leftover processes by an env token."""

from __future__ import annotations

import atexit
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import uuid
from pathlib import Path
from typing import Any

from inenv.probe import RESULT_MARKER

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "probes_fixtures"
TOKEN_VAR = "STACKPROBE_TEST_TOKEN"


_COMMITTED: dict[str, Path] = {}


def benchmark(name: str) -> Any:
    """The module of ``benchmarks/<name>.py``, loaded from its file (the folder is no package) and entered in
    ``sys.modules`` under ``name``, so its dataclasses resolve their module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def committed(folder: str = "results") -> Path:
    """``folder`` of the checkout as its HEAD commit holds it, exported once per test process: tests read the
    committed results, never what a user's own runs of the main job added to the working tree. Outside a git
    checkout (an unpacked release) the working folder is what was shipped, and is copied as it is."""
    if folder in _COMMITTED:
        return _COMMITTED[folder]
    dest = Path(tempfile.mkdtemp(prefix="stackprobe-committed-"))
    atexit.register(shutil.rmtree, dest, True)
    try:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", "HEAD", folder], capture_output=True,
                                 check=True).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(dest, filter="data")
    except (OSError, subprocess.CalledProcessError, tarfile.TarError):
        shutil.copytree(ROOT / folder, dest / folder)
    _COMMITTED[folder] = dest / folder
    return dest / folder


def report_md(out: Path) -> str:
    """Every Markdown page `checks report --out OUT` wrote: the answer, its archive of the cells no matrix declares
    (a local environment's among them) and each host's page."""
    pages = [out, *out.parent.glob(f"{out.stem}-archive.md"), *sorted((out.parent / "hosts").glob("*.md"))]
    return "\n".join(p.read_text() for p in pages)


def fixture_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["STACKPROBE_PROBE_PATH"] = str(FIXTURES)
    env["PYTHONPATH"] = str(ROOT)
    env[TOKEN_VAR] = uuid.uuid4().hex
    env.update(extra)
    return env


def pids_with_env(needle: str) -> list[int]:
    """Live processes whose environment contains `needle` (e.g. a per-test token)."""
    found = []
    raw = needle.encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if raw in f.read():
                    with open(f"/proc/{entry}/stat") as s:
                        if s.read().split(") ", 1)[1].startswith("Z"):
                            continue  # a zombie holds nothing and will be reaped by its parent
                    found.append(int(entry))
        except OSError:
            continue
    return found


def run_worker(probe_id: str, ranks: int = 1, params: list[list[str]] | None = None, timeout: float = 120,
               env: dict[str, str] | None = None, extra_args: list[str] | None = None) -> tuple[dict[str, Any], str]:
    env = env or fixture_env()
    variant = {"probe_id": probe_id, "ranks": ranks, "params": params or [], "share_gpu": False}
    cmd = [sys.executable, "-m", "inenv.worker", "--probe", probe_id, "--variant", json.dumps(variant)]
    proc = subprocess.run(cmd + (extra_args or []), capture_output=True, text=True, env=env, timeout=timeout,
                          cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_MARKER)]
    assert proc.returncode == 0, proc.stderr
    assert len(lines) == 1, f"expected one result line, got stdout={proc.stdout[:500]!r}"
    return json.loads(lines[0][len(RESULT_MARKER):]), env[TOKEN_VAR]

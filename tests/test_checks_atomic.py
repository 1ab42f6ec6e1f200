"""The one atomic writer: whole old or whole new content under a real SIGKILL, standard library only."""

from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from inenv import atomic
from tests.checks_helpers import ROOT

WRITER = """
import sys
from pathlib import Path
from inenv import atomic
path, size = Path(sys.argv[1]), int(sys.argv[2])
i = 0
while True:
    atomic.write_bytes(path, bytes([65 + i % 2]) * size)
    i += 1
    if i == 3:
        print("going", flush=True)
"""


def test_sigkill_mid_write_leaves_the_old_or_the_new_content(tmp_path: Path) -> None:
    path, size = tmp_path / "f.bin", 8 << 20  # 8 MiB: each write takes long enough to be killed inside it
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(path), str(size)], cwd=ROOT, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout is not None and proc.stdout.readline() == "going\n"
    time.sleep(0.15)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    data = path.read_bytes()
    assert len(data) == size and data in (b"A" * size, b"B" * size)


def test_permissions_are_those_of_a_plain_file_or_kept(tmp_path: Path) -> None:
    new = tmp_path / "sub" / "new.json"
    atomic.write_json(new, {"b": 1, "a": [1, 2]})
    assert new.read_text() == '{\n  "a": [\n    1,\n    2\n  ],\n  "b": 1\n}\n'
    assert new.stat().st_mode & 0o777 == atomic.new_file_mode()  # not mkstemp's 0600
    secret = tmp_path / "secret.txt"
    secret.write_text("old")
    secret.chmod(0o600)
    atomic.write_text(secret, "new")
    assert secret.read_text() == "new" and secret.stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["secret.txt", "sub"]  # no temporary file left


def test_a_failed_write_keeps_the_old_file_and_leaves_nothing(tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    atomic.write_json(path, {"ok": True}, indent=None)
    assert path.read_text() == '{"ok": true}\n'
    with pytest.raises(ValueError):
        atomic.write_json(path, {"loop": _circular()})
    assert json.loads(path.read_text()) == {"ok": True}
    assert [p.name for p in tmp_path.iterdir()] == ["m.json"]


def _circular() -> list:
    loop: list = []
    loop.append(loop)
    return loop


def test_replace_dir_swaps_whole_folders(tmp_path: Path) -> None:
    target = tmp_path / "cell"
    atomic.replace_dir(target, {"a": "1", "b": "2"})
    (target / "build.json").write_text("{}")
    atomic.replace_dir(target, {"a": "3"}, keep=("build.json",))
    assert sorted(p.name for p in target.iterdir()) == ["a", "build.json"] and (target / "a").read_text() == "3"
    assert [p.name for p in tmp_path.iterdir()] == ["cell"]


def test_standard_library_only() -> None:
    """The ranks import it inside cell environments, which hold only the libraries under test."""
    tree = ast.parse((ROOT / "inenv" / "atomic.py").read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported and imported <= set(sys.stdlib_module_names) | {"__future__"}


def test_every_writer_uses_it() -> None:
    """No other module of the host or the environment side renames files into place itself."""
    offenders = [str(p.relative_to(ROOT)) for d in ("checks", "provision", "inenv", "common")
                 for p in (ROOT / d).rglob("*.py")
                 if p.name != "atomic.py" and ("os.replace(" in p.read_text() or "mkstemp(" in p.read_text())]
    assert offenders == []

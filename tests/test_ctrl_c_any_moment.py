"""Ctrl-C at any moment of a command, from the console scripts a user runs: exit 130 (or the command had
finished: 0), at most one line saying it was interrupted, never a traceback. The moments swept start once the
interpreter's own start-up is over (the first tens of milliseconds, before any stackprobe code runs: an
interrupt there is Python's, reported as death by SIGINT, which a shell shows as 130 too)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.checks_helpers import ROOT

BIN = Path(sys.executable).parent
MOMENTS_S = (0.05, 0.1, 0.2, 0.35, 0.6, 1.0, 1.6)


def _commands(tmp: Path) -> dict[str, list[str]]:
    fixed = str(ROOT / "tests" / "golden" / "advise" / "results")  # results of the tests' own, not the working ones
    return {
        "checks report": ["checks", "report", "--results", fixed, "--out", str(tmp / "table.md")],
        "checks advise": ["checks", "advise", "--results", fixed],
        "checks validate": ["checks", "validate", fixed],
        "checks run": ["checks", "run", "--backend", "local", "--probe", "inventory", "--results", str(tmp / "r")],
        "provision plan": ["provision", "plan", "--no-reach-check"],
    }


@pytest.mark.parametrize("name", ["checks report", "checks advise", "checks validate", "checks run",
                                  "provision plan"])
def test_ctrl_c_at_any_moment_is_one_line_and_exit_130(tmp_path: Path, name: str) -> None:
    cmd = _commands(tmp_path)[name]
    exe = BIN / cmd[0]
    if not exe.exists():
        pytest.fail(f"{exe} is missing: `uv sync` installs the console scripts")
    interrupted = 0
    for moment in MOMENTS_S:
        proc = subprocess.Popen([str(exe), *cmd[1:]], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        time.sleep(moment)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=300)
        said = [ln for ln in err.splitlines() if "interrupted" in ln]
        assert "Traceback" not in err and "Exception ignored" not in err, (moment, err[-2000:])
        assert proc.returncode in (0, 130, -signal.SIGINT), (moment, proc.returncode, err[-2000:])
        if proc.returncode == 130:
            interrupted += 1
            assert len(said) == 1, (moment, err[-2000:])
        else:
            assert len(said) <= 1, (moment, err[-2000:])
    assert interrupted >= 2  # the sweep reached the command itself, not only its end


def test_ctrl_c_while_the_interpreter_joins_a_pool_ends_by_the_signal(tmp_path: Path) -> None:
    """A command that returned while a thread pool's worker still runs: the interpreter's shutdown joins it, and a
    Ctrl-C there ends the process by SIGINT, with nothing printed about an ignored exception."""
    (tmp_path / "pool_left_running.py").write_text(
        "import time\nfrom concurrent.futures import ThreadPoolExecutor\n\n"
        "def main():\n"
        "    ThreadPoolExecutor(1).submit(time.sleep, 5)\n"
        "    print('returned', flush=True)\n"
        "    return 0\n")
    script = "import sys\nfrom common.entry import _run\nsys.exit(_run('checks', 'pool_left_running'))\n"
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"})
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "returned"
    time.sleep(0.5)  # main has returned: the interpreter is in its shutdown, joining the sleeping worker
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert "Exception ignored" not in err and "Traceback" not in err, err
    assert proc.returncode == -signal.SIGINT, (proc.returncode, err)

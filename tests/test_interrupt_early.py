"""Ctrl-C at any instant of `checks report` and `checks advise`, from the first milliseconds (while the command
modules are still being imported) to the end: exit 130 with one line, or the command's own result if it had
finished; never a traceback. A signal that comes while the interpreter itself is starting ends it as SIGINT
does any program (the shell shows 130), before anything ran or printed, and so does one that comes while it
shuts down after the command returned; the delays start after the interpreter's start."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.checks_helpers import committed

SCRIPT = Path(sys.executable).parent / "checks"
# From 0.15 s: the interpreter's own start (20-60 ms here, by load) is before any program's code can act
DELAYS_S = (0.15, 0.2, 0.3, 0.45, 0.65, 0.9, 1.3)


@pytest.mark.skipif(not SCRIPT.exists(), reason="the checks console script is not installed in this environment")
@pytest.mark.parametrize("cmd", ["report", "advise"])
def test_ctrl_c_at_any_moment_is_one_line_and_130(cmd: str, tmp_path: Path) -> None:
    args = {"report": ["report", "--results", str(committed()), "--out", str(tmp_path / "t.md")],
            "advise": ["advise", "--results", str(committed())]}[cmd]
    interrupted = 0
    for delay in DELAYS_S:
        p = subprocess.Popen([str(SCRIPT), *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        time.sleep(delay)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=120)
        assert "Traceback" not in err, (delay, err[-2000:])
        if p.returncode == -signal.SIGINT:  # while the interpreter started or shut down: SIGINT's own ending
            continue
        if p.returncode == 130:
            interrupted += 1
            lines = [ln for ln in err.splitlines() if ln.strip()]
            assert lines[-1].endswith("interrupted") and sum("interrupted" in ln for ln in lines) == 1, (delay, err)
        else:
            assert p.returncode == 0, (delay, p.returncode, err[-2000:])
    assert interrupted >= 2  # the early signals land while the command is still starting

"""inenv.forked: when ranks may be forked from the serving worker, and what a forked rank is to its worker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from inenv import forked
from tests.checks_helpers import ROOT


def _prepared(code: str) -> str:
    """What inenv.forked.prepare says in a fresh interpreter after ``code`` (this test process may hold threads of
    its own: pytest's workers)."""
    script = f"import threading\nfrom inenv import forked\n{code}\nprint(repr(forked.prepare(())))"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_a_python_thread_beside_the_main_one_refuses_forking() -> None:
    assert _prepared("") == "''"
    started = "threading.Thread(target=threading.Event().wait, daemon=True).start()"
    assert _prepared(started) == "'the serving worker runs 2 Python threads'"


def test_a_forked_process_reads_as_popen_does() -> None:
    pid = os.fork()
    if pid == 0:
        time.sleep(30)
        os._exit(0)
    read, write = os.pipe()
    os.close(read)
    proc = forked.Forked(pid, os.fdopen(write, "wb"))
    assert proc.poll() is None
    proc.kill()
    assert proc.wait(timeout=10) == -signal.SIGKILL and proc.returncode == -signal.SIGKILL
    proc.send_signal(signal.SIGTERM)  # ended: nothing to signal, no error
    pid = os.fork()
    if pid == 0:
        os._exit(3)
    read, write = os.pipe()
    os.close(read)
    assert forked.Forked(pid, os.fdopen(write, "wb")).wait(timeout=10) == 3

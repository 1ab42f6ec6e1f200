"""inenv.forked: when ranks may be forked from the serving worker, and what a forked rank is to its worker."""

from __future__ import annotations

import os
import signal
import threading
import time

from inenv import forked


def test_a_python_thread_beside_the_main_one_refuses_forking() -> None:
    assert forked.prepare(()) == ""
    stop = threading.Event()
    th = threading.Thread(target=stop.wait, daemon=True)
    th.start()
    try:
        assert forked.prepare(()) == "the serving worker runs 2 Python threads"
    finally:
        stop.set()
        th.join()


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

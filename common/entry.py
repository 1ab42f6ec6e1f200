"""The console scripts `checks` and `provision`: Ctrl-C from the first instant ends them with one line and exit
code 130. The command-line modules take a while to import (rich, the report, the registry), and an interrupt
during an import would otherwise end in a traceback; until the command's own handling is in place, an
interrupt here says so and exits, having written nothing."""

from __future__ import annotations

import os  # loaded with the interpreter already: importing them costs nothing, so no interrupt lands here
import sys

INTERRUPTED = 130

try:
    import contextlib
    import importlib
    import signal
    from collections.abc import Callable
    from types import FrameType

    from common import home
except KeyboardInterrupt:  # Ctrl-C before any handler could be set
    os.write(2, f"{os.path.basename(sys.argv[0])}: interrupted\n".encode())
    os._exit(INTERRUPTED)


def _stop(name: str) -> Callable[[int, FrameType | None], None]:
    def stop(signum: int, frame: FrameType | None) -> None:
        sys.stderr.write(f"{name}: interrupted\n")
        sys.stderr.flush()
        os._exit(INTERRUPTED)  # nothing is open yet: no cleanup to run

    return stop


def _run(name: str, module: str) -> int:
    previous = signal.signal(signal.SIGINT, _stop(name))
    if previous is not signal.SIG_IGN:  # the package's early handler (common/__init__.py) or Python's own
        previous = signal.default_int_handler
    try:
        main = importlib.import_module(module).main
    finally:
        signal.signal(signal.SIGINT, previous)  # the command handles Ctrl-C itself from here on
    problem = home.check_private()  # an installed wheel's cache folder: the user's alone, or no command runs
    if problem:
        sys.stderr.write(f"{name}: {problem}\n")
        return 2
    try:
        return int(main())
    except KeyboardInterrupt:  # between the handlers: the command's own catch was not yet reached
        sys.stderr.write(f"{name}: interrupted\n")
        return INTERRUPTED
    finally:
        _quiet_exit()


def _quiet_exit() -> None:
    """The command is over: what it printed goes out now, and a Ctrl-C during the interpreter's shutdown (joining
    a thread pool's workers, atexit hooks) ends the process by the signal itself, as a shell reports it, instead
    of a KeyboardInterrupt raised inside those hooks and printed as an ignored exception."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the flush is not cut short by an interrupt raised inside it
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe or stream: nothing more can reach it
            stream.flush()
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def checks() -> int:
    return _run("checks", "checks.cli")


def provision() -> int:
    return _run("provision", "provision.cli")

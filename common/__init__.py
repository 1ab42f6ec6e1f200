"""What provision and checks share on the host.

Cell ids, the matrix and catalog, resolution, the reason catalogue, progress.

Importing this package is the first thing the `checks` and `provision` console scripts do, so when it runs as
one of them (and Ctrl-C is not ignored) it makes Ctrl-C end the process at once with one line and exit code
130 until common.entry hands Ctrl-C to the command: an interrupt while the import system is still loading
the command would otherwise print a traceback. ``_signal`` is the interpreter's own, already loaded.
"""

import sys as _sys

if _sys.argv and _sys.argv[0].rsplit("/", 1)[-1] in ("checks", "provision"):
    import _signal

    def _early_interrupt(signum: int, frame: object) -> None:
        import os

        os.write(2, f"{_sys.argv[0].rsplit('/', 1)[-1]}: interrupted\n".encode())
        os._exit(130)

    if _signal.getsignal(_signal.SIGINT) is _signal.default_int_handler:
        _signal.signal(_signal.SIGINT, _early_interrupt)

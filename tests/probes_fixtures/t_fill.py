"""Fills the file system at STACKPROBE_TEST_FILL (when set) until it is full, then passes: the result that
follows finds no room in the store."""

import os

from inenv.probe import ProbeSpec, RankContext, outcome

SPEC = ProbeSpec(id="t-fill", title="fill the disk", feature="a full disk under the store", ranks=(1,),
                 needs_gpu=False, timeout_s=60)


def run(ctx: RankContext) -> dict:
    path = os.environ.get("STACKPROBE_TEST_FILL")
    if path:
        try:
            with open(path, "ab") as f:
                while True:
                    f.write(b"\0" * 4096)
                    f.flush()
        except OSError:
            pass
    return outcome("pass")

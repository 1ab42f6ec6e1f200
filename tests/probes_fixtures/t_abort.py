"""What a CUDA runtime abort looks like from outside: the C++ message on stderr, then SIGABRT."""

import os
import sys

from inenv.probe import ProbeSpec, RankContext, outcome

SPEC = ProbeSpec(id="t-abort", title="abort", feature="crash classification", ranks=(1,), needs_gpu=False,
                 timeout_s=30)


def run(ctx: RankContext) -> dict:
    sys.stderr.write("terminate called after throwing an instance of 'c10::Error'\n"
                     "  what():  CUDA error: an illegal memory access was encountered\n")
    sys.stderr.flush()
    os.abort()
    return outcome("pass")

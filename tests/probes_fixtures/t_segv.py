"""A real segmentation fault in rank 0 (a NULL read through ctypes)."""

import ctypes

from inenv.probe import ProbeSpec, RankContext, outcome

SPEC = ProbeSpec(id="t-segv", title="segfault", feature="crash classification", ranks=(1,), needs_gpu=False,
                 timeout_s=30)


def run(ctx: RankContext) -> dict:
    ctypes.string_at(0)
    return outcome("pass")

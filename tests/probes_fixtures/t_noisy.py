"""Writes about 64 MB to stdout and stderr, then passes: pipes must not deadlock, logs stay bounded."""

import os

from inenv.probe import ProbeSpec, RankContext, outcome

SPEC = ProbeSpec(id="t-noisy", title="noisy", feature="output handling", ranks=(2,), needs_gpu=False, timeout_s=60)


def run(ctx: RankContext) -> dict:
    line = b"x" * 1023 + b"\n"
    block = line * 1024
    for _ in range(32):
        os.write(1, block)
        os.write(2, block)
    os.write(2, b"noisy-done\n")
    return outcome("pass")

"""Reports how this rank's Python keeps bytecode: the prefix folder and whether it may write at all."""

import sys

from inenv.probe import ProbeSpec, RankContext, outcome

SPEC = ProbeSpec(id="t-env-report", title="rank environment", feature="bytecode cache", ranks=(1,), needs_gpu=False,
                 timeout_s=60)


def run(ctx: RankContext) -> dict:
    return outcome("pass", evidence={"pycache_prefix": sys.pycache_prefix,
                                     "dont_write_bytecode": bool(sys.flags.dont_write_bytecode)})

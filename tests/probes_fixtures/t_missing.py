"""Requires a package no environment has."""

from inenv.probe import ProbeSpec, RankContext, outcome

SPEC = ProbeSpec(id="t-missing", title="missing", feature="skip rules", needs_gpu=False,
                 requires=("stackprobe_no_such_module",), timeout_s=30)


def run(ctx: RankContext) -> dict:
    return outcome("pass")

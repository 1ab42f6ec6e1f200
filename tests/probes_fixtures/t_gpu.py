"""Needs a GPU and a module that is never installed: must be `skip` without launching anything."""

from checks.probe import ProbeSpec, RankContext, outcome

SPEC = ProbeSpec(id="t-gpu", title="gpu", feature="skip rules", ranks=(1, 2), requires=("torch",), timeout_s=30)


def run(ctx: RankContext) -> dict:
    return outcome("pass")

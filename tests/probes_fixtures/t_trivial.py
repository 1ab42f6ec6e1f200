"""Does nothing and passes: measures the harness itself."""

from inenv.probe import ProbeSpec, RankContext, outcome

SPEC = ProbeSpec(id="t-trivial", title="trivial", feature="harness overhead", ranks=(1, 2), needs_gpu=False,
                 timeout_s=60)


def run(ctx: RankContext) -> dict:
    return outcome("pass", metrics={"rank": ctx.rank, "world": ctx.world_size})

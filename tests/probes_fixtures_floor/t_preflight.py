"""A probe that can tell some variants' verdicts before launch: mode=decided is `skip` from preflight, mode=broken
has a preflight that raises (the ranks then decide), any other mode launches and passes."""

from inenv.probe import ProbeSpec, RankContext, Variant, outcome

SPEC = ProbeSpec(id="t-preflight", title="preflight", feature="verdicts without launching", ranks=(2,),
                 needs_gpu=False, timeout_s=60)


def preflight(variant: Variant) -> dict | None:
    mode = variant.param("mode")
    if mode == "decided":
        return outcome("skip", "decided from the files", "probe-api-unknown", evidence={"looked_for": ["x:y"]})
    if mode == "broken":
        raise OSError("cannot read the package")
    return None


def run(ctx: RankContext) -> dict:
    return outcome("pass", metrics={"rank": ctx.rank})

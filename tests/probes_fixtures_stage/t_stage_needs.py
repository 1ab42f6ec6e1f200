"""Passes, naming the flashinfer module its variant declares it loads (nothing is loaded: the host's plan is what
is tested)."""

from inenv.probe import HostView, ProbeSpec, RankContext, Variant, outcome

MODULES = ("trtllm_comm", "vllm_comm")

SPEC = ProbeSpec(id="t-stage-needs", title="stage needs", feature="a variant per module it loads", ranks=(1,),
                 needs_gpu=False, timeout_s=60, loads=tuple(("module", m, (m,)) for m in MODULES))


def variants(host: HostView) -> list[Variant]:
    return [Variant("t-stage-needs", 1, (("module", m),)) for m in MODULES]


def run(ctx: RankContext) -> dict:
    return outcome("pass", metrics={"module": ctx.variant.param("module")})

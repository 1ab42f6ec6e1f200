"""Raises the error flashinfer <= 0.6.16 raises on SM120: the catalogue must recognise it."""

from inenv.probe import ProbeSpec, RankContext

SPEC = ProbeSpec(id="t-raise", title="raise", feature="failure classification", ranks=(1,), needs_gpu=False,
                 timeout_s=30)


def run(ctx: RankContext) -> dict:
    raise RuntimeError("No supported CUDA architectures found for major versions [9, 10].")

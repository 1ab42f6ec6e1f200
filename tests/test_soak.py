"""`checks run --soak MIN`: the load probe's variants replay MIN minutes each, run again whatever this host
recorded, may take that much longer, and the plan counts it; nothing else changes."""

from __future__ import annotations

import pytest

from checks.results.provenance import Checkout
from checks.run import session
from checks.run.options import RunOptions, UsageError
from checks.run.plan import CellTarget, WorkItem
from checks.run.runner import level_variant
from inenv.probe import ProbeSpec, Variant

CELL = CellTarget("cell", "resolved")
LOAD = ProbeSpec("load", "l", "f", ranks=(2,), min_ranks=2, distinct_gpus=False, sustained=True)
STEP = ProbeSpec("step", "s", "f", ranks=(2,), min_ranks=2, distinct_gpus=False)


def items() -> list[WorkItem]:
    load = WorkItem(CELL, LOAD, Variant("load", 2, (("backend", "nccl"),)), 300.0, reused="r1")
    step = WorkItem(CELL, STEP, Variant("step", 2, (("backend", "nccl"),)), 900.0, reused="r1")
    return [load, step]


def test_the_ranks_of_a_load_variant_are_told_how_long_to_replay_and_no_other() -> None:
    load, step = items()
    assert level_variant(load, "full", 120.0).params == (("backend", "nccl"), ("env.STACKPROBE_SOAK_S", "120"))
    assert level_variant(step, "full", 120.0) == step.variant
    assert level_variant(load, "full", None) == load.variant


def test_a_soak_reruns_the_load_variants_and_gives_them_the_time() -> None:
    planned = session.Planned(items(), {}, Checkout("0", "unknown", None), {}, {})
    soaked = session.soaked(RunOptions(soak_s=600.0), planned).items
    assert [(it.reused, it.timeout_s) for it in soaked] == [(None, 900.0), ("r1", 900.0)]
    assert session.soaked(RunOptions(), planned).items == planned.items


@pytest.mark.parametrize("soak, level, why", [
    (0.0, None, "--soak 0: give the minutes"), (-60.0, None, "--soak -1: give the minutes"),
    (600.0, "quick", "--soak replays the load probe's variants, which the quick level does not run")])
def test_a_soak_that_cannot_be_is_refused(soak: float, level: str | None, why: str) -> None:
    with pytest.raises(UsageError, match=why):
        RunOptions(soak_s=soak, level=level).check()

"""The order parallel image builders take the cells in: the torch builds first, one cell of each."""

from __future__ import annotations

from pathlib import Path

from provision.build import spread
from provision.buildprogress import Step


def _step(cid: str, torch_lock: str) -> Step:
    return Step(folder=Path(cid), cell={"cell_id": cid, "torch_lock": torch_lock}, previous={}, base=None,
                dockerfile=Path(f"{cid}.Dockerfile"), tag=f"stackprobe/{cid}:x", inputs={})


def _key(s: Step) -> str:
    return s.cell["torch_lock"]


def test_one_cell_of_each_torch_build_before_the_second_of_any() -> None:
    steps = [_step("a1", "A"), _step("a2", "A"), _step("b1", "B"), _step("a3", "A"), _step("c1", "C"),
             _step("b2", "B")]
    assert [s.cell_id for s in spread(steps, _key)] == ["a1", "b1", "c1", "a2", "b2", "a3"]


def test_nothing_lost_or_repeated_and_one_build_keeps_its_order() -> None:
    steps = [_step(f"x{i}", "X") for i in range(4)]
    assert [s.cell_id for s in spread(steps, _key)] == ["x0", "x1", "x2", "x3"]
    assert spread([], _key) == []

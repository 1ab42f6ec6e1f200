"""NCCL as a matrix axis: `nccl: [pinned, "2.32.6"]` doubles the cells, the other NCCL wheel goes beside the
same torch with an override of torch's own pin, and its cells share their torch build's layer (the NCCL wheel is
swapped in the cell's last layer)."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from common.api import DEFAULT_MATRIX
from common.catalog import load as load_catalog
from common.cellid import CellId, parse
from common.errors import InputError
from common.matrix import load
from common.resolve import cell_id, resolve
from provision.lock import overridden, torch_key, torch_lock_differences, torch_requirements
from tests.checks_helpers import ROOT

MATRIX = """
matrix:
  cuda: ["13.0", "12.8"]
  torch: [stable]
  sgl_kernel: [none]
  flashinfer: [none]
  nccl: [pinned, "2.32.6"]
  exclude:
    - {cuda: "12.8", nccl: "2.32.6"}
"""


def _matrix(tmp_path: Path, text: str = MATRIX) -> Path:
    path = tmp_path / "m.yaml"
    path.write_text(text)
    return path


def test_the_nccl_axis_expands_and_names_its_cells(tmp_path: Path) -> None:
    catalog = load_catalog()
    cells = load(_matrix(tmp_path)).cells
    # worked out by hand: 2 CUDA x 2 NCCL values, minus the excluded CUDA 12.8 one; the newest torch (no
    # sgl-kernel) is 2.15.0, whose CUDA 13.0 build is on the PyTorch index and 12.8 build is not published
    assert [cell_id(c, catalog) for c in cells] == [
        "cu130-torch2.15.0-sglnone-finone", "cu130-torch2.15.0-sglnone-finone-nccl2.32.6",
        "cu128-torch2.15.0-sglnone-finone"]


def test_the_default_matrix_has_the_newest_stack_and_its_nccl_twin() -> None:
    """Every default cell keeps torch's own NCCL but one: the newest stack's twin, which differs from it in the NCCL
    release alone (the same CUDA, torch and flashinfer, no sgl-kernel), so the page shows one stack on both."""
    catalog = load_catalog()
    cells = load(DEFAULT_MATRIX).cells
    twins = [c for c in cells if c.nccl != "pinned"]
    assert [(c.cuda, c.torch, c.sgl_kernel, c.flashinfer, c.nccl) for c in twins] == [
        ("13.2", "stable", "none", "0.7.4", "2.32.6")]
    [twin] = twins
    base = [c for c in cells if c == dataclasses.replace(twin, nccl="pinned")]
    assert len(base) == 1
    assert cell_id(base[0], catalog) == "cu132-torch2.15.0-sglnone-fi0.7.4"
    assert cell_id(twin, catalog) == "cu132-torch2.15.0-sglnone-fi0.7.4-nccl2.32.6"
    pinned, other = resolve(base[0], catalog), resolve(twin, catalog)
    assert [s.requirement for s in other.sources] == ["torch==2.15.0", "flashinfer-python==0.7.4",
                                                      "nvidia-nccl-cu13==2.32.6"]
    assert [s.requirement for s in pinned.sources] == ["torch==2.15.0", "flashinfer-python==0.7.4"]
    assert other.overrides == ("nvidia-nccl-cu13==2.32.6",) and pinned.overrides == ()


def test_the_twins_committed_locks_differ_in_nccl_and_agree_on_torch_and_flashinfer() -> None:
    """`provision lock` of both cells: the twin's lock holds NCCL 2.32.6 where the newest stack's holds the 2.30.7
    torch 2.15.0 pins, and both hold the same torch, flashinfer and apache-tvm-ffi."""
    def pins(cid: str) -> dict[str, str]:
        text = (ROOT / "envs" / cid / "requirements.lock").read_text()
        return dict(re.findall(r"^([A-Za-z0-9_.-]+)==([^ ;\\]+)", text, re.M))

    base, twin = pins("cu132-torch2.15.0-sglnone-fi0.7.4"), pins("cu132-torch2.15.0-sglnone-fi0.7.4-nccl2.32.6")
    assert (base["nvidia-nccl-cu13"], twin["nvidia-nccl-cu13"]) == ("2.30.7", "2.32.6")
    for package in ("torch", "flashinfer-python", "apache-tvm-ffi"):
        assert base[package] == twin[package], package


def test_a_bad_nccl_value_is_one_line_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(InputError) as e:
        load(_matrix(tmp_path, MATRIX.replace('"2.32.6"]', '"newest"]')))
    assert "matrix.nccl[1]" in e.value.one_line() and "newest" in e.value.one_line()


def test_the_cell_id_carries_the_nccl_release_and_reads_back() -> None:
    cid = CellId("cu130", "2.14.1", "0.4.10", "none", engine="sglang0.5.23", nccl="2.32.6")
    assert str(cid) == "cu130-torch2.14.1-sgl0.4.10-finone-sglang0.5.23-nccl2.32.6"
    assert parse(str(cid)) == cid and parse("cu130-torch2.14.1-sgl0.4.10-finone").nccl == ""


def test_the_other_nccl_goes_beside_torch_with_an_override_and_shares_the_torch_layer(tmp_path: Path) -> None:
    catalog = load_catalog()
    text = ('matrix: {cuda: ["13.0"], torch: ["2.14.1"], sgl_kernel: [none], flashinfer: [none], '
            'nccl: [pinned, "2.32.6"]}\n')
    pinned, other = (resolve(c, catalog) for c in load(_matrix(tmp_path, text)).cells)
    assert [s.requirement for s in other.sources] == ["torch==2.14.1", "nvidia-nccl-cu13==2.32.6"]
    assert other.overrides == ("nvidia-nccl-cu13==2.32.6",) and pinned.overrides == ()
    assert overridden(other) == {"nvidia-nccl-cu13"} and overridden(pinned) == frozenset()
    assert "nccl" not in torch_requirements(other)
    assert torch_key(other) == torch_key(pinned)
    twelve = load(_matrix(tmp_path, text.replace('"13.0"', '"12.9"').replace('"2.14.1"', '"2.13.0"'))).cells[1]
    assert [s.requirement for s in resolve(twelve, catalog).sources][-1] == "nvidia-nccl-cu12==2.32.6"


def test_the_twins_committed_torch_lock_is_its_base_cells_and_differs_from_its_lock_in_nccl_alone() -> None:
    """One torch layer for the newest stack and its twin: the same torch.lock, byte for byte, recorded under one
    key; the twin's full lock departs from it in the NCCL wheel only, which the check of a cell's lock against
    its torch build's pins lets through for that cell alone."""
    envs = ROOT / "envs"
    base, twin = envs / "cu132-torch2.15.0-sglnone-fi0.7.4", envs / "cu132-torch2.15.0-sglnone-fi0.7.4-nccl2.32.6"
    torch_lock = (base / "torch.lock").read_text()
    assert (twin / "torch.lock").read_text() == torch_lock
    assert "nvidia-nccl-cu13==2.30.7" in torch_lock
    meta = [json.loads((d / "cell.json").read_text())["torch_lock"] for d in (base, twin)]
    assert meta[0] == meta[1]
    lock = (twin / "requirements.lock").read_text()
    assert torch_lock_differences(torch_lock, lock, frozenset({"nvidia-nccl-cu13"})) == []
    assert torch_lock_differences(torch_lock, lock) == ["nvidia-nccl-cu13 2.32.6 (torch.lock: 2.30.7)"]

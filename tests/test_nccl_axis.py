"""NCCL as a matrix axis: `nccl: [pinned, "2.32.6"]` doubles the cells, the other NCCL wheel goes beside the
same torch with an override of torch's own pin, and its cells get their own torch layer."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.api import DEFAULT_MATRIX
from common.catalog import load as load_catalog
from common.cellid import CellId, parse
from common.errors import InputError
from common.matrix import load
from common.resolve import cell_id, resolve
from provision.lock import torch_key, torch_overrides, torch_requirements

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


def test_a_matrix_without_the_axis_keeps_torchs_nccl() -> None:
    assert {c.nccl for c in load(DEFAULT_MATRIX).cells} == {"pinned"}


def test_a_bad_nccl_value_is_one_line_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(InputError) as e:
        load(_matrix(tmp_path, MATRIX.replace('"2.32.6"]', '"newest"]')))
    assert "matrix.nccl[1]" in e.value.one_line() and "newest" in e.value.one_line()


def test_the_cell_id_carries_the_nccl_release_and_reads_back() -> None:
    cid = CellId("cu130", "2.14.1", "0.4.10", "none", engine="sglang0.5.23", nccl="2.32.6")
    assert str(cid) == "cu130-torch2.14.1-sgl0.4.10-finone-sglang0.5.23-nccl2.32.6"
    assert parse(str(cid)) == cid and parse("cu130-torch2.14.1-sgl0.4.10-finone").nccl == ""


def test_the_other_nccl_goes_beside_torch_with_an_override_and_its_own_torch_layer(tmp_path: Path) -> None:
    catalog = load_catalog()
    text = ('matrix: {cuda: ["13.0"], torch: ["2.14.1"], sgl_kernel: [none], flashinfer: [none], '
            'nccl: [pinned, "2.32.6"]}\n')
    pinned, other = (resolve(c, catalog) for c in load(_matrix(tmp_path, text)).cells)
    assert [s.requirement for s in other.sources] == ["torch==2.14.1", "nvidia-nccl-cu13==2.32.6"]
    assert other.overrides == ("nvidia-nccl-cu13==2.32.6",) and pinned.overrides == ()
    assert torch_overrides(other) == other.overrides and torch_overrides(pinned) == ()
    assert "nvidia-nccl-cu13==2.32.6\n" in torch_requirements(other)
    assert torch_key(other) != torch_key(pinned)
    twelve = load(_matrix(tmp_path, text.replace('"13.0"', '"12.9"').replace('"2.14.1"', '"2.13.0"'))).cells[1]
    assert [s.requirement for s in resolve(twelve, catalog).sources][-1] == "nvidia-nccl-cu12==2.32.6"

"""Cell ids: one module builds and reads them; a --local cell names its toolkit."""

from __future__ import annotations

import pytest

from checks.run.plan import local_cell_id
from common import cellid
from common.cellid import CellId

ENV = {"torch": "2.11.0+cu130", "torch_cuda": "13.0", "flashinfer": "0.6.18", "python": "3.11.9"}


@pytest.mark.parametrize(
    ("versions", "want"),
    [
        ({**ENV, "nvcc": "13.0"}, "local-cu130-torch2.11.0-sglnone-fi0.6.18-nvcc13.0"),
        ({**ENV, "nvcc": "12.8"}, "local-cu130-torch2.11.0-sglnone-fi0.6.18-nvcc12.8"),
        (ENV, "local-cu130-torch2.11.0-sglnone-fi0.6.18-nonvcc"),
        ({"python": "3.12.1"}, "local-nocuda-notorch-sglnone-finone-nonvcc"),
    ],
)
def test_local_cells_with_another_toolkit_are_other_rows(versions: dict[str, str], want: str) -> None:
    assert local_cell_id(versions) == want


@pytest.mark.parametrize(
    "text",
    [
        "cu130-torch2.11.0-sgl0.4.2-fi0.6.8.post1",
        "cu128-torchnightly-sglnone-fi0.6.17",
        "cu130-torch2.13.0-sgl0.4.7-fi0.6.18-jitcache",
        "cu130-torch2.14.0-sglnone-fi0.7.2.post1-vllm0.33.0",
        "cu130-torch2.14.1-sgl0.4.10-fi0.7.2-sglang0.5.23-jitcache",
        "local-cu130-torch2.11.0-sglnone-fi0.6.18-nvcc13.0",
        "local-cu130-torch2.11.0-sglnone-fi0.6.18-nonvcc",
        "local-nocuda-notorch-sglnone-finone",  # before local ids named their toolkit
    ],
)
def test_ids_read_back_into_the_parts_they_were_made_from(text: str) -> None:
    parsed = cellid.parse(text)
    assert parsed is not None and str(parsed) == text


def test_parts_of_a_local_id() -> None:
    parsed = cellid.parse("local-cu130-torch2.11.0-sglnone-fi0.6.18-nvcc12.8")
    assert parsed == CellId("cu130", "2.11.0", "none", "0.6.18", local=True, nvcc="12.8")
    assert cellid.parse("results-2026") is None


def test_select_by_torch_reads_the_version_the_cell_id_names() -> None:
    """`--torch 2.11.0` picks a cell whose matrix entry asked for the stable channel: the resolved id names the
    version (the resolved versions are left empty here, so only the id can answer)."""
    from common.matrix import Cell
    from common.resolve import Resolved
    from common.select import select

    stable = Resolved(Cell("13.0", "stable", "0.4.2", "0.6.18"), "cu130-torch2.11.0-sgl0.4.2-fi0.6.18", "resolved", "")
    nightly = Resolved(Cell("13.0", "nightly", "none", "0.7.4"), "cu130-torchnightly-sglnone-fi0.7.4", "resolved", "")
    assert select([stable, nightly], torch="2.11.0") == [stable]
    assert select([stable, nightly], torch="nightly") == [nightly]


def test_an_engine_cell_names_its_engine_release() -> None:
    parsed = cellid.parse("cu130-torch2.14.0-sglnone-fi0.7.2.post1-vllm0.33.0")
    assert parsed == CellId("cu130", "2.14.0", "none", "0.7.2.post1", engine="vllm0.33.0")
    assert cellid.parse("cu130-torch2.14.0-sglnone-fi0.7.2-tgi1.0") is None  # not an engine the tool knows

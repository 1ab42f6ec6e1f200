"""Matrix model: expansion, selection, validation errors (golden files under tests/golden/provision/)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from common.api import DEFAULT_MATRIX, plan, plan_cells
from common.catalog import load as load_catalog
from common.errors import InputError
from common.matrix import load
from common.resolve import cell_id
from provision.cli import main
from provision.planview import plan_lines

GOLDEN = Path(__file__).parent / "golden" / "provision"


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if os.environ.get("STACKPROBE_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert path.exists(), f"golden file {path} missing: run with STACKPROBE_UPDATE_GOLDEN=1 and review it"
    assert text == path.read_text()


def ids(path: Path) -> list[str]:
    cat = load_catalog()
    return [cell_id(c, cat) + (f"  preset={c.preset}" if c.preset else "") for c in load(path, cat).cells]


def test_default_matrix_expansion_golden() -> None:
    cells = ids(DEFAULT_MATRIX)
    assert len(cells) == 7
    check_golden("default-cells.txt", "\n".join(cells) + "\n")


def test_default_matrix_cells_each_answer_their_own_question() -> None:
    """The SM12x gate on one stack (only flashinfer differs), CUDA 12.8, SGLang's current release, the newest
    stack (`stable` without sgl-kernel is the newest torch release) and its NCCL twin, and nightly; three torch
    builds resolve here, and the cells on one build differ only in what sits above torch (or beside it: NCCL)."""
    cells = {c.cell_id: c for c in plan(DEFAULT_MATRIX, offline=True)}
    assert list(cells) == ["cu130-torch2.14.1-sgl0.4.10-fi0.6.16", "cu130-torch2.14.1-sgl0.4.10-fi0.6.17",
                           "cu128-torch2.9.1-sgl0.4.1-fi0.6.17", "cu130-torch2.14.1-sgl0.4.10-fi0.7.2",
                           "cu132-torch2.15.0-sglnone-fi0.7.4", "cu132-torch2.15.0-sglnone-fi0.7.4-nccl2.32.6",
                           "cu130-torchnightly-sglnone-fi0.7.4"]
    assert all(c.status == "resolved" for c in cells.values())
    assert cells["cu130-torch2.14.1-sgl0.4.10-fi0.7.2"].cell.preset == "sglang-0.5.23"
    newest = cells["cu132-torch2.15.0-sglnone-fi0.7.4"]
    assert newest.cell.torch == "stable" and newest.versions["torch"] == load_catalog().torch_latest_stable
    builds = {(c.versions["torch"], c.versions["torch_cuda"]) for c in cells.values() if not c.prerelease}
    assert builds == {("2.14.1", "cu130"), ("2.9.1", "cu128"), ("2.15.0", "cu132")}
    assert all(s.where == "registry" for c in cells.values() if not c.prerelease for s in c.sources)


def test_github_actions_semantics_golden() -> None:
    cells = ids(GOLDEN / "semantics.yaml")
    # 8 combinations - 3 excluded = 5 originals; include adds 2 (the duplicate preset entry adds nothing)
    assert len(cells) == 7
    assert sum(c.startswith("cu130") and "-jitcache" in c for c in cells) == 3  # attached to originals only
    assert "cu130-torchnightly-sglnone-fi0.6.17" in cells
    # the same list worked out by hand from GitHub Actions' rules (stable: 2.9.1 for sgl-kernel 0.4.1, 2.11.0 for
    # 0.4.2, the torch each links): the golden file holds this, and a regenerated one must still
    assert [c.split("  ")[0] for c in cells] == [
        "cu128-torch2.9.1-sgl0.4.1-fi0.6.17", "cu128-torch2.11.0-sgl0.4.2-fi0.6.17",
        "cu130-torch2.9.1-sgl0.4.1-fi0.6.17-jitcache", "cu130-torch2.11.0-sgl0.4.2-fi0.6.17-jitcache",
        "cu130-torchnightly-sgl0.4.2-fi0.6.17-jitcache", "cu130-torchnightly-sglnone-fi0.6.17",
        "cu130-torch2.11.0-sgl0.4.2-fi0.6.8.post1"]
    check_golden("semantics-cells.txt", "\n".join(cells) + "\n")


def test_default_plan_offline_golden() -> None:
    check_golden("default-plan-offline.txt", "\n".join(plan_lines(plan(DEFAULT_MATRIX, offline=True))) + "\n")


@pytest.mark.parametrize(
    ("kw", "expected"),
    [
        ({"cuda": "13"}, {"cu130", "cu132"}),
        ({"cuda": "13.2"}, {"cu132"}),
        ({"cuda": "12.8"}, {"cu128"}),
        ({"cuda": "12"}, {"cu128"}),
    ],
)
def test_select_by_cuda_prefix(kw: dict[str, str], expected: set[str]) -> None:
    cells = plan(DEFAULT_MATRIX, offline=True, **kw)
    assert {c.cell_id.split("-")[0] for c in cells} == expected


def test_select_by_torch_and_glob() -> None:
    nightly = plan(DEFAULT_MATRIX, torch="nightly", offline=True)
    assert nightly and all("torchnightly" in c.cell_id for c in nightly)
    exact = plan(DEFAULT_MATRIX, torch="2.14.1", offline=True)
    assert {c.cell_id for c in exact} == {f"cu130-torch2.14.1-sgl0.4.10-fi{v}" for v in ("0.6.16", "0.6.17", "0.7.2")}
    stable = plan(DEFAULT_MATRIX, torch="stable", offline=True)
    assert {c.cell_id for c in stable} == {c.cell_id for c in plan(DEFAULT_MATRIX, offline=True)} - {
        "cu130-torchnightly-sglnone-fi0.7.4", "cu130-torch2.14.1-sgl0.4.10-fi0.7.2"}  # the preset pins its torch
    globbed = plan(DEFAULT_MATRIX, only=["*fi0.7.*", "cu128-*-fi0.6.17"], offline=True)
    assert [c.cell_id for c in globbed] == [
        "cu128-torch2.9.1-sgl0.4.1-fi0.6.17", "cu130-torch2.14.1-sgl0.4.10-fi0.7.2",
        "cu132-torch2.15.0-sglnone-fi0.7.4", "cu132-torch2.15.0-sglnone-fi0.7.4-nccl2.32.6",
        "cu130-torchnightly-sglnone-fi0.7.4",
    ]


def test_empty_selection_is_bad_input() -> None:
    with pytest.raises(InputError, match="no cell matches --cuda 12.9"):
        plan(DEFAULT_MATRIX, cuda="12.9", offline=True)


def test_the_selector_that_empties_the_selection_is_the_one_named() -> None:
    """--cuda 13 selects cells; the glob is what selects none of them: the message names the glob, with the
    cells the CUDA selector left, and suggests no other CUDA version."""
    with pytest.raises(InputError) as caught:
        plan(DEFAULT_MATRIX, cuda="13", only=["zzz"], offline=True)
    said = str(caught.value)
    kept = len(plan(DEFAULT_MATRIX, cuda="13", offline=True))
    assert f"no cell matches --only 'zzz' among the {kept} cell(s) --cuda 13 selects" in said
    assert "did you mean" not in said and "\n" not in said


@pytest.mark.parametrize("given", [{"cuda": ""}, {"torch": " "}, {"only": [""]}, {"only": ["cu13*", ""]}])
def test_an_empty_selector_is_named_as_one(given: dict) -> None:
    option = next(iter(given))
    with pytest.raises(InputError, match=f"^--{option} '.*': an empty selector selects nothing; give "):
        plan(DEFAULT_MATRIX, offline=True, **given)


def test_plan_cells_interface() -> None:
    cells = plan_cells(DEFAULT_MATRIX, cuda="13", only="*fi0.7.2")
    assert len(cells) == 1
    c = cells[0]
    assert (c.cell_id, c.status, c.cuda) == ("cu130-torch2.14.1-sgl0.4.10-fi0.7.2", "resolved", "13.0")
    assert c.versions["torch"] == "2.14.1" and c.versions["sgl_kernel"] == "0.4.10"


BAD = [
    ("matrix: [", "not valid YAML", 1),
    ("kernel_archs: [sm_99z]\nmatrix:\n  cuda: ['13.0']\n  torch: [stable]\n  sgl_kernel: [none]\n"
     "  flashinfer: [none]\n",
     "kernel_archs[0]: 'sm_99z' is not a GPU architecture", 1),
    ("kernel_archs: 9.0a\nmatrix:\n  cuda: ['13.0']\n  torch: [stable]\n  sgl_kernel: [none]\n"
     "  flashinfer: [none]\n",
     "kernel_archs: expected a list of GPU architectures", 1),
    ("matrix:\n  cuda: ['13.0']\n  torch: [stable]\n  sgl_kernel: [none]\n  flashinfer: [none]\n"
     "  include:\n    - {cuda: '13.0', kernel_archs: [true]}\n",
     "matrix.include[0].kernel_archs[0]: expected an architecture string", 7),
    ("", "the file is empty", None),
    ("matrx: {}", "unknown key 'matrx'; allowed: matrix, description, kernel_archs (did you mean 'matrix'?)", 1),
    ("matrix:\n  cuda: ['12.8']\n  torch: [stable]\n  sgl_kernel: [none]\n", "missing axis 'flashinfer'", 1),
    ("matrix:\n  cuda: ['12.7']\n  torch: [stable]\n  sgl_kernel: [none]\n  flashinfer: [none]\n",
     "matrix.cuda[0]: unknown CUDA version '12.7'; allowed: 12.6, 12.8, 12.9, 13.0, 13.2 (did you mean '12.8'?)", 2),
    ("matrix:\n  cuda: ['13.0']\n  torch: [stabel]\n  sgl_kernel: [none]\n  flashinfer: [none]\n",
     "unknown torch channel 'stabel'; use stable, nightly or an exact version (did you mean 'stable'?)", 3),
    ("matrix:\n  cuda: ['13.0']\n  torch: [stable]\n  sgl_kernel: ['0.4.2; rm -rf /']\n  flashinfer: [none]\n",
     "matrix.sgl_kernel[0]: '0.4.2; rm -rf /' has characters other than", 4),
    ("matrix:\n  cuda: ['13.0']\n  torch: [stable]\n  sgl_kernel: [none]\n  flashinfer: ['$(id)']\n",
     "has characters other than", 5),
    ("matrix:\n  cuda: ['13.0']\n  torch: [stable]\n  sgl_kernel: [none]\n  flashinfer: [zero.six]\n",
     "'zero.six' is not a flashinfer version", 5),
    ("matrix:\n  cuda: ['13.0']\n  torch: [stable]\n  sgl_kernel: [none]\n  flashinfer: [none]\n"
     "  include:\n    - {cuda: '13.0', flashnifer: '0.6.17'}\n",
     "matrix.include[0].flashnifer: unknown key 'flashnifer'", 7),
    ("matrix:\n  cuda: ['13.0']\n  torch: [stable]\n  sgl_kernel: [none]\n  flashinfer: [none]\n"
     "  include:\n    - {cuda: '13.0', torch: nightly}\n",
     "matrix.include[0]: this entry matches no cell, so it adds one, but it lacks sgl_kernel, flashinfer", 7),
    ("matrix:\n  cuda: ['13.0']\n  torch: [stable]\n  sgl_kernel: [none]\n  flashinfer: [none]\n"
     "  exclude:\n    - {cuda: '12.8'}\n",
     "is not a value of the cuda axis (13.0), so this exclude matches nothing", 7),
    ("matrix:\n  cuda: ['13.0']\n  torch: [stable]\n  sgl_kernel: [none]\n  flashinfer: [none]\n"
     "  include:\n    - {preset: sglang-0.5.99, cuda: '13.0'}\n", "unknown preset 'sglang-0.5.99'", 7),
    ("matrix:\n  cuda: ['13.0']\n  torch: [stable]\n  sgl_kernel: [none]\n  flashinfer: ['0.7.4']\n"
     "  include:\n    - {cuda: '13.0', engine: true}\n",
     "matrix.include[0].engine: engine: true installs a preset's engine release; add preset: vllm-<version>", 7),
    ("matrix:\n  cuda: ['13.0']\n  torch: [stable]\n  sgl_kernel: [none]\n  flashinfer: ['0.7.4']\n"
     "  include:\n    - {preset: vllm-0.33.0, cuda: '13.0', engine: 'yes'}\n",
     "matrix.include[0].engine: expected true or false", 7),
    ("matrix:\n  cuda: ['13.0', '13.0']\n  torch: [stable]\n  sgl_kernel: [none]\n  flashinfer: [none]\n",
     "duplicate value '13.0'", 2),
    ("matrix:\n  cuda: []\n  torch: [stable]\n  sgl_kernel: [none]\n  flashinfer: [none]\n", "empty list", 2),
    ("matrix:\n  cuda: ['13.0']\n  cuda: ['12.8']\n", "duplicate key 'cuda'", 3),
    ("matrix:\n  cuda: [{a: 1}]\n  torch: [stable]\n  sgl_kernel: [none]\n  flashinfer: [none]\n",
     "expected a version string, got dict", 2),
]


@pytest.mark.parametrize(("text", "message", "line"), BAD)
def test_bad_matrix_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str,
                                    line: int | None) -> None:
    f = tmp_path / "m.yaml"
    f.write_text(text)
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--matrix", str(f), "--no-reach-check"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert message in err
    assert str(f) + (f":{line}" if line else "") in err


def test_missing_matrix_file(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--matrix", "/nonexistent/m.yaml"])
    assert exc.value.code == 2
    assert "file not found" in capsys.readouterr().err


def test_kernel_archs_default_matrix_and_include(tmp_path: Path) -> None:
    """The matrix-wide list, an include entry's own list for the cells it matches, none, and the default."""
    from common.matrix import load

    f = tmp_path / "m.yaml"
    f.write_text("kernel_archs: ['sm_100a', '9.0A']\nmatrix:\n  cuda: ['13.0']\n  torch: [stable]\n"
                 "  sgl_kernel: [none]\n  flashinfer: ['0.6.17', '0.7.4']\n"
                 "  include:\n    - {flashinfer: '0.7.4', kernel_archs: ['12.0f']}\n"
                 "    - {cuda: '13.2', torch: stable, sgl_kernel: none, flashinfer: '0.7.4', kernel_archs: none}\n")
    m = load(f)
    got = {(c.cuda, c.flashinfer): c.kernel_archs for c in m.cells}
    assert got == {("13.0", "0.6.17"): ("10.0a", "9.0a"), ("13.0", "0.7.4"): ("12.0f",), ("13.2", "0.7.4"): ()}
    f.write_text("matrix:\n  cuda: ['13.0']\n  torch: [stable]\n  sgl_kernel: [none]\n  flashinfer: ['0.7.4']\n")
    assert load(f).cells[0].kernel_archs == ("9.0a", "12.0a", "12.0f")


def test_an_engine_cell_installs_the_release_itself_beside_its_pins(tmp_path: Path) -> None:
    f = tmp_path / "m.yaml"
    f.write_text("matrix:\n  cuda: ['13.0']\n  torch: [stable]\n  sgl_kernel: [none]\n  flashinfer: ['0.7.4']\n"
                 "  include:\n    - {preset: vllm-0.33.0, cuda: '13.0', engine: true}\n"
                 "    - {preset: vllm-0.33.0, cuda: '13.0'}\n")
    cells = {r.cell_id: r for r in plan(str(f))}
    # vLLM 0.33.0's published pins: torch 2.14.0 and flashinfer-python 0.7.2.post1, no sgl-kernel
    engine = cells["cu130-torch2.14.0-sglnone-fi0.7.2.post1-vllm0.33.0"]
    plain = cells["cu130-torch2.14.0-sglnone-fi0.7.2.post1"]
    assert [s.requirement for s in engine.sources] == ["torch==2.14.0", "flashinfer-python==0.7.2.post1",
                                                       "vllm==0.33.0"]
    assert [s.requirement for s in plain.sources] == ["torch==2.14.0", "flashinfer-python==0.7.2.post1"]
    assert engine.versions["engine"] == "vllm 0.33.0" and "engine" not in plain.versions

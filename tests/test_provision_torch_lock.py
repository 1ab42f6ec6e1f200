"""torch.lock depends on the torch build alone: real uv, against a local index of stand-in wheels (metadata
only) shaped like the registry releases, so no network.

- torch 2.11.0 needs cuda-bindings >=13.0.3,<14; cuda-python 13.4.4 needs cuda-bindings ~=13.4.4 and there is
  no cuda-python 13.5.x;
- flashinfer-python 0.6.18 needs cuda-python; 0.6.8.post1 does not (alone beside torch it lets the resolver
  take cuda-bindings 13.5.0, which is how one committed cell came to have a torch layer of its own);
- flashinfer-python 0.6.99 (made up) needs cuda-bindings >=13.5: it cannot share the torch build's pins.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from test_provision_lock_guard import TOOLKIT_EXTRAS, _wheel, simple_index

from common.catalog import load as load_catalog
from common.matrix import Cell
from common.resolve import resolve
from provision import lock
from provision.cli import main

WHEELS = [
    ("torch", "2.11.0", ('cuda-bindings<14,>=13.0.3; platform_system == "Linux"', "filelock")),
    ("filelock", "3.20.0", ()),
    ("flashinfer-python", "0.6.18", ("cuda-python>=12.0", "torch")),
    ("flashinfer-python", "0.6.8.post1", ("torch", "filelock")),
    ("flashinfer-python", "0.6.99", ("cuda-bindings>=13.5", "torch")),
    ("cuda-bindings", "13.4.4", ()),
    ("cuda-bindings", "13.5.0", ()),
    ("cuda-python", "13.4.4", ("cuda-bindings~=13.4.4",)),
    ("sglang-kernel", "0.4.2", ("torch==2.11.0",)),
]


def _index(tmp_path: Path, wheels: list[tuple[str, str, tuple[str, ...]]]) -> str:
    folder = tmp_path / "wheels"
    folder.mkdir(exist_ok=True)
    for name, version, requires in wheels:
        _wheel(folder, name, version, requires)
    _wheel(folder, "cuda-toolkit", "13.0.2", extras=tuple(TOOLKIT_EXTRAS))
    return simple_index(folder, tmp_path / "simple")


@pytest.fixture
def index(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    if shutil.which(lock.uv_bin()) is None:
        pytest.skip("needs uv")
    monkeypatch.setenv("UV_CACHE_DIR", str(tmp_path / "uv-cache"))
    monkeypatch.setattr(lock, "_toolkit_cache", {})  # the stand-in toolkit lock must not outlive the test
    url = _index(tmp_path, WHEELS)
    monkeypatch.setenv("UV_INDEX_URL", url)
    return url


def _cell(flashinfer: str, kernel: str = "none"):  # noqa: ANN202 - a Resolved
    r = resolve(Cell("13.0", "2.11.0", kernel, flashinfer), load_catalog())
    assert r.status == "resolved" and r.indexes == ()  # a registry-only cell: the index above stands in
    return r


def test_cells_of_one_torch_build_get_one_torch_lock(index: str, tmp_path: Path) -> None:
    envs = tmp_path / "envs"
    newer, older = _cell("0.6.18"), _cell("0.6.8.post1")
    assert lock.torch_key(newer) == lock.torch_key(older)
    # the cell's own closure, compiled alone: without cuda-python it takes cuda-bindings 13.5.0
    alone = lock.uv_compile(lock.requirements_in(older), lock.compile_args(older), (), lock.guards(older))
    assert lock.pinned(lock.closure_subset(alone, "torch"), "cuda-bindings") == "13.5.0"

    out = lock.lock_cells([older, newer], envs, echo=False)
    assert [r["status"] for r in out] == ["locked", "locked"]
    a, b = ((envs / r.cell_id / "torch.lock").read_bytes() for r in (older, newer))
    assert a == b and lock.pinned(a.decode(), "cuda-bindings") == "13.4.4"
    assert lock.pinned(a.decode(), "flashinfer-python") is None and lock.pinned(a.decode(), "cuda-python") is None
    for r in (older, newer):  # each full lock keeps the torch build's pins
        full = (envs / r.cell_id / "requirements.lock").read_text()
        assert lock.torch_lock_differences(a.decode(), full) == []


def test_a_cell_locked_later_reuses_its_torch_builds_lock(index: str, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A newer cuda-bindings and cuda-python appear on the index between two `provision lock` runs: the
    second cell still gets the first one's torch.lock byte for byte, and the first is not locked again."""
    envs = tmp_path / "envs"
    first, second = _cell("0.6.18"), _cell("0.6.8.post1")
    assert lock.lock_cell(first, envs, lock.uv_version())["status"] == "locked"
    monkeypatch.setenv("UV_INDEX_URL", _index(tmp_path, [*WHEELS, ("cuda-bindings", "13.6.0", ()),
                                                          ("cuda-python", "13.6.0", ("cuda-bindings~=13.6.0",))]))
    fresh = lock.closure_subset(lock.uv_compile(lock.torch_requirements(second), lock.torch_compile_args(second)),
                                "torch")
    assert lock.pinned(fresh, "cuda-bindings") == "13.6.0"  # resolved today, the torch lock would differ
    assert lock.lock_cell(second, envs, lock.uv_version())["status"] == "locked"
    shared = (envs / first.cell_id / "torch.lock").read_text()
    assert (envs / second.cell_id / "torch.lock").read_text() == shared
    assert lock.pinned((envs / second.cell_id / "requirements.lock").read_text(), "cuda-bindings") == "13.4.4"
    assert lock.lock_cell(first, envs, lock.uv_version())["status"] == "unchanged"
    # a cell whose torch.lock is not its build's (locked apart) is locked again to the shared one
    (envs / second.cell_id / "torch.lock").write_text(fresh)
    assert lock.lock_cell(second, envs, lock.uv_version())["status"] == "locked"
    assert (envs / second.cell_id / "torch.lock").read_text() == shared


def test_a_cell_that_conflicts_with_its_torch_lock_is_one_line_exit_2(
        index: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    matrix = tmp_path / "m.yaml"
    matrix.write_text("matrix:\n  cuda: ['13.0']\n  torch: ['2.11.0']\n  sgl_kernel: [none]\n"
                      "  flashinfer: ['0.6.18', '0.6.99']\n")
    envs = tmp_path / "envs"
    with pytest.raises(SystemExit) as exc:
        main(["lock", "--matrix", str(matrix), "--envs", str(envs), "--no-reach-check"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    cid = "cu130-torch2.11.0-sglnone-fi0.6.99"
    assert err.startswith(f"provision: {cid}: its packages do not fit the torch.lock of its torch build "
                          "(torch==2.11.0 cu130)"), err
    assert "it needs cuda-bindings 13.5.0 (torch.lock: 13.4.4)" in err
    assert not (envs / cid).exists()  # nothing half-locked
    assert (envs / "cu130-torch2.11.0-sglnone-fi0.6.18" / "torch.lock").exists()


def test_the_sgl_kernel_gets_a_lock_of_its_own_shared_by_the_cells_that_have_it(index: str, tmp_path: Path) -> None:
    envs = tmp_path / "envs"
    cells = [_cell("0.6.18", "0.4.2"), _cell("0.6.8.post1", "0.4.2"), _cell("0.6.18")]
    assert [r["status"] for r in lock.lock_cells(cells, envs, echo=False)] == ["locked"] * 3
    a, b = ((envs / r.cell_id / "kernel.lock").read_text() for r in cells[:2])
    assert a == b and a.startswith("sglang-kernel==0.4.2 \\\n    --hash=sha256:") and "# via" not in a
    assert [name for name, _, _ in lock.parse_blocks(a)] == ["sglang-kernel"]
    assert not (envs / cells[2].cell_id / "kernel.lock").exists()  # no sgl-kernel, no such layer
    # a cell locked before kernel.lock existed gets it from its lock, without being resolved again
    (envs / cells[0].cell_id / "kernel.lock").unlink()
    assert lock.lock_cell(cells[0], envs, lock.uv_version())["status"] == "unchanged"
    assert (envs / cells[0].cell_id / "kernel.lock").read_text() == a

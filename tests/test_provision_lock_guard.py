"""The cuda-python guard of `provision lock`, on the inputs it generates, resolved by the real uv against a
local index of stand-in wheels (metadata only) that copy the dependency shape of the registry releases:

- torch 2.11.0 needs cuda-bindings >=13.0.3,<14; flashinfer-python 0.6.18 needs cuda-python >=12.0;
- cuda-python 13.4.4 needs cuda-bindings ~=13.4.4, and there is no cuda-python 13.5.x for cuda-bindings 13.5.0;
- cuda-python 12.6.2.post1 needs nothing: it ships its own cuda/bindings files, which overwrite cuda-bindings'.

No network: the index is a folder, the uv cache a temporary one.
"""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import zipfile
from pathlib import Path

import pytest

from common.catalog import load as load_catalog
from common.matrix import Cell
from common.resolve import resolve
from provision import lock

ROOT = Path(__file__).resolve().parents[1]
TOOLKIT_EXTRAS = lock.TOOLKIT_EXTRAS.split(",")


def _wheel(folder: Path, name: str, version: str, requires: tuple[str, ...] = (), extras: tuple[str, ...] = ()) -> None:
    dist = name.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    files = {
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        + "".join(f"Provides-Extra: {e}\n" for e in extras) + "".join(f"Requires-Dist: {r}\n" for r in requires),
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: stackprobe-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    digest = {k: base64.urlsafe_b64encode(hashlib.sha256(v.encode()).digest()).rstrip(b"=").decode()
              for k, v in files.items()}
    record = "".join(f"{k},sha256={digest[k]},{len(v)}\n" for k, v in files.items())
    files[f"{info}/RECORD"] = record + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(folder / f"{dist}-{version}-py3-none-any.whl", "w") as z:
        for k, v in files.items():
            z.writestr(k, v)


def _index(tmp_path: Path, bindings_floor: str) -> str:
    """A PEP 503 index in a folder; torch asks cuda-bindings >= ``bindings_floor``."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "torch", "2.11.0", (f'cuda-bindings<14,>={bindings_floor}; platform_system == "Linux"',))
    _wheel(wheels, "flashinfer-python", "0.6.18", ("cuda-python>=12.0", "torch"))
    _wheel(wheels, "cuda-bindings", "13.4.4")
    _wheel(wheels, "cuda-bindings", "13.5.0")
    _wheel(wheels, "cuda-python", "13.4.4", ("cuda-bindings~=13.4.4",))
    _wheel(wheels, "cuda-python", "12.6.2.post1")
    _wheel(wheels, "cuda-toolkit", "13.0.2", extras=tuple(TOOLKIT_EXTRAS))
    return simple_index(wheels, tmp_path / "simple")


def simple_index(wheels: Path, simple: Path) -> str:
    """A PEP 503 index over the wheels in ``wheels``, written afresh under ``simple``; its file URI."""
    shutil.rmtree(simple, ignore_errors=True)
    for whl in sorted(wheels.iterdir()):
        project = simple / whl.name.split("-")[0].replace("_", "-")
        project.mkdir(parents=True, exist_ok=True)
        sha = hashlib.sha256(whl.read_bytes()).hexdigest()
        with open(project / "index.html", "a") as f:
            f.write(f'<a href="{whl.as_uri()}#sha256={sha}">{whl.name}</a>\n')
    return simple.as_uri()


@pytest.fixture
def cell(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):  # noqa: ANN201 - a Resolved
    if shutil.which(lock.uv_bin()) is None:
        pytest.skip("needs uv")
    monkeypatch.setenv("UV_CACHE_DIR", str(tmp_path / "uv-cache"))
    monkeypatch.setattr(lock, "_toolkit_cache", {})  # the stand-in toolkit lock must not outlive the test
    r = resolve(Cell("13.0", "2.11.0", "none", "0.6.18"), load_catalog())
    assert r.status == "resolved" and r.indexes == ()  # a registry-only cell: the index below stands in
    return r


def test_a_plain_install_takes_the_old_cuda_python_and_the_guard_prevents_it(
        cell, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What `uv pip install torch==2.11.0 flashinfer-python==0.6.18` resolves on Python 3.12, with and
    without the constraint `provision lock` adds to this cell."""
    monkeypatch.setenv("UV_INDEX_URL", _index(tmp_path, "13.0.3"))
    plain = ["--python-version", "3.12", "--no-header"]
    unguarded = lock.uv_compile(lock.requirements_in(cell), plain)
    pins = (lock.pinned(unguarded, "cuda-python"), lock.pinned(unguarded, "cuda-bindings"))
    assert pins == ("12.6.2.post1", "13.5.0")
    assert lock.guards(cell) == ("cuda-python>=13",)
    guarded = lock.uv_compile(lock.requirements_in(cell), plain, cell.overrides, lock.guards(cell))
    assert (lock.pinned(guarded, "cuda-python"), lock.pinned(guarded, "cuda-bindings")) == ("13.4.4", "13.4.4")


def test_a_cuda_13_lock_cannot_pin_the_old_cuda_python(cell, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where nothing but cuda-python 12.6.2.post1 fits the rest, `provision lock` refuses the cell (uv says
    why) instead of writing a lock whose install breaks `import flashinfer`."""
    monkeypatch.setenv("UV_INDEX_URL", _index(tmp_path, "13.5"))
    with pytest.raises(lock.LockError) as exc:
        lock.lock_cell(cell, tmp_path / "envs", lock.uv_version())
    assert exc.value.args[0] == "unavailable" and "cuda-python" in exc.value.args[1]
    assert not (tmp_path / "envs" / cell.cell_id).exists()


def test_a_kept_lock_that_breaks_the_guard_is_locked_again(cell, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UV_INDEX_URL", _index(tmp_path, "13.0.3"))
    envs = tmp_path / "envs"
    assert lock.lock_cell(cell, envs, lock.uv_version())["status"] == "locked"
    path = envs / cell.cell_id / "requirements.lock"
    assert lock.pinned(path.read_text(), "cuda-python") == "13.4.4" and "-c constraints.txt" in path.read_text()
    assert lock.lock_cell(cell, envs, lock.uv_version())["status"] == "unchanged"
    path.write_text(path.read_text().replace("cuda-python==13.4.4", "cuda-python==12.6.2.post1"))  # an old lock
    assert lock.lock_cell(cell, envs, lock.uv_version())["status"] == "locked"
    assert lock.pinned(path.read_text(), "cuda-python") == "13.4.4"


def test_the_committed_locks_are_kept_as_they_are(tmp_path: Path) -> None:
    """Every committed cell still counts as locked: same inputs, and every guard holds (no relock, so the
    images built from them keep their tags)."""
    from common.api import plan

    envs = tmp_path / "envs"
    shutil.copytree(ROOT / "envs", envs)
    matrices = [ROOT / "matrix.yaml", *sorted((ROOT / "matrices").glob("*.yaml"))]  # the default and the named ones
    cells = {r.cell_id: r for m in matrices for r in plan(m, offline=True) if r.status == "resolved"}
    committed = sorted(p.name for p in envs.iterdir() if (p / "cell.json").exists())
    assert committed and set(committed) <= set(cells)
    for cid in committed:
        uv = json.loads((envs / cid / "cell.json").read_text())["uv"]
        assert lock.guard_violations((envs / cid / "requirements.lock").read_text(), lock.guards(cells[cid])) == []
        assert lock.lock_cell(cells[cid], envs, uv)["status"] == "unchanged", cid
    # every cell locked with its torch build's key shares that build's torch.lock byte for byte; an engine cell
    # whose pins contradict that lock holds its own, under a key of its own
    by_build: dict[str, set[bytes]] = {}
    for cid in committed:
        key = json.loads((envs / cid / "cell.json").read_text()).get("torch_lock")
        if key is not None and cells[cid].cell.engine and key == lock.own_layer_key(cells[cid]):
            continue
        if key is not None:
            assert key == lock.torch_key(cells[cid]), cid
            by_build.setdefault(key, set()).add((envs / cid / "torch.lock").read_bytes())
    assert by_build and all(len(texts) == 1 for texts in by_build.values())
    assert len(by_build) >= 3  # the default matrix's torch builds here: 2.9.1 cu128, 2.14.1 cu130, 2.15.0 cu132

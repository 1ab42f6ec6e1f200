"""Locking: real uv resolution against the registry, the torch layer subset, atomic writes.

uv runs cache first (tests/uvcache.py): a second run of these tests resolves from uv's cache and asks the
index nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from uvcache import cache_first_uv

from common.api import resolve_all
from provision import lock
from provision.cli import main
from provision.lock import closure_subset, parse_blocks, pinned, write_dir_atomically


@pytest.fixture(autouse=True)
def _uv_cache_first(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    shim = cache_first_uv(tmp_path_factory.mktemp("uv-cache-first"), lock.uv_bin())
    monkeypatch.setattr(lock, "uv_bin", lambda: str(shim))


SAMPLE = """\
filelock==3.20.0 \\
    --hash=sha256:aa
    # via torch
flashinfer-python==0.6.17 \\
    --hash=sha256:bb
    # via -r requirements.in
numpy==2.4.6 ; python_full_version < '3.12' \\
    --hash=sha256:cc
    # via
    #   flashinfer-python
    #   torch
nvidia-cublas==13.1.0.3 ; sys_platform == 'linux' \\
    --hash=sha256:dd
    # via
    #   cuda-toolkit
cuda-toolkit==13.0.2 ; sys_platform == 'linux' \\
    --hash=sha256:ee
    # via torch
tabulate==0.10.0 \\
    --hash=sha256:ff
    # via flashinfer-python
torch==2.11.0 \\
    --hash=sha256:00
    # via
    #   -r requirements.in
    #   flashinfer-python
"""


def test_closure_subset_follows_via_annotations() -> None:
    sub = closure_subset(SAMPLE, "torch")
    names = [b[0] for b in parse_blocks(sub)]
    assert names == ["filelock", "numpy", "nvidia-cublas", "cuda-toolkit", "torch"]
    assert "tabulate" not in sub and "flashinfer" not in sub
    assert "--hash=sha256:dd" in sub and "# via" not in sub
    assert pinned(SAMPLE, "torch") == "2.11.0" and pinned(SAMPLE, "Flashinfer_Python") == "0.6.17"


def test_write_dir_atomically_replaces_and_keeps_build_json(tmp_path: Path) -> None:
    target = tmp_path / "cell"
    write_dir_atomically(target, {"a": "1", "b": "2"})
    (target / "build.json").write_text("{}")
    write_dir_atomically(target, {"a": "3"})
    assert sorted(p.name for p in target.iterdir()) == ["a", "build.json"]
    assert (target / "a").read_text() == "3"
    assert [p.name for p in tmp_path.iterdir()] == ["cell"]  # no temp folder left


def test_lock_registry_cell_for_real(tmp_path: Path) -> None:
    """The registry alone resolves the CUDA 12.8 cell (torch 2.9.1 there is a cu128 build)."""
    with pytest.raises(SystemExit) as exc:
        main(["lock", "--only", "cu128-torch2.9.1-sgl0.4.1-fi0.6.17", "--envs", str(tmp_path), "--json",
              "--no-reach-check"])
    assert exc.value.code == 0
    folder = tmp_path / "cu128-torch2.9.1-sgl0.4.1-fi0.6.17"
    lock = (folder / "requirements.lock").read_text()
    assert pinned(lock, "torch") == "2.9.1" and pinned(lock, "sglang-kernel") == "0.4.1"
    assert pinned(lock, "nvidia-nccl-cu12") and "--hash=sha256:" in lock
    assert pinned((folder / "torch.lock").read_text(), "flashinfer-python") is None
    assert pinned((folder / "toolkit.lock").read_text(), "nvidia-cuda-nvcc-cu12", ) is not None
    cell = json.loads((folder / "cell.json").read_text())
    assert cell["expected"] == {"cuda": "12.8", "torch_cuda": "cu128", "torch": "2.9.1", "sgl_kernel": "0.4.1",
                                "flashinfer": "0.6.17", "nccl": pinned(lock, "nvidia-nccl-cu12")}
    before = (folder / "requirements.lock").stat().st_mtime_ns
    main_again = ["lock", "--only", "cu128-torch2.9.1-sgl0.4.1-fi0.6.17", "--envs", str(tmp_path), "--no-reach-check"]
    with pytest.raises(SystemExit):
        main(main_again)
    assert (folder / "requirements.lock").stat().st_mtime_ns == before  # unchanged inputs: not re-resolved


def test_dry_run_renders_without_docker(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    matrix = tmp_path / "m.yaml"
    matrix.write_text("matrix:\n  cuda: ['13.0']\n  torch: [stable]\n  sgl_kernel: ['0.4.2']\n"
                      "  flashinfer: ['0.6.17']\n  include:\n    - {cuda: '12.8', torch: nightly, sgl_kernel: none,"
                      " flashinfer: none}\n")
    with pytest.raises(SystemExit) as exc:
        main(["build", "--dry-run", "--matrix", str(matrix), "--envs", str(tmp_path / "e"),
              "--dockerfiles", str(tmp_path / "d"), "--json", "--no-reach-check"])
    assert exc.value.code == 0
    rows = {r["cell_id"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["cu130-torch2.11.0-sgl0.4.2-fi0.6.17"]["status"] == "would-build"
    assert rows["cu128-torchnightly-sglnone-finone"]["status"] == "unavailable"
    assert (tmp_path / "d" / "cu130-torch2.11.0-sgl0.4.2-fi0.6.17.Dockerfile").exists()
    assert (tmp_path / "e" / "cu130-torch2.11.0-sgl0.4.2-fi0.6.17" / "requirements.lock").exists()
    assert [c.cell_id for c in resolve_all(matrix, offline=True)] == list(rows)


def test_overrides_keep_a_kernels_torch_pin_out_of_the_lock() -> None:
    """Real uv against the registry: sglang-kernel 0.4.7 declares torch==2.13.0, which --no-deps ignores at
    install; the override makes the lock agree, so a nightly torch is not refused by that pin."""
    from provision.lock import LockError, uv_compile

    req = "torch>=2.14\nsglang-kernel==0.4.7\n"
    args = ["--python-version", "3.11", "--no-header"]
    with pytest.raises(LockError) as exc:
        uv_compile(req, args)
    assert exc.value.args[0] == "unavailable" and "torch==2.13.0" in exc.value.args[1]
    lock = uv_compile(req, args, ("torch",))
    assert pinned(lock, "sglang-kernel") == "0.4.7" and pinned(lock, "torch") not in (None, "2.13.0")


def test_cell_json_carries_the_expectation_only_where_there_is_one() -> None:
    from common.catalog import load as load_catalog
    from common.matrix import Cell
    from common.resolve import resolve
    from provision.lock import cell_json

    cat = load_catalog()
    nightly = cell_json(resolve(Cell("13.0", "nightly", "0.4.2", "0.6.17"), cat), SAMPLE, "0.13.9", "h")
    assert nightly["overrides"] == ["torch"]
    assert "expect `import sgl_kernel` to fail" in nightly["expect"][0]
    paired = cell_json(resolve(Cell("13.0", "stable", "0.4.2", "0.6.17"), cat), SAMPLE, "0.13.9", "h")
    assert "expect" not in paired and "overrides" not in paired


def test_live_check_tells_unpublished_from_unreachable() -> None:
    from common.catalog import load as load_catalog
    from common.matrix import Cell
    from common.resolve import UNAVAILABLE, resolve
    from provision.lock import live_check

    cat = load_catalog()
    ghost = resolve(Cell("13.0", "stable", "none", "0.6.99"), cat, lambda h: None)  # no such flashinfer
    ghost = type(ghost)(**{**ghost.__dict__, "sources": ghost.sources[1:], "indexes": ()})  # registry only
    (checked,) = live_check([ghost])
    assert checked.status == UNAVAILABLE and "flashinfer-python" in checked.reason


def test_engine_cells_lock_for_real_and_share_the_torch_layer_only_where_the_engine_allows(tmp_path: Path) -> None:
    """vLLM 0.33.0 caps setuptools (<81 on Python > 3.11) below the release torch 2.14.0 takes on its own, so
    its cell gets a torch layer of its own; SGLang 0.5.23's pins fit its torch build's shared layer."""
    engines = Path(__file__).resolve().parents[1] / "matrices" / "engines.yaml"
    for only in ("cu130-torch2.14.1-sgl0.4.10-fi0.7.2", "*-sglang0.5.23", "*-vllm0.33.0"):
        m = engines if "0.5.23" in only or "vllm" in only else Path(__file__).resolve().parents[1] / "matrix.yaml"
        with pytest.raises(SystemExit) as exc:
            main(["lock", "--matrix", str(m), "--only", only, "--envs", str(tmp_path), "--no-reach-check"])
        assert exc.value.code == 0
    plain = tmp_path / "cu130-torch2.14.1-sgl0.4.10-fi0.7.2"
    sgl = tmp_path / "cu130-torch2.14.1-sgl0.4.10-fi0.7.2-sglang0.5.23"
    vllm = tmp_path / "cu130-torch2.14.0-sglnone-fi0.7.2.post1-vllm0.33.0"
    assert pinned((sgl / "requirements.lock").read_text(), "sglang") == "0.5.23"
    assert (sgl / "torch.lock").read_text() == (plain / "torch.lock").read_text()
    assert json.loads((sgl / "cell.json").read_text())["torch_lock"] == json.loads(
        (plain / "cell.json").read_text())["torch_lock"]
    full = (vllm / "requirements.lock").read_text()
    assert pinned(full, "vllm") == "0.33.0" and pinned(full, "torch") == "2.14.0"
    setuptools = [text for name, text, _ in parse_blocks(full) if name == "setuptools"]
    assert setuptools and all(text.startswith("setuptools==80.") for text in setuptools)
    assert "setuptools==80." in (vllm / "torch.lock").read_text()  # torch's closure within vLLM's resolution
    cell = json.loads((vllm / "cell.json").read_text())
    assert cell["cell"]["engine"] is True and cell["expected"]["engine"] == "vllm==0.33.0"

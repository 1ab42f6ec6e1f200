"""Resolution: every reason a cell cannot exist, and reachability as a separate status."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from test_provision_matrix import GOLDEN, check_golden

from common.api import DEFAULT_MATRIX, resolve_all
from common.catalog import load as load_catalog
from common.matrix import Cell
from common.resolve import RESOLVED, UNAVAILABLE, UNREACHABLE, resolve
from provision.planview import plan_json, plan_lines


def test_reasons_golden() -> None:
    cells = resolve_all(GOLDEN / "reasons.yaml", offline=True)
    check_golden("reasons-plan.txt", "\n".join(plan_lines(cells)) + "\n")
    by_id = {c.cell_id: c for c in cells}
    assert by_id["cu126-torch2.15.0-sglnone-finone"].status == UNAVAILABLE
    assert "no SM120 code" in by_id["cu126-torch2.15.0-sglnone-finone"].reason
    assert "has no CUDA 12.8 build" in by_id["cu128-torch2.15.0-sglnone-fi0.6.17"].reason
    assert "newest release with cu128: 2.11.0" in by_id["cu128-torch2.15.0-sglnone-fi0.6.17"].reason
    assert "nightly has no cu128 builds" in by_id["cu128-torchnightly-sglnone-fi0.6.17"].reason
    other_torch = by_id["cu130-torch2.9.1-sgl0.4.2-finone"]  # installable: the ABI pairing is an expectation
    assert other_torch.status == RESOLVED and "torch 2.11.0's C++ ABI" in other_torch.expect[0]
    assert "only as a CUDA 13.0 build" in by_id["cu129-torch2.13.0-sgl0.4.7-finone"].reason
    assert "not published for cu128" in by_id["cu128-torch2.11.0-sglnone-fi0.7.2-jitcache"].reason
    assert by_id["cu128-torch2.11.0-sglnone-fi0.6.18-jitcache"].status == RESOLVED
    assert "no installable wheel" in by_id["cu130-torch2.11.0-sgl0.4.2-fi0.4.1"].reason
    assert "not in the catalog" in by_id["cu130-torch2.10.1-sglnone-finone"].reason
    assert "sgl-kernel 0.9.9 is not in the catalog" in by_id["cu130-torch2.15.0-sgl0.9.9-finone"].reason
    nightly_kernel = by_id["cu130-torchnightly-sgl0.4.2-finone"]  # installable: the ABI pairing is no status
    assert nightly_kernel.status == RESOLVED and nightly_kernel.reason == ""
    assert by_id["cu128-torch2.9.1-sgl0.4.1-fi0.6.7.post2"].status == RESOLVED  # SGLang 0.5.10 preset


def test_plan_json_roundtrip_fields() -> None:
    data = plan_json(resolve_all(DEFAULT_MATRIX, offline=True))
    real = next(d for d in data if d["cell_id"] == "cu130-torch2.14.1-sgl0.4.10-fi0.7.2")
    assert real["requirements"] == ["torch==2.14.1", "sglang-kernel==0.4.10", "flashinfer-python==0.7.2"]
    assert set(real["sources"].values()) == {"registry"}


def test_unreachable_differs_from_unpublished() -> None:
    cat = load_catalog()
    cell = Cell("12.8", "stable", "0.4.2", "none")
    down = resolve(cell, cat, lambda host: "DNS: Name or service not known")
    assert down.status == UNREACHABLE and "download.pytorch.org" in down.reason
    up = resolve(cell, cat, lambda host: None)
    assert up.status == RESOLVED
    assert [s.requirement.split(" @ ")[0] for s in up.sources] == ["torch==2.11.0+cu128", "sglang-kernel"]
    assert up.indexes == ("https://download.pytorch.org/whl/cu128",)
    # a registry-only cell never asks the network
    reg = resolve(Cell("13.0", "stable", "0.4.2", "0.6.17"), cat, lambda host: 1 / 0)  # type: ignore[arg-type]
    assert reg.status == RESOLVED and reg.indexes == ()
    # unpublished stays unavailable whatever the network says
    assert resolve(Cell("12.8", "nightly", "none", "none"), cat, lambda h: None).status == UNAVAILABLE


def test_kernel_with_another_torch_is_installable_and_expects_the_import_to_fail() -> None:
    """A known ABI pairing predicts an import failure; it is carried as an expectation, never as the status."""
    cat = load_catalog()
    cell = Cell("13.0", "nightly", "0.4.2", "0.6.17")
    up = resolve(cell, cat, lambda h: None)
    assert up.status == RESOLVED and up.reason == ""
    assert [s.package for s in up.sources] == ["torch", "sglang-kernel", "flashinfer-python"]
    assert up.indexes == ("https://download.pytorch.org/whl/nightly/cu130",) and up.prerelease
    (expect,) = up.expect
    assert "import sgl_kernel" in expect and "torch 2.11.0's C++ ABI" in expect and "inventory" in expect
    assert up.overrides == ("torch",)  # the kernel's own torch pin (0.4.7+) must not veto the nightly
    down = resolve(cell, cat, lambda h: "DNS: Name or service not known")
    assert down.status == UNREACHABLE and down.expect == up.expect
    line = plan_lines([down])[0]
    assert " unreachable " in line and "note: expect `import sgl_kernel` to fail" in line
    assert plan_json([down])[0]["expect"] == [expect]
    # what cannot be installed stays unavailable, with no expectation attached
    no_wheels = resolve(Cell("12.8", "nightly", "0.4.2", "none"), cat, lambda h: None)
    assert no_wheels.status == UNAVAILABLE and no_wheels.expect == ()
    # an exact torch release against the kernel's pairing is installable too: the same expectation, no veto
    other = resolve(Cell("13.0", "2.9.1", "0.4.2", "none"), cat)
    assert other.status == RESOLVED and other.overrides == ("torch",)
    (other_expect,) = other.expect
    assert "torch 2.11.0's C++ ABI" in other_expect and "this cell has torch 2.9.1" in other_expect
    # matching cells carry no expectation and no override
    paired = resolve(Cell("13.0", "stable", "0.4.2", "none"), cat)
    assert paired.expect == () and paired.overrides == ()


def test_catalog_facts_all_have_sources() -> None:
    cat = load_catalog()
    assert all(c.source for c in cat.cuda.values())
    assert all(t.source for t in cat.torch.values())
    assert all(k.source for k in cat.kernels.values())
    assert all(r.source for r in cat.jit_cache)


def test_stable_follows_kernel_abi() -> None:
    cat = load_catalog()
    assert resolve(Cell("12.8", "stable", "0.4.1", "none"), cat).versions["torch"] == "2.9.1"
    assert resolve(Cell("13.0", "stable", "0.4.2", "none"), cat).versions["torch"] == "2.11.0"
    assert resolve(Cell("13.0", "stable", "0.4.10", "none"), cat).versions["torch"] == "2.14.1"
    newest = resolve(Cell("13.0", "stable", "none", "none"), cat)
    assert newest.versions["torch"] == cat.torch_latest_stable == "2.15.0"
    # the newest release's registry wheel is its CUDA 13.2 build: that cell needs no PyTorch index
    on_132 = resolve(Cell("13.2", "stable", "none", "0.7.4"), cat)
    assert on_132.sources[0].requirement == "torch==2.15.0" and on_132.indexes == ()
    assert newest.sources[0].requirement == "torch==2.15.0+cu130" and newest.indexes


def test_wrong_catalog_fact_changes_resolution() -> None:
    """The self-check test builds on this: a false 'registry is cu128' fact makes a registry cell."""
    cat = load_catalog()
    lying = replace(cat, torch=dict(cat.torch, **{"2.11.0": replace(cat.torch["2.11.0"], registry="cu128")}))
    r = resolve(Cell("12.8", "2.11.0", "none", "none"), lying)
    assert r.status == RESOLVED and r.sources[0].requirement == "torch==2.11.0" and r.indexes == ()


def test_golden_dir_exists() -> None:
    assert Path(GOLDEN).is_dir()

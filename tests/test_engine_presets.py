"""Engine presets: vLLM beside SGLang in the catalog, a release whose pins the registry does not serve is
unavailable in the plan, a wheel's glibc floor refuses a venv cell on an older host, and the catalog check
notices when any of these facts drift (readings written here, not read from the index)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

from common import catalog
from common.resolve import UNAVAILABLE, resolve
from provision import catalogcheck as cc
from provision.venvbuild import below_floor, glibc_here
from tests.checks_helpers import ROOT


def _plan(matrix: str) -> list[dict[str, object]]:
    out = subprocess.run([sys.executable, "-m", "provision.cli", "plan", "--matrix", matrix, "--no-reach-check",
                          "--json"],
                         cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_vllm_presets_carry_their_pins_and_no_sgl_kernel() -> None:
    c = catalog.load()
    v = c.presets["vllm-0.33.0"]
    assert (v.engine, v.torch, v.flashinfer, v.sgl_kernel, v.platform) == ("vllm", "2.14.0", "0.7.2.post1", "none",
                                                                          "manylinux_2_28")
    assert "2.14.0" in c.torch  # the torch vLLM pins has a row, so its cell resolves
    assert all(p.engine == "sglang" for p in c.presets.values() if p.name.startswith("sglang-"))
    assert "0.33.0" not in c.sglang_pins  # an SGLang release map never holds vLLM versions


def test_engines_matrix_plans_both_engines_and_refuses_the_unserved_vllm_release() -> None:
    cells = {str(c["cell_id"]): c for c in _plan("matrices/engines.yaml")}
    assert cells["cu130-torch2.14.1-sgl0.4.10-fi0.7.2-sglang0.5.23"]["status"] == "resolved"
    assert cells["cu130-torch2.14.0-sglnone-fi0.7.2.post1-vllm0.33.0"]["status"] == "resolved"
    assert len(cells) == 3  # each release once, carrying its engine
    refused = cells["cu130-torch2.14.0-sglnone-fi0.7.3-vllm0.34.0"]
    assert refused["status"] == UNAVAILABLE
    assert "vllm 0.34.0" in str(refused["reason"]) and "flashinfer-python 0.7.3 is not on the registry" in str(
        refused["reason"])


def test_a_served_release_resolves_once_its_unserved_note_is_gone() -> None:
    c = catalog.load()
    served = dataclasses.replace(c.presets["vllm-0.34.0"], unserved="")
    c2 = dataclasses.replace(c, presets={**c.presets, "vllm-0.34.0": served})
    from common.matrix import Cell

    cell = Cell("13.0", "2.14.0", "none", "0.7.3", preset="vllm-0.34.0")
    assert resolve(cell, c).status == UNAVAILABLE
    assert resolve(cell, c2).status == "resolved"


def test_glibc_floor_refuses_a_venv_cell_on_an_older_host() -> None:
    r = next(r for r in (resolve(c, catalog.load()) for c in _engine_cells()) if r.cell.preset == "sglang-0.5.23")
    why = below_floor(r, (2, 31))
    assert why is not None and "manylinux_2_34" in why and "glibc 2.31" in why
    assert below_floor(r, (2, 34)) is None and below_floor(r, (2, 39)) is None
    assert below_floor(r, None) is None  # a host whose glibc cannot be read is not refused on a guess
    here = glibc_here()
    assert here is None or here >= (2, 17)


def _engine_cells() -> list:  # type: ignore[type-arg]
    from common.matrix import load

    return list(load(ROOT / "matrices" / "engines.yaml", catalog.load()).cells)


def _readings(c: catalog.Catalog, **vllm_over: dict[str, cc.Seen]) -> cc.Readings:
    """Readings that agree with the catalog everywhere, but for the vLLM fields given."""
    ok = cc.Seen
    vllm = {}
    for p in c.engine_presets("vllm"):
        vllm[p.version] = {"torch": ok(p.torch, "m"), "flashinfer": ok(p.flashinfer, "m"),
                           "platform": ok(p.platform, "f"), "unserved": ok("x is not on the index" if p.unserved
                                                                           else "", "l")}
    for version, fields in vllm_over.items():
        vllm[version.replace("_", ".")].update(fields)
    sglang = {p.version: {"torch": ok(p.torch, "m"), "sgl_kernel": ok(p.sgl_kernel, "m"),
                          "flashinfer": ok(p.flashinfer, "m"), "platform": ok(p.platform or "none", "f")}
              for p in c.engine_presets("sglang")}
    kernels = {k.version: cc.KernelSeen(ok(k.version, "l"), ok(k.torch, "m"), ok(k.registry_cuda, "w"))
               for k in c.kernels.values()}
    return cc.Readings("index", {p: ok(v, "l") for p, v in c.newest.items()}, sglang, kernels,
                       {v: ok(t.registry, "w") for v, t in c.torch.items()}, vllm)


def test_catalog_check_flags_vllm_drift() -> None:
    c = catalog.load()
    assert cc.compare(c, _readings(c)).drift == ()
    moved = cc.compare(c, _readings(c, **{"0_33_0": {"flashinfer": cc.Seen("0.7.4", "meta")}}))
    assert [d.key for d in moved.drift] == ["vllm.releases[0.33.0].flashinfer"]
    served_now = cc.compare(c, _readings(c, **{"0_34_0": {"unserved": cc.Seen("", "lists")}}))
    assert [(d.key, d.recorded, d.registry) for d in served_now.drift] == [
        ("vllm.releases[0.34.0].unserved", "unserved", "served")]
    gone = cc.compare(c, _readings(c, **{"0_33_0": {"unserved": cc.Seen("torch 2.14.0 is not on the index", "l")}}))
    assert [d.key for d in gone.drift] == ["vllm.releases[0.33.0].unserved"]
    newer = cc.compare(c, dataclasses.replace(_readings(c), newest={**_readings(c).newest,
                                                                     "vllm": cc.Seen("0.35.0", "list")}))
    assert [d.key for d in newer.drift] == ["newest.vllm"]

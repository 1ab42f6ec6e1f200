"""`checks advise`, the model estimate, nearest green and `checks diff` on frozen real results.

tests/golden/advise/results holds lines of the committed 2x H200 and no-GPU runs (make_fixture.py); the goldens
next to it are what the commands print for them. Regenerate after an intended change with
STACKPROBE_UPDATE_GOLDEN=1. The PCIe host below is a MIMIC: the same measured rows with their host, backend and
probe names relabelled, built in this file only and never written under results/.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from checks.cli import main
from checks.report import advise, decisions, diff, estimate, launch, nearest
from checks.results import hostresults
from checks.results.result import ProbeResult, Verdict
from common import catalog, reasons
from inenv.status import Status
from tests.checks_helpers import ROOT, committed

GOLDEN = ROOT / "tests" / "golden" / "advise"
FIXTURE = GOLDEN / "results"
UPDATE = os.environ.get("STACKPROBE_UPDATE_GOLDEN") == "1"
H200 = "h200x2-5bce98f7"
CPU = "cpu-5bce98f7"
CELL = "local-cu130-torch2.11.0-sglnone-fi0.6.18"
PINS = {p.version: p.sgl_kernel for p in catalog.load().presets.values()}
ENGINES = launch.load()


def _golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if UPDATE:
        path.write_text(text)
    assert text == path.read_text(), f"{name} differs from the golden (STACKPROBE_UPDATE_GOLDEN=1)"


def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def hosts() -> dict[str, hostresults.HostResults]:
    return hostresults.load(FIXTURE)


def _advice(h: hostresults.HostResults, ranks: int = 2) -> advise.CellAdvice:
    return advise.advise_cell(h.host_id, CELL, ranks, h.latest(), h.facts)


# --------------------------------------------------------------------------------------------------
# Goldens


def test_advise_golden_h200_deepseek_tp2(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _cli(capsys, "advise", "--results", str(FIXTURE), "--host", H200, "--model", "deepseek-v3",
                        "--tp", "2")
    assert code == 0
    _golden("advise-h200x2-deepseek-v3-tp2.txt", out)
    code, js, _ = _cli(capsys, "advise", "--results", str(FIXTURE), "--host", H200, "--model", "deepseek-v3",
                       "--tp", "2", "--json")
    assert code == 0
    _golden("advise-h200x2-deepseek-v3-tp2.json", js)
    data = json.loads(js)[0]
    cell = data["cells"][0]
    assert cell["advice"]["sizes"][0]["use"] == "flashinfer-custom-ar"
    assert cell["estimate"]["model"]["hidden"] == 7168
    assert data["estimate_is"].startswith("an estimate")


def test_estimate_golden_every_model_shape(hosts: dict[str, hostresults.HostResults]) -> None:
    a = _advice(hosts[H200])
    text = []
    for _, model in sorted(estimate.model_shapes().items()):
        b = decisions.estimate_block(estimate.estimate(a, model, batch=32, draft=4))
        text += [b.title, *b.lines, ""]
    _golden("estimate-h200x2-tp2-batch32.txt", "\n".join(text))
    _assert_estimate_facts("\n".join(text), batch=32, draft=4)


def _measured_latency() -> dict[str, dict[int, float]]:
    """backend -> {bytes: µs} of the 2x H200 ar-latency run, read from its JSON lines."""
    out: dict[str, dict[int, float]] = {}
    for line in (FIXTURE / H200 / "20261129T164359Z-5173.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row["probe_id"] == "ar-latency" and row["status"] == "pass" and row["cell_id"] == CELL:
            backend = row["variant"].split("backend=")[1]
            out[backend] = {int(k): float(v) for k, v in row["metrics"]["latency_us"].items()}
    return out


def _at(curve: dict[int, float], nbytes: int) -> float:
    """The latency at ``nbytes``, straight between the two measured sizes around it."""
    if nbytes in curve:
        return curve[nbytes]
    lo = max(n for n in curve if n < nbytes)
    hi = min(n for n in curve if n > nbytes)
    return curve[lo] + (nbytes - lo) / (hi - lo) * (curve[hi] - curve[lo])


def _assert_estimate_facts(text: str, batch: int, draft: int) -> None:
    """What every model's estimate must say, worked out here from the model table's data and the measured curves:
    the allreduce count and sizes of a step, and each backend's time per call and per step."""
    from inenv import models as table

    models = {name: {**d, **table.SOURCES[name]} for name, d in table.SHAPES.items()}
    measured = _measured_latency()
    assert sorted(measured) == ["flashinfer-custom-ar", "nccl", "nccl-direct", "symm-mem-one-shot",
                                "symm-mem-two-shot"]
    blocks = text.split("\nEstimate, not a measurement")
    assert len(blocks) == len(models) == 6
    for model, block in zip((models[k] for k in sorted(models)), blocks, strict=True):
        hidden, layers = model["hidden"], model["layers"]
        calls = layers * 2
        assert f"{model['label']}, tp 2, cell `{CELL}`" in block
        assert f"hidden {hidden}, {layers} layers × 2 allreduces = {calls} allreduces per forward pass" in block
        decode, verify = batch * hidden * 2, batch * draft * hidden * 2
        shown = {458752: "448 KiB", 1835008: "1.75 MiB", 524288: "512 KiB", 2097152: "2 MiB", 262144: "256 KiB",
                 1048576: "1 MiB", 393216: "384 KiB", 1572864: "1.5 MiB", 327680: "320 KiB",
                 1310720: "1.25 MiB"}  # bf16 bytes of 32 and 128 tokens at hidden 7168, 8192, 4096, 6144, 5120
        assert f"decode step {batch} tokens = {shown[decode]} per allreduce" in block
        assert f"= {batch * draft} tokens = {shown[verify]} per allreduce" in block
        for backend, curve in measured.items():
            d, v = _at(curve, decode), _at(curve, verify)
            assert (f"- {backend}: decode {d * calls:.1f} µs/step ({d:.2f} µs per call" in block
                    and f"verify {v * calls:.1f} µs/step ({v:.2f} µs per call" in block), (model["label"], backend)
        fastest = min(measured, key=lambda b: _at(measured[b], decode))
        assert f"Fastest measured: decode {fastest} " in block


def test_diff_goldens(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _cli(capsys, "diff", "20261129T155743Z-e6d7", "20261129T161848Z-92e5", "--results", str(FIXTURE))
    assert code == 0
    _golden("diff-runs.txt", out)
    assert "verdict fail (abi-mismatch) → pass" in out  # flashinfer's custom AR, broken then fixed
    code, out, _ = _cli(capsys, "diff", "cu130-torch2.11.0-sgl0.4.2-fi0.6.16", "cu130-torch2.11.0-sgl0.4.2-fi0.6.17",
                        "--results", str(FIXTURE))
    assert code == 0
    _golden("diff-cells.txt", out)
    assert "fi-jit / ranks=1,module=trtllm_comm,arch=12.0a: verdict fail (fi-arch-gate) → pass" in out


# --------------------------------------------------------------------------------------------------
# What the advice says on the real 2x H200 results


def test_advice_on_h200_names_the_fastest_exact_backend_with_its_results(
        hosts: dict[str, hostresults.HostResults]) -> None:
    a = _advice(hosts[H200])
    first = a.sizes[0]
    assert (first.nbytes, first.tokens, first.fastest, first.use) == (14336, 1, "flashinfer-custom-ar",
                                                                      "flashinfer-custom-ar")
    assert first.fastest_us == 4.427 and first.ratio_vs_nccl == 0.5716
    assert any("/ar-latency/ranks=2,backend=flashinfer-custom-ar" in i for i in first.ids)
    assert any("/custom-ar/ranks=2,impl=flashinfer" in i for i in first.ids)  # the eager-exact proof
    assert [s.use for s in a.sizes[5:]] == ["symm-mem-two-shot"] * 5
    (x,) = a.crossovers
    assert (x.below, x.above, x.lo, x.hi) == ("flashinfer-custom-ar", "symm-mem-two-shot", 229376, 458752)
    assert x.at is not None and 440_000 < x.at < 458752
    tree = next(v for v in a.avoid if "NCCL_ALGO=Tree" in v.what)
    assert (tree.status, tree.reason_code, len(tree.ids)) == ("partial", "nccl-algo-unavailable", 4)
    slow = next(v for v in a.avoid if v.what.startswith("flashinfer-custom-ar at"))
    assert "7 MiB" in slow.what and "1.40×" in slow.why
    assert [u.feature for u in a.untimed] == ["fi-fusion", "NCCL_ALGO=Ring", "NCCL_ALGO=allreduce:tree"]
    assert a.multicast is False and a.full_nvlink is True
    assert any(m.what == "flashinfer-pcie-ipc" and "ar-latency" in m.run for m in a.missing)


def test_launch_settings_come_from_the_data_file_and_the_host(hosts: dict[str, hostresults.HostResults]) -> None:
    a = _advice(hosts[H200])
    plan = launch.plan(a, ENGINES, PINS)
    by = {(s.engine, s.release, s.backend): s for s in plan.settings}
    assert by[("SGLang", "0.5.11", "flashinfer-custom-ar")].state == "default"
    assert "--disable-custom-all-reduce" in by[("SGLang", "0.5.11", "flashinfer-custom-ar")].note
    assert by[("SGLang", "0.5.23", "flashinfer-custom-ar")].settings == ("SGLANG_OPT_USE_CUSTOM_ALL_REDUCE_V2=0",)
    two = by[("SGLang", "0.5.11", "symm-mem-two-shot")]
    assert two.state == "unavailable-here" and "multicast" in two.note  # the release needs it, the host has none
    assert by[("vLLM", "0.33.0", "symm-mem-two-shot")].state == "unavailable-here"
    assert by[("SGLang", "0.5.23", "fi-fusion")].settings == ("--flashinfer-allreduce-fusion-backend trtllm",)
    assert all(s.source for s in plan.settings if s.state != "not-covered")
    assert any("no SGLang release" in n for n in plan.scope)  # the cell has no sgl-kernel


def test_a_cell_runs_the_sglang_release_that_pins_its_sgl_kernel() -> None:
    assert launch.cell_sglang("cu130-torch2.11.0-sgl0.4.2-fi0.6.17", PINS) == ("0.5.11",)
    assert launch.cell_sglang("cu128-torch2.9.1-sgl0.4.1-fi0.6.16", PINS) == ("0.5.10",)
    assert launch.cell_sglang(CELL, PINS) == ()
    assert launch.cell_sglang("not-a-cell", PINS) == ()


def test_every_data_file_path_names_a_known_backend_and_covered_releases() -> None:
    known = set(advise.BACKENDS) | set(advise.UNTIMED)
    for p in ENGINES.paths:
        assert p.backend in known, p
        assert set(p.releases) <= set(ENGINES.releases[p.engine]), p
        assert p.source, p
        assert p.supported or p.why, p


# --------------------------------------------------------------------------------------------------
# Estimate


def test_interpolation_is_exact_linear_bounded_below_and_refuses_above() -> None:
    curve = {100: 10.0, 300: 30.0}
    assert estimate.interpolate(curve, 100) == estimate.Point(10.0, "measured")
    assert estimate.interpolate(curve, 200) == estimate.Point(20.0, "interpolated")
    assert estimate.interpolate(curve, 50) == estimate.Point(10.0, "below-range")
    assert estimate.interpolate(curve, 301) is None
    assert estimate.interpolate({}, 1) is None


def test_estimate_uses_the_exact_message_size_and_counts_every_allreduce(
        hosts: dict[str, hostresults.HostResults]) -> None:
    a = _advice(hosts[H200])
    e = estimate.estimate(a, estimate.parse_model("deepseek-v3"), batch=8, draft=4)
    nccl = next(r for r in e.rows if r.backend == "nccl")
    assert (nccl.decode.nbytes, nccl.decode.per_call.how) == (8 * 7168 * 2, "measured")
    assert math.isclose(nccl.decode.total_us, 7.243 * 122)
    llama = estimate.estimate(a, estimate.parse_model("llama-3.1-70b"), batch=8, draft=4)
    row = next(r for r in llama.rows if r.backend == "nccl")
    n = 8 * 8192 * 2  # 128 KiB: between the measured 112 KiB and 224 KiB
    assert row.decode.nbytes == n and row.decode.per_call.how == "interpolated"
    lat = a.curve("nccl").latency_us
    t = (n - 114688) / (229376 - 114688)
    assert math.isclose(row.decode.per_call.us, lat[114688] + t * (lat[229376] - lat[114688]))
    assert math.isclose(row.decode.total_us, row.decode.per_call.us * 160)
    fi = next(r for r in llama.rows if r.backend == "flashinfer-custom-ar")
    assert math.isclose(fi.decode.saving, 1 - fi.decode.total_us / row.decode.total_us)
    big = estimate.estimate(a, estimate.parse_model("hidden=8192,layers=80"), batch=512, draft=4)
    assert all(r.decode.total_us is None and r.verify.total_us is None for r in big.rows)  # above 7 MiB


@pytest.mark.parametrize(("spec", "message"), [
    ("gpt-5", "unknown model 'gpt-5'; model shapes: deepseek-v3"), ("hidden=7168", "both hidden=N and layers=N"),
    ("hidden=x,layers=2", "positive"),
    ("hidden=8,layers=2,dtype=fp8", "dtype='fp8'"), ("depth=3", "is not one of"),
])
def test_bad_model_specs_say_what_to_give(spec: str, message: str) -> None:
    with pytest.raises(estimate.ModelError, match=message.replace("(", r"\(").replace("*", r"\*")):
        estimate.parse_model(spec)


def test_model_shapes_are_the_published_ones() -> None:
    p = estimate.model_shapes()
    assert {k: (m.hidden, m.layers, m.allreduces) for k, m in p.items()} == {
        "deepseek-v3": (7168, 61, 122), "kimi-k2": (7168, 61, 122), "llama-3.1-70b": (8192, 80, 160),
        "qwen3-235b-a22b": (4096, 94, 188), "qwen3-32b": (5120, 64, 128), "qwen3-coder-480b-a35b": (6144, 62, 124)}
    assert all("huggingface.co" in m.source and "checked against" in m.source for m in p.values())
    assert estimate.parse_model("hidden=4096,layers=94,dtype=fp32").dtype_bytes == 4


# --------------------------------------------------------------------------------------------------
# Nearest green, diff


def test_nearest_green_is_the_cell_one_flashinfer_release_away(hosts: dict[str, hostresults.HostResults]) -> None:
    greens = nearest.nearest_green(hosts[CPU].latest())
    g = next(g for g in greens if g.cell_id.endswith("fi0.6.16") and g.variant.endswith("trtllm_comm,arch=12.0a"))
    assert (g.nearest, g.changes) == ("cu130-torch2.11.0-sgl0.4.2-fi0.6.17", ("flashinfer 0.6.16 → 0.6.17",))
    assert g.failing_id.split("/")[1:] == [g.cell_id, "fi-jit", g.variant]


def _res(cell: str, status: Status, probe: str = "p", variant: str = "ranks=1", run: str = "r1") -> ProbeResult:
    return ProbeResult(run, "h", cell, probe, variant, Verdict(status), "2026-11-29T00:00:00Z")


def test_nearest_green_prefers_fewest_axis_changes_then_the_newest_versions() -> None:
    failing = _res("cu130-torch2.11.0-sgl0.4.2-fi0.6.16", Status.FAIL)
    two_axes = _res("cu128-torch2.9.1-sgl0.4.2-fi0.6.16", Status.PASS)
    old = _res("cu130-torch2.11.0-sgl0.4.2-fi0.6.8", Status.PASS)
    new = _res("cu130-torch2.11.0-sgl0.4.2-fi0.6.17", Status.PASS)
    nightly = _res("cu130-torchnightly-sgl0.4.2-fi0.6.16", Status.PASS)
    (g,) = nearest.nearest_green([failing, two_axes, old, new])
    assert g.nearest == new.cell_id
    (g,) = nearest.nearest_green([failing, two_axes, old, new, nightly])
    assert g.nearest == nightly.cell_id  # one axis too, and nightly is newer than any release
    (g,) = nearest.nearest_green([failing, _res("odd-cell", Status.PASS)])
    assert g.nearest == "odd-cell" and len(g.changes) == len(nearest.AXES)


def test_nearest_green_leaves_out_what_the_host_could_not_check_further() -> None:
    """A partial saying how far this host could check (one rank where NCCL refuses two on one GPU) is not a
    shortfall another cell of the host makes good; a partial for another reason is still looked up."""
    one_rank = ProbeResult("r1", "h", "cu130-torch2.11.0-sglnone-fi0.7.4", "nccl-graphs", "ranks=1,check=table",
                           Verdict(Status.PARTIAL, "nccl-setup-only", "one rank"), "2026-11-29T00:00:00Z")
    other = ProbeResult("r1", "h", "cu130-torch2.11.0-sglnone-fi0.7.4", "inventory", "ranks=1",
                        Verdict(Status.PARTIAL, "dependency-pin-violated", "a pin"), "2026-11-29T00:00:00Z")
    bound = reasons.default().host_bound_codes
    assert {"nccl-setup-only", "symm-mem-nccl-one-rank", "symm-mem-multicast-disabled"} <= bound
    assert [g.probe_id for g in nearest.nearest_green([one_rank, other], bound)] == ["inventory"]
    assert [g.probe_id for g in nearest.nearest_green([one_rank, other])] == ["inventory", "nccl-graphs"]


def test_diff_selects_runs_hosts_cells_and_refuses_mixed_kinds(hosts: dict[str, hostresults.HostResults]) -> None:
    assert diff.select(hosts, H200).kind == "host"
    assert diff.select(hosts, f"{H200}/{CELL}").kind == "cell"
    assert diff.select(hosts, "20261129T164359Z-5173").kind == "run"
    with pytest.raises(diff.SelectError, match="a run and"):
        diff.diff(diff.select(hosts, "20261129T164359Z-5173"), diff.select(hosts, H200))
    with pytest.raises(diff.SelectError, match="did you mean"):
        diff.select(hosts, "20261129T164359Z-5174")
    d = diff.diff(diff.select(hosts, "20261129T161848Z-92e5"), diff.select(hosts, "20261129T164359Z-5173"))
    assert d.compared == 12 and all(not c.verdict_changed for c in d.changes) and d.changes  # reruns: numbers moved


def test_since_previous_compares_the_newest_run_with_what_came_before(
        hosts: dict[str, hostresults.HostResults]) -> None:
    d = diff.since_previous(hosts[H200])
    assert d is not None and d.b == "20261129T171209Z-9f3a" and d.compared == 12
    assert {c.key[1] for c in d.changes} == {"custom-ar"}
    assert all(c.a_id.startswith("20261129T161848Z-92e5/") for c in d.changes)


# --------------------------------------------------------------------------------------------------
# Command line


@pytest.mark.parametrize(("argv", "message"), [
    (["advise", "--tp", "1"], "--tp 1"), (["advise", "--tp", "two"], "--tp"), (["advise", "--model", "gpt"], "--model"),
    (["advise", "--host", "h200x3"], "--host"), (["advise", "--cell", "nope"], "--cell"),
    (["advise", "--batch", "0"], "--batch"), (["diff", "nope", H200], "names no run"),
    (["diff", H200, "20261129T164359Z-5173"], "compare two runs"),
])
def test_bad_input_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    code, out, err = _cli(capsys, *argv, "--results", str(FIXTURE))
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and message in err


def test_missing_results_directory_is_bad_input(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = _cli(capsys, "advise", "--results", str(tmp_path / "none"))
    assert code == 2 and "--results" in err


# --------------------------------------------------------------------------------------------------
# A PCIe host MIMIC: measured 2x H200 rows, relabelled. Not a measurement of any PCIe host.

MIMIC_HOST = "pcie2x-MIMIC-relabelled-h200-rows"


def _relabel(r: ProbeResult, **changes: Any) -> ProbeResult:
    return dataclasses.replace(r, host_id=MIMIC_HOST, **changes)


def _mimic(hosts: dict[str, hostresults.HostResults]) -> hostresults.HostResults:
    rows = {r.result_id: r for r in hosts[H200].results}

    def row(run: str, probe: str, variant: str) -> ProbeResult:
        return rows[f"{run}/{CELL}/{probe}/{variant}"]

    fi_timed = row("20261129T164359Z-5173", "ar-latency", "ranks=2,backend=flashinfer-custom-ar")
    fi_exact = row("20261129T171209Z-9f3a", "custom-ar", "ranks=2,impl=flashinfer,full_nvlink=topology")
    relabelled = [
        _relabel(row("20261129T164359Z-5173", "ar-latency", "ranks=2,backend=nccl")),
        # the custom allreduce's measured curve and exactness, named as the PCIe IPC kernel's
        _relabel(fi_timed, variant="ranks=2,backend=flashinfer-pcie-ipc"),
        _relabel(fi_exact, probe_id="pcie-ipc", variant="ranks=2,op=all-reduce"),
        # the custom allreduce as broken as it once measured (a missing symbol), as on hosts where it cannot run
        _relabel(row("20261129T155743Z-e6d7", "ar-latency", "ranks=2,backend=flashinfer-custom-ar"),
                 run_id="20261129T164359Z-5173"),
        *(_relabel(r) for r in hosts[H200].latest() if r.probe_id in ("nccl-graphs", "symm-mem")),
    ]
    facts = {"gpu_name": "MIMIC (H200 rows relabelled)", "gpu_count": 2, "interconnect": "PCIe (mimic)",
             "multicast": [False, False]}
    return hostresults.HostResults(MIMIC_HOST, ("20261129T161848Z-92e5", "20261129T164359Z-5173"),
                                   tuple(relabelled), facts)


def test_pcie_mimic_advises_the_pcie_ipc_kernel_and_its_settings(hosts: dict[str, hostresults.HostResults]) -> None:
    h = _mimic(hosts)
    d = decisions.decide(h, ENGINES, PINS, model=estimate.parse_model("deepseek-v3"))
    (c,) = d.cells
    a = c.advice
    assert a.sizes[0].use == "flashinfer-pcie-ipc"
    assert any(x.what.startswith("ar-latency backend=flashinfer-custom-ar") and x.reason_code == "abi-mismatch"
               for x in a.avoid)
    by = {(s.engine, s.release, s.backend): s for s in c.launch.settings}
    assert by[("SGLang", "0.5.11", "flashinfer-pcie-ipc")].state == "unsupported"
    s23 = by[("SGLang", "0.5.23", "flashinfer-pcie-ipc")]
    assert s23.settings == ("SGLANG_ENABLE_PCIE_IPC_ALLREDUCE=1",) and "--disable-custom-all-reduce" in s23.note
    assert by[("vLLM", "0.33.0", "flashinfer-pcie-ipc")].settings == ("VLLM_ALLREDUCE_USE_FLASHINFER_PCIE_IPC=1",)
    text = decisions.render(d)
    _golden("advise-pcie-mimic.txt", "MIMIC: measured 2x H200 rows relabelled in tests/test_checks_advise.py\n" + text)


# --------------------------------------------------------------------------------------------------
# Any result set, however partial or damaged: no traceback, and no backend named without a passing exact
# measurement (checked here independently of advise's own bookkeeping).


def _params(v: str) -> dict[str, str]:
    return dict(p.partition("=")[::2] for p in v.split(",") if p)


def _ok(x: Any) -> bool:
    return isinstance(x, dict) and x.get("verdict") == "ok"


def _exact_all(x: Any) -> bool:
    return isinstance(x, dict) and bool(x) and all(isinstance(c, dict) and c.get("verdict") == "exact"
                                                 for c in x.values())


def _proves_eager(backend: str, r: ProbeResult, cell: str, ranks: int) -> bool:
    p, ev = _params(r.variant), r.verdict.evidence
    if r.cell_id != cell or p.get("ranks") != str(ranks) or p.get("gpus") == "shared":
        return False
    if r.verdict.status not in (Status.PASS, Status.PARTIAL):
        return False
    if backend in ("nccl", "nccl-direct"):
        op = (ev.get("ops") or {}).get("all_reduce") if isinstance(ev.get("ops"), dict) else None
        return (r.probe_id == "nccl-graphs" and p.get("algo") == "default" and isinstance(op, dict)
                and (_ok(op.get("eager")) or _ok(op.get("eager_after"))) and _ok(op.get("graph")))
    if backend.startswith("symm-mem-"):
        kind = backend[len("symm-mem-"):].replace("-", "_")
        op = (ev.get("ops") or {}).get(kind) if isinstance(ev.get("ops"), dict) else None
        return r.probe_id == "symm-mem" and isinstance(op, dict) and _ok(op.get("eager")) and _ok(op.get("graph"))
    if backend == "flashinfer-custom-ar":
        g = ev.get("graph")
        return (r.probe_id == "custom-ar" and p.get("impl") == "flashinfer" and _exact_all(ev.get("eager"))
                and isinstance(g, dict) and _exact_all(g.get("checks")))
    if backend == "flashinfer-pcie-ipc":
        return r.probe_id == "pcie-ipc" and p.get("op") == "all-reduce" and r.verdict.status is Status.PASS
    return False


def _timed_exact(backend: str, r: ProbeResult, cell: str, ranks: int, nbytes: int | None) -> bool:
    p = _params(r.variant)
    lat = r.verdict.metrics.get("latency_us")
    return (r.probe_id == "ar-latency" and r.cell_id == cell and p.get("ranks") == str(ranks)
            and p.get("backend") == backend and r.verdict.status in (Status.PASS, Status.PARTIAL)
            and isinstance(lat, dict) and (nbytes is None or str(nbytes) in lat))


def _measured_exactly(backend: str, results: list[ProbeResult], cell: str, ranks: int, nbytes: int | None) -> bool:
    return (any(_timed_exact(backend, r, cell, ranks, nbytes) for r in results)
            and any(_proves_eager(backend, r, cell, ranks) for r in results))


ROWS = [r for h in hostresults.load(FIXTURE).values() for r in h.results]
JUNK = st.one_of(st.none(), st.booleans(), st.integers(-5, 10**9), st.floats(allow_nan=True, allow_infinity=True),
                 st.text(max_size=8), st.lists(st.integers(), max_size=3),
                 st.dictionaries(st.text(max_size=6), st.integers() | st.text(max_size=4), max_size=3))


def _damage(draw: st.DrawFn, r: ProbeResult) -> ProbeResult:
    what = draw(st.sampled_from(["keep", "keep", "keep", "status", "metrics", "evidence", "variant", "run"]))
    v = r.verdict
    if what == "status":
        v = dataclasses.replace(v, status=draw(st.sampled_from(list(Status))), reason_code=draw(st.text(max_size=12)))
    elif what == "metrics":
        key = draw(st.sampled_from(["latency_us", "ratio_vs_nccl", "headline", "nccl_latency_us"]))
        value = draw(JUNK | st.dictionaries(st.sampled_from(["14336", "114688", "x", "-1", "7340032", "99"]), JUNK,
                                            max_size=4))
        v = dataclasses.replace(v, metrics={**v.metrics, key: value})
    elif what == "evidence":
        key = draw(st.sampled_from(["ops", "eager", "graph", "hidden", "device_multicast_support",
                                    "topology_full_nvlink", "multimem"]))
        v = dataclasses.replace(v, evidence={**v.evidence, key: draw(JUNK)})
    elif what == "variant":
        odd = ["", "ranks=", "ranks=4,backend=nccl", "ranks=2,x", "ranks=2,backend=zzz", r.variant + ",gpus=shared"]
        return dataclasses.replace(r, variant=draw(st.sampled_from(odd)))
    elif what == "run":
        return dataclasses.replace(r, run_id=draw(st.sampled_from(["20261130T000000Z-ffff", "0", r.run_id])))
    return dataclasses.replace(r, verdict=v)


# Most sets are a random part of the 2x H200 results (so advice has something to stand on), each row possibly
# damaged, plus rows from anywhere in the fixture.
BASE = hostresults.load(FIXTURE)[H200].latest()


@st.composite
def result_sets(draw: st.DrawFn) -> list[ProbeResult]:
    keep = draw(st.lists(st.booleans(), min_size=len(BASE), max_size=len(BASE)))
    rows = [_damage(draw, r) for r, k in zip(BASE, keep, strict=True) if k]
    extra = draw(st.lists(st.sampled_from(ROWS), max_size=15))
    return rows + [_damage(draw, r) for r in extra]


FACTS = st.fixed_dictionaries({}, optional={"gpu_count": JUNK | st.integers(0, 8), "gpu_name": JUNK,
                                            "multicast": JUNK | st.lists(st.booleans(), max_size=3),
                                            "interconnect": JUNK})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=result_sets(), facts=FACTS, tp=st.sampled_from([None, 2, 4]),
       model=st.sampled_from([None, "deepseek-v3", "qwen3-235b-a22b", "hidden=1,layers=1"]))
def test_any_result_set_gives_advice_without_a_traceback_or_an_unproven_backend(
        rows: list[ProbeResult], facts: dict[str, Any], tp: int | None, model: str | None) -> None:
    runs = tuple(sorted({r.run_id for r in rows}))
    h = hostresults.HostResults("h", runs, tuple(rows), facts)
    d = decisions.decide(h, ENGINES, PINS, tp=tp, model=estimate.parse_model(model) if model else None)
    decisions.render(d)
    json.dumps(decisions.to_json(d))
    latest = h.latest()
    for c in d.cells:
        a = c.advice
        named = [(s.fastest, s.nbytes) for s in a.sizes] + [(s.use, s.nbytes) for s in a.sizes]
        named += [(s.runner_up, s.nbytes) for s in a.sizes if s.runner_up]
        named += [(x.below, x.lo) for x in a.crossovers] + [(x.above, x.hi) for x in a.crossovers]
        named += [(s.backend, None) for s in c.launch.settings if s.backend in advise.BACKENDS]
        if c.estimate is not None:
            named += [(r.backend, None) for r in c.estimate.rows]
        for backend, nbytes in named:
            assert _measured_exactly(backend, latest, a.cell_id, a.ranks, nbytes), (backend, nbytes)
    diff.compare(diff._keyed(latest, True), diff._keyed(list(rows), True))  # damaged results: no traceback either
    diff.since_previous(h)


def test_report_sections_carry_the_advice_the_default_estimate_and_nearest_green(tmp_path: Path) -> None:
    from checks.report.answer import Stack
    from checks.report.report import generate

    out = tmp_path / "docs" / "compatibility.md"
    every = sorted({r.cell_id for h in hostresults.load(FIXTURE).values() for r in h.results})
    assert generate(FIXTURE, out, None, check=False, stacks=[Stack(c, "matrix.yaml") for c in every]) == 0
    page = out.with_suffix(".html").read_text()
    h200 = (out.parent / "hosts" / f"{H200}.md").read_text().split(f"host `{H200}`")[1]
    md = (out.parent / "hosts" / f"{CPU}.md").read_text()
    assert "### What to launch with on this host" in h200
    assert "Estimate, not a measurement — DeepSeek-V3 / R1 class, tp 2" in h200
    assert "→ use flashinfer-custom-ar" in h200 and "Since the newest run `20261129T171209Z-9f3a`" in h200
    cpu = md.split(f"host `{CPU}`")[1].split("\n## ")[0]
    assert "passes in `cu130-torch2.11.0-sgl0.4.2-fi0.6.17` (flashinfer 0.6.16 → 0.6.17)" in cpu
    assert "<b>Estimate, not a measurement" in page


def test_advise_without_host_leaves_out_gpu_less_hosts_in_one_line(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """The committed results hold a GPU-less host beside two H200 hosts: advise without --host prints the H200
    hosts only, and one line says which host was left out and how to pick one; --host still shows it. (On a
    machine whose own host is none of them: --here names one that is not.)"""
    assert main(["advise", "--results", str(committed()), "--here", "cpu-00000000"]) == 0
    out, err = capsys.readouterr()
    assert "host cpu-5bce98f7" not in out and "no GPU on this host" not in out
    assert "host h200x1-5bce98f7" in out and "host h200x2-5bce98f7" in out
    [line] = [ln for ln in err.splitlines() if ln.startswith("checks advise:")]
    assert "left out cpu-5bce98f7" in line and "`--host ID` picks one" in line
    assert main(["advise", "--results", str(committed()), "--host", "cpu-5bce98f7"]) == 0
    assert capsys.readouterr().out.startswith("host: cpu-5bce98f7 (no GPU), newest run ")
    only = tmp_path / "results"
    only.mkdir()
    shutil.copytree(committed() / "cpu-5bce98f7", only / "cpu-5bce98f7")  # a results folder's links are not read
    assert main(["advise", "--results", str(only), "--here", "cpu-00000000"]) == 0
    out, err = capsys.readouterr()
    assert out == f"this host: cpu-00000000 has no results in {only}; `uv run checks run --all` records them\n"
    assert err.count("\n") == 1 and "no host has GPU results" in err


def test_ties_use_the_run_to_run_spread_measured_across_cells_of_one_build() -> None:
    """The committed 2x H200 results time the same backends in four cells of one build (cu130, torch 2.11.0,
    flashinfer 0.6.8.post1 / 0.6.17 / 0.6.18 / 0.7.4). At 14 KiB, 2 ranks, their latest results read NCCL
    7.480, 7.493, 7.574, 7.586 µs and flashinfer-custom-ar 4.407, 4.410, 4.412, 4.425 µs (read off the jsonl
    files): spreads 0.106/7.5335 and 0.018/4.411 of the median."""
    h = hostresults.load(committed())["h200x2-5bce98f7"]
    cell = "cu130-torch2.11.0-sglnone-fi0.6.17"
    sp = advise.spreads(h.latest(), cell, 2)
    nccl, car = sp.by[("nccl", 14336)], sp.by[("flashinfer-custom-ar", 14336)]
    assert (nccl.samples, car.samples) == (4, 4)  # the local-... cell of the same torch is another environment
    assert nccl.relative == pytest.approx(0.106 / 7.5335, rel=1e-3)
    assert car.relative == pytest.approx(0.018 / 4.411, rel=1e-3)
    assert sp.tie("flashinfer-custom-ar", 14336) == pytest.approx(0.106 / 7.5335, rel=1e-3)
    assert advise.Spreads({}).tie("nccl", 14336) == advise.NOISE  # nothing timed twice: the assumed 5%
    # a gain of 5% is a tie under the assumed 5%, and a switch where the measured spreads are 1.4% and 3.3%
    a = advise.advise_cell(h.host_id, cell, 2, h.latest(), h.facts)
    assert a.spread == sp and all(s.tie == sp.tie(s.fastest, s.nbytes) for s in a.sizes)
    curves = [advise.Curve("nccl", {14336: 7.5}, {14336: 1.0}, ("n",)),
              advise.Curve("symm-mem-two-shot", {14336: 7.125}, {14336: 0.95}, ("s",))]
    [assumed] = advise._per_size(curves, 7168, advise.Spreads({}))
    [measured] = advise._per_size(curves, 7168, sp)
    assert (assumed.use, measured.use) == ("nccl", "symm-mem-two-shot")
    text = decisions.render(decisions.decide(h, ENGINES, PINS, cell=cell, tp=2))
    assert "Ties: a gain smaller than the larger run-to-run spread" in text and "nccl ≤" in text


def test_a_host_whose_peer_to_peer_failed_is_not_advised_a_p2p_backend(
        hosts: dict[str, hostresults.HostResults]) -> None:
    """The committed 2x H200 rows advise flashinfer-custom-ar at 2 ranks; the same rows plus a host-p2p pair
    whose first NCCL allreduce with defaults hung (and passed with NCCL_P2P_DISABLE=1) advise no backend that
    needs peer-to-peer, and say why under avoid."""
    h = hosts[H200]
    before = _advice(h)
    assert "flashinfer-custom-ar" in {c.backend for c in before.curves}
    hung = ProbeResult("r9", H200, "other-cell", "host-p2p", "ranks=2,check=nccl,pair=0-1,p2p=default",
                       Verdict(Status.HANG, note="first allreduce did not return in 90 s; bridge 0000:00:01.0 has "
                               "ACS ReqRedir CmpltRedir set", reason_code="p2p-acs-redirect"), "2026-12-03T00:00:00Z")
    ok = ProbeResult("r9", H200, "other-cell", "host-p2p", "ranks=2,check=nccl,pair=0-1,p2p=disabled",
                     Verdict(Status.PASS), "2026-12-03T00:00:00Z")
    after = advise.advise_cell(h.host_id, CELL, 2, [*h.latest(), hung, ok], h.facts)
    backends = {c.backend for c in after.curves}
    assert backends and not backends & {"flashinfer-custom-ar", "flashinfer-pcie-ipc", "symm-mem-one-shot",
                                        "symm-mem-two-shot"}
    assert all(s.use not in {"flashinfer-custom-ar", "flashinfer-pcie-ipc"} for s in after.sizes)
    lines = [a for a in after.avoid if a.status == "host"]
    assert [a.what for a in lines] == ["flashinfer-custom-ar (needs direct GPU peer-to-peer)",
                                       "flashinfer-pcie-ipc (needs direct GPU peer-to-peer)",
                                       "symm-mem-one-shot (needs direct GPU peer-to-peer)",
                                       "symm-mem-two-shot (needs direct GPU peer-to-peer)"]
    assert all(a.reason_code == "p2p-acs-redirect" and "ACS ReqRedir" in a.why
               and "NCCL_P2P_DISABLE=1 passes on GPUs 0-1" in a.why for a in lines)


@pytest.mark.parametrize("executor", ["venv", "docker", "slurm"])
def test_missing_latency_names_the_back_end_that_ran_the_cell(tmp_path: Path, executor: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """The command for a missing ar-latency result reruns the cell the way its runs were made: a venv
    host is told `--backend venv`, never a Docker command it cannot run. The fixture's local cell is renamed
    to a built cell's id (a local cell is rerun with `--backend local` and no cell)."""
    cell = CELL.removeprefix("local-")
    host = tmp_path / H200
    host.mkdir()
    for src in (FIXTURE / H200).iterdir():
        if src.name.endswith(".manifest.json"):
            m = json.loads(src.read_text())
            m["executor"] = executor
            (host / src.name).write_text(json.dumps(m))
        elif src.suffix == ".jsonl":
            keep = [ln for ln in src.read_text().splitlines() if json.loads(ln)["probe_id"] != "ar-latency"]
            (host / src.name).write_text("".join(f"{ln.replace(CELL, cell)}\n" for ln in keep))
    code, out, _ = _cli(capsys, "advise", "--results", str(tmp_path), "--host", H200, "--cell", cell, "--tp", "2")
    assert code == 0
    assert f"checks run --backend {executor} --only {cell} --probe ar-latency" in out
    others = {"venv", "docker", "slurm"} - {executor}
    assert not any(f"--backend {o} " in out for o in others), out


def test_a_host_with_too_few_gpus_says_in_one_line_what_a_bigger_host_would_time() -> None:
    cell = "cu130-torch2.11.0-sglnone-fi0.7.4"
    note = "needs 2 GPUs (a latency of ranks time-slicing one GPU means nothing), host has 1"
    skipped = [ProbeResult("r1", "h200x1-12345678", cell, "ar-latency", f"ranks=2,backend={b}",
                           Verdict(Status.SKIP, "too-few-gpus", note), "2026-12-06T00:00:00Z")
               for b in ("nccl", "nccl-direct", "symm-mem-one-shot", "symm-mem-two-shot", "flashinfer-custom-ar",
                         "flashinfer-pcie-ipc")]
    got = advise.advise_cell("h200x1-12345678", cell, 2, skipped, {"gpu_count": 1}, "venv")
    assert got.missing == (advise.Missing(
        "allreduce latency at 2 ranks (nccl, nccl-direct, symm-mem-one-shot, symm-mem-two-shot, "
        "flashinfer-custom-ar, flashinfer-pcie-ipc)",
        "needs 2 GPUs (a latency of ranks time-slicing one GPU means nothing), host has 1; a host with a GPU per "
        "rank would time these and rank them here"),)
    other = [ProbeResult("r1", "h200x1-12345678", cell, "ar-latency", "ranks=2,backend=flashinfer-pcie-ipc",
                         Verdict(Status.SKIP, "missing-package", "flashinfer is not installed"),
                         "2026-12-06T00:00:00Z"), skipped[0]]
    lines = advise.advise_cell("h200x1-12345678", cell, 2, other, {"gpu_count": 1}, "venv").missing
    whats = [m.what for m in lines]
    assert whats[0] == "allreduce latency at 2 ranks (nccl)"
    assert lines[whats.index("flashinfer-pcie-ipc")].why == "skip (missing-package): flashinfer is not installed"

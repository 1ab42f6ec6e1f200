"""One report over results from several hosts (gathered by the Slurm executor, one results folder per kind
of node, or copied by hand): a section per host as before, plus one cross-host row per cell and probe."""

from __future__ import annotations

from pathlib import Path

from checks.report.report import across_hosts, build_model, generate
from checks.results.provenance import Checkout, Provenance
from checks.results.result import ProbeResult, Verdict
from checks.results.store import RunStore
from checks.run import manifest
from checks.run.plan import CellTarget
from inenv.status import Status

HASH = "0123456789abcdef"
CURRENT = {"symm-mem": HASH, "nccl-graphs": HASH, "fi-jit": HASH}
CELL, OTHER = "cu130-torch2.11.0-sglnone-fi0.6.18", "cu130-torch2.11.0-sglnone-fi0.7.4"
FACTS = {
    "h200x8-1a2b3c4d": {"gpu_name": "NVIDIA H200", "gpu_count": 8, "compute_capability": "9.0"},
    "b200x8-5e6f7a8b": {"gpu_name": "NVIDIA B200", "gpu_count": 8, "compute_capability": "10.0"},
    "cpu-9c8d7e6f": {"gpu_count": 0},
}


def _host(root: Path, host_id: str, verdicts: dict[tuple[str, str, str], Status]) -> None:
    store = RunStore(root, host_id, "20261130T120000Z-0001")
    code = Checkout("0.1.0", "f" * 40, False)
    cells = [CellTarget(c, "local", versions={"torch": "2.11.0", "cuda": "13.0"}) for c in (CELL, OTHER)]
    store.write_manifest(manifest.build(store.run_id, host_id, "2026-11-30T12:00:00Z", "slurm",
                                        {"host_id": host_id, **FACTS[host_id]}, cells, {}, code, CURRENT, []))
    for (cell, probe, variant), status in sorted(verdicts.items()):
        v = Verdict(status, "" if status is Status.PASS else "nccl-error", "" if status is Status.PASS else "x")
        store.append(ProbeResult(store.run_id, host_id, cell, probe, variant, v, "2026-11-30T12:00:01Z",
                                 Provenance("0.1.0", "f" * 40, False, HASH)))


def _results(tmp_path: Path) -> Path:
    root = tmp_path / "results"
    _host(root, "h200x8-1a2b3c4d", {(CELL, "symm-mem", "ranks=2"): Status.PASS,
                                    (CELL, "symm-mem", "ranks=4"): Status.PASS,
                                    (CELL, "nccl-graphs", "ranks=2"): Status.PASS,
                                    (OTHER, "fi-jit", "ranks=1"): Status.PASS})
    _host(root, "b200x8-5e6f7a8b", {(CELL, "symm-mem", "ranks=2"): Status.PASS,
                                    (CELL, "symm-mem", "ranks=4"): Status.FAIL,
                                    (CELL, "nccl-graphs", "ranks=2"): Status.PASS})
    return root


def test_one_row_per_cell_and_probe_across_hosts(tmp_path: Path) -> None:
    sections, _ = build_model(_results(tmp_path), tmp_path / "docs", current=CURRENT)
    across = across_hosts(sections)
    assert across is not None
    assert [h["label"] for h in across["hosts"]] == ["NVIDIA B200 ×8", "NVIDIA H200 ×8"]
    rows = {(r["cell_id"], r["probe"]): r for r in across["rows"]}
    assert list(rows) == [(CELL, "nccl-graphs"), (CELL, "symm-mem"), (OTHER, "fi-jit")]
    assert rows[(CELL, "symm-mem")]["agree"] == "no"
    assert [c.worst for c in rows[(CELL, "symm-mem")]["cells"]] == [Status.FAIL, Status.PASS]
    assert rows[(CELL, "nccl-graphs")]["agree"] == "yes"
    assert rows[(OTHER, "fi-jit")]["agree"] == "one host" and rows[(OTHER, "fi-jit")]["cells"][0] is None


def test_the_report_has_the_cross_host_table_and_every_host_section(tmp_path: Path) -> None:
    out = tmp_path / "docs" / "compatibility.md"
    assert generate(_results(tmp_path), out, None, check=False, current=CURRENT) == 0
    md = out.read_text()
    sections, _, table = md.partition("## Across hosts")  # after every host's own section
    assert table and "## NVIDIA B200 ×8 — host `b200x8-5e6f7a8b`" in sections and "## NVIDIA H200 ×8" in sections
    assert "| cell | probe | NVIDIA B200 ×8<br>`b200x8-5e6f7a8b` | NVIDIA H200 ×8<br>`h200x8-1a2b3c4d` |" in table
    assert f"| `{CELL}` | symm-mem | ✅1 ❌1 | ✅2 | no |" in table
    assert f"| `{CELL}` | nccl-graphs | ✅ | ✅ | yes |" in table
    assert f"| `{OTHER}` | fi-jit | · | ✅ | one host |" in table
    html = out.with_suffix(".html").read_text()
    assert "<h2>Across hosts</h2>" in html
    assert ('<td class="fail" title="1 pass, 1 fail"><span class="st pass">pass 1</span> '
            '<span class="st fail">FAIL 1</span> </td>') in html


def test_a_single_host_has_no_cross_host_table(tmp_path: Path) -> None:
    root = tmp_path / "results"
    _host(root, "h200x8-1a2b3c4d", {(CELL, "symm-mem", "ranks=2"): Status.PASS})
    sections, _ = build_model(root, tmp_path / "docs", current=CURRENT)
    assert across_hosts(sections) is None
    out = tmp_path / "docs" / "compatibility.md"
    generate(root, out, None, check=False, current=CURRENT)
    assert "Across hosts" not in out.read_text() and "Across hosts" not in out.with_suffix(".html").read_text()


def test_a_verdict_proven_without_a_gpu_is_marked_static_in_the_overview_and_across_hosts(tmp_path: Path) -> None:
    """A CPU host's fi-jit pass (compiled, never run) beside a GPU host's: the hosts agree only in part, and the
    overview's no-GPU column says its pass is static."""
    root = _results(tmp_path)
    _host(root, "cpu-9c8d7e6f", {(OTHER, "fi-jit", "ranks=1"): Status.PASS})
    sections, _ = build_model(root, tmp_path / "docs", current=CURRENT)
    rows = {(r["cell_id"], r["probe"]): r for r in across_hosts(sections)["rows"]}
    assert rows[(OTHER, "fi-jit")]["agree"] == "yes, static on cpu-9c8d7e6f"
    assert rows[(CELL, "nccl-graphs")]["agree"] == "yes"  # two GPU hosts that ran it
    out = tmp_path / "docs" / "compatibility.md"
    assert generate(root, out, None, check=False, current=CURRENT) == 0
    table = out.read_text().partition("## Across hosts")[2]
    assert f"| `{OTHER}` | fi-jit | · | ✅ *(static)* | ✅ | yes, static on cpu-9c8d7e6f |" in table
    html = out.with_suffix(".html").read_text()
    overview = html.partition('<section id="overview">')[2].partition("</section>")[0]
    fi_jit = next(ln for ln in overview.splitlines() if "<b>fi-jit</b>" in ln)
    cells = fi_jit.split("<td")[2:]  # per host class: the GPU classes first, no GPU last
    assert "(static)" in cells[-1] and not any("(static)" in c for c in cells[:-1])

"""One report over results from several hosts (gathered by the Slurm executor, one results folder per kind
of node, or copied by hand): a column per hardware class in each cell of the answer, a page per host."""

from __future__ import annotations

from pathlib import Path

from checks.report import answer
from checks.report.answer import Stack
from checks.report.report import build_model, generate
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


STACKS = [Stack(CELL, "matrix.yaml"), Stack(OTHER, "matrix.yaml")]


def test_hosts_of_two_classes_are_two_columns_of_each_cell(tmp_path: Path) -> None:
    sections, _ = build_model(_results(tmp_path), tmp_path / "docs", current=CURRENT)
    a = answer.build(sections, STACKS, {"nccl-error": "NCCL failed"})
    assert [(c.hw.label, c.hosts) for c in a.classes] == [("B200 ×8", ("b200x8-5e6f7a8b",)),
                                                          ("H200 ×8", ("h200x8-1a2b3c4d",))]
    symm = next(r for r in a.rows if r.key == "symm-mem")
    b200, h200 = symm.cells[0]  # the first stack, CELL: the worst of the B200's two variants, the H200's pass
    assert b200 is not None and (b200.status, b200.reason, b200.variants) == ("fail", "nccl-error", 2)
    assert h200 is not None and (h200.status, h200.reason, h200.variants) == ("pass", "", 2)
    assert symm.cells[1] == (None, None)  # neither ran symm-mem on OTHER
    assert a.reasons == (("nccl-error", "NCCL failed"),)


def test_the_report_has_a_column_per_stack_and_a_verdict_per_class_in_each(tmp_path: Path) -> None:
    out = tmp_path / "docs" / "compatibility.md"
    assert generate(_results(tmp_path), out, None, check=False, current=CURRENT, stacks=STACKS) == 0
    md = out.read_text()
    assert f"| feature | `{CELL}` | `{OTHER}` |" in md
    row = next(ln for ln in md.splitlines() if ln.startswith("| Symmetric memory (torch) |"))
    assert row == "| Symmetric memory (torch) | B200×8 [❌][r1] nccl-error<br>H200×8 [✅][r2] | · |"
    assert "[r1]: ../results/b200x8-5e6f7a8b/20261130T120000Z-0001.jsonl" in md
    for host in ("b200x8-5e6f7a8b", "h200x8-1a2b3c4d"):  # a page per host, linked
        assert f"[`{host}`](hosts/{host}.md)" in md
        assert f"## NVIDIA {host[:4].upper()} ×8 — host `{host}`" in (out.parent / "hosts" / f"{host}.md").read_text()
    html = out.with_suffix(".html").read_text()
    assert 'class="v cls-b200-x8-d" data-class="B200 ×8" data-status="fail"' in html


def test_hosts_of_one_class_are_one_column_and_their_disagreement_is_shown(tmp_path: Path) -> None:
    """A second H200 x8 host: the class keeps the newest verdict per variant, names the host it came from, and
    says where the two hosts disagree."""
    root = _results(tmp_path)
    store = RunStore(root, "h200x8-99999999", "20261201T120000Z-0002")  # a later run on another H200 x8 machine
    store.write_manifest(manifest.build(store.run_id, "h200x8-99999999", "2026-12-01T12:00:00Z", "slurm",
                                        {"host_id": "h200x8-99999999", **FACTS["h200x8-1a2b3c4d"]},
                                        [CellTarget(CELL, "local", versions={"torch": "2.11.0", "cuda": "13.0"})],
                                        {}, Checkout("0.1.0", "f" * 40, False), CURRENT, []))
    store.append(ProbeResult(store.run_id, "h200x8-99999999", CELL, "symm-mem", "ranks=4",
                             Verdict(Status.FAIL, "nccl-error", "x"), "2026-12-01T12:00:01Z",
                             Provenance("0.1.0", "f" * 40, False, HASH)))
    sections, _ = build_model(root, tmp_path / "docs", current=CURRENT)
    a = answer.build(sections, STACKS, {})
    assert [c.hw.label for c in a.classes] == ["B200 ×8", "H200 ×8"]
    assert a.classes[1].hosts == ("h200x8-1a2b3c4d", "h200x8-99999999")
    h200 = next(r for r in a.rows if r.key == "symm-mem").cells[0][1]
    assert h200 is not None
    assert (h200.status, h200.host, h200.run) == ("fail", "h200x8-99999999", "20261201T120000Z-0002")
    assert h200.disagree == (("pass", ("h200x8-1a2b3c4d",)), ("fail", ("h200x8-99999999",)))
    out = tmp_path / "docs" / "compatibility.md"
    assert generate(root, out, None, check=False, current=CURRENT, stacks=STACKS) == 0
    row = next(ln for ln in out.read_text().splitlines() if ln.startswith("| Symmetric memory (torch) |"))
    assert row == ("| Symmetric memory (torch) | B200×8 [❌][r1] nccl-error<br>H200×8 [❌][r3] nccl-error "
                   "⚠ 1 pass, 1 fail | · |")


def test_a_cell_no_matrix_declares_goes_to_the_archive(tmp_path: Path) -> None:
    out = tmp_path / "docs" / "compatibility.md"
    assert generate(_results(tmp_path), out, None, check=False, current=CURRENT, stacks=STACKS[:1]) == 0
    md, archive = out.read_text(), (out.parent / "compatibility-archive.md").read_text()
    assert OTHER not in md and f"`{OTHER}`" in archive and "[the archive page](compatibility-archive.md) (1 cell)" in md
    assert OTHER not in (out.parent / "hosts" / "h200x8-1a2b3c4d.md").read_text()

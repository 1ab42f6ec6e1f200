"""The answer the page opens on: hardware classes, the feature x declared-stack table, what to launch with, the
archive of undeclared cells, and the page built from the committed results (checks/report/answer.py, hwclass.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from checks.cli import main
from checks.report import answer
from checks.report.report import generate
from checks.results import hwclass
from checks.results.result import ProbeResult, Verdict
from inenv.status import Status
from tests.checks_helpers import ROOT, committed


# --- hardware classes --------------------------------------------------------------------------------------------
def test_a_class_is_gpu_model_count_interconnect_and_driver_major() -> None:
    h200x2 = hwclass.of({"gpu_name": "NVIDIA H200", "gpu_count": 2, "interconnect": "NVLink (NV18)",
                         "driver": "580.159.04"})
    assert (h200x2.gpu, h200x2.count, h200x2.interconnect, h200x2.driver_major) == ("H200", 2, "NVLink (NV18)", "580")
    assert h200x2.label == "H200 ×2, NVLink (NV18), driver 580" and h200x2.short == "H200×2"
    assert h200x2.slug == "h200-x2-nvlink-nv18-d580"
    one = hwclass.of({"gpu_name": "NVIDIA H200", "gpu_count": 1, "interconnect": "single GPU", "driver": "580.1"})
    assert one.label == "H200 ×1, driver 580"  # one GPU has no interconnect to name
    assert hwclass.of({"gpu_count": 0, "interconnect": "none"}).label == "no GPU"
    assert hwclass.of({"gpu_name": "NVIDIA H200", "gpu_count": "8"}).label == "no GPU"  # a count of another shape
    newer = hwclass.of({"gpu_name": "NVIDIA H200", "gpu_count": 1, "driver": "590.2"})
    assert newer != one and newer.label == "H200 ×1, driver 590"  # another driver major: another class


def test_hosts_group_into_classes_gpu_classes_first_most_gpus_first() -> None:
    facts = {f"h200x1-{i:08x}": {"gpu_name": "NVIDIA H200", "gpu_count": 1, "driver": "580.159.04"} for i in range(14)}
    facts["h200x2-5bce98f7"] = {"gpu_name": "NVIDIA H200", "gpu_count": 2, "interconnect": "NVLink (NV18)",
                                "driver": "580.159.04"}
    facts["cpu-5bce98f7"] = {"gpu_count": 0}
    groups = hwclass.group(facts)
    assert [(c.label, len(hosts)) for c, hosts in groups.items()] == [
        ("H200 ×2, NVLink (NV18), driver 580", 1), ("H200 ×1, driver 580", 14), ("no GPU", 1)]


def test_a_crafted_gpu_name_reaches_no_selector_through_the_slug() -> None:
    c = hwclass.of({"gpu_name": "x}*{background:url(https:e.example)}#y", "gpu_count": 2})
    assert re.fullmatch(r"[a-z0-9-]+", c.slug) and "(" not in c.slug and "{" not in c.slug
    assert c.label.startswith("x}*{background")  # the label keeps the text; each page escapes it


def test_short_names_grow_where_two_classes_would_share_one() -> None:
    a = hwclass.HwClass("H200", 1, "", "580")
    b = hwclass.HwClass("H200", 1, "", "590")
    c = hwclass.HwClass("H100", 1, "", "580")
    assert hwclass.shorts([a, b, c]) == {a: "H200 ×1, driver 580", b: "H200 ×1, driver 590", c: "H100×1"}


# --- the answer ----------------------------------------------------------------------------------------------------
def test_declared_stacks_are_the_matrices_cells_in_order(tmp_path: Path) -> None:
    (tmp_path / "matrices").mkdir()
    (tmp_path / "matrix.yaml").write_text('matrix:\n  cuda: ["13.0"]\n  torch: ["2.14.1"]\n  sgl_kernel: ["none"]\n'
                                          '  flashinfer: ["0.6.16", "0.6.17"]\n')
    (tmp_path / "matrices" / "b.yaml").write_text('matrix:\n  cuda: ["13.0"]\n  torch: ["2.14.1"]\n'
                                                  '  sgl_kernel: ["none"]\n  flashinfer: ["0.6.17", "0.7.4"]\n')
    assert [(s.cell_id, s.matrix) for s in answer.declared(tmp_path)] == [
        ("cu130-torch2.14.1-sglnone-fi0.6.16", "matrix.yaml"), ("cu130-torch2.14.1-sglnone-fi0.6.17", "matrix.yaml"),
        ("cu130-torch2.14.1-sglnone-fi0.7.4", "matrices/b.yaml")]


class _Size:
    def __init__(self, tokens: int | None, nbytes: int, use: str) -> None:
        self.tokens, self.nbytes, self.use = tokens, nbytes, use


def test_launch_ranges_name_each_run_of_one_backend() -> None:
    sizes = [_Size(1, 14336, "a"), _Size(2, 28672, "a"), _Size(4, 57344, "b"), _Size(8, 114688, "c"),
             _Size(16, 229376, "c")]
    assert answer.ranges(sizes) == (("1-2 tokens", "a"), ("4 tokens", "b"), ("8-16 tokens", "c"))
    assert answer.ranges([_Size(None, 1024, "a"), _Size(None, 2048, "a")]) == (("1024-2048 bytes", "a"),)


# --- the page from the committed results ---------------------------------------------------------------------------
FEATURE_LABELS = ["Allreduce fusion JIT, this GPU (compile)", "Allreduce fusion JIT, SM120 12.0a (compile)",
                  "Allreduce fusion JIT, SM120 12.0f (compile)", "Allreduce + RMSNorm fusion (run)",
                  "Custom allreduce, flashinfer", "Custom allreduce, sgl-kernel", "PCIe IPC collectives (flashinfer)",
                  "NCCL algorithms under CUDA graphs", "Symmetric memory (torch)", "EP all-to-all (flashinfer MoE)",
                  "Rank agreement, decode step per backend"]


@pytest.fixture(scope="module")
def page(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("page") / "docs" / "compatibility.md"
    assert generate(committed(), out, None, check=False, quiet=True) == 0
    return out


def _table(md: str) -> list[list[str]]:
    section = md.split("## The answer\n")[1].strip().split("\n\n")[0]
    return [[c.strip() for c in re.split(r"(?<!\\)\|", ln)[1:-1]] for ln in section.splitlines()]


def test_the_first_table_has_a_row_per_feature_and_a_column_per_declared_stack(page: Path) -> None:
    md = page.read_text()
    assert md.index("## The answer") < md.index("## What to launch with") < md.index("## Hardware classes")
    rows = _table(md)
    header, body = rows[0], rows[2:]
    assert header[0] == "feature"
    assert header[1:] == [f"`{s.cell_id}`" for s in answer.declared(ROOT)]  # every declared stack, in order
    for cell in ("cu130-torch2.14.1-sgl0.4.10-fi0.6.16", "cu132-torch2.15.0-sglnone-fi0.7.4",
                 "cu130-torch2.11.0-sglnone-fi0.7.4"):  # from matrix.yaml and matrices/
        assert f"`{cell}`" in header
    labels = [r[0] for r in body]
    assert labels[:len(FEATURE_LABELS)] == FEATURE_LABELS
    assert all(label.startswith("Under load") for label in labels[len(FEATURE_LABELS):]) and len(labels) > 11
    assert all(len(r) == len(header) for r in body)


def test_fourteen_h200_hosts_make_one_column_and_each_host_has_a_page(page: Path) -> None:
    md = page.read_text()
    h200 = sorted(p.name for p in committed().iterdir() if p.name.startswith("h200x1-"))
    assert len(h200) >= 14
    [row] = [ln for ln in md.splitlines() if ln.startswith("| H200 ×1, driver 580 |")]
    assert all(f"`{h}`" in row for h in h200)  # one class, every host of it named
    assert sum(ln.startswith("| H200 ×1") for ln in md.splitlines()) == 1
    data = json.loads(_json(committed()))
    [cls] = [c for c in data["classes"] if c["class"] == "H200 ×1, driver 580"]
    assert sorted(cls["hosts"]) == h200
    for h in cls["hosts"]:  # a page per host, or the archive where it ran no declared stack
        assert f"[`{h}`](hosts/{h}.md)" in row or f"`{h}` ([archive](compatibility-archive.md))" in row
    paged = re.findall(r"\(hosts/([a-z0-9-]+)\.md\)", md)
    assert paged and all((page.parent / "hosts" / f"{h}.md").is_file() for h in paged)


def test_no_undeclared_cell_on_the_main_page_and_each_is_on_the_archive(page: Path) -> None:
    md, archive = page.read_text(), (page.parent / "compatibility-archive.md").read_text()
    for cell in ("cu128-torchnightly-sgl0.4.1-fi0.6.16", "cu128-torch2.11.0-sgl0.4.2-fi0.6.16",
                 "local-cu130-torch2.11.0-sglnone-fi0.7.4-nvcc13.0"):  # cells no matrix declares now
        assert cell not in md and f"`{cell}`" in archive
        assert not any(cell in p.read_text() for p in (page.parent / "hosts").glob("*.md"))
    assert "[the archive page](compatibility-archive.md)" in md


def test_no_advice_block_without_a_line_of_advice_and_no_skip_list_for_a_host_without_gpus(page: Path) -> None:
    for host_page in sorted((page.parent / "hosts").glob("*.md")):
        text = host_page.read_text()
        blocks = text.split("\n**")[1:]
        for block in blocks:
            body = block.split("**", 1)[1].split("\n\n**")[0]
            assert any(ln.lstrip().startswith("- ") for ln in body.splitlines()), (host_page.name, block[:200])
        if host_page.name.startswith("cpu-"):
            assert "Missing:" not in text and "skip (no-gpu)" not in text, host_page.name
    md = page.read_text()
    # one line per class says what a host with (more) GPUs would add, instead of the skips per cell
    assert re.search(r"^- no GPU: \d+ variants of .* skipped \(no-gpu\); a GPU host would run them\.$", md, re.M)
    assert "no-gpu" not in "".join(_table(md)[0] + [c for r in _table(md)[2:] for c in r])


def test_the_main_page_is_under_300_lines_and_advises_the_2x_h200(page: Path) -> None:
    md = page.read_text()
    assert len(md.splitlines()) < 300
    [line] = [ln for ln in md.splitlines() if ln.startswith("- **H200 ×2, NVLink (NV18), driver 580, 2 ranks**, "
                                                              "`cu130-torch2.11.0-sglnone-fi0.7.4`")]
    assert ": flashinfer-pcie-ipc for 1-8 tokens; " in line and "(host `h200x2-5bce98f7`, run " in line


def _json(results: Path) -> str:
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["report", "--results", str(results), "--json"]) == 0
    return buf.getvalue()


def test_report_json_gives_the_answer_by_hardware_class(tmp_path: Path) -> None:
    data = json.loads(_json(committed()))
    assert [c["class"] for c in data["classes"]][-1] == "no GPU"
    assert "H200 ×2, NVLink (NV18), driver 580" in [c["class"] for c in data["classes"]]
    row = next(f for f in data["features"] if f["feature"] == "fusion-jit-sm120a")
    assert row["cells"]["cu130-torch2.14.1-sgl0.4.10-fi0.6.16"]["no GPU"]["status"] == "fail"
    assert row["cells"]["cu130-torch2.14.1-sgl0.4.10-fi0.6.16"]["no GPU"]["reason"] == "fi-arch-gate"
    assert row["cells"]["cu130-torch2.14.1-sgl0.4.10-fi0.6.17"]["no GPU"]["status"] == "pass"
    [adv] = [a for a in data["launch"] if a["class"] == "H200 ×2, NVLink (NV18), driver 580" and a["ranks"] == 2
             and a["cell_id"] == "cu130-torch2.11.0-sglnone-fi0.7.4"]
    assert adv["use"][0] == {"sizes": "1-8 tokens", "backend": "flashinfer-pcie-ipc"}
    assert not (tmp_path / "docs").exists()  # --json writes no page


def test_advise_groups_hosts_by_hardware_class(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["advise", "--results", str(committed()), "--here", "cpu-00000000"]) == 0
    out = capsys.readouterr().out
    headings = [ln for ln in out.splitlines() if ln.startswith("== hardware class ")]
    assert headings[0].startswith("== hardware class H200 ×2, NVLink (NV18), driver 580: h200x2-5bce98f7")
    labels = [h.split(": ")[0] for h in headings]
    assert len(labels) == len(set(labels))  # each class once: its hosts together
    assert "  hardware class: H200 ×1, driver 580" in out
    assert main(["advise", "--results", str(committed()), "--here", "cpu-00000000", "--json"]) == 0
    decided = json.loads(capsys.readouterr().out)
    assert {d["host_id"]: d["hardware_class"] for d in decided}["h200x2-5bce98f7"] == (
        "H200 ×2, NVLink (NV18), driver 580")


def _section(host: str, facts: dict, rows: list[tuple[str, str, str, str, str]]) -> SimpleNamespace:
    """A host section as answer.build reads it: (run, cell, probe, variant, status[:reason]) per latest result."""
    latest = []
    for run, cell, probe, variant, said in rows:
        status, _, reason = said.partition(":")
        latest.append(ProbeResult(run, host, cell, probe, variant, Verdict(Status(status), reason), "t"))
    runs = [{"run_id": r, "path": f"../results/{host}/{r}.jsonl"} for r in sorted({row[0] for row in rows})]
    return SimpleNamespace(host_id=host, raw_facts=facts, latest=latest, runs=runs, decided=None)


def test_load_has_a_row_per_backend_and_each_class_shows_one_verdict_with_its_reason() -> None:
    cell, run = "cu130-torch2.14.1-sglnone-fi0.7.4", "20261206T000000Z-aaaa"
    gpu = {"gpu_name": "NVIDIA H200", "gpu_count": 2, "interconnect": "NVLink (NV18)", "driver": "580.1"}
    sections = [
        _section("h200x2-00000001", gpu, [
            (run, cell, "load", "ranks=2,backend=nccl,pattern=replay", "pass"),
            (run, cell, "load", "ranks=2,backend=nccl,pattern=two-comms", "partial:load-slow"),
            (run, cell, "load", "ranks=4,backend=flashinfer-fusion,pattern=replay", "skip:too-few-gpus"),
            (run, cell, "load", "ranks=2,backend=flashinfer-fusion,pattern=replay", "pass"),
            (run, cell, "symm-mem", "ranks=2", "crash:signal"),
            (run, cell, "symm-mem", "ranks=4", "fail:symm-mem-op-failed")]),
        _section("cpu-00000002", {"gpu_count": 0}, [(run, cell, "load", "ranks=2,backend=nccl,pattern=replay",
                                                     "skip:no-gpu")])]
    a = answer.build(sections, [answer.Stack(cell, "matrix.yaml")], {"signal": "killed"})
    rows = {r.label: r.cells[0] for r in a.rows}
    assert [r.label for r in a.rows][-2:] == ["Under load: flashinfer-fusion", "Under load: nccl"]
    gpu_nccl, cpu_nccl = rows["Under load: nccl"]
    assert gpu_nccl is not None and (gpu_nccl.status, gpu_nccl.reason, gpu_nccl.variants) == ("partial", "load-slow", 2)
    assert cpu_nccl is None  # a skip for want of a GPU is counted under the table, not shown in the cell
    fusion = rows["Under load: flashinfer-fusion"][0]
    assert fusion is not None and (fusion.status, fusion.variants) == ("pass", 1)  # too few GPUs: not shown
    symm = rows["Symmetric memory (torch)"][0]
    assert symm is not None and (symm.status, symm.reason) == ("crash", "signal")  # the worst failure met
    assert a.unshown == (("H200 ×2, NVLink (NV18), driver 580", "too-few-gpus", 1, ("load",)),
                         ("no GPU", "no-gpu", 1, ("load",)))
    assert a.reasons == (("load-slow", ""), ("signal", "killed"))

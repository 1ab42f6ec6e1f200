"""The HTML page's order, filters and hand-written SVG plots (the browser test sees them render)."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from checks.report import plots, report
from checks.report.report import build_model, render
from checks.results.result import ProbeResult, Verdict
from inenv.status import Status

RUN = "20260101T000000Z-abcd"


def _write_host(root: Path, host: str, facts: dict, rows: list[tuple[str, dict, str, str]]) -> None:
    """rows: (cell id, versions, variant, status) of probe ar-latency."""
    folder = root / host
    folder.mkdir(parents=True)
    lines = [{"schema": "stackprobe.result/1", "run_id": RUN, "host_id": host, "cell_id": cell,
              "probe_id": "ar-latency", "variant": variant, "status": status, "reason_code": "", "note": "",
              "remediation": "", "metrics": {}, "evidence": {},
              "started_at": "2026-01-01T00:00:00+00:00", "duration_s": 1.0}
             for cell, _, variant, status in rows]
    (folder / f"{RUN}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    cells = {cell: {"versions": v} for cell, v, _, _ in rows}
    (folder / f"{RUN}.manifest.json").write_text(json.dumps({"schema": "stackprobe.manifest/1", "run_id": RUN,
                                                             "host_id": host, "facts": facts, "cells": cells}))


def _v(torch: str, fi: str) -> dict:
    return {"cuda": "13.0", "torch": torch, "flashinfer": fi, "sgl_kernel": "none"}


def test_page_opens_on_the_answer_and_every_host_and_filters_by_class(tmp_path: Path) -> None:
    """The page starts with the answer, then the hosts, GPU hosts first; its host picker starts on every host (a
    GPU-less user's own host is shown), and each host section carries its hardware class for the class filter."""
    cell = "cu130-torch2.11.0-sglnone-fi0.7.4"
    gpu = {"gpu_name": "NVIDIA B200", "gpu_count": 8, "interconnect": "NVLink (NV18)", "driver": "580.1"}
    _write_host(tmp_path, "b200x8-0000aaaa", gpu, [(cell, _v("2.11.0", "0.7.4"), "ranks=2,backend=nccl", "pass")])
    _write_host(tmp_path, "cpu-0000bbbb", {"gpu_count": 0}, [(cell, _v("2.11.0", "0.7.4"), "ranks=2,backend=nccl",
                                                             "skip")])
    sections, _ = build_model(tmp_path, tmp_path, current={})
    page = render(sections, "html", "../results")
    assert page.index('id="answer"') < page.index('id="host-b200x8-0000aaaa"') < page.index('id="host-cpu-0000bbbb"')
    assert '<input class="pick" type="radio" name="host" id="pick-all" checked>' in page
    assert '<input class="pick" type="radio" name="host" id="pick-gpu">' in page
    assert 'class="host gpu cls-b200-x8-nvlink-nv18-d580" id="host-b200x8-0000aaaa"' in page
    assert 'class="host nogpu cls-nogpu" id="host-cpu-0000bbbb"' in page
    assert '<label for="fc-b200-x8-nvlink-nv18-d580">B200 ×8, NVLink (NV18), driver 580</label>' in page


def _latency(cell: str, backend: str, us: dict[int, float], status: Status = Status.PASS,
             probe: str = "ar-latency") -> ProbeResult:
    variant = f"ranks=2,backend={backend}" if probe == "ar-latency" else "ranks=2,op=all-reduce"
    metrics = {"latency_us": {str(k): v for k, v in us.items()}}
    return ProbeResult(RUN, "h-00000000", cell, probe, variant, Verdict(status, metrics=metrics), "t")


def test_latency_plot_draws_every_measured_backend_with_nccl_as_reference() -> None:
    sizes = (14336, 114688, 917504)
    rs = [_latency("c", "nccl", dict(zip(sizes, (7.5, 7.3, 12.9), strict=True))),
          _latency("c", "symm-mem-one-shot", dict(zip(sizes, (6.9, 7.0, 11.0), strict=True))),
          _latency("c", "flashinfer-custom-ar", dict(zip(sizes, (4.1, 4.3, 8.0), strict=True))),
          _latency("c", "x", {14336: 1.0}, Status.FAIL),  # failed: not drawn
          _latency("c", "y", {}, Status.PASS, probe="pcie-ipc")]  # no curve: not drawn
    (plot,) = plots.latency_plots(rs)
    assert [s.label for s in plot.series] == ["nccl", "flashinfer-custom-ar", "symm-mem-one-shot"]
    svg = plots.latency_svg(plot)
    lines = re.findall(r'<polyline points="([^"]+)" fill="none" stroke="([^"]+)" stroke-width="([^"]+)"', svg)
    assert [(len(p.split()), colour, width) for p, colour, width in lines] == [
        (3, "#000", "3"), (3, plots.COLOURS[0], "1.6"), (3, plots.COLOURS[1], "1.6")]
    assert "nccl (reference)" in svg and "14 KiB" in svg and "896 KiB" in svg
    shuffled = rs[:]
    random.Random(1).shuffle(shuffled)
    assert plots.latency_svg(plots.latency_plots(shuffled)[0]) == svg  # same results, same bytes


def test_plot_text_from_results_is_escaped() -> None:
    crafted = 'a"><script>alert(1)</script>'
    (plot,) = plots.latency_plots([_latency("c", crafted, {1024: 2.0, 2048: 3.0})])
    svg = plots.latency_svg(plot)
    assert "<script" not in svg and "a&quot;&gt;&lt;script&gt;" in svg
    bars = plots.estimate_svg(crafted, [plots.Bar(crafted, 10.0, None)])
    assert "<script" not in bars and "beyond the measured sizes" in bars


def test_a_host_folder_outside_the_grammar_reaches_no_selector_or_link(tmp_path: Path) -> None:
    evil = "x{}*{background:url(https:e.example)}#y"
    _write_host(tmp_path, evil, {"gpu_name": "GPU", "gpu_count": 2}, [
        ("cu130-torch2.11.0-sglnone-fi0.6.18", _v("2.11.0", "0.6.18"), "ranks=2,backend=nccl", "pass")])
    sections, _ = build_model(tmp_path, tmp_path, current={})
    page = render(sections, "html", "../results")
    style = page[page.index("<style>"):page.index("</style>")]
    assert "url(" not in style and "e.example" not in style
    assert "e.example" not in page  # the store skips a folder whose name is no host id, with a warning
    assert report.anchor(evil).startswith("x") and "e.example" not in report.anchor(evil)
    assert report.anchor("h200x2-5bce98f7") == "h200x2-5bce98f7"

"""The user's own machine first: `checks advise` starts with this host's standing, says a host without a GPU in
a few lines, and the page starts with the host of the newest run."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from checks.cli import main
from checks.report import here
from checks.report.report import generate
from checks.results.hostresults import HostResults
from checks.results.provenance import Provenance
from checks.results.result import ProbeResult, Verdict
from checks.results.store import RunStore
from inenv.status import Status
from tests.checks_helpers import committed

CPU = "cpu-7eb23414"  # the committed results' host without a GPU whose run is the newest
# its newest run: the latest results file's name (run ids sort by time), read off the folder, not the code
CPU_RUN = max(p.stem for p in (Path(__file__).resolve().parent.parent / "results" / CPU).glob("*.jsonl"))
GPU = "h200x1-f50bcc97"
CELL = "cu130-torch2.14.1-sgl0.4.10-fi0.6.16"


def _r(cell: str, probe: str, variant: str, status: Status, code: str = "", run: str = "20261204T000000Z-aaaa",
       host: str = "cpu-00000001") -> ProbeResult:
    return ProbeResult(run, host, cell, probe, variant, Verdict(status, code, note="n"), "2026-12-04T00:00:00Z",
                       Provenance("0.1.0", "0" * 40, False, "0" * 16))


def _host() -> HostResults:
    rs = [
        _r("c1", "fi-jit", "ranks=1,module=vllm_comm,arch=12.0a", Status.PASS),
        _r("c1", "fi-jit", "ranks=1,module=vllm_comm,arch=9.0a", Status.PASS),
        _r("c1", "fi-jit", "ranks=1,module=trtllm_comm,arch=12.0a", Status.FAIL, "fi-arch-gate"),
        _r("c1", "fi-jit", "ranks=1,module=moe_a2a,arch=local", Status.SKIP, "no-gpu"),
        _r("c1", "inventory", "ranks=1", Status.PARTIAL, "ext-python-mismatch"),
        _r("c1", "ar-latency", "ranks=2,backend=nccl", Status.SKIP, "no-gpu"),
        _r("c1", "ar-latency", "ranks=2,backend=symm", Status.SKIP, "no-gpu"),
        _r("c2", "inventory", "ranks=1", Status.NOT_RUN, "cell-unreachable"),
        _r("c2", "fi-jit", "ranks=1,module=vllm_comm,arch=12.0a", Status.NOT_RUN, "cell-unreachable"),
    ]
    return HostResults("cpu-00000001", ("20261204T000000Z-aaaa",), tuple(rs), {"gpu_count": 0, "host_label": "no GPU"})


def test_a_host_without_a_gpu_is_said_per_cell_with_each_reason_once() -> None:
    h = here.standing(_host(), {"fi-arch-gate": "the gate refuses", "ext-python-mismatch": "another Python's tag",
                                "cell-unreachable": "index not reached"})
    assert here.rows(h) == [
        "c1: works: compiles vllm_comm (12.0a, 9.0a) · does not: fi-jit fail fi-arch-gate: trtllm_comm (12.0a); "
        "inventory partial ext-python-mismatch",
        "not-run cell-unreachable: c2",
        "why cell-unreachable: index not reached",
        "why ext-python-mismatch: another Python's tag",
        "why fi-arch-gate: the gate refuses",
        "A GPU host adds the runtime verdicts (3 variant(s) skipped here without a GPU: ar-latency, fi-jit), their "
        "latencies and the launch advice: run `uv run checks run --all` there, then `checks advise` on its results.",
    ]
    assert here.lines(h)[0] == "this host: cpu-00000001 (no GPU), newest run 20261204T000000Z-aaaa"


def test_the_newest_run_names_its_host() -> None:
    assert here.newest_host({"a": ["20261201T000000Z-aaaa", "20261203T000000Z-bbbb"],
                             "b": ["20261202T000000Z-cccc"], "c": []}) == "a"
    assert here.newest_host({}) is None


def _advise(capsys: pytest.CaptureFixture[str], *argv: str) -> list[str]:
    assert main(["advise", "--results", str(committed()), *argv]) == 0
    return capsys.readouterr().out.splitlines()


def test_advise_on_a_host_without_a_gpu_says_it_in_a_few_lines(capsys: pytest.CaptureFixture[str]) -> None:
    out = _advise(capsys, "--here", CPU)
    assert out[0] == f"this host: {CPU} (no GPU), newest run {CPU_RUN}"
    assert any(line.startswith(f"  {CELL}: works: compiles moe_a2a (12.0a, 12.0f), vllm_comm (12.0a, 12.0f) · "
                               "does not: ") and "fi-jit fail fi-arch-gate: trtllm_comm (12.0a, 12.0f)" in line
               for line in out)
    assert "  why fi-no-nvcc: no nvcc in this environment, so flashinfer cannot JIT-compile" in out
    assert any(line.startswith("  A GPU host adds the runtime verdicts (") for line in out)
    assert out[-1].startswith("other hosts with GPU results: ") and "`checks advise --host ID`" in out[-1]
    assert "h200x1-fdf098b5" in out[-1] and "h200x2-5bce98f7" in out[-1]  # committed GPU hosts, named
    assert len(out) < 30 and not any(line.startswith(("host h200", "host h100")) for line in out)  # no other advice
    on = _advise(capsys, "--host", CPU)
    standing = on[:on.index("")] if "" in on else on  # then the engine gates the host's cells read, if any
    assert on[0] == f"host: {CPU} (no GPU), newest run {CPU_RUN}" and len(standing) < 30
    assert not any("skip (no-gpu)" in line for line in on)
    gates = [line for line in on[len(standing):] if line.startswith("Engine gates — cell `")]
    assert len(gates) == 4 and not any(line.startswith("host h200") for line in on)


def test_advise_on_a_gpu_host_starts_with_it(capsys: pytest.CaptureFixture[str]) -> None:
    out = _advise(capsys, "--here", GPU)
    assert out[0].startswith(f"this host: {GPU} (NVIDIA H200 ×1), newest run ")
    advice = [line for line in out if line.startswith("host h200")]
    assert advice[0].startswith(f"host {GPU}:") and len(advice) > 1


def test_advise_on_a_host_without_results_says_how_to_make_them(capsys: pytest.CaptureFixture[str]) -> None:
    out = _advise(capsys, "--here", "cpu-00000000")
    assert out[0] == (f"this host: cpu-00000000 has no results in {committed()}; `uv run checks run --all` "
                      "records them")


def test_the_newest_runs_host_says_first_what_that_run_measured(tmp_path: Path) -> None:
    """A GPU host's older run and a newer run of a host without a GPU: the page names the newer run and its host,
    whose own page starts with that run's standing (its results only), and so does the HTML page's section."""
    from checks.report.answer import Stack

    results = tmp_path / "results"
    shutil.copytree(committed() / "h200x2-5bce98f7", results / "h200x2-5bce98f7")
    store = RunStore(results, "cpu-00000002", "20261204T110000Z-eeee")  # an earlier run under the same host id
    store.append_all([_r(CELL, "inventory", "ranks=1", Status.FAIL, "", store.run_id, "cpu-00000002")])
    store = RunStore(results, "cpu-00000002", "20261204T120000Z-ffff")
    store.append_all([_r(CELL, "inventory", "ranks=1", Status.PASS, run=store.run_id, host="cpu-00000002"),
                      _r(CELL, "ar-latency", "ranks=2,backend=nccl", Status.SKIP, "no-gpu", store.run_id,
                         "cpu-00000002")])
    out = tmp_path / "docs" / "compatibility.md"
    assert generate(results, out, None, check=False, quiet=True, stacks=[Stack(CELL, "matrix.yaml")]) == 0
    assert ("The newest run, [`20261204T120000Z-ffff`](../results/cpu-00000002/20261204T120000Z-ffff.jsonl), ran on "
            "`cpu-00000002`: [its page](hosts/cpu-00000002.md)") in out.read_text()
    md = (out.parent / "hosts" / "cpu-00000002.md").read_text()
    sections = [line for line in md.splitlines() if line.startswith("## ")]
    assert sections[0] == "## What the newest run measured here"
    first = md.split(sections[0])[1].split("\n## ")[0]
    assert f"- {CELL}: works: inventory passes" in first and "fail" not in first  # the earlier run is not this one
    assert "A GPU host adds the runtime verdicts (1 variant(s)" in first
    assert ("- 1 other run recorded under this host id (20261204T110000Z-eeee), on this machine or another of the "
            "same kind: their verdicts are in the host's table, not in these lines") in first
    page = out.with_suffix(".html").read_text()
    assert page.index('<section id="answer">') < page.index('<section id="newest">')
    assert f"<li>{CELL}: works: inventory passes</li>" in page

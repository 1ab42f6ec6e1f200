"""`checks advise --draft`: a backend whose ranks diverged bit for bit is not advised for the verify step, and
`--accept L` counts the verify step in tokens per second (a published default per model where one exists).

Built on the frozen 2x H200 results of tests/golden/advise/results plus one planted step result whose agreement
check diverged; the planted row is made here only, never written under results/.
"""

from __future__ import annotations

import dataclasses
import re

import pytest

from checks.cli import main
from checks.report import advise, decisions, estimate, launch
from checks.results import hostresults
from checks.results.result import ProbeResult, Verdict
from common import catalog
from inenv.status import Status
from tests.checks_helpers import ROOT

FIXTURE = ROOT / "tests" / "golden" / "advise" / "results"
H200 = "h200x2-5bce98f7"
CELL = "local-cu130-torch2.11.0-sglnone-fi0.6.18"
PINS = {p.version: p.sgl_kernel for p in catalog.load().presets.values()}
ENGINES = launch.load()
SUMMARY = {"cases": 30, "judged": 30, "ranks_identical": False, "differing_elements": 12,
           "max_ulp_between_ranks": 1, "deterministic": True, "max_ulp_vs_reference": 1.5,
           "divergent_cases": ["bf16:graph:256x7168"], "nondeterministic_cases": [], "unsupported": [],
           "not_judged": []}


@pytest.fixture(scope="module")
def host() -> hostresults.HostResults:
    return hostresults.load(FIXTURE)[H200]


def _diverged(backend: str = "flashinfer-custom-ar") -> ProbeResult:
    """A step result at 8 ranks sharing one GPU whose agreement check found ranks apart."""
    v = Verdict(Status.PARTIAL, note=f"{backend}: ranks' outputs differ bit for bit", reason_code="rank-divergent",
                metrics={"agreement": SUMMARY})
    variant = f"ranks=8,placement=shared,gpus=1,backend={backend}"
    return ProbeResult("20261204T000000Z-aaaa", H200, CELL, "step", variant, v, "2026-12-04T00:00:00Z")


def _with(h: hostresults.HostResults, *extra: ProbeResult) -> hostresults.HostResults:
    return dataclasses.replace(h, results=(*h.results, *extra), runs=(*h.runs, *(r.run_id for r in extra)))


def test_a_divergent_backend_is_named_not_for_the_verify_step(host: hostresults.HostResults) -> None:
    before = advise.advise_cell(H200, CELL, 2, host.latest(), host.facts)
    assert before.not_for_verify == ()
    h = _with(host, _diverged())
    a = advise.advise_cell(H200, CELL, 2, h.latest(), h.facts)
    (x,) = a.not_for_verify
    assert x.backend == "flashinfer-custom-ar" and "8 ranks sharing GPUs" in x.why and "bf16:graph:256x7168" in x.why
    assert x.ids == (f"20261204T000000Z-aaaa/{CELL}/step/ranks=8,placement=shared,gpus=1,backend=flashinfer-custom-ar",)
    # right numbers: still advised for decode messages, not listed to avoid
    assert "flashinfer-custom-ar" in {s.use for s in a.sizes}
    assert not [v for v in a.avoid if v.reason_code == "rank-divergent"]


@pytest.mark.parametrize(("probe", "variant", "backend"), [
    ("pcie-ipc", "ranks=4,placement=shared,gpus=1,op=all-reduce", "flashinfer-pcie-ipc"),
    ("fi-fusion", "ranks=8,placement=shared,gpus=1", "flashinfer-fusion"),
    ("custom-ar", "ranks=4,placement=shared,gpus=1,impl=flashinfer", "flashinfer-custom-ar"),
    ("symm-mem", "ranks=4,placement=shared,gpus=1", "symm-mem"),
])
def test_a_feature_probes_divergence_names_the_backend_as_the_step_does(host: hostresults.HostResults, probe: str,
                                                                        variant: str, backend: str) -> None:
    v = Verdict(Status.PARTIAL, note="ranks' outputs differ bit for bit", reason_code="rank-divergent",
                metrics={"agreement": SUMMARY})
    r = ProbeResult("20261204T000000Z-aaaa", H200, CELL, probe, variant, v, "2026-12-04T00:00:00Z")
    h = _with(host, r)
    (x,) = advise.advise_cell(H200, CELL, 2, h.latest(), h.facts).not_for_verify
    assert x.backend == backend and f"{probe} at " in x.why


def test_draft_estimate_leaves_the_divergent_backend_out_of_the_verify_step(host: hostresults.HostResults) -> None:
    model = estimate.parse_model("deepseek-v3")
    plain = decisions.render(decisions.decide(host, ENGINES, PINS, cell=CELL, tp=2, model=model, draft=4))
    # on the recorded rows alone the custom allreduce is the fastest verify step
    assert re.search(r"Fastest measured: decode \S+ .*; verify flashinfer-custom-ar ", plain)
    text = decisions.render(decisions.decide(_with(host, _diverged()), ENGINES, PINS, cell=CELL, tp=2, model=model,
                                             draft=4))
    assert "Not for a speculative verify step: flashinfer-custom-ar: ranks' outputs differ bit for bit" in text
    fastest = next(ln for ln in text.splitlines() if ln.startswith("Fastest measured:"))
    verify = fastest.split("; verify ", 1)[1]
    assert not verify.startswith("flashinfer-custom-ar")
    assert "‡ flashinfer-custom-ar left out of the verify step" in text
    assert any(ln.startswith("- flashinfer-custom-ar:") and "‡ not for the verify step" in ln
               for ln in text.splitlines())


def test_accept_counts_the_verify_step_in_tokens(host: hostresults.HostResults) -> None:
    model = estimate.parse_model("deepseek-v3")
    d = decisions.decide(host, ENGINES, PINS, cell=CELL, tp=2, model=model, batch=8, draft=4, accept=2.5)
    (c,) = d.cells
    assert c.accept is not None and c.accept.length == 2.5
    assert c.estimate is not None
    text = decisions.render(d)
    assert "Acceptance length 2.5 tokens per sequence per verify step (given with --accept)" in text
    for row in c.estimate.rows:
        total = row.verify.total_us
        if total is None:
            continue
        per_token = total / (8 * 2.5)  # 8 sequences keep 2.5 tokens each per verify step
        ceiling = 8 * 2.5 / (total * 1e-6)
        line = next(ln for ln in text.splitlines() if ln.startswith(f"- {row.backend}:") and "verify" in ln)
        assert f"{per_token:.2f} µs of allreduce per generated token" in line
        assert f"at most {ceiling:,.0f} tok/s from the allreduces alone" in line


def test_a_published_acceptance_is_the_default_only_where_it_was_published() -> None:
    kimi = estimate.default_acceptance("kimi-k2", 4)
    assert kimi is not None and kimi.length == 2.88 and "EAGLE-3" in kimi.source
    assert estimate.default_acceptance("kimi-k2", 3) is None  # published at 3 draft tokens (4 verified) only
    assert estimate.default_acceptance("deepseek-v3", 4) is None


def test_tokens_per_second() -> None:
    assert estimate.tokens_per_s(8, 2.88, 1000.0) == pytest.approx(8 * 2.88 * 1000)
    assert estimate.tokens_per_s(8, 2.0, None) is None and estimate.tokens_per_s(8, 2.0, 0.0) is None


@pytest.mark.parametrize(("argv", "message"), [
    (["--accept", "2"], "give --model too"),
    (["--model", "kimi-k2", "--accept", "5"], "--accept 5"),
    (["--model", "kimi-k2", "--accept", "0.5"], "--accept 0.5"),
    (["--model", "kimi-k2", "--accept", "nan"], "--accept nan"),
])
def test_bad_accept_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    code = main(["advise", "--results", str(FIXTURE), *argv])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and message in err


def test_advise_at_any_tp(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["advise", "--results", str(FIXTURE), "--host", H200, "--tp", "3"])
    out, _ = capsys.readouterr()
    assert code == 0
    assert "3 ranks" in out and "this host has 2 GPUs" in out

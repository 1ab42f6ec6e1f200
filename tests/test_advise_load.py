"""`checks advise` and the load probe: a backend that hung or drifted under load with a GPU per rank is not advised
in that cell, at any rank count, and the advice says where it stopped; on ranks sharing a GPU it is not."""

from __future__ import annotations

import pytest

from checks.report import advise
from checks.results import hostresults
from checks.results.result import ProbeResult, Verdict
from inenv.status import Status
from tests.checks_helpers import ROOT

FIXTURE = ROOT / "tests" / "golden" / "advise" / "results"
H200 = "h200x2-5bce98f7"
CELL = "local-cu130-torch2.11.0-sglnone-fi0.6.18"
HUNG = ("flashinfer-custom-ar two-streams: replay 2 (512 tokens, PDL off, stream 1; verified to replay 0) and the "
        "replays queued after it did not finish; device work not finished after 15 s")


@pytest.fixture(scope="module")
def host() -> hostresults.HostResults:
    return hostresults.load(FIXTURE)[H200]


def load_result(variant: str, status: Status, code: str, note: str) -> ProbeResult:
    return ProbeResult("r9", H200, CELL, "load", variant, Verdict(status, note=note, reason_code=code),
                       "2026-12-06T00:00:00Z")


def test_a_hang_under_load_takes_the_backend_out_of_the_advice_and_says_where(host: hostresults.HostResults) -> None:
    before = advise.advise_cell(host.host_id, CELL, 2, host.latest(), host.facts)
    assert "flashinfer-custom-ar" in {c.backend for c in before.curves}
    hung = load_result("ranks=2,backend=flashinfer-custom-ar,pattern=two-streams", Status.HANG, "load-hang", HUNG)
    after = advise.advise_cell(host.host_id, CELL, 2, [*host.latest(), hung], host.facts)
    assert "flashinfer-custom-ar" not in {c.backend for c in after.curves}
    assert all(s.use != "flashinfer-custom-ar" for s in after.sizes)
    [line] = [a for a in after.avoid if a.what.startswith("load ")]
    assert line.what == "load backend=flashinfer-custom-ar pattern=two-streams"
    assert (line.status, line.reason_code) == ("hang", "load-hang") and "replay 2 (512 tokens" in line.why
    # the same backend drifting at 8 ranks rules it out at 2 ranks too
    drift = load_result("ranks=8,backend=flashinfer-custom-ar,pattern=replay", Status.FAIL, "load-drift",
                        "flashinfer-custom-ar replay: wrong output at replay 1730 (96 tokens, PDL off, stream 0)")
    other = advise.advise_cell(host.host_id, CELL, 2, [*host.latest(), drift], host.facts)
    assert "flashinfer-custom-ar" not in {c.backend for c in other.curves}
    assert [a.reason_code for a in other.avoid if a.what.startswith("load ")] == ["load-drift"]


def test_a_hang_on_ranks_sharing_a_gpu_and_a_divergence_leave_the_advice(host: hostresults.HostResults) -> None:
    shared = load_result("ranks=2,placement=shared,gpus=1,backend=flashinfer-custom-ar,pattern=two-streams",
                         Status.HANG, "load-hang", HUNG)
    divergent = load_result("ranks=2,backend=flashinfer-custom-ar,pattern=replay", Status.PARTIAL,
                            "rank-divergent", "bitwise different across ranks at replay 64")
    got = advise.advise_cell(host.host_id, CELL, 2, [*host.latest(), shared, divergent], host.facts)
    assert "flashinfer-custom-ar" in {c.backend for c in got.curves}
    assert not [a for a in got.avoid if a.what.startswith("load ")]
    # ranks that disagree bit for bit under load keep the backend off a speculative verify step
    [kept_off] = [n for n in got.not_for_verify if n.backend == "flashinfer-custom-ar"]
    assert "load at 2 ranks: bitwise different across ranks at replay 64" in kept_off.why

"""What probes declare about their records (inenv.probe.declared), how the host reads results through it, and
the parsed variant and cell a ProbeResult carries."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from checks.results.provenance import hashed_bytes, source_hash
from checks.results.result import ProbeResult, Verdict
from inenv import registry
from inenv.probe import DECLARED_MARK, Declared, Role, declared
from inenv.status import Status
from tests.checks_helpers import ROOT, committed


def test_every_shipped_probe_declares_valid_fields() -> None:
    probes = registry.discover()
    decl = {pid: declared(mod) for pid, (_, mod) in probes.items()}
    assert all(d.metrics for d in decl.values())  # every shipped probe writes metrics, so each declares them
    assert {pid for pid, d in decl.items() if d.allreduce_path} == {
        "ar-latency", "custom-ar", "fi-fusion", "load", "nccl-graphs", "pcie-ipc", "symm-mem"}
    # the roles checks advise ranks backends by sit on ar-latency
    assert decl["ar-latency"].metric(Role.LATENCY) == "latency_us"
    assert decl["ar-latency"].metric(Role.RATIO_VS_NCCL) == "ratio_vs_nccl"


def test_every_metric_in_the_committed_results_is_declared_by_its_probe() -> None:
    decl = registry.declarations()
    undeclared: dict[str, set[str]] = {}
    fixture = ROOT / "tests" / "golden" / "advise" / "results"
    files = [*(committed()).glob("*/*.jsonl"), *fixture.glob("*/*.jsonl")]
    assert files
    for path in files:
        for line in path.read_text().splitlines():
            row = json.loads(line)
            names = {f.name for f in decl.get(row["probe_id"], Declared()).metrics}
            missing = set(row.get("metrics") or {}) - names
            if missing:
                undeclared.setdefault(row["probe_id"], set()).update(missing)
    assert undeclared == {}


@pytest.mark.parametrize(("attrs", "error"), [
    ({"METRICS": (("t", "s", "time", "no-such-role"),)}, "unknown role 'no-such-role'"),
    ({"METRICS": (("t", "s", "time"),)}, "is not a (name, unit, meaning, role or None) row"),
    ({"METRICS": (("t", "s", "", None),)}, "needs a name, a unit and a meaning"),
    ({"METRICS": (("a", "µs", "x", "latency"), ("b", "µs", "y", "latency"))}, "a field name or a role appears twice"),
    ({"EVIDENCE": [("a", "bool", "x", None)]}, "EVIDENCE: a tuple"),
    ({"ALLREDUCE_PATH": "yes"}, "ALLREDUCE_PATH: True or False"),
    ({"BUILD_COST": {"a": 1.0}}, "BUILD_COST: a tuple of (value, seconds) pairs"),
    ({"BUILD_COST": (("a", -1.0),)}, "('a', -1.0) is not a (value, seconds >= 0) pair"),
    ({"BUILD_COST": (("a", True),)}, "('a', True) is not a (value, seconds >= 0) pair"),
])
def test_a_malformed_declaration_says_what_is_wrong(attrs: dict[str, object], error: str) -> None:
    with pytest.raises(ValueError, match=error.replace("(", r"\(").replace(")", r"\)")):
        declared({"__name__": "t_probe", **attrs})


def test_build_costs_are_read_as_seconds_per_build() -> None:
    d = declared({"__name__": "t_probe", "BUILD_COST": (("big", 900), ("small", 10.5))})
    assert d.build_cost == (("big", 900.0), ("small", 10.5))


def test_a_probe_declaring_nothing_gives_the_host_no_key() -> None:
    d = declared({"__name__": "t_probe"})
    assert d == Declared() and d.metric(Role.LATENCY) is None and d.evidence_key(Role.HIDDEN) is None


BODY = 'SPEC = None\n\n\ndef run(ctx):\n    return 1\n'
BLOCK = (f"\n\n{DECLARED_MARK}: what this probe records\n"
         'METRICS = (\n    ("t_us", "µs", "time", "latency"),\n)\nALLREDUCE_PATH = True\n'
         'BUILD_COST = (("big", 900.0), ("small", 10))\n')


def test_the_declaration_block_is_left_out_of_the_probe_hash(tmp_path: Path) -> None:
    plain, with_block = tmp_path / "a" / "t_probe.py", tmp_path / "b" / "t_probe.py"
    for p, text in ((plain, BODY), (with_block, BODY + BLOCK)):
        p.parent.mkdir()
        p.write_text(text)
    assert hashed_bytes(with_block) == BODY.encode()
    assert source_hash([with_block]) == source_hash([plain])


def test_code_after_the_mark_counts_for_the_hash(tmp_path: Path) -> None:
    plain, sneaky = tmp_path / "a" / "t_probe.py", tmp_path / "b" / "t_probe.py"
    for p, text in ((plain, BODY), (sneaky, BODY + BLOCK + "\n\ndef run(ctx):\n    return 2\n")):
        p.parent.mkdir()
        p.write_text(text)
    assert hashed_bytes(sneaky) == sneaky.read_bytes()
    assert source_hash([sneaky]) != source_hash([plain])


def _result(cell_id: str, variant: str) -> ProbeResult:
    return ProbeResult("20261201T000000Z-abcd", "h", cell_id, "ar-latency", variant, Verdict(Status.PASS),
                       "2026-12-01T00:00:00Z")


def test_a_result_carries_its_variant_params_and_its_cell() -> None:
    r = _result("cu130-torch2.11.0-sgl0.4.2-fi0.6.18", "ranks=2,gpus=shared,algo=allreduce:tree,mode=graph")
    assert (r.ranks, r.shared_gpu, dict(r.params)) == (2, True, {"algo": "allreduce:tree", "mode": "graph"})
    assert r.cell is not None and (r.cell.torch, r.cell.flashinfer, r.cell.local) == ("2.11.0", "0.6.18", False)
    local = _result("local-cu130-torch2.11.0-sglnone-fi0.6.18", "ranks=1")
    assert local.cell is not None and local.cell.local and local.ranks == 1 and not local.shared_gpu
    odd = _result("my-own-env", "ranks=two,x")
    assert odd.cell is None and odd.ranks is None and dict(odd.params) == {"x": ""}


def test_the_json_of_a_result_is_what_it_was() -> None:
    """The parsed parts are not written: a committed line reads and writes back to the same object."""
    line = next((committed()).glob("*/*.jsonl")).read_text().splitlines()[0]
    obj = json.loads(line)
    back = ProbeResult.from_json(obj).to_json()
    assert back == obj
    assert set(back) == {"schema", "run_id", "host_id", "cell_id", "probe_id", "variant", "status", "reason_code",
                         "note", "remediation", "metrics", "evidence", "started_at", "duration_s", "code"}


def test_cell_and_image_states_are_enums_spelled_in_the_manifest() -> None:
    from checks.run.plan import CellState, CellTarget, ImageState

    cell = CellTarget("cu130-x", "resolved", image="img", image_status="built")
    assert cell.status is CellState.RESOLVED and cell.image_status is ImageState.BUILT
    assert CellTarget("cu130-y", CellState.UNAVAILABLE).image_status is ImageState.NONE
    assert json.dumps({"status": cell.status, "image_status": cell.image_status}) == (
        '{"status": "resolved", "image_status": "built"}')
    with pytest.raises(ValueError, match="'built-ish' is not a valid ImageState"):
        CellTarget("cu130-z", "resolved", image_status="built-ish")

"""The next step for an NCCL algorithm failure is chosen per NCCL release and offered only where that exact setting
passed on the same release (common/reasons.py, checks/results/remedies.py): NCCL >= 2.31 enables only the
collectives NCCL_ALGO names (vllm-project/vllm#58179), so ``allreduce:tree`` is advice for 2.24-2.30 alone.
Checked on planted results and on every committed result; the settings and releases below are written out here,
never read back from the code under test."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from checks.report.report import build_model
from checks.results import remedies
from checks.results.result import ProbeResult
from checks.results.store import latest_results
from common import reasons
from inenv.status import Status
from tests.checks_helpers import committed

CAT = reasons.default()
ALGO_UNAVAILABLE = "nccl-algo-unavailable"
# a variant's algo value -> the NCCL_ALGO it runs under (the key spells NCCL's "," as "+" and ";" as ".")
NCCL_ALGO = {"Ring": "Ring", "Tree": "Tree", "allreduce:tree": "allreduce:tree",
             "ring+tree.allreduce:tree": "ring,tree;allreduce:tree"}
PER_COLLECTIVE = 'NCCL_ALGO="ring,tree;allreduce:tree"'
ALLREDUCE_ONLY = 'NCCL_ALGO="allreduce:tree"'
NEW, OLD = "2.32.6", "2.30.7"
CELL_NEW, CELL_OLD = "cu132-torch2.15.0-sglnone-fi0.7.4-nccl2.32.6", "cu132-torch2.15.0-sglnone-fi0.7.4"
RUN = "20261206T000000Z-abcd"
HOST = "h200x2-0000aaaa"


def _result(cell: str, nccl: str, algo: str, status: str, code: str = "", proto: str = "",
            warmup: str = "yes") -> dict[str, Any]:
    variant = f"ranks=2,algo={algo}{f',proto={proto}' if proto else ''},warmup={warmup},runtime_connect=default"
    return {"schema": "stackprobe.result/1", "run_id": RUN, "host_id": HOST, "cell_id": cell,
            "probe_id": "nccl-graphs", "variant": variant, "status": status, "reason_code": code,
            "note": "broadcast fails eagerly too" if code else "", "remediation": "", "metrics": {},
            "evidence": {"env": {"nccl": nccl}, "nccl_version": nccl}, "started_at": "2026-12-06T00:00:00+00:00",
            "duration_s": 6.0}


def _planted() -> list[dict[str, Any]]:
    """Two cells of one stack on NCCL 2.32.6 and 2.30.7: global Tree needs a remedy on both; on 2.32.6
    ``allreduce:tree`` fails as vllm-project/vllm#58179 says and ``ring,tree;allreduce:tree`` passes; on 2.30.7
    ``allreduce:tree`` passes and the per-collective string was not run."""
    return [
        _result(CELL_NEW, NEW, "Tree", "partial", ALGO_UNAVAILABLE),
        _result(CELL_NEW, NEW, "allreduce:tree", "partial", ALGO_UNAVAILABLE, proto="Simple"),
        _result(CELL_NEW, NEW, "allreduce:tree", "partial", ALGO_UNAVAILABLE),
        _result(CELL_NEW, NEW, "ring+tree.allreduce:tree", "pass"),
        _result(CELL_NEW, NEW, "ring+tree.allreduce:tree", "pass", proto="Simple"),
        _result(CELL_OLD, OLD, "Tree", "partial", ALGO_UNAVAILABLE),
        _result(CELL_OLD, OLD, "allreduce:tree", "pass"),
        _result(CELL_OLD, OLD, "allreduce:tree", "pass", warmup="no"),
    ]


def _results(rows: list[dict[str, Any]]) -> list[ProbeResult]:
    return [ProbeResult.from_json(r) for r in rows]


def _offered(rows: list[dict[str, Any]]) -> dict[tuple[str, str], str]:
    got = _results(rows)
    seen = remedies.shown(got)
    return {(r.cell_id, r.variant): remedies.offered(r, CAT, seen) or "" for r in got
            if r.verdict.status is not Status.PASS}


def test_on_2_31_and_later_only_the_setting_that_names_every_collective_is_offered() -> None:
    offered = _offered(_planted())
    tree_new = offered[(CELL_NEW, "ranks=2,algo=Tree,warmup=yes,runtime_connect=default")]
    assert tree_new.startswith(f"use {PER_COLLECTIVE}")
    assert all(not text.startswith(f"use the per-collective syntax {ALLREDUCE_ONLY}") for (cell, _), text in
               offered.items() if cell == CELL_NEW)
    # on 2.30.7 the per-collective string was not run: the allreduce-only setting that passed there is offered
    tree_old = offered[(CELL_OLD, "ranks=2,algo=Tree,warmup=yes,runtime_connect=default")]
    assert tree_old.startswith(f"use the per-collective syntax {ALLREDUCE_ONLY}")


def test_no_remedy_without_a_pass_on_the_same_release_or_with_a_failure_there() -> None:
    fallback = CAT.get(ALGO_UNAVAILABLE).remediation  # type: ignore[union-attr]
    assert "NCCL_ALGO=" not in fallback and "ring,tree" not in fallback  # it advises no setting
    # the per-collective string passed on 2.32.6 only: a 2.31.0 cell with the same failure gets the fallback
    rows = [_result("cu132-x-nccl2.31.0", "2.31.0", "Tree", "partial", ALGO_UNAVAILABLE),
            _result(CELL_NEW, NEW, "ring+tree.allreduce:tree", "pass")]
    assert _offered(rows)[("cu132-x-nccl2.31.0", "ranks=2,algo=Tree,warmup=yes,runtime_connect=default")] == fallback
    # one variant of the setting that failed on the release outweighs the one that passed
    rows = [*_planted(), _result(CELL_NEW, NEW, "ring+tree.allreduce:tree", "fail", "nccl-op-hang", warmup="no")]
    assert _offered(rows)[(CELL_NEW, "ranks=2,algo=Tree,warmup=yes,runtime_connect=default")] == fallback
    # a release nobody recorded offers nothing release-bound
    unknown = {**_result(CELL_OLD, OLD, "Tree", "partial", ALGO_UNAVAILABLE), "evidence": {}}
    assert _offered([unknown, *_planted()[6:]])[(CELL_OLD, "ranks=2,algo=Tree,warmup=yes,runtime_connect=default")] \
        == fallback


def _failing(results: list[ProbeResult]) -> set[tuple[str, str]]:
    """(release, NCCL_ALGO) pairs some nccl-graphs result of NCCL's protocol shows failing: worked out here from the
    variant key and the recorded release, not by the code under test. A one-rank set-up check that NCCL accepted
    (partial + nccl-setup-only: one rank moves nothing between GPUs) shows nothing failing."""
    out = set()
    for r in results:
        if r.verdict.reason_code == "nccl-setup-only":
            continue
        params = dict(p.split("=", 1) for p in r.variant.split(",") if "=" in p)
        release = (r.verdict.evidence.get("env") or {}).get("nccl") or r.verdict.evidence.get("nccl_version")
        if r.probe_id == "nccl-graphs" and "proto" not in params and params.get("algo") in NCCL_ALGO and \
                r.verdict.status in (Status.FAIL, Status.PARTIAL, Status.HANG, Status.CRASH):
            out.add((str(release), NCCL_ALGO[params["algo"]]))
    return out


def _advised(text: str) -> str | None:
    """The NCCL_ALGO a next step tells the reader to use, read from its words."""
    for remedy in CAT.get(ALGO_UNAVAILABLE).remedies:  # type: ignore[union-attr]
        if text == remedy.remediation:
            return dict(remedy.setting)["NCCL_ALGO"]
    return None


def _no_remedy_shown_failing(results: list[ProbeResult]) -> int:
    """Asserts that no result is offered a setting the results show failing on its release; returns how many
    results were offered a setting."""
    seen, failing, count = remedies.shown(results), _failing(results), 0
    for r in results:
        if r.verdict.status is Status.PASS or r.verdict.reason_code != ALGO_UNAVAILABLE:
            continue
        algo = _advised(remedies.offered(r, CAT, seen) or "")
        if algo is not None:
            count += 1
            assert (remedies.nccl_release(r), algo) not in failing, (r.result_id, algo)
    return count


def test_no_planted_result_is_offered_a_setting_the_results_show_failing() -> None:
    assert _no_remedy_shown_failing(_results(_planted())) == 4  # each cell's Tree, and 2.32.6's two allreduce:tree


def test_no_committed_result_is_offered_a_setting_the_results_show_failing() -> None:
    every = [r for folder in sorted(committed().iterdir()) if folder.is_dir()
             for r in latest_results(folder).values()]
    # the 2x H200 host's global Tree on NCCL 2.28.9 is offered allreduce:tree, which passed there
    assert _no_remedy_shown_failing(every) >= 1


def test_the_page_offers_the_release_s_remedy(tmp_path: Path) -> None:
    folder = tmp_path / "results" / HOST
    folder.mkdir(parents=True)
    (folder / f"{RUN}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _planted()))
    known = CAT.reasons
    sections, _ = build_model(tmp_path / "results", tmp_path, current={},
                              catalogue_messages={r.code: r.message for r in known},
                              catalogue_remediations={r.code: r.remediation for r in known})
    notes = {(n.remediation, where) for s in sections for n in s.footnotes for where in n.where}
    new = {rem for rem, (cell, _, _) in notes if cell == CELL_NEW}
    old = {rem for rem, (cell, _, _) in notes if cell == CELL_OLD}
    assert {rem.split(" (", 1)[0] for rem in new} == {f"use {PER_COLLECTIVE}"}
    assert {rem.split(" (", 1)[0] for rem in old} == {f"use the per-collective syntax {ALLREDUCE_ONLY}"}


@pytest.mark.parametrize(("remedies_yaml", "said"), [
    ("    - {nccl: 'two', setting: {NCCL_ALGO: Ring}, remediation: r}", "a.remedies[0].nccl: NCCL releases"),
    ("    - {nccl: '>=2.24', setting: {ALGO: Ring}, remediation: r}", "a.remedies[0].setting: a mapping of NCCL"),
    ("    - {nccl: '>=2.24', setting: {NCCL_ALGO: ''}, remediation: r}", "a.remedies[0].setting"),
    ("    - {nccl: '>=2.24', setting: {NCCL_ALGO: Ring}}", "a.remedies[0]: must be a mapping of exactly nccl"),
    ("    - {nccl: '>=2.24', setting: {NCCL_ALGO: Ring}, remediation: ' '}", "a.remedies[0].remediation"),
    ("    x: 1", "a.remedies: must be a list"),
])
def test_a_bad_remedy_is_one_line_naming_it(remedies_yaml: str, said: str) -> None:
    text = f"- code: a\n  message: m\n  remediation: r\n  remedies:\n{remedies_yaml}\n" \
           "- code: unknown-error\n  message: m\n  remediation: r\n"
    with pytest.raises(reasons.CatalogueError) as e:
        reasons.parse(reasons.yamlsrc.plain(text), "x.yaml")
    assert said in str(e.value) and "\n" not in str(e.value)


def test_a_bad_host_bound_is_one_line_naming_it() -> None:
    text = "- code: a\n  message: m\n  remediation: r\n  host_bound: 'yes'\n" \
           "- code: unknown-error\n  message: m\n  remediation: r\n"
    with pytest.raises(reasons.CatalogueError) as e:
        reasons.parse(reasons.yamlsrc.plain(text), "x.yaml")
    assert "a.host_bound: must be true or false" in str(e.value) and "\n" not in str(e.value)
    ok = reasons.parse(reasons.yamlsrc.plain(text.replace("'yes'", "true")), "x.yaml")
    assert ok.host_bound_codes == frozenset({"a"})

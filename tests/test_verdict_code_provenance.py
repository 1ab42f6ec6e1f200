"""Host-side code that decides verdicts after a probe ran has a version recorded and shown with what it decided:
the requirement judge (checks/run/hostjudge.py) stamps the verdicts it shapes, a later change to that file marks
them stale on the page, and advice names the version of the gate reader (checks/report/gates.py) beside the gates
it read."""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import json
import shutil
from pathlib import Path

import pytest

from checks.cli import main
from checks.report import report
from checks.results import freshness, provenance
from checks.results.provenance import Provenance
from checks.results.result import ProbeResult, Verdict
from checks.run import hostjudge, incremental
from common.canonical import layout_free_source
from inenv.status import Status
from tests.checks_helpers import ROOT
from tests.test_architecture import graph, sources

HOST, RUN, CELL = "cpu-0a1b2c3d", "20261204T020803Z-abcd", "cu130-torch2.14.0-sglnone-fi0.7.2.post1"
INVENTORY_HASH = "0123456789abcdef"


def _file_version(*paths: Path) -> str:
    """Files' version written out: sha256 over each file's name, NUL, its layout-free text, NUL (16 hex)."""
    h = hashlib.sha256()
    for path in paths:
        h.update(path.name.encode() + b"\0" + layout_free_source(path.read_text()).encode() + b"\0")
    return h.hexdigest()[:16]


# The result record, the probe API and the versioning itself: shared by every judge, in no judge's version
RECORD = {"checks.results.result", "checks.results.provenance", "inenv.probe", "inenv.status", "inenv.probes"}


def _closure(path: Path) -> tuple[Path, ...]:
    """A judge's file, then every project module its imports reach, found by the architecture test's own reader
    of the import graph (RECORD and the packages' ``__init__`` files aside), sorted by file name."""
    edges, src = graph(), sources()
    start = next(m for m, f in src.items() if f.resolve() == path.resolve())
    seen, todo = {start}, [start]
    while todo:
        for target in edges[todo.pop()] - seen - RECORD:
            if src[target].name != "__init__.py":
                seen.add(target)
                todo.append(target)
    return (path, *sorted((src[m] for m in seen - {start}), key=lambda f: (f.name, f.as_posix())))


# The judge's own imports, read off the file by hand: its import closure starts with them
DIRECT = (ROOT / "inenv" / "dists.py", ROOT / "inenv" / "probes" / "inventory.py")
JUDGE = _closure(ROOT / "checks" / "run" / "hostjudge.py")
GATES = _closure(ROOT / "checks" / "report" / "gates.py")
PACKAGING = {"packaging": importlib.metadata.version("packaging")}


def _raw(requires: list[str]) -> Verdict:
    """An inventory pass that recorded its environment's declared requirements, for the host to judge."""
    return Verdict(Status.PASS, evidence={"installed": {
        "markers": {"python_version": "3.12", "sys_platform": "linux"},
        "requirements": {"vllm": {"version": "0.33.0", "requires": requires},
                         "torch": {"version": "2.15.0", "requires": []}}}})


def _result(verdict: Verdict) -> ProbeResult:
    return ProbeResult(RUN, HOST, CELL, "inventory", "ranks=1", verdict, "2026-12-04T02:08:03+00:00",
                       Provenance("0.1.0", "a" * 40, False, INVENTORY_HASH))


def test_the_requirement_judge_stamps_the_verdicts_it_shapes_with_its_version() -> None:
    judged = hostjudge.judge("inventory", _raw(["torch==2.14.0"]))
    assert judged.status is Status.PARTIAL and judged.reason_code == "dependency-pin-violated"
    assert judged.evidence[provenance.JUDGED_BY] == {"hostjudge.py": _file_version(*JUDGE)}
    assert judged.evidence[provenance.JUDGED_WITH] == PACKAGING
    nothing = Verdict(Status.PASS, evidence={"installed": {}})  # no requirements recorded: nothing judged
    assert provenance.JUDGED_BY not in hostjudge.judge("inventory", nothing).evidence
    assert provenance.VERDICT_CODE["hostjudge.py"] == Path(hostjudge.__file__).resolve()


def _page(results: Path, out: Path) -> str:
    (results / HOST).mkdir(parents=True, exist_ok=True)
    manifest = {"schema": "stackprobe.manifest/2", "run_id": RUN, "host_id": HOST, "executor": "docker",
                "facts": {}, "code": {"version": "0.1.0", "commit": "a" * 40, "dirty": False,
                                      "probe_hashes": {"inventory": INVENTORY_HASH}}}
    (results / HOST / f"{RUN}.manifest.json").write_text(json.dumps(manifest))
    sections, _ = report.build_model(results, out, current={"inventory": INVENTORY_HASH})
    (s,) = sections
    cell = s.rows[0]["cells"]["inventory"]
    return ("stale " if cell.stale else "current ") + " | ".join([*s.judged, *(f.why for f in s.refresh)])


def test_changing_the_requirement_judge_marks_the_verdicts_it_shaped(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A verdict judged by this checkout's judge is current, and the page names the judge's version; a copy
    of the judge with one value changed, taken as this checkout's, makes the same verdict stale, with why."""
    judged = _result(hostjudge.judge("inventory", _raw(["torch==2.14.0"])))
    version = _file_version(*JUDGE)
    results = tmp_path / "results"
    (results / HOST).mkdir(parents=True)
    (results / HOST / f"{RUN}.jsonl").write_text(json.dumps(judged.to_json()) + "\n")

    copy = tmp_path / "judge" / "hostjudge.py"
    copy.parent.mkdir()
    shutil.copy(ROOT / "checks" / "run" / "hostjudge.py", copy)
    monkeypatch.setitem(provenance.VERDICT_CODE, "hostjudge.py", copy)
    assert freshness.staleness(judged, {"inventory": INVENTORY_HASH}) == ""
    assert _page(results, tmp_path / "out") == (
        f"current inventory (1 variant): by the requirement judge hostjudge.py {version}")

    text = copy.read_text()
    assert "\nSHOWN = 3 " in text
    copy.write_text(text.replace("\nSHOWN = 3 ", "\nSHOWN = 4 "))
    assert freshness.staleness(judged, {"inventory": INVENTORY_HASH}) == freshness.JUDGE_CHANGED
    page = _page(results, tmp_path / "out")
    assert page.startswith(f"stale inventory (1 variant): by the requirement judge hostjudge.py {version} | ")
    assert "judged on the host by another version of its host-side judge (the judge's file and the modules it " \
           "imports" in page


def test_a_rerun_does_not_carry_a_verdict_judged_by_another_version(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The refresh command the page prints reruns what the judge shaped: a changed judge is a reason not to
    carry the earlier verdict forward (it would stay stale), like a changed probe."""
    inputs = incremental.Inputs("sha256:env", "host")
    judged = _result(incremental.stamped(hostjudge.judge("inventory", _raw(["torch==2.14.0"])), inputs, False))
    copy = tmp_path / "hostjudge.py"
    shutil.copy(ROOT / "checks" / "run" / "hostjudge.py", copy)
    monkeypatch.setitem(provenance.VERDICT_CODE, "hostjudge.py", copy)
    assert incremental.why_not(judged, inputs, INVENTORY_HASH, "full") == ""
    copy.write_text(copy.read_text() + "\nEXTRA = 1\n")
    assert incremental.why_not(judged, inputs, INVENTORY_HASH, "full") == (
        "the host-side code that judged it changed (or it recorded no version of it)")


def test_a_judged_verdict_that_names_no_judge_version_is_stale(tmp_path: Path) -> None:
    """Judged before results named the judge (its counts in the evidence, no version), or naming a version
    that is not a hash: stale, never taken as current."""
    judged = hostjudge.judge("inventory", _raw([]))
    unnamed = _result(judged.replace(evidence={k: v for k, v in judged.evidence.items()
                                               if k != provenance.JUDGED_BY}))
    assert "requirements_read" in unnamed.verdict.evidence["installed"]
    assert freshness.staleness(unnamed, {"inventory": INVENTORY_HASH}) == freshness.JUDGE_CHANGED
    forged = _result(judged.with_evidence(judged_by={"hostjudge.py": "<b>any</b>"}))
    assert freshness.staleness(forged, {"inventory": INVENTORY_HASH}) == freshness.JUDGE_CHANGED
    assert freshness.staleness(_result(judged), {"inventory": INVENTORY_HASH}) == ""
    untouched = _result(Verdict(Status.PASS, evidence={"installed": {}}))  # no host-side code shaped it
    assert freshness.staleness(untouched, {"inventory": INVENTORY_HASH}) == ""


def test_advice_names_the_gate_readers_version_beside_the_gates(capsys: pytest.CaptureFixture[str]) -> None:
    fixture, host = ROOT / "tests" / "golden" / "gates" / "results", "cpu-7eb23414"
    version = _file_version(*GATES)
    assert main(["advise", "--results", str(fixture), "--host", host]) == 0
    out = capsys.readouterr().out
    assert f"Read by stackprobe's gate reader gates.py {version}." in out
    assert main(["advise", "--results", str(fixture), "--host", host, "--json"]) == 0
    (decision,) = json.loads(capsys.readouterr().out)
    assert decision["gate_reader"] == version


def _tree(tmp: Path) -> Path:
    """The requirement judge and the modules it imports, copied to a tree of their own."""
    for f in JUDGE:
        dest = tmp / f.relative_to(ROOT)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(f, dest)
    return tmp


def test_a_judges_version_covers_the_modules_it_imports_found_by_reading_its_imports(tmp_path: Path) -> None:
    """The judge's distribution table (inenv/dists.py) is in its version because the judge imports it: a changed
    table makes a verdict the judge shaped stale; a module the judge starts to import joins its version."""
    root = _tree(tmp_path / "tree")
    judge = root / "checks" / "run" / "hostjudge.py"
    assert [f.name for f in provenance.judge_sources(judge, root)] == [f.name for f in JUDGE]
    assert provenance.judge_third_party(judge, root) == ["packaging"]
    before = provenance.judge_version(judge, root)
    assert before == _file_version(*JUDGE)
    judged = _result(hostjudge.judge("inventory", _raw(["torch==2.14.0"])))
    assert freshness.staleness(judged, {"inventory": INVENTORY_HASH}, {"hostjudge.py": before}) == ""

    dists = root / "inenv" / "dists.py"
    dists.write_text(dists.read_text() + "\nEXTRA_TABLE_ROW = 1\n")
    after = provenance.judge_version(judge, root)
    assert after != before
    assert freshness.staleness(judged, {"inventory": INVENTORY_HASH}, {"hostjudge.py": after}) == \
        freshness.JUDGE_CHANGED

    (root / "checks" / "report").mkdir(parents=True)
    shutil.copy(ROOT / "checks" / "report" / "engine_rules.py", root / "checks" / "report" / "engine_rules.py")
    judge.write_text(judge.read_text().replace("from inenv import dists\n",
                                               "from inenv import dists\nfrom checks.report import engine_rules\n"))
    assert "engine_rules.py" in [f.name for f in provenance.judge_sources(judge, root)]


def test_a_verdict_judged_with_another_packaging_or_recording_none_is_stale() -> None:
    judged = hostjudge.judge("inventory", _raw(["torch==2.14.0"]))
    assert freshness.staleness(_result(judged), {"inventory": INVENTORY_HASH}) == ""
    other = judged.with_evidence(**{provenance.JUDGED_WITH: {"packaging": "0.1"}})
    assert freshness.staleness(_result(other), {"inventory": INVENTORY_HASH}) == freshness.JUDGE_CHANGED
    none = judged.replace(evidence={k: v for k, v in judged.evidence.items() if k != provenance.JUDGED_WITH})
    assert freshness.staleness(_result(none), {"inventory": INVENTORY_HASH}) == freshness.JUDGE_CHANGED


def test_a_judges_closure_reaches_past_its_own_imports() -> None:
    """The requirement judge's version covers the modules its imports import in turn: the helpers of the probe it
    reads (inventory's installed-metadata reader), not only the files it names."""
    assert JUDGE[0].name == "hostjudge.py" and set(DIRECT) < set(JUDGE)
    assert ROOT / "inenv" / "kit" / "_installed.py" in JUDGE
    assert [f.name for f in provenance.judge_sources(JUDGE[0])] == [f.name for f in JUDGE]


def test_the_judges_are_the_modules_that_declare_a_role(tmp_path: Path) -> None:
    """VERDICT_CODE is read off the files: a module of checks/ with a VERDICT_ROLE string at its top is a judge,
    one that only mentions the word is not, and two judges of one file name are refused (a result records the
    name)."""
    (tmp_path / "checks" / "a").mkdir(parents=True)
    (tmp_path / "checks" / "a" / "judge.py").write_text('"""A judge."""\nVERDICT_ROLE = "test judge"\n')
    (tmp_path / "checks" / "a" / "other.py").write_text('def f():\n    VERDICT_ROLE = "not at the top"\n')
    assert provenance.declared_judges(tmp_path) == {"judge.py": (tmp_path / "checks" / "a" / "judge.py",
                                                                 "test judge")}
    (tmp_path / "checks" / "b").mkdir()
    (tmp_path / "checks" / "b" / "judge.py").write_text('VERDICT_ROLE = "another"\n')
    with pytest.raises(ValueError, match="two judges named judge.py"):
        provenance.declared_judges(tmp_path)
    assert set(provenance.VERDICT_CODE) == {"hostjudge.py", "gates.py", "classify.py", "acct.py"}


def makes_verdicts(path: Path, root: Path = ROOT) -> bool:
    """Whether a module makes or changes a verdict: on the host, it calls the typed result's ``Verdict(...)`` or a
    ``.replace(status=...)``; in the environment (a module that is not a probe), it names a status
    (``Status.FAIL``), which is how a worker or a helper decides one."""
    tree = ast.parse(path.read_text())
    if path.relative_to(root).parts[0] == "inenv":
        return any(isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "Status"
                   and n.attr.isupper() for n in ast.walk(tree))
    typed = any(isinstance(n, ast.ImportFrom) and n.module == "checks.results.result"
                and any(a.name == "Verdict" for a in n.names) for n in ast.walk(tree))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    return any(typed and isinstance(n.func, ast.Name) and n.func.id == "Verdict"
               or isinstance(n.func, ast.Attribute) and n.func.attr == "replace"
               and any(k.arg == "status" for k in n.keywords) for n in calls)


def _own_name(path: Path) -> str:
    return path.parent.name if path.name == "__init__.py" else path.stem


def test_every_module_that_makes_or_changes_a_verdict_is_in_a_hash() -> None:
    """A module that decides a verdict is in some probe's hash (its probe, the helpers and facts it imports), in
    some judge's version (its import closure), or one of the modules every verdict passes through
    (provenance.SHARED_CONTRACT); a new one outside all three fails here until it is hashed or declared."""
    from inenv import registry

    probes = [p for pid, (_, mod) in registry.discover().items() for p in provenance.probe_sources(Path(mod.__file__))]
    judged = [p for path in provenance.VERDICT_CODE.values() for p in provenance.judge_sources(path)]
    hashed = {p.resolve() for p in [*probes, *judged]}
    makers = [p for p in sources().values() if "probes" not in p.relative_to(ROOT).parts[:2] and makes_verdicts(p)]
    outside = sorted(str(p.relative_to(ROOT)) for p in makers
                     if p.resolve() not in hashed and _own_name(p) not in provenance.SHARED_CONTRACT)
    assert outside == []
    assert {"classify.py", "hostjudge.py", "acct.py", "worker.py"} <= {p.name for p in makers}


def test_the_verdict_maker_check_sees_each_form(tmp_path: Path) -> None:
    host = tmp_path / "checks" / "run" / "x.py"
    host.parent.mkdir(parents=True)
    host.write_text("from checks.results.result import Verdict\ndef f(s):\n    return Verdict(s, 'c', 'n')\n")
    changed = tmp_path / "checks" / "run" / "y.py"
    changed.write_text("def f(v):\n    return v.replace(status=None)\n")
    reader = tmp_path / "checks" / "run" / "z.py"
    reader.write_text("from inenv.status import Status\ndef f(v):\n    return v.status is Status.PASS\n")
    worker = tmp_path / "inenv" / "w.py"
    worker.parent.mkdir()
    worker.write_text("def f(r):\n    r['status'] = Status.HANG.value\n")
    assert [makes_verdicts(p, tmp_path) for p in (host, changed, reader, worker)] == [True, True, False, True]


def test_a_modules_distribution_is_found_by_its_name_its_top_level_list_or_its_record(tmp_path: Path,
                                                                                      monkeypatch) -> None:
    """Three distributions in a site folder of their own: one named as its module, one listing its module in
    top_level.txt (as PyYAML lists yaml), one with only a RECORD whose files (absent here: never stat'ed) name it."""
    site = tmp_path / "site"
    for name, version, extra in (("plainmod", "1.0", {}), ("PyFake", "2.0", {"top_level.txt": "fakeyaml\n"}),
                                 ("recorded-dist", "3.0", {"RECORD": "recmod/__init__.py,,\nrecmod/x.py,,\n"
                                                                     "recorded_dist-3.0.dist-info/METADATA,,\n"})):
        info = site / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        for fname, text in extra.items():
            (info / fname).write_text(text)
    monkeypatch.syspath_prepend(str(site))
    provenance._providers.cache_clear()
    try:
        assert provenance._providers("plainmod") == ("plainmod",)
        assert provenance._providers("fakeyaml") == ("PyFake",)
        assert provenance._providers("recmod") == ("recorded-dist",)
        assert provenance._providers("nosuchmodule_xyz") == ("nosuchmodule_xyz",)
    finally:
        provenance._providers.cache_clear()

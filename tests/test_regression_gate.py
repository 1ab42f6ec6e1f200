"""CI's regression gate (`checks diff --base REV`) cannot be talked past: a pass -> fail is judged by host, cell,
probe and variant; a differing probe hash excuses it only when this checkout computes both hashes as versions
of the probe; removals are gated; an expected-changes entry covers its exact key only; the base revision is
read blob by blob, a committed symbolic link being one warning line."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from checks import cli
from checks.results import changes, provenance
from checks.results.provenance import current_probe_hashes
from tests.checks_helpers import ROOT, committed

H2 = "h200x2-5bce98f7"
NEWEST = "20261201T021126Z-b42a"
GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t",
           "PATH": "/usr/bin:/bin"}


def _main(*argv: str | Path) -> int:
    return cli.main([str(a) for a in argv])


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, env=GIT_ENV)


def _repo(tmp_path: Path, with_code: bool = False) -> Path:
    """A git repository holding the committed 2x H200's results (and, asked, this checkout's `inenv` tree)."""
    repo = tmp_path / "repo"
    shutil.copytree(committed() / H2, repo / "results" / H2)
    if with_code:
        tracked = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-z", "inenv"], capture_output=True,
                                 check=True).stdout.decode().split("\0")
        for rel in filter(None, tracked):
            if (ROOT / rel).is_file():
                (repo / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(ROOT / rel, repo / rel)
    _git(repo, "init", "-q")
    return repo


def _lines(repo: Path) -> tuple[Path, list[str]]:
    path = repo / "results" / H2 / f"{NEWEST}.jsonl"
    return path, path.read_text().splitlines()


def _first_pass(lines: list[str]) -> tuple[int, dict]:
    return next((i, json.loads(ln)) for i, ln in enumerate(lines) if json.loads(ln)["status"] == "pass")


def _set(path: Path, lines: list[str], n: int, row: dict) -> None:
    lines[n] = json.dumps(row)
    path.write_text("\n".join(lines) + "\n")


def _drop(folder: Path, gone: Callable[[dict], bool]) -> None:
    """Every run of ``folder`` without the results ``gone`` (a predicate on a result) picks."""
    for f in folder.glob("*.jsonl"):
        kept = [ln for ln in f.read_text().splitlines() if not gone(json.loads(ln))]
        f.write_text("".join(f"{ln}\n" for ln in kept))


def _commit(repo: Path, message: str) -> None:
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", message)


def _gate(repo: Path, capsys: pytest.CaptureFixture, base: str = "HEAD~1") -> tuple[int, str, str]:
    capsys.readouterr()
    code = _main("diff", "--base", base, "--results", repo / "results")
    io = capsys.readouterr()
    assert "Traceback" not in io.err
    return code, io.out, io.err


def _entry(row: dict, variant: str | None = None) -> str:
    v = row["variant"] if variant is None else variant
    return (f"- host: {row['host_id']}\n  cell: {row['cell_id']}\n  probe: {row['probe_id']}\n  variant: '{v}'\n"
            "  why: planted by this test\n")


def test_a_failing_line_with_a_hash_no_known_probe_version_produces_is_gated(tmp_path: Path,
                                                                              capsys: pytest.CaptureFixture) -> None:
    repo = _repo(tmp_path)
    _commit(repo, "base")
    path, lines = _lines(repo)
    n, first = _first_pass(lines)
    _set(path, lines, n, {**first, "status": "fail", "reason_code": "ar-wrong-result",
                          "code": {**first["code"], "probe_hash": "e" * 16}})
    _commit(repo, "a fail that claims other probe code")
    code, out, err = _gate(repo, capsys)
    assert code == 1
    assert f"probe code {first['code']['probe_hash'][:12]} -> eeeeeeeeeeee" in out
    assert "(unverified)" in err and first["variant"] in err

    # the same claim with this checkout's own hash: the passing line's hash is no version known here either
    now = current_probe_hashes()[first["probe_id"]]
    assert first["code"]["probe_hash"] != now
    _set(path, lines, n, {**first, "status": "fail", "code": {**first["code"], "probe_hash": now}})
    _commit(repo, "a fail by this checkout's code")
    assert _gate(repo, capsys, "HEAD~2")[0] == 1


def test_a_flip_is_excused_only_when_both_hashes_are_versions_this_checkout_computes(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The base revision holds another version of the probe: its hash (this checkout's hashing of the base's
    code) and the hash now are both known, so a pass by the base's code turning into a fail by this checkout's
    is a change of the probe; a passing line that claims a hash neither version has is gated."""
    repo = _repo(tmp_path, with_code=True)
    path, lines = _lines(repo)
    n, first = _first_pass(lines)
    probe_file = repo / "inenv" / "probes" / "ar_latency.py"
    assert first["probe_id"] == "ar-latency"
    probe_file.write_text("# an older version of the probe\n" + probe_file.read_text())
    old = provenance.probe_hash(probe_file, repo / "inenv" / "kit")
    now = current_probe_hashes()["ar-latency"]
    assert old != now
    _set(path, lines, n, {**first, "code": {**first["code"], "probe_hash": old}})
    _commit(repo, "base: a pass by the older probe")
    _set(path, lines, n, {**first, "status": "fail", "reason_code": "ar-wrong-result",
                          "code": {**first["code"], "probe_hash": now}})
    _commit(repo, "the new probe fails")
    code, out, err = _gate(repo, capsys)
    assert code == 0, err
    assert "pass -> fail" in out and f"probe code {old[:12]} -> {now[:12]}" in out

    # the same flip from a base whose pass claims a hash no version of the probe produces: gated
    _git(repo, "reset", "-q", "--hard", "HEAD~1")
    path, lines = _lines(repo)
    _set(path, lines, n, {**first, "code": {**first["code"], "probe_hash": "0123456789abcdef"}})
    _commit(repo, "base: a pass claiming unknown code")
    _set(path, lines, n, {**first, "status": "fail", "reason_code": "ar-wrong-result",
                          "code": {**first["code"], "probe_hash": now}})
    _commit(repo, "the new probe fails")
    code, _, err = _gate(repo, capsys)
    assert code == 1 and "(unverified)" in err


def test_an_entry_for_another_variant_does_not_cover_a_flip(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    repo = _repo(tmp_path)
    _commit(repo, "base")
    path, lines = _lines(repo)
    n, first = _first_pass(lines)
    other = next(json.loads(ln) for ln in lines if json.loads(ln)["probe_id"] == first["probe_id"]
                 and json.loads(ln)["cell_id"] == first["cell_id"] and json.loads(ln)["variant"] != first["variant"])
    _set(path, lines, n, {**first, "status": "fail", "reason_code": "ar-wrong-result"})
    _commit(repo, "plant a flip")
    expected = repo / "results" / "expected-changes.yaml"
    expected.write_text(_entry(first, other["variant"]))  # same host, cell and probe; another variant
    code, _, err = _gate(repo, capsys)
    assert code == 1 and "with the same probe code" in err
    assert f"variant: '{first['variant']}'" in err  # the entry to add is printed
    expected.write_text(_entry(first))
    assert _gate(repo, capsys)[0] == 0

    # an entry without its variant names no exact key: refused, one line
    expected.write_text(_entry(first).replace(f"  variant: '{first['variant']}'\n", ""))
    code, _, err = _gate(repo, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "entry 1" in err and "variant" in err


def test_removed_hosts_cells_and_results_are_gated(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    repo = _repo(tmp_path)
    _commit(repo, "base")
    res = repo / "results" / H2
    # one key's results removed from every run
    row = _first_pass(_lines(repo)[1])[1]
    key = (row["cell_id"], row["probe_id"], row["variant"])
    _drop(res, lambda r: (r["cell_id"], r["probe_id"], r["variant"]) == key)
    _commit(repo, "drop a result")
    code, out, err = _gate(repo, capsys)
    assert code == 1
    assert f"removed: {H2} {row['cell_id']} {row['probe_id']} {row['variant']}" in out
    assert "removed: the table showed it" in err
    (repo / "results" / "expected-changes.yaml").write_text(_entry(row))
    assert _gate(repo, capsys)[0] == 0

    # a whole cell removed: one line says so
    cells = sorted({json.loads(ln)["cell_id"] for f in res.glob("*.jsonl") for ln in f.read_text().splitlines()})
    _drop(res, lambda r: r["cell_id"] == cells[-1])
    _commit(repo, "drop a cell")
    code, out, err = _gate(repo, capsys)
    assert code == 1 and f"removed cell on {H2}: {cells[-1]}" in out

    # the whole host removed: one line says so, and every key it showed is gated
    shutil.rmtree(res)
    _commit(repo, "drop the host")
    code, out, err = _gate(repo, capsys)
    assert code == 1 and f"removed host: {H2}" in out
    assert err.count("removed: the table showed it") > 10


def test_a_committed_symlink_run_file_in_the_base_is_one_warning_line(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture) -> None:
    repo = _repo(tmp_path)
    link = repo / "results" / H2 / "20261101T000000Z-abcd.jsonl"
    os.symlink("/etc/passwd", link)
    _commit(repo, "base with a link")
    (repo / "results" / "expected-changes.yaml").write_text("[]\n")
    _commit(repo, "a second commit")
    code, _, err = _gate(repo, capsys)
    assert code == 0
    said = [ln for ln in err.splitlines() if ln.startswith("warning: base") and "20261101T000000Z-abcd" in ln]
    assert len(said) == 1 and "a symbolic link in the revision; not followed" in said[0], err


def test_diff_base_names_the_cause_outside_a_repository(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    res = tmp_path / "results"
    shutil.copytree(committed() / H2, res / H2)
    capsys.readouterr()
    assert _main("diff", "--base", "HEAD~1", "--results", res) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not inside a git repository" in err[0] and "not a commit" not in err[0]

    repo = _repo(tmp_path)
    _commit(repo, "base")
    assert _main("diff", "--base", "no-such-rev", "--results", repo / "results") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not a commit of the git repository" in err[0]


def test_figures_and_host_facts_are_changes_too() -> None:
    """Pure: the same verdicts with other numbers, and a newer manifest with other host facts, are listed."""
    from checks.results.reader import Run

    row = {"cell_id": "c", "probe_id": "p", "variant": "", "status": "pass", "metrics": {"us": 1.5, "list": [1, 2]},
           "evidence": {"reused_from": "x", "deep": {"a": [{"b": 1}]}}, "note": "", "remediation": ""}
    facts = {"gpu_count": 2, "driver": "580"}
    before = {"h": {"r1": Run("r1", {"facts": facts}, (row,))}}
    same = changes.compare(before, {"h": {"r1": Run("r1", {"facts": facts}, ({**row, "evidence": {
        "reused_from": "y", "deep": {"a": [{"b": 1}]}}},))}})
    assert same.empty  # carrying a result from another run changes nothing shown
    x10 = {**row, "metrics": {"us": 15.0, "list": [10, 20]}, "evidence": {"deep": {"a": [{"b": 10}]}}}
    found = changes.compare(before, {"h": {"r2": Run("r2", {"facts": {**facts, "driver": "590"}}, (x10,))}})
    assert not found.flips
    lines = found.lines()
    assert any(ln.startswith("figures: h c p (no variant): 4 value(s) changed") for ln in lines), lines
    assert any(ln.startswith("host facts of h: 1 value(s) changed (facts.driver \"580\" -> \"590\")") for ln in lines)

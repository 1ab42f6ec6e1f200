"""Contributions arrive checked: a bundle cannot rewrite a host's advice, text from outside reaches no page as
markup or control characters, and CI's regression gate fails on a committed pass that turns into a fail."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from checks import cli
from checks.results.provenance import current_probe_hashes
from tests.checks_helpers import committed, report_md

H2 = "h200x2-5bce98f7"
NEWEST = "20261201T021126Z-b42a"
FORGED = "20261202T000000Z-dead"
CELL = "cu130-torch2.11.0-sglnone-fi0.6.8.post1"


def _main(*argv: str | Path) -> int:
    return cli.main([str(a) for a in argv])


def _p2p_result(run: str, variant: str, code: dict) -> dict:
    return {"schema": "stackprobe.result/2", "run_id": run, "host_id": H2, "cell_id": CELL, "probe_id": "host-p2p",
            "variant": variant, "status": "fail", "reason_code": "p2p-copy-failed", "note": "peer copy failed",
            "remediation": "", "metrics": {}, "evidence": {}, "started_at": "2026-12-02T00:00:00+00:00",
            "duration_s": 1.0, "code": code}


def _forged_bundle(path: Path, with_manifest: bool, probe_hash: str = "f" * 16) -> None:
    """The attack as the campaign wrote it: a bundle naming the committed 2x H200 with one new run of four
    failed host-p2p peer copies, the run's manifest copied from the host's newest (same GPUs) or absent."""
    manifest = json.loads((committed() / H2 / f"{NEWEST}.manifest.json").read_text())
    manifest["run_id"] = FORGED
    code = {"version": "0.1.0", "commit": "b" * 40, "dirty": False, "probe_hash": probe_hash}
    results = [_p2p_result(FORGED, f"check=copy,pair={a}-{b}", code) for a, b in ((0, 1), (1, 0), (0, 0), (1, 1))]
    runs = [{"run_id": FORGED, "manifest": manifest if with_manifest else None, "results": results}]
    path.write_text(json.dumps({"schema": "stackprobe.bundle/1", "host_id": H2, "host": {}, "scrubbed": {},
                                "code": {"runs": [], "warnings": []}, "runs": runs}))


def _advice(res: Path, capsys: pytest.CaptureFixture) -> str:
    capsys.readouterr()
    assert _main("advise", "--results", res, "--host", H2) == 0
    return capsys.readouterr().out


def test_a_forged_bundle_for_an_existing_host_changes_none_of_its_advice(tmp_path: Path,
                                                                        capsys: pytest.CaptureFixture) -> None:
    res = tmp_path / "results"
    shutil.copytree(committed() / H2, res / H2)
    before_files = sorted(p.name for p in (res / H2).iterdir())
    before = _advice(res, capsys)
    assert "needs direct GPU peer-to-peer" not in before

    # no manifest: refused (its GPUs cannot be checked), nothing written
    bare = tmp_path / "bare.json"
    _forged_bundle(bare, with_manifest=False)
    assert _main("import", bare, "--results", res) == 1
    assert "has no manifest" in capsys.readouterr().err
    assert sorted(p.name for p in (res / H2).iterdir()) == before_files

    # a manifest with the same GPUs: every advice line it would flip printed, nothing written without the flag
    forged = tmp_path / "forged.json"
    _forged_bundle(forged, with_manifest=True)
    assert _main("import", forged, "--results", res) == 1
    err = capsys.readouterr().err
    assert "not imported" in err and "--accept-flips" in err
    assert "+ Avoid: flashinfer-custom-ar (needs direct GPU peer-to-peer)" in err
    assert "- 14 KiB (1 token): flashinfer-custom-ar" in err  # the line it would take away is named too
    assert (f"contributed results of host {H2} (hardware class unknown: the bundle names no GPU count), measured "
            "by stackprobe") in err  # the forged bundle's host facts are empty
    assert sorted(p.name for p in (res / H2).iterdir()) == before_files
    assert _advice(res, capsys) == before

    # asked for explicitly, it is applied: the check above can fail
    assert _main("import", forged, "--accept-flips", "--results", res) == 0
    after = _advice(res, capsys)
    assert "needs direct GPU peer-to-peer" in after
    # and the advice says which run was measured elsewhere, by which code
    assert f"run {FORGED}: contributed: imported from forged.json, measured by stackprobe 0.1.0 at " in after


def test_import_counts_results_claiming_this_checkouts_probe_code(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture) -> None:
    """A bundle whose results copy this checkout's probe hash is told apart from one that does not, on import."""
    res = tmp_path / "results"
    claim = current_probe_hashes()["host-p2p"]
    for name, probe_hash, said in (("old", "f" * 16, "0 of 4 claim"), ("claim", claim, "4 of 4 claim")):
        path = tmp_path / f"{name}.json"
        _forged_bundle(path, with_manifest=True, probe_hash=probe_hash)
        capsys.readouterr()
        _main("import", path, "--results", res / name)
        assert f"{said} this checkout's probe code" in capsys.readouterr().err


def test_an_imported_run_that_claims_this_checkouts_probe_code_keeps_its_rerun_mark(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The hash an imported result records is the bundle's claim: the page marks it for a rerun all the same,
    while the same lines written here (no origin record) by a clean commit of this code are current."""
    from checks.report.report import STALE_MARK

    claim = current_probe_hashes()["host-p2p"]
    bundle = tmp_path / "claim.json"
    _forged_bundle(bundle, with_manifest=True, probe_hash=claim)
    res = tmp_path / "results"
    assert _main("import", bundle, "--results", res) == 0
    out = tmp_path / "page.md"

    def page() -> str:
        capsys.readouterr()
        assert _main("report", "--results", res, "--out", out) == 0
        return report_md(out)

    md = page()
    assert STALE_MARK in md and "measured elsewhere and imported" in md
    (res / H2 / f"{FORGED}.origin.json").unlink()  # the same run, as if made here
    md = page()
    assert STALE_MARK not in md and "measured elsewhere" not in md


def test_import_notes_results_of_a_dirty_checkout_and_names_a_linked_run_as_one(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    bundle = tmp_path / "dirty.json"
    _forged_bundle(bundle, with_manifest=True)
    doc = json.loads(bundle.read_text())
    for r in doc["runs"][0]["results"][:3]:
        r["code"]["dirty"] = True
    bundle.write_text(json.dumps(doc))
    res = tmp_path / "results"
    capsys.readouterr()
    assert _main("import", bundle, "--results", res / "a") == 0
    notes = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("note: ")]
    assert len(notes) == 1 and "of 4 result(s), 3 were made by a checkout with uncommitted changes" in notes[0]

    # a run file here that is a symbolic link: said as one, not as a run "with different results"
    (res / "b" / H2).mkdir(parents=True)
    (res / "b" / H2 / f"{FORGED}.jsonl").symlink_to(tmp_path / "elsewhere.jsonl")
    assert _main("import", bundle, "--results", res / "b") == 1
    err = capsys.readouterr().err
    said = [ln for ln in err.splitlines() if FORGED in ln and "warning" in ln]
    assert said and all("different results" not in ln for ln in said), err
    assert any("its results file under" in ln and "is a symbolic link; refused" in ln for ln in said), err
    assert not (tmp_path / "elsewhere.jsonl").exists()


def test_diff_of_a_run_whose_file_is_a_link_says_so_instead_of_comparing_an_empty_run(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    res = tmp_path / "results"
    shutil.copytree(committed() / H2, res / H2)
    runs = sorted(p.name.removesuffix(".jsonl") for p in (res / H2).glob("*.jsonl"))
    linked = res / H2 / f"{runs[0]}.jsonl"
    linked.rename(tmp_path / "real.jsonl")
    linked.symlink_to(tmp_path / "real.jsonl")
    capsys.readouterr()
    assert _main("diff", runs[0], runs[1], "--results", res) == 2
    io = capsys.readouterr()
    said = [ln for ln in io.err.splitlines() if ln.startswith("checks diff: run ")]
    assert len(said) == 1 and "a symbolic link; not followed" in said[0] and runs[0] in said[0]
    assert "Changes from" not in io.out and "only in" not in io.out


def _x10(value: object) -> object:
    """Every number under ``value`` times ten (booleans and text kept)."""
    if isinstance(value, dict):
        return {k: _x10(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_x10(v) for v in value]
    return value * 10 if isinstance(value, int | float) and not isinstance(value, bool) else value


def test_a_newer_run_with_the_same_verdicts_and_other_figures_needs_accept_flips(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    res = tmp_path / "results"
    shutil.copytree(committed() / H2, res / H2)
    before_files = sorted(p.name for p in (res / H2).iterdir())
    manifest = json.loads((committed() / H2 / f"{NEWEST}.manifest.json").read_text())
    rows = [json.loads(ln) for ln in (committed() / H2 / f"{NEWEST}.jsonl").read_text().splitlines()]
    results = [{**r, "run_id": FORGED, "metrics": _x10(r["metrics"]), "evidence": _x10(r["evidence"]),
                "duration_s": r["duration_s"] * 10} for r in rows]
    bundle = tmp_path / "x10.json"
    bundle.write_text(json.dumps({"schema": "stackprobe.bundle/1", "host_id": H2, "host": {}, "scrubbed": {},
                                  "code": {"runs": [], "warnings": []},
                                  "runs": [{"run_id": FORGED, "manifest": {**manifest, "run_id": FORGED},
                                            "results": results}]}))
    capsys.readouterr()
    assert _main("import", bundle, "--results", res) == 1
    err = capsys.readouterr().err
    assert "pass -> fail" not in err and "verdict:" not in err  # the verdicts are the same
    figures = [ln for ln in err.splitlines() if ln.strip().startswith("figures: ")]
    shown = [[r["metrics"], r["evidence"], r["duration_s"]] for r in rows]
    with_numbers = [x for x in shown if _x10(x) != x]  # a result that records no number has no figure to change
    assert with_numbers and len(figures) == len(with_numbers)
    assert "not imported" in err and "--accept-flips" in err
    assert sorted(p.name for p in (res / H2).iterdir()) == before_files
    assert _main("import", bundle, "--accept-flips", "--results", res) == 0


# --- text from outside is data ------------------------------------------------------------------------------
CONTROLS = "\x1b[2J\x07\x00\x08\x7f\x85\x9b\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"
BAD_CHAR = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
FENCE_NOTE = "```\nrm -rf ~\n```" + CONTROLS


def _bundle_full_of_controls(tmp_path: Path) -> Path:
    """A small host's bundle whose every free text (notes, remediations, evidence, versions, host facts) carries
    C0, C1 and bidirectional characters, one result with a reason code no catalogue has and a remediation that
    tells the reader to delete their home folder."""
    host, run, cell = "gpux2-0123abcd", "20260101T000000Z-abcd", "cu130-torch2.11.0-sglnone-fi0.6.18"
    code = {"version": "0.1.0" + CONTROLS, "commit": "a" * 40, "dirty": False, "probe_hash": "0" * 16}

    def result(variant: str, status: str, reason: str) -> dict:
        return {"schema": "stackprobe.result/2", "run_id": run, "host_id": host, "cell_id": cell,
                "probe_id": "ar-latency", "variant": variant, "status": status, "reason_code": reason,
                "note": "note " + FENCE_NOTE, "remediation": "rm -rf ~" + CONTROLS,
                "metrics": {"latency_us": {"4096": 1.5}}, "evidence": {"log_tail": CONTROLS, "kernel": "k" + CONTROLS},
                "started_at": "2026-01-01T00:00:00+00:00", "duration_s": 1.0, "code": code}

    results = [result("ranks=2,backend=nccl", "pass", ""), result("ranks=2,backend=custom", "fail", "made-up-code")]
    manifest = {"schema": "stackprobe.manifest/2", "run_id": run, "host_id": host, "written_at": "x" + CONTROLS,
                "executor": "docker", "level": "full", "probes": {}, "argv": ["run"],
                "cells": {cell: {"versions": {"torch": "2.11.0" + CONTROLS, "flashinfer": CONTROLS}}},
                "code": {**code, "probe_hashes": {}},
                "facts": {"gpu_name": "GPU X" + CONTROLS, "gpu_count": 2, "driver": "580" + CONTROLS,
                          "interconnect": CONTROLS, "topology": CONTROLS, "nccl": CONTROLS}}
    path = tmp_path / "controls.json"
    path.write_text(json.dumps({"schema": "stackprobe.bundle/1", "host_id": host, "host": {}, "scrubbed": {},
                                "code": {"runs": [], "warnings": [CONTROLS]},
                                "runs": [{"run_id": run, "manifest": manifest, "results": results}]}))
    return path


def test_a_bundle_full_of_control_characters_reaches_no_page_raw(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture) -> None:
    res = tmp_path / "results"
    assert _main("import", _bundle_full_of_controls(tmp_path), "--results", res) == 0
    err = capsys.readouterr().err
    assert not BAD_CHAR.search(err.replace("\n", "")), "import printed a control character"
    out = tmp_path / "docs" / "compatibility.md"
    assert _main("report", "--results", res, "--out", out) == 0
    md, html = report_md(out), out.with_suffix(".html").read_text()
    for name, text in (("md", md), ("html", html)):
        found = sorted({hex(ord(c)) for c in BAD_CHAR.findall(text)})
        assert found == [], f"{name} holds {found}"
    assert "\\x1b" in md and "\\u202e" in md  # shown, not dropped
    # the next step comes from the local catalogue only: an unknown code says so, the bundle's text is not one
    assert "next step:* rm" not in md and "rm -rf ~\x1b" not in md  # the bundle's remediation is no next step
    notes = [ln for ln in md.splitlines() if "`made-up-code`" in ln]
    assert notes and all("unknown reason code made-up-code" in ln and "*next step:*" not in ln for ln in notes)
    assert not any(ln.lstrip().startswith("```") for ln in md.splitlines())  # the note's fence opens nothing
    capsys.readouterr()
    assert _main("advise", "--results", res) == 0
    printed = capsys.readouterr().out
    assert not BAD_CHAR.search(printed.replace("\n", ""))


def test_one_escaping_function_per_destination() -> None:
    from common import escape

    nasty = "a\x1b[31m\u202eb\x85c\td\ne"
    for fn in (escape.terminal, escape.markdown, escape.markdown_prose, escape.shell):
        assert not BAD_CHAR.search(fn(nasty)) and "\n" not in fn(nasty), fn.__name__
    assert not BAD_CHAR.search(escape.html(nasty)) and "\n" in escape.html(nasty)
    assert escape.markdown("[x](javascript:1) *b* <i> &#x202E; $m$ `c` # h | t") == \
        "\\[x\\]\\(javascript:1) \\*b\\* &lt;i&gt; \\&\\#x202E; \\$m\\$ \\`c\\` \\# h \\| t"
    assert escape.markdown("NCCL_ALGO _em_") == "NCCL_ALGO \\_em\\_"
    assert escape.markdown_prose("```sh run `checks run`") == "\\`\\`\\`sh run `checks run`"
    assert escape.markdown_prose("- item") == "\\- item" and escape.markdown_prose("3. x") == "3\\. x"


# --- the regression gate ------------------------------------------------------------------------------------
def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True,
                   env={"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                        "GIT_COMMITTER_EMAIL": "t@t", "PATH": "/usr/bin:/bin"})


def test_the_regression_gate_fails_on_a_planted_flip_and_passes_with_its_expected_entry(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    repo = tmp_path / "repo"
    res = repo / "results"
    shutil.copytree(committed() / H2, res / H2)
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "base")
    capsys.readouterr()
    assert _main("diff", "--base", "HEAD", "--results", res) == 0
    assert "no change" in capsys.readouterr().out

    # plant: the newest run's first passing result now fails, same probe hash
    path = res / H2 / f"{NEWEST}.jsonl"
    lines = path.read_text().splitlines()
    n, first = next((i, json.loads(ln)) for i, ln in enumerate(lines) if json.loads(ln)["status"] == "pass")
    lines[n] = json.dumps({**first, "status": "fail", "reason_code": "ar-wrong-result"})
    path.write_text("\n".join(lines) + "\n")
    _git(repo, "commit", "-qam", "plant a flip")
    capsys.readouterr()
    assert _main("diff", "--base", "HEAD~1", "--results", res) == 1
    io = capsys.readouterr()
    key = f"{H2} {first['cell_id']} {first['probe_id']} {first['variant']}"
    assert f"pass -> fail: {key}: pass -> fail (ar-wrong-result) (same probe code)" in io.out
    assert "1 gated change(s)" in io.err and key in io.err

    # a different probe hash that no version of the probe known here produces is a claim: gated too
    lines[n] = json.dumps({**first, "status": "fail", "code": {**first["code"], "probe_hash": "e" * 16}})
    path.write_text("\n".join(lines) + "\n")
    assert _main("diff", "--base", "HEAD~1", "--results", res) == 1
    assert "(unverified)" in capsys.readouterr().err
    lines[n] = json.dumps({**first, "status": "fail", "reason_code": "ar-wrong-result"})
    path.write_text("\n".join(lines) + "\n")

    # with its reviewed entry the gate passes, and still prints the flip
    (res / "expected-changes.yaml").write_text(
        f"- host: {H2}\n  cell: {first['cell_id']}\n  probe: {first['probe_id']}\n  variant: '{first['variant']}'\n"
        "  why: planted by this test\n")
    capsys.readouterr()
    assert _main("diff", "--base", "HEAD~1", "--results", res) == 0
    assert "pass -> fail" in capsys.readouterr().out
    assert _main("validate", res) == 0  # the list is a known name in a results folder

    # a bad list is one line, exit 2
    (res / "expected-changes.yaml").write_text("- host: x\n")
    capsys.readouterr()
    assert _main("diff", "--base", "HEAD~1", "--results", res) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "expected-changes.yaml: entry 1" in err[0]


# --- the writer keeps the readers' limits -------------------------------------------------------------------
def _checks(*args: str) -> subprocess.CompletedProcess[str]:
    from tests.checks_helpers import ROOT, fixture_env

    return subprocess.run([sys.executable, "-m", "checks.cli", *args], capture_output=True, text=True,
                          env=fixture_env(), cwd=ROOT, timeout=300)


def test_a_result_too_large_for_the_reader_is_cut_with_a_marker_and_read_back(tmp_path: Path) -> None:
    """An engine gate value of 3 MB: the line stays under the reader's 1 MiB limit, says what was cut, and
    the one reader takes it without a warning; the verdict and the other evidence stay."""
    from checks.results import reader
    from checks.results.result import ProbeResult
    from checks.results.store import RunStore, read_file

    host, run = "gpux2-0123abcd", "20260101T000000Z-abcd"
    obj = {"schema": "stackprobe.result/2", "run_id": run, "host_id": host,
           "cell_id": "cu130-torch2.11.0-sglnone-fi0.6.18", "probe_id": "engine", "variant": "", "status": "pass",
           "reason_code": "", "note": "gates read \udcff", "remediation": "", "metrics": {"gates": 3},
           "evidence": {"gates": {"sglang.x": "v" * 3_000_000}, "kept": "small"},
           "started_at": "2026-01-01T00:00:00+00:00", "duration_s": 1.0,
           "code": {"version": "0.1.0", "commit": "a" * 40, "dirty": False, "probe_hash": "0" * 16}}
    store = RunStore(tmp_path, host, run)
    store.append(ProbeResult.from_json(obj))
    assert store.unstored == []
    line = store.results_path.read_bytes()
    assert len(line) <= reader.MAX_LINE
    [back], warnings = read_file(store.results_path)
    assert warnings == [] and back.verdict.status.value == "pass" and back.verdict.evidence["kept"] == "small"
    assert "evidence.gates (3000" in back.verdict.evidence["cut"] and "gates" not in back.verdict.evidence
    assert back.verdict.note == "gates read ?"  # a lone surrogate (an undecodable byte) costs one character


def test_resume_never_appends_through_a_link(tmp_path: Path) -> None:
    one = ("--backend", "local", "--level", "full", "--results", str(tmp_path), "--no-report")
    assert _checks("run", *one, "--probe", "t-trivial").returncode == 0
    [path] = sorted(tmp_path.glob("*/*.jsonl"))
    outside = tmp_path.parent / "elsewhere.jsonl"
    path.rename(outside)
    path.symlink_to(outside)
    before = outside.read_bytes()
    p = _checks("run", *one, "--resume", "--probe", "t-trivial", "--probe", "t-raise")
    assert p.returncode == 0, p.stderr
    assert f"{path.name} is a symbolic link, which no reader follows; a new run starts instead" in p.stderr
    assert outside.read_bytes() == before  # nothing appended through the link
    runs = sorted(q for q in path.parent.glob("*.jsonl") if not q.is_symlink())
    assert len(runs) == 1 and b"t-raise" in runs[0].read_bytes()


def test_a_read_only_results_folder_is_refused_before_any_probe_runs(tmp_path: Path) -> None:
    """A results folder on a read-only mount (made in a private mount namespace, so root's write permission does
    not hide it): one line, exit 2, no probe started."""
    ro = tmp_path / "ro"
    ro.mkdir()
    (ro / "keep").write_text("")
    if shutil.which("unshare") is None or subprocess.run(
            ["unshare", "-m", "sh", "-c", f"mount --bind {ro} {ro} && mount -o remount,bind,ro {ro}"],
            capture_output=True).returncode != 0:
        pytest.skip("no private mount namespace here to make a read-only folder in")
    from tests.checks_helpers import ROOT, fixture_env

    script = (f"mount --bind {ro} {ro} && mount -o remount,bind,ro {ro} && exec {sys.executable} -m checks.cli run "
              f"--backend local --level full --probe t-trivial --results {ro}/results")
    p = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, env=fixture_env(),
                       cwd=ROOT, timeout=300)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert "results folder: cannot write" in lines[0] and "Read-only file system" in lines[0]
    assert "nothing was run" in lines[0] and "plan" not in p.stderr
    assert sorted(x.name for x in ro.iterdir()) == ["keep"]


# --- earlier rounds' items ----------------------------------------------------------------------------------
def test_a_result_whose_started_at_is_no_time_is_refused() -> None:
    from checks.results import reader

    obj = {"schema": "stackprobe.result/1", "run_id": "20260101T000000Z-abcd", "host_id": "gpux2-0123abcd",
           "cell_id": "cu130-torch2.11.0-sglnone-fi0.6.18", "probe_id": "ar-latency", "variant": "", "status": "pass",
           "reason_code": "", "note": "", "remediation": "", "metrics": {}, "evidence": {}, "started_at": "zzz",
           "duration_s": 1.0}
    assert "started_at 'zzz': not an ISO 8601 date and time" in str(
        reader.check_result(obj, "gpux2-0123abcd", "20260101T000000Z-abcd"))
    obj["started_at"] = "2026-01-01T00:00:00"
    assert "without its UTC offset" in str(reader.check_result(obj, "gpux2-0123abcd", "20260101T000000Z-abcd"))
    obj["started_at"] = "2026-01-01T00:00:00+00:00"
    assert reader.check_result(obj, "gpux2-0123abcd", "20260101T000000Z-abcd") is None


def test_one_result_nested_too_deep_is_left_out_and_the_rest_of_the_bundle_imported(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "b.json"
    _forged_bundle(path, with_manifest=True)
    data = json.loads(path.read_text())
    deep: object = 1
    for _ in range(40):
        deep = [deep]
    data["runs"][0]["results"][0]["evidence"] = {"x": deep}
    path.write_text(json.dumps(data))
    capsys.readouterr()
    assert _main("import", path, "--results", tmp_path / "results") == 1
    err = capsys.readouterr().err
    assert "result 1: nested deeper than 32 levels; skipped" in err and f"imported {H2}/{FORGED}" in err
    written = (tmp_path / "results" / H2 / f"{FORGED}.jsonl").read_text().splitlines()
    assert len(written) == 3


def test_a_gzip_bundle_is_said_to_be_compressed(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import gzip

    path = tmp_path / "b.json"
    _forged_bundle(path, with_manifest=True)
    gz = tmp_path / "b.json.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    capsys.readouterr()
    assert _main("import", gz, "--results", tmp_path / "results") == 2
    err = capsys.readouterr().err
    assert "a gzip-compressed file, not JSON text: decompress it first (gunzip FILE)" in err and "UTF-8" not in err


def test_a_bare_cloud_secret_and_a_short_host_name_in_an_assignment_are_scrubbed() -> None:
    from checks.share.scrub import Identity, Scrubber

    s = Scrubber(Identity(hostnames=("vm",)))
    assert s.text("key wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY here") == "key <redacted> here"
    assert s.text("HOSTNAME=vm") == "HOSTNAME=<host>"
    assert s.text("runs in a VM guest") == "runs in a VM guest"  # the word, not the host
    commit = "9d1208350136edab352b931e3af3cb23c20a7bed"  # a commit (hex, one case) is no secret
    assert s.text(f"commit {commit}") == f"commit {commit}"


def test_a_worker_killed_mid_run_leaves_no_scratch_folder(tmp_path: Path) -> None:
    """The worker's scratch folders live in one the host side removes after the process, SIGKILL or not."""
    from checks.run.isolate import run_isolated

    made = tmp_path / "made"
    code = ("import os, pathlib, tempfile, time; d = tempfile.mkdtemp(prefix='stackprobe-inventory-', "
            f"dir=os.environ['STACKPROBE_SCRATCH']); pathlib.Path({str(made)!r}).write_text(d); time.sleep(60)")
    out = run_isolated([sys.executable, "-c", code], dict(os.environ), timeout_s=3)
    assert out.timed_out
    left = Path(made.read_text())
    assert left.name.startswith("stackprobe-inventory-") and not left.exists() and not left.parent.exists()


def test_sigterm_twice_as_uv_run_delivers_it_still_says_what_was_kept(tmp_path: Path) -> None:
    """A SIGTERM to `uv run`'s process group reaches checks twice (uv forwards its own): the second must not cut
    the clean-up short, so the run still says where its results are and what it recorded."""
    import signal
    import time

    from tests.checks_helpers import ROOT, fixture_env

    proc = subprocess.Popen([sys.executable, "-m", "checks.cli", "run", "--backend", "local", "--level", "full",
                             "--probe", "t-trivial", "--probe", "t-zz-slow", "--results", str(tmp_path / "r"),
                             "--no-report"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=fixture_env(), cwd=ROOT, start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not list((tmp_path / "r").glob("*/*.jsonl")):
        time.sleep(0.2)
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.05)  # uv forwards the signal a moment after the group got it; the kernel merges two at once
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out
    assert "interrupted: results finished so far are kept in" in out and "verdicts:" in out, out

"""Results folders as untrusted input: every bad file, line, name and path the bad-input campaign found is
skipped with one warning (or refused with one line and exit 2), every good result still reaches the table,
and what reaches a document or a pasted command line is escaped for it. Real files, FIFOs, permissions, a
real full file system (a tmpfs in a private mount namespace) and a real shell."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from checks.report.report import generate
from checks.results import hostfacts
from checks.results.freshness import command
from checks.results.provenance import Provenance
from checks.results.result import ProbeResult, Verdict
from checks.results.store import RunLock, RunStore, read_file
from common import memlock
from inenv import atomic
from inenv.status import Status
from tests.checks_helpers import ROOT, committed, fixture_env

HOST = "cpu-0123abcd"
RUNS = ("20261130T120000Z-aaaa", "20261201T120000Z-bbbb")
CELLS = ("cu130-torch2.11.0-sgl0.4.2-fi0.6.16", "cu128-torch2.9.1-sgl0.4.1-fi0.6.17")
CODE = Provenance("0.1.0", "0" * 40, False, "1" * 16)
UNPRIVILEGED_UID = 12345  # owns the files a test makes unreadable; outside the user namespace's map


def checks(*args: str, env: dict[str, str] | None = None, prefix: tuple[str, ...] = (),
           timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*prefix, sys.executable, "-m", "checks.cli", *args], capture_output=True, text=True,
                          env=env or fixture_env(), cwd=ROOT, timeout=timeout)


def _result(run: str, cell: str, variant: str, status: Status = Status.PASS, note: str = "",
            probe: str = "fi-jit", host: str = HOST) -> ProbeResult:
    return ProbeResult(run, host, cell, probe, variant, Verdict(status, note=note, duration_s=1.0),
                       f"{run[:4]}-{run[4:6]}-{run[6:8]}T12:00:00Z", CODE)


def _good_runs(results: Path, host: str = HOST) -> list[ProbeResult]:
    """Two runs of one host, each with a manifest; every result differs between the runs in its note."""
    written = []
    for i, run in enumerate(RUNS):
        store = RunStore(results, host, run)
        store.write_manifest({"schema": "stackprobe.manifest/2", "run_id": run, "host_id": host, "executor": "docker",
                              "facts": {"host_id": host, "gpu_count": 0}, "cells": {}, "probes": {}})
        rs = [_result(run, c, f"ranks=1,module=m{j}", Status.PASS if (i + j) % 2 else Status.FAIL,
                      note=f"run {i}", host=host) for c in CELLS for j in range(2)]
        store.append_all(rs)
        written += rs
    return written


def _can_drop_privileges() -> tuple[str, ...] | None:
    """The prefix under which a file owned by UNPRIVILEGED_UID with mode 0 cannot be read: none when not
    root, ``unshare -r`` for root (no DAC override there for an owner outside its id map)."""
    if os.geteuid() != 0:
        return ()
    if shutil.which("unshare") and subprocess.run(["unshare", "-r", "true"], capture_output=True).returncode == 0:
        return ("unshare", "-r")
    return None


def _lock_away(path: Path, mode: int = 0) -> None:
    if os.geteuid() == 0:
        os.chown(path, UNPRIVILEGED_UID, UNPRIVILEGED_UID)
    path.chmod(mode)


class Seeded:
    """A results folder with good runs and one bad example of each class; ``marks``: for each bad item, a
    text its one warning contains."""

    def __init__(self, root: Path, unreadable: bool) -> None:
        self.root = root
        self.good = _good_runs(root)
        host = root / HOST
        self.marks: dict[str, str] = {}
        bad_lines = host / "20261202T120000Z-cccc.jsonl"
        atomic.write_json(host / "20261202T120000Z-cccc.manifest.json",
                          {"schema": "stackprobe.manifest/2", "run_id": "20261202T120000Z-cccc", "host_id": HOST,
                           "facts": {"host_id": HOST, "gpu_count": 0}})
        good_line = json.dumps(_result("20261202T120000Z-cccc", CELLS[0], "ranks=1,module=last").to_json())
        with open(bad_lines, "wb") as f:
            f.write(b'{"schema": "stackprobe.result/2", "note": "caf\xe9 latin-1"}\n')  # line 1: undecodable
            f.write(b"[" * 100_000 + b"]" * 100_000 + b"\n")  # line 2: nested past any limit
            f.write(json.dumps({**json.loads(good_line), "variant": "ranks=1,x=1", "note": "\ud800"}).encode()
                    + b"\n")  # line 3: a lone surrogate
            f.write(json.dumps({**json.loads(good_line), "cell_id": "cu130-torch2|x<script>-sgl1-fi1"}).encode()
                    + b"\n")  # line 4: a cell id outside its grammar
            f.write(b" " * (1 << 20) + b"{}\n")  # line 5: too long
            f.write(json.dumps({**json.loads(good_line), "variant": "ranks=1,x=2"}).replace(
                '"duration_s": 1.0', '"duration_s": NaN').encode() + b"\n")  # line 6: NaN
            f.write(good_line.encode() + b"\n")  # line 7: good
            f.write(json.dumps({**json.loads(good_line), "note": "again"}).encode() + b"\n")  # line 8: its key again
            last = _result("20261202T120000Z-cccc", CELLS[1], "ranks=1,module=last")
            f.write(json.dumps(last.to_json()).encode())  # line 9: complete, no final newline: kept
        self.marks.update({"latin1": f"{bad_lines.name}:1: not UTF-8", "deep": f"{bad_lines.name}:2: nested",
                           "surrogate": f"{bad_lines.name}:3: a string is not valid Unicode text (a lone surrogate)",
                           "cell": f"{bad_lines.name}:4: cell id", "long": f"{bad_lines.name}:5: ",
                           "nan": f"{bad_lines.name}:6: not valid JSON (NaN is not a JSON number)",
                           "duplicate": f"{bad_lines.name}:8: a second result for "
                                        f"{CELLS[0]}/fi-jit/ranks=1,module=last"})
        (host / "20261202T130000Z-dddd.jsonl").symlink_to(host / "nowhere")
        self.marks["dangling"] = "20261202T130000Z-dddd.jsonl: a symbolic link; not followed"
        (host / "20261202T140000Z-eeee.jsonl").mkdir()
        self.marks["folder"] = "20261202T140000Z-eeee.jsonl: a folder; not read"
        os.mkfifo(host / "20261202T150000Z-ffff.jsonl")
        self.marks["fifo"] = "20261202T150000Z-ffff.jsonl: a FIFO; not read"
        (host / "20261202T160000Z-0000.jsonl").write_bytes(good_line.encode()[:40])
        self.marks["torn"] = "20261202T160000Z-0000.jsonl:1: unterminated last line"
        (host / "not-a-run.jsonl").write_text(good_line + "\n")
        self.marks["run-name"] = "not-a-run.jsonl: not a run's .jsonl or .manifest.json; not read"
        (root / "javascript:alert(1)").mkdir()
        (root / "javascript:alert(1)" / f"{RUNS[0]}.jsonl").write_text(good_line + "\n")
        self.marks["scheme"] = "javascript:alert(1): folder name: host id 'javascript:alert(1)' is not of the form"
        bad_name = os.fsencode(str(root)) + b"/cpu-\xff\xfe-0123abcd"
        os.mkdir(bad_name)
        self.marks["non-utf8"] = "cpu-\\udcff\\udcfe-0123abcd: folder name: host id"
        if unreadable:
            locked = host / "20261202T170000Z-1111.jsonl"
            locked.write_text(good_line + "\n")
            _lock_away(locked)
            self.marks["unreadable"] = "20261202T170000Z-1111.jsonl: cannot be read (Permission denied)"
            other = root / "h200x2-0123abcd"
            _good_runs(root, "h200x2-0123abcd")
            _lock_away(other, 0)
            self.marks["unlistable"] = "h200x2-0123abcd: cannot be listed (Permission denied)"

    def assert_one_warning_each(self, stderr: str) -> None:
        for what, mark in self.marks.items():
            assert stderr.count(mark) == 1, (what, mark, stderr)
        assert "Traceback" not in stderr


@pytest.fixture
def seeded(tmp_path: Path) -> Seeded:
    prefix = _can_drop_privileges()
    s = Seeded(tmp_path / "results", unreadable=prefix is not None)
    s.prefix = prefix or ()  # type: ignore[attr-defined]
    return s


def _md(out: Path) -> str:
    """Every Markdown page a report to ``out`` wrote: the answer, the archive, each host's page."""
    pages = [out, *out.parent.glob(f"{out.stem}-archive.md"), *sorted((out.parent / "hosts").glob("*.md"))]
    return "\n".join(p.read_text() for p in pages)


def test_seeded_folder_report_advise_diff_and_run_warn_once_per_bad_item(seeded: Seeded, tmp_path: Path) -> None:
    prefix = seeded.prefix  # type: ignore[attr-defined]
    out = tmp_path / "out" / "table.md"
    if prefix:  # the table's folder must be writable by the unprivileged side too
        out.parent.mkdir()
        os.chmod(tmp_path, 0o777)
    p = checks("report", "--results", str(seeded.root), "--out", str(out), prefix=prefix)
    assert p.returncode == 0, p.stderr
    seeded.assert_one_warning_each(p.stderr)
    n = len(seeded.marks)
    assert f"checks report: {n} unreadable item(s)" in p.stderr, p.stderr
    md, html = _md(out), out.with_suffix(".html").read_text()
    assert f"**{n} unreadable items in the results folder were skipped**" in md
    assert f"<b>{n} unreadable items in the results folder were skipped</b>" in html
    for cell in CELLS:  # every good result is in the table
        assert f"| `{cell}` |" in md
    assert "20261202T120000Z-cccc" in md  # the run whose only good line lacks its newline is listed
    assert "<script>" not in md and "javascript:" not in html.split("<body>")[1].replace(
        "javascript:alert(1): folder name", "")

    p = checks("advise", "--results", str(seeded.root), prefix=prefix)
    assert p.returncode == 0, p.stderr
    seeded.assert_one_warning_each(p.stderr)
    assert f"checks advise: {n} unreadable item(s)" in p.stderr, p.stderr

    p = checks("diff", RUNS[0], RUNS[1], "--results", str(seeded.root), prefix=prefix)
    assert p.returncode == 0, p.stderr
    seeded.assert_one_warning_each(p.stderr)
    assert "Changes from" in p.stdout

    p = checks("validate", str(seeded.root), prefix=prefix)  # the same reader: the same items left out
    assert p.returncode == 1, p.stderr
    seeded.assert_one_warning_each(p.stderr)
    kept = len(seeded.good) + 2  # the bad-lines run keeps its line 7 and its last line
    runs = 7 + ("unreadable" in seeded.marks)  # the unreadable file is a run whose results are left out
    assert f"{runs} run(s), {kept} result(s)" in p.stderr, p.stderr

    p = checks("run", "--local", "--probe", "t-trivial", "--results", str(seeded.root), "--level", "full",
               prefix=prefix)  # one pass, one table: its warnings once
    assert p.returncode == 0, p.stderr
    seeded.assert_one_warning_each(p.stderr)
    table = _md(seeded.root / "compatibility.md")
    assert all(f"| `{cell}` |" in table for cell in CELLS) and "t-trivial" in table


def test_a_fifo_named_jsonl_never_blocks_a_reader(tmp_path: Path) -> None:
    host = tmp_path / HOST
    host.mkdir()
    os.mkfifo(host / f"{RUNS[0]}.jsonl")
    os.mkfifo(host / f"{RUNS[0]}.manifest.json")
    got: list[tuple[list[ProbeResult], list[str]]] = []
    reader = threading.Thread(target=lambda: got.append(read_file(host / f"{RUNS[0]}.jsonl")), daemon=True)
    reader.start()
    reader.join(10)  # an open() without O_NONBLOCK waits for a writer forever
    assert got, "read_file blocked on a FIFO"
    results, warnings = got[0]
    assert results == [] and len(warnings) == 1 and "a FIFO" in warnings[0]
    p = checks("report", "--results", str(tmp_path), "--out", str(tmp_path / "t.md"), timeout=60)
    assert p.returncode == 2 and "a FIFO; not read" in p.stderr and "Traceback" not in p.stderr


def test_undecodable_deep_and_surrogate_lines_name_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / HOST / f"{RUNS[0]}.jsonl"
    path.parent.mkdir()
    good = json.dumps(_result(RUNS[0], CELLS[0], "ranks=1").to_json())
    path.write_bytes(b"\xff\xfe binary\n" + b"[" * 5000 + b"]" * 5000 + b"\n" + b'{"a": "\\udc80"}\n'
                     + b"{" + b'"a":{' * 40 + b"}" * 41 + b"\n" + good.encode() + b"\n")
    results, warnings = read_file(path)
    assert [r.variant for r in results] == ["ranks=1"]
    assert [w.split(": ", 1)[0] for w in warnings] == [f"{path}:{n}" for n in (1, 2, 3, 4)]
    assert "not UTF-8 text (byte 0)" in warnings[0]
    assert "nested deeper than 32 levels" in warnings[1] and "nested deeper than 32 levels" in warnings[3]
    assert "lone surrogate" in warnings[2]


def test_unreadable_file_and_host_folder_are_warned_not_dropped(tmp_path: Path) -> None:
    prefix = _can_drop_privileges()
    if prefix is None:
        pytest.skip("root without user namespaces: no file is unreadable to this process")
    results = tmp_path / "results"
    _good_runs(results)
    _good_runs(results, "h200x1-0123abcd")
    _lock_away(results / "h200x1-0123abcd")
    _lock_away(results / HOST / f"{RUNS[1]}.jsonl")
    os.chmod(tmp_path, 0o777)
    p = checks("report", "--results", str(results), "--out", str(tmp_path / "t.md"), prefix=prefix)
    assert p.returncode == 0, p.stderr
    assert "h200x1-0123abcd: cannot be listed (Permission denied)" in p.stderr
    assert f"{RUNS[1]}.jsonl: cannot be read (Permission denied)" in p.stderr
    assert "**2 unreadable items in the results folder were skipped**" in (tmp_path / "t.md").read_text()


# --- filesystem errors: one line, exit 2 --------------------------------------------------------------------
def _one_line_exit_2(p: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert p.returncode == 2, (p.returncode, p.stderr)
    assert "Traceback" not in p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert all(n in last for n in needles), p.stderr


def test_results_at_a_file_compile_cache_at_a_file_and_out_under_a_file(tmp_path: Path) -> None:
    a_file = tmp_path / "plain"
    a_file.write_text("x")
    _one_line_exit_2(checks("run", "--local", "--probe", "t-trivial", "--results", str(a_file), "--no-report"),
                     str(a_file))
    _one_line_exit_2(checks("run", "--local", "--probe", "t-trivial", "--results", str(tmp_path / "r"),
                            "--compile-cache", str(a_file), "--no-report"), str(a_file), "not a folder")
    results = tmp_path / "results"
    _good_runs(results)
    _one_line_exit_2(checks("report", "--results", str(results), "--out", str(a_file / "t.md")), str(a_file))


def test_results_in_a_place_that_cannot_be_written(tmp_path: Path) -> None:
    prefix = _can_drop_privileges()
    if prefix is None:
        pytest.skip("root without user namespaces: every folder is writable to this process")
    ro = tmp_path / "ro"
    ro.mkdir()
    _lock_away(ro, 0o555)
    os.chmod(tmp_path, 0o777)
    p = checks("run", "--local", "--probe", "t-trivial", "--results", str(ro / "results"), "--no-report",
               prefix=prefix)
    _one_line_exit_2(p, str(ro / "results"), "Permission denied")


def test_a_full_disk_lists_the_results_it_could_not_store(tmp_path: Path) -> None:
    if os.geteuid() != 0 or subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode != 0:
        pytest.skip("a tmpfs needs root or a user namespace with its own mounts")
    disk = tmp_path / "disk"
    disk.mkdir()
    argv = [sys.executable, "-m", "checks.cli", "run", "--local", "--probe", "t-fill", "--results",
            str(disk / "results"), "--no-report", "--fresh"]
    script = f"mount -t tmpfs -o size=256k tmpfs {shlex.quote(str(disk))} && exec {shlex.join(argv)}"
    env = fixture_env(STACKPROBE_TEST_FILL=str(disk / "filler"))
    p = subprocess.run(["unshare", "-rm", "sh", "-c", script], capture_output=True, text=True, env=env, cwd=ROOT,
                       timeout=120)
    assert p.returncode == 2, p.stderr
    assert "Traceback" not in p.stderr
    assert "No space left on device" in p.stderr
    assert "1 result(s) were measured but not stored" in p.stderr
    assert "not stored: " in p.stderr and "/t-fill/ranks=1 pass" in p.stderr


# --- silent loss -------------------------------------------------------------------------------------------
def test_resume_keeps_a_complete_last_line_without_its_newline(tmp_path: Path) -> None:
    one = ("--level", "full", "--results", str(tmp_path), "--no-report")  # one run, resumed below
    assert checks("run", "--local", "--probe", "t-trivial", *one).returncode == 0
    [path] = sorted(tmp_path.glob("*/*.jsonl"))
    path.write_bytes(path.read_bytes().rstrip(b"\n"))
    p = checks("run", "--local", "--resume", "--probe", "t-trivial", *one)
    assert p.returncode == 0, p.stderr
    assert "resumed: 2 variant(s)" in p.stderr
    stored, warnings = read_file(path)
    assert len(stored) == 2 and warnings == []


def test_report_of_another_results_folder_never_touches_the_committed_table(tmp_path: Path) -> None:
    committed = ROOT / "docs" / "compatibility.md"
    before = committed.read_bytes(), committed.with_suffix(".html").read_bytes()
    results = tmp_path / "results"
    _good_runs(results)
    try:
        p = checks("report", "--results", str(results))
        assert p.returncode == 0, p.stderr
        assert (results / "compatibility.md").exists() and (results / "compatibility.html").exists()
        assert (committed.read_bytes(), committed.with_suffix(".html").read_bytes()) == before
    finally:  # restore the committed table whatever the report under test did to it
        committed.write_bytes(before[0])
        committed.with_suffix(".html").write_bytes(before[1])


# --- injection -------------------------------------------------------------------------------------------
def test_notes_and_names_cannot_inject_into_the_documents(tmp_path: Path) -> None:
    results = tmp_path / "results"
    _good_runs(results)
    evil = "a | b `code` <script>alert(1)</script> [x](javascript:alert(1))\nnext"
    RunStore(results, HOST, RUNS[1]).append(_result(RUNS[1], CELLS[0], "ranks=1,module=evil", Status.FAIL, evil))
    (results / "javascript:alert(1)").mkdir()
    out = tmp_path / "t.md"
    assert generate(results, out, None, check=False) == 0
    md, html = _md(out), out.with_suffix(".html").read_text()
    assert "<script>" not in md and "<script>" not in html
    assert "](javascript:" not in md and 'href="javascript:' not in html
    [note] = [ln for ln in md.splitlines() if "alert(1)" in ln]
    assert note.count("|") == note.count("\\|") == 1 and "\\`code\\`" in note and "&lt;script" in note
    table_rows = [ln for ln in md.splitlines() if ln.startswith(f"| `{CELLS[0]}`")]
    assert all(r.count(" | ") == table_rows[0].count(" | ") for r in table_rows)
    from checks.report.report import link, md_text

    assert link("javascript:alert(1)/x.jsonl") == "javascript%3Aalert%281%29/x.jsonl"
    assert md_text("|`<") == "\\|\\`&lt;"


def _shell_words(line: str, cwd: Path) -> list[str]:
    """What a POSIX shell makes of ``line``'s arguments (everything after the command name), run for real."""
    p = subprocess.run(["sh", "-c", f"set -- {line.split(' ', 1)[1]}; for a; do printf '%s\\n' \"$a\"; done"],
                       capture_output=True, text=True, cwd=cwd, check=True)
    return p.stdout.splitlines()


def test_pasted_commands_and_settings_are_shell_quoted(tmp_path: Path) -> None:
    from common import escape

    cell = "cu130-$(touch pwned)-x;touch pwned2"
    line = command(("fi-jit",), (cell,), "docker")
    assert _shell_words(line, tmp_path) == ["run", "--backend", "docker", "--only", cell, "--probe", "fi-jit"]
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "pwned2").exists()
    setting = escape.setting("NCCL_ALGO=Ring;touch pwned|sh")
    assert _shell_words(f"env {setting}", tmp_path) == ["NCCL_ALGO=Ring;touch pwned|sh"]
    assert escape.setting("NCCL_ALGO=allreduce:tree") == "NCCL_ALGO=allreduce:tree"  # plain stays plain
    assert not (tmp_path / "pwned").exists()


def test_a_crafted_algo_in_a_result_never_reaches_advise(tmp_path: Path) -> None:
    results = tmp_path / "results"
    _good_runs(results)
    crafted = _result(RUNS[1], CELLS[0], "ranks=2,algo=Ring;curl${IFS}x|sh,mode=graph", probe="nccl-graphs")
    with open(results / HOST / f"{RUNS[1]}.jsonl", "a") as f:
        f.write(json.dumps(crafted.to_json()) + "\n")
    p = checks("advise", "--results", str(results))
    assert p.returncode == 0, p.stderr
    assert "curl" not in p.stdout and "variant 'ranks=2,algo=Ring;curl" in p.stderr


# --- ids -------------------------------------------------------------------------------------------------
def test_id_grammars_accept_every_committed_id_and_refuse_crafted_ones() -> None:
    from checks.results import ids
    from checks.results.store import scan

    found, warnings = scan(committed())
    assert found and warnings == []
    for host, run, path in found:
        assert ids.valid("host id", host) and ids.valid("run id", run)
        rs, bad = read_file(path)
        assert rs and bad == []
    for crafted in ("javascript:alert(1)-01234567", "cpu-0123abc", "../cpu-0123abcd", "CPU-0123abcd"):
        assert not ids.valid("host id", crafted)
    assert not ids.valid("cell id", "cu130-torch2|x-sgl1-fi1") and not ids.valid("cell id", "cu130-torch`x`-sgl1-fi1")
    assert not ids.valid("run id", "20261201T000000Z-0001;x") and not ids.valid("variant", "ranks=1,algo=$(x)")


@pytest.mark.parametrize("kind, crafted", [
    ("run id", "2026\u0661201T000000Z-0001"),  # an Arabic-Indic digit one
    ("run id", "\uff12\uff10\uff12\uff16" + "1201T000000Z-0001"),  # fullwidth 2026
    ("run id", "20261301T000000Z-0001"),  # month 13
    ("run id", "20260230T000000Z-0001"),  # 30 February
    ("run id", "20990101T000000Z-0001"),  # decades ahead of any clock
    ("host id", "h200x2-5bce98f\u0667"),  # Arabic-Indic seven in the hash
    ("probe id", "ar-l\u0430tency"),  # Cyrillic a
    ("reason code", "fi-no-nv\u0441c"),  # Cyrillic s
])
def test_look_alike_and_impossible_ids_are_refused(kind: str, crafted: str) -> None:
    from checks.results import ids

    assert not ids.valid(kind, crafted) and ids.problem(kind, crafted) is not None


def test_a_run_id_of_this_minute_is_valid_and_one_beyond_the_skew_is_not() -> None:
    from datetime import UTC, datetime, timedelta

    from checks.results import ids

    now = datetime.now(UTC)
    assert ids.valid("run id", (now + timedelta(minutes=5)).strftime("%Y%m%dT%H%M%SZ") + "-abcd")
    assert not ids.valid("run id", (now + timedelta(hours=2)).strftime("%Y%m%dT%H%M%SZ") + "-abcd")


# --- litter, permissions, secrets --------------------------------------------------------------------------
def test_the_next_run_removes_a_killed_writers_temporary_files(tmp_path: Path) -> None:
    folder = tmp_path / HOST
    folder.mkdir()
    left = [folder / f".{RUNS[0]}.jsonl.k3j2h1.tmp", folder / f".{RUNS[0]}.manifest.json.a8b7.tmp"]
    for p in left:
        p.write_text("half")
    keep = folder / f"{RUNS[0]}.jsonl"
    keep.write_text("")
    with RunLock(folder):
        pass
    assert not any(p.exists() for p in left) and keep.exists()


def test_files_written_honour_the_umask(tmp_path: Path) -> None:
    results = tmp_path / "results"
    old = os.umask(0o077)
    try:
        _good_runs(results)
        assert generate(results, tmp_path / "t.md", None, check=False) == 0
        atomic.replace_dir(tmp_path / "d", {"a": "x"})
    finally:
        os.umask(old)
    for p in [*results.glob("*/*"), tmp_path / "t.md", tmp_path / "t.html"]:
        assert p.stat().st_mode & 0o777 == 0o600, p
    assert (tmp_path / "d").stat().st_mode & 0o777 == 0o700


def test_credentials_inside_environment_values_are_not_recorded() -> None:
    env = hostfacts.safe_env({"NCCL_COMM_ID": "user:secret@10.0.0.1:29500",
                              "NCCL_TOPO_FILE": "https://admin:hunter2@host.example/topo.xml",
                              "NCCL_SOCKET_IFNAME": "eth0", "NCCL_API_TOKEN": "x"})
    assert env == {"NCCL_COMM_ID": "***@10.0.0.1:29500", "NCCL_TOPO_FILE": "https://***@host.example/topo.xml",
                   "NCCL_SOCKET_IFNAME": "eth0"}


# --- host identity ---------------------------------------------------------------------------------------
def test_host_id_tells_machines_apart_and_ignores_the_host_name(monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path: Path) -> None:
    gpus = [{"name": "NVIDIA H200"}] * 2
    a = hostfacts.host_id(gpus, "machine-a", ["GPU-1", "GPU-2"])
    assert a.startswith("h200x2-") and re.fullmatch(r"h200x2-[0-9a-f]{8}", a)
    assert a != hostfacts.host_id(gpus, "machine-b", ["GPU-1", "GPU-2"])  # same model, same name, two boxes
    assert a != hostfacts.host_id(gpus, "machine-a", ["GPU-3", "GPU-4"])  # the GPUs moved to another box
    assert a == hostfacts.host_id(gpus, "machine-a", ["GPU-2", "GPU-1"])
    monkeypatch.setattr(hostfacts.socket, "gethostname", lambda: "localhost")
    first = hostfacts.collect(env={})["host_id"]
    monkeypatch.setattr(hostfacts.socket, "gethostname", lambda: "gpu-node-01")
    assert hostfacts.collect(env={})["host_id"] == first  # the host name is no input
    assert first != "cpu-" + hashlib.sha256(b"localhost").hexdigest()[:8]
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))  # no machine-id: a key kept under the state folder
    key = hostfacts.machine_key((str(tmp_path / "absent"),))
    assert key == hostfacts.machine_key((str(tmp_path / "absent"),)) and len(key) == 32
    assert (tmp_path / "stackprobe" / "host-key").read_text().strip() == key


def test_memlock_statement_names_the_runs_it_describes() -> None:
    note = "not raised: the Docker daemon refused (error setting rlimit type 8: operation not permitted)"
    text = memlock.summary([("20261129T000000Z-aaaa", note), ("20261129T000000Z-aaaa", note)],
                           newest="20261201T000000Z-bbbb")
    assert "(2 of 2 variants run in containers, in run 20261129T000000Z-aaaa)" in text
    assert text.endswith("The newest run, 20261201T000000Z-bbbb, ran no variant in a container")
    assert "newest run" not in memlock.summary([("20261201T000000Z-bbbb", note)], newest="20261201T000000Z-bbbb")


# --- bounded matrix YAML ---------------------------------------------------------------------------------
def _plan(matrix: Path) -> subprocess.CompletedProcess[str]:
    import resource

    def cap() -> None:  # the old loader grew to 2.4 GB on the bomb: let it fail inside this test instead
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))

    return subprocess.run([sys.executable, "-m", "provision.cli", "plan", "--matrix", str(matrix)],
                          capture_output=True, text=True, cwd=ROOT, timeout=30, preexec_fn=cap,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_a_yaml_alias_bomb_is_refused_at_once_with_one_line(tmp_path: Path) -> None:
    levels = ["a: &a [" + ", ".join(['"x"'] * 10) + "]"]
    for prev, name in zip("abcdefg", "bcdefgh", strict=True):
        levels.append(f"{name}: &{name} [" + ", ".join([f"*{prev}"] * 10) + "]")
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(levels) + "\nmatrix: {cuda: [*h]}\n")
    assert bomb.stat().st_size < 1024
    p = _plan(bomb)
    assert p.returncode == 2, p.stderr[-500:]
    assert p.stderr.strip().count("\n") == 0 and "aliases" in p.stderr and str(bomb) in p.stderr


def test_a_version_written_as_a_float_gets_a_hint_to_quote_it(tmp_path: Path) -> None:
    m = tmp_path / "m.yaml"
    m.write_text('matrix:\n  cuda: ["13.0"]\n  torch: [2.10]\n  sgl_kernel: [none]\n  flashinfer: ["0.6.17"]\n')
    p = _plan(m)
    assert p.returncode == 2, p.stdout + p.stderr
    assert f"{m}:3: matrix.torch[0]: 2.10 reads as the number 2.1; quote it" in p.stderr


@pytest.mark.parametrize("make, kind", [
    (lambda p: os.mkfifo(p), "a FIFO"),
    (lambda p: p.mkdir(), "a directory"),
    (lambda p: p.symlink_to(p.parent / "elsewhere.md"), "a symbolic link"),
])
def test_user_named_outputs_refuse_anything_but_a_regular_file(tmp_path: Path, make, kind: str,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """report --out, run --report and share --out: one line, exit 2, nothing replaced or written."""
    from checks.cli import main

    res = tmp_path / "results"
    shutil.copytree(committed() / "h200x2-5bce98f7", res / "h200x2-5bce98f7")
    target = tmp_path / "t.md"
    make(target)
    argvs = [["report", "--results", str(res), "--out", str(target)],
             ["run", "--backend", "local", "--probe", "inventory", "--results", str(res), "--report", str(target)],
             ["share", "--results", str(res), "--host", "h200x2-5bce98f7", "--out", str(target)]]
    for argv in argvs:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and kind in err[0] and "t.md" in err[0], (argv, err)
    assert os.path.lexists(target) and not (tmp_path / "elsewhere.md").exists()
    assert not target.with_suffix(".html").exists()
    assert sorted(p.name for p in (res / "h200x2-5bce98f7").iterdir()) == sorted(
        p.name for p in (committed() / "h200x2-5bce98f7").iterdir())


def test_an_output_under_a_file_or_a_device_is_refused() -> None:
    from common import outputs

    assert "character device" in outputs.problem(Path("/dev/null"), "--out")
    assert "is not a directory" in outputs.problem(Path("/dev/null/x.md"), "--out")
    assert "is not a directory" in outputs.problem(Path("/dev/null/x/y.md"), "--out")
    assert outputs.problem(Path("/nonexistent-dir-for-test/x.md"), "--out") is None  # made on write


def test_a_gpu_name_from_a_manifest_reaches_no_heading_as_markup(tmp_path: Path) -> None:
    """The host heading, its table row and the page's heading and picker show a crafted GPU name as text."""
    from checks.cli import main

    res = tmp_path / "results"
    shutil.copytree(committed() / "h200x2-5bce98f7", res / "h200x2-5bce98f7")
    payload = "H200 [x](javascript:alert(1)) <img src=x onerror=alert(2)> `$(id)` | cell"
    for m in (res / "h200x2-5bce98f7").glob("*.manifest.json"):
        data = json.loads(m.read_text())
        data["facts"]["gpu_name"] = payload
        m.write_text(json.dumps(data))
    out = tmp_path / "c.md"
    assert main(["report", "--results", str(res), "--out", str(out)]) == 0
    md = _md(out)
    heading = next(ln for ln in md.splitlines() if ln.startswith("## ") and "h200x2-5bce98f7" in ln)
    assert "](" not in heading and "<img" not in heading and "`$(id)`" not in heading and " | cell" not in heading
    assert "javascript:alert(1)" in heading  # shown as text, not dropped
    # the hardware class named by it: a row of the classes table, and a name in the answer's cells
    [row] = [ln for ln in out.read_text().splitlines() if ln.startswith("| H200 \\[x\\]")]
    assert "<img" not in row and "](javascript" not in row and len(re.split(r"(?<!\\)\|", row)) == 5, row
    page = out.with_suffix(".html").read_text()
    assert "<img src=x" not in page and "&lt;img src=x onerror=alert(2)&gt;" in page

"""The report's stamp: with nothing its pages are made from changed and no page touched, a second report writes
nothing; any changed input or touched page makes it write the pages again."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from checks.report.report import generate
from common import home
from tests.checks_helpers import ROOT

GOLDEN_RESULTS = ROOT / "tests" / "golden" / "checks" / "results"
OLD = 1_000_000_000  # a modification time no page written by a test has: 2001


@pytest.fixture
def layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    monkeypatch.setattr(home, "CACHE_ROOT", tmp_path / "cache")
    shutil.copytree(GOLDEN_RESULTS, tmp_path / "results")
    return tmp_path / "results", tmp_path / "docs" / "compatibility.md"


def _pages(out: Path) -> dict[Path, str]:
    return {p: p.read_text() for p in sorted(out.parent.rglob("*.*"))}


def _age(out: Path) -> None:
    for p in out.parent.rglob("*.*"):
        os.utime(p, (OLD, OLD))


def _rewritten(out: Path) -> list[str]:
    return sorted(p.name for p in out.parent.rglob("*.*") if p.stat().st_mtime_ns != OLD * 10**9)


def test_nothing_changed_writes_nothing_and_says_so(layout, capsys) -> None:
    results, out = layout
    assert generate(results, out, None, False, reuse=True) == 0
    first = _pages(out)
    assert out in first and out.with_suffix(".html") in first
    _age(out)
    capsys.readouterr()
    assert generate(results, out, None, False, reuse=True) == 0
    assert _rewritten(out) == []
    assert "up to date" in capsys.readouterr().err
    assert _pages(out) == first


def test_without_reuse_the_pages_are_written_every_time(layout) -> None:
    results, out = layout
    generate(results, out, None, False, reuse=True)
    _age(out)
    generate(results, out, None, False)
    assert "compatibility.md" in _rewritten(out)


def test_a_removed_run_is_no_longer_on_the_pages(layout) -> None:
    results, out = layout
    run = results / "cpu-5bce98f7" / "20261129T130000Z-e5f6.jsonl"
    assert run.is_file()
    generate(results, out, None, False, reuse=True)
    assert any(run.name in text for text in _pages(out).values())
    run.unlink()
    generate(results, out, None, False, reuse=True)
    assert not any(run.name in text for text in _pages(out).values())


def test_a_touched_results_file_writes_the_pages_again(layout) -> None:
    results, out = layout
    generate(results, out, None, False, reuse=True)
    _age(out)
    os.utime(results / "cpu-5bce98f7" / "20261129T130000Z-e5f6.jsonl", (OLD + 5, OLD + 5))
    generate(results, out, None, False, reuse=True)
    assert "compatibility.md" in _rewritten(out)


def test_a_page_edited_by_hand_is_written_again(layout) -> None:
    results, out = layout
    generate(results, out, None, False, reuse=True)
    want = out.read_text()
    out.write_text("hand edit\n")
    assert generate(results, out, None, True) == 1  # --check compares bytes, whatever the stamp says
    generate(results, out, None, False, reuse=True)
    assert out.read_text() == want


def test_a_removed_page_and_a_stray_host_page_are_put_right(layout) -> None:
    results, out = layout
    generate(results, out, None, False, reuse=True)
    html = out.with_suffix(".html").read_text()
    out.with_suffix(".html").unlink()
    stray = out.parent / "hosts" / "gone-00000000.md"
    stray.write_text("a host the results do not hold\n")
    generate(results, out, None, False, reuse=True)
    assert out.with_suffix(".html").read_text() == html
    assert not stray.exists()


@pytest.mark.parametrize("text", ["", "{not json", "[]", '{"format": 1, "fingerprint": "x", "pages": {}}'])
def test_a_stamp_that_does_not_parse_or_match_is_no_stamp(layout, text: str) -> None:
    results, out = layout
    generate(results, out, None, False, reuse=True)
    stamps = list((home.CACHE_ROOT / "report-stamps").glob("*.json"))
    assert len(stamps) == 1
    stamps[0].write_text(text)
    _age(out)
    generate(results, out, None, False, reuse=True)
    assert "compatibility.md" in _rewritten(out)
    assert stamps[0].read_text() != text  # a stamp of what was just written replaces it


def test_an_unreadable_results_line_leaves_no_stamp_so_its_warning_comes_again(layout, capsys) -> None:
    results, out = layout
    with (results / "cpu-5bce98f7" / "20261129T130000Z-e5f6.jsonl").open("a") as fh:
        fh.write("{broken\n")
    generate(results, out, None, False, reuse=True)
    assert "warning:" in capsys.readouterr().err
    generate(results, out, None, False, reuse=True)
    assert "warning:" in capsys.readouterr().err


def test_pages_inside_the_results_folder_do_not_make_their_own_stamp_stale(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(home, "CACHE_ROOT", tmp_path / "cache")
    results = tmp_path / "res"
    shutil.copytree(GOLDEN_RESULTS, results)
    out = results / "compatibility.md"  # where `checks report --results DIR` writes for a folder of its own
    generate(results, out, None, False, reuse=True)
    written = [*results.glob("compatibility*"), *(results / "hosts").glob("*.md")]
    assert len(written) >= 3
    for p in written:
        os.utime(p, (OLD, OLD))
    generate(results, out, None, False, reuse=True)
    assert [p.name for p in written if p.stat().st_mtime_ns != OLD * 10**9] == []

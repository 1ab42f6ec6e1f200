"""stackprobe's readings of engine releases' gate rules (checks/report/engine_rules.py) against the engines' code.

Each reading holds the file and lines of the release it was read from and a fingerprint of those lines. The
lines each span cites are committed under tests/engine_sources/<engine>-<version>/ (one file per span, named
``<path>.<first>-<last>``, the wheel they came from in ``WHEEL``), so every machine, CI included, checks each
fingerprint against the lines read and that a one-character change to a copy of them fails the reading. Where
the release's wheel is on this machine too (uv's cache, or a folder of wheels named by
STACKPROBE_ENGINE_WHEELS), its source as installed must hold exactly the committed lines; where it is not, that
test skips and says so. Every engine release an engine matrix installs must have a reading.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import zipfile
from pathlib import Path

import pytest
import yaml

from checks.report import engine_rules
from checks.report.engine_rules import Span
from provision import installer
from tests.checks_helpers import ROOT

RELEASES = sorted(engine_rules.READINGS)


def _uv_cache() -> Path | None:
    if os.environ.get("UV_CACHE_DIR"):
        return Path(os.environ["UV_CACHE_DIR"])
    uv = installer.uv()
    if not uv:
        return None
    proc = subprocess.run([uv, "cache", "dir"], capture_output=True, text=True, env=installer.env())
    return Path(proc.stdout.strip()) if proc.returncode == 0 and proc.stdout.strip() else None


def release_source(engine: str, version: str) -> dict[str, str] | None:
    """path inside the wheel -> text, for every file a reading of this release cites; None without the wheel."""
    paths = {s.path for s in engine_rules.READINGS[(engine, version)].spans()}
    folder = os.environ.get("STACKPROBE_ENGINE_WHEELS")
    for wheel in sorted(Path(folder).glob(f"{engine}-{version}-*.whl")) if folder else []:
        with zipfile.ZipFile(wheel) as z:
            return {p: z.read(p).decode() for p in paths}
    cache = _uv_cache()
    for info in sorted((cache / "archive-v0").glob(f"*/{engine}-{version}.dist-info")) if cache else []:
        root = info.parent
        if all((root / p).is_file() for p in paths):
            return {p: (root / p).read_text() for p in paths}
    return None


SOURCES = ROOT / "tests" / "engine_sources"


def committed_span(engine: str, version: str, span: Span) -> list[str] | None:
    """The lines a span cites, as committed under SOURCES; None when they are not."""
    path = SOURCES / f"{engine}-{version}" / f"{span.path}.{span.first}-{span.last}"
    return path.read_text().splitlines() if path.is_file() else None


def committed_source(engine: str, version: str) -> dict[str, str]:
    """path inside the wheel -> a text holding the committed lines of every span at their own line numbers
    (the other lines blank), as the wheel's file holds them."""
    files: dict[str, list[str]] = {}
    for span in engine_rules.READINGS[(engine, version)].spans():
        lines = committed_span(engine, version, span)
        assert lines is not None, f"{span.cite()} of {engine} {version} is not committed under {SOURCES}"
        text = files.setdefault(span.path, [])
        text.extend([""] * max(0, span.last - len(text)))
        text[span.first - 1:span.last] = lines
    return {path: "\n".join(lines) + "\n" for path, lines in files.items()}


def _source_or_skip(engine: str, version: str) -> dict[str, str]:
    found = release_source(engine, version)
    if found is None:
        pytest.skip(f"{engine} {version}'s wheel is neither in uv's cache nor in STACKPROBE_ENGINE_WHEELS "
                    f"(`uv pip install --no-deps --target <tmp> {engine}=={version}` puts it in the cache)")
    return found


@pytest.mark.parametrize(("engine", "version"), RELEASES)
def test_every_fingerprint_is_that_of_the_committed_lines_it_cites(engine: str, version: str) -> None:
    """Without any wheel: each span's committed lines hash to its fingerprint (SHA-256 of the lines, trailing
    blanks stripped, joined by newlines; first 16 hex digits, computed here), and the reading compares them so."""
    reading = engine_rules.READINGS[(engine, version)]
    for span in reading.spans():
        lines = committed_span(engine, version, span)
        assert lines is not None and len(lines) == span.last - span.first + 1, span.cite()
        assert hashlib.sha256("\n".join(ln.rstrip() for ln in lines).encode()).hexdigest()[:16] == span.sha
    source = committed_source(engine, version)
    assert [d for s in reading.spans() if (d := s.differs(source[s.path]))] == []


@pytest.mark.parametrize(("engine", "version"), RELEASES)
def test_the_release_as_installed_holds_exactly_the_committed_lines(engine: str, version: str) -> None:
    source = _source_or_skip(engine, version)
    reading = engine_rules.READINGS[(engine, version)]
    assert [d for s in reading.spans() if (d := s.differs(source[s.path]))] == []
    for span in reading.spans():
        assert source[span.path].splitlines()[span.first - 1:span.last] == committed_span(engine, version, span)


@pytest.mark.parametrize(("engine", "version"), RELEASES)
def test_a_changed_copy_of_the_release_fails_its_reading(engine: str, version: str) -> None:
    """A copy of the release's files (the committed lines where the wheel is not here) with one line of each
    span changed (a comparison flipped, a number changed), or a line inserted above it: every span read there
    reports the difference."""
    source = release_source(engine, version) or committed_source(engine, version)
    for span in engine_rules.READINGS[(engine, version)].spans():
        lines = source[span.path].splitlines()
        body = lines[span.first - 1:span.last]
        i = next(k for k, line in enumerate(body) if line.strip())
        edited = body[i].replace(" not in ", " in ", 1) if " not in " in body[i] else body[i] + " + 1"
        changed = [*lines[:span.first - 1 + i], edited, *lines[span.first + i:]]
        assert span.differs("\n".join(changed)) is not None, span.cite()
        shifted = [*lines[:span.first - 1], "# a line added above", *lines[span.first - 1:]]
        assert span.differs("\n".join(shifted)) is not None, span.cite()
        assert span.differs("\n".join(lines)) is None


GATE_CODE = [
    "        if self.device_capability not in SIZES:",
    "            return",
    "        if self.world_size not in SIZES[self.device_capability]:",
    "            return",
]


def test_a_copy_of_gate_lookup_code_changed_by_one_character_fails_its_span() -> None:
    """Lines written here stand for a release's lookup; the span's fingerprint is computed here by hand
    (SHA-256 of the lines joined by newlines, first 16 hex digits), not by the code under test."""
    text = "\n".join(["class SymmMem:", "    def __init__(self):", *GATE_CODE, ""])
    sha = hashlib.sha256("\n".join(GATE_CODE).encode()).hexdigest()[:16]
    span = Span("pkg/symm_mem.py", 3, 6, sha)
    assert span.differs(text) is None
    assert span.differs(text.replace("not in SIZES:", "in SIZES:")) is not None  # the rule inverted
    assert span.differs(text.replace("world_size not in", "world_size  not in")) is not None
    assert span.differs(text.replace("    def __init__", "    # moved\n    def __init__")) is not None
    assert "the file has 2 lines" in (span.differs("a\nb\n") or "")
    assert span.differs(text.replace("return\n", "return   \n")) is None  # trailing blanks do not count


def test_every_engine_release_an_engine_matrix_installs_has_a_reading() -> None:
    """An engine preset in a matrix under matrices/ is a release cells install; its gates are judged only by a
    reading of its code, so each must have one, unless the catalogue says the registry cannot serve it."""
    catalog = yaml.safe_load((ROOT / "common" / "catalog.yaml").read_text())
    installed = set()
    for matrix in sorted((ROOT / "matrices").glob("*.yaml")):
        for entry in (yaml.safe_load(matrix.read_text()).get("matrix") or {}).get("include") or []:
            preset = str(entry.get("preset") or "")
            engine, _, version = preset.partition("-")
            if entry.get("engine") and engine in ("vllm", "sglang"):
                installed.add((engine, version))
    assert ("vllm", "0.33.0") in installed and ("sglang", "0.5.23") in installed
    served = {(e, v) for e, v in installed if "unserved" not in catalog[e]["releases"].get(v, {})}
    assert served - set(engine_rules.READINGS) == set()

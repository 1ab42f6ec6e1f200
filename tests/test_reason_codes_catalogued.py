"""Every reason code the in-environment side can emit has an entry in common/reasons.yaml.

The codes come from the sources (tests/reason_scan.py reads them with ast), so a new probe's code, or a new
way of passing one, is caught without anyone updating a list here.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from common import reasons
from tests.checks_helpers import ROOT
from tests.reason_scan import Scanner, emitted_codes


def test_every_reason_code_a_probe_or_the_worker_can_emit_is_catalogued() -> None:
    scan = emitted_codes(ROOT)
    assert scan.unresolved == [], "teach tests/reason_scan.py this way of passing a reason code"
    catalogue = reasons.load()
    missing = {code: where for code, where in sorted(scan.codes.items()) if catalogue.get(code) is None}
    assert missing == {}, "add these codes to common/reasons.yaml (message and remediation)"


def test_the_scan_reads_the_real_sources_not_nothing() -> None:
    """A few codes whose emitting line is known: the inventory without torch, the worker's too-few-ranks
    refusal, a code passed to Lockstep.step through a variable, one from ApiUnknown's constant."""
    scan = emitted_codes(ROOT)
    assert any(w.startswith("inenv/probes/inventory.py:") for w in scan.codes["no-torch"])
    assert any(w.startswith("inenv/worker.py:") for w in scan.codes["too-few-ranks"])
    assert "custom-ar-graph-failed" in scan.codes and "probe-api-unknown" in scan.codes


def _scan(tmp_path: Path, sources: dict[str, str]) -> tuple[set[str], list[str]]:
    pkg = tmp_path / "env"
    pkg.mkdir()
    for name, text in sources.items():
        (pkg / name).write_text(textwrap.dedent(text))
    scan = Scanner(tmp_path, sorted(pkg.glob("*.py"))).scan()
    return set(scan.codes), scan.unresolved


def test_the_scan_follows_every_door_a_code_takes(tmp_path: Path) -> None:
    api = """
        from dataclasses import dataclass

        REASON = "const-in-api"

        def outcome(status, note="", reason_code="", metrics=None, evidence=None):
            return {"status": status, "reason_code": reason_code}

        @dataclass(frozen=True)
        class Skip:
            code: str
            note: str

        class Lock:
            def step(self, what, code, *, status="fail"):
                return outcome(status, what, code(what) if callable(code) else code)
    """
    probe = """
        from env.api import REASON, Lock, Skip, outcome

        TABLE = (("row-a", "x"), ("row-b", "y"))

        def classify(text):
            for code, pat in TABLE:
                if pat in text:
                    return code
            return "classify-default"

        def check(n):
            if n < 2:
                return "tuple-code", "too few"
            return None

        def record(ok):
            return {"verdict": "error", "code": "record-code"} if not ok else {"verdict": "ok"}

        def run(ctx):
            lock = Lock()
            failed, other = "tuple-assigned", "unused-note"
            lock.step("a", failed)
            lock.step("b", classify)
            skipped = check(ctx)
            if skipped:
                return outcome("skip", skipped[1], skipped[0])
            first = record(ctx)
            Skip("skip-class", "n")
            outcome("fail", "n", first.get("code") or "fallback")
            outcome("fail", reason_code="kw" if ctx else REASON)
            return outcome("fail", "n", "positional")
    """
    codes, unresolved = _scan(tmp_path, {"api.py": api, "probe.py": probe})
    assert unresolved == []
    assert codes == {"const-in-api", "row-a", "row-b", "classify-default", "tuple-code", "record-code",
                     "tuple-assigned", "skip-class", "fallback", "kw", "positional"}


def test_a_code_the_scan_cannot_follow_is_reported_not_dropped(tmp_path: Path) -> None:
    probe = """
        def outcome(status, note="", reason_code=""):
            return {"status": status}

        def run(ctx):
            return outcome("fail", "n", f"made-{ctx.rank}")
    """
    codes, unresolved = _scan(tmp_path, {"probe.py": probe})
    assert codes == set() and len(unresolved) == 1 and "made-" in unresolved[0]


def test_a_method_of_the_same_name_on_another_class_is_not_a_call_site(tmp_path: Path) -> None:
    lock = """
        def outcome(status, note="", reason_code=""):
            return {}

        class Lock:
            def step(self, what, code):
                return outcome("fail", what, code)
    """
    other = """
        def run(backend, buf):
            backend.step(buf, "not-a-code")
    """
    codes, unresolved = _scan(tmp_path, {"lock.py": lock, "other.py": other})
    assert codes == set() and unresolved == []

"""The repository stands alone: nothing in it cites design notes or research files that are not in it, or the
project's tracker (issue numbers, work items), and its comments say what the code does, not its history."""

from __future__ import annotations

import io
import re
import subprocess
import tokenize

import pytest

from tests.checks_helpers import ROOT

# spelled in pieces, so this file does not match itself
CITATION = re.compile("|".join(("DESIGN" + r"\.md", "research" + " §", "research" + "/")))
SUFFIXES = (".py", ".md", ".yaml", ".j2", ".sh", ".toml")


def test_no_citation_of_documents_outside_the_repository() -> None:
    tracked = subprocess.run(["git", "-C", str(ROOT), "ls-files"], capture_output=True, text=True, check=True).stdout
    found = [f"{name}:{n}" for name in tracked.split() if name.endswith(SUFFIXES) and (ROOT / name).is_file()
             for n, line in enumerate((ROOT / name).read_text(errors="replace").splitlines(), 1)
             if CITATION.search(line)]
    assert found == []


# Comments and docstrings say what the code does and why; the project's tracker and the code's own history
# belong in commit messages. Each pattern is spelled so that ordinary prose does not match it: an issue
# number or work item, and turns of phrase that only narrate a change.
TRACKER = re.compile(r"(?<![a-z])issues?[ _]?#?\d+|(?<![\w&#\"`'])#\d+\b|\bitems? \d+\b", re.IGNORECASE)
HISTORY = re.compile(
    "|".join((
        r"\bno longer\b", r"\bpreviously\b", r"\bformerly\b", r"\(was\b", r"\banymore\b", r"\bin the past\b",
        r"(?<!\bis )(?<!\bare )(?<!\bbe )(?<!\bbeen )(?<!\bbeing )\bused to\b",
        r"\bthe old (?:code|way|behaviou?r)\b", r"\bbefore (?:this|the) (?:change|fix|refactor|rewrite)\b",
        r"\bwas (?:changed|removed|moved|replaced|fixed|rewritten)\b", r"\bwe now\b",
        r"\bnow (?:uses|does|runs|reads|keeps|says|returns)\b",
    )),
    re.IGNORECASE,
)
CODE_SUFFIXES = (".py", ".yaml", ".sh", ".toml")
# Lines left as they are: a probe helper's bytes are part of every recorded verdict's probe hash, so rewording
# one marks the committed verdicts of every probe that imports it stale. Reword it with the next change that
# reruns those probes, and drop it from here.
HASHED_PROSE = {("inenv/kit/_dist.py", "# once, so the clients no longer retry against a server that is not yet "
                 "listening (0.24-0.6 s per variant).")}
UNCHECKED = ("tests/golden/advise/results/",)  # recorded results: what the probes wrote, not prose of ours


def prose(name: str, text: str) -> list[tuple[int, str]]:
    """(line, text) of the comments and docstrings of a Python file, and of the ``#`` comments of another."""
    if not name.endswith(".py"):
        return [(n, line.split("#", 1)[1]) for n, line in enumerate(text.splitlines(), 1) if "#" in line]
    out: list[tuple[int, str]] = []
    starts = (None, tokenize.INDENT, tokenize.DEDENT, tokenize.NEWLINE, tokenize.NL)
    previous = None
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT or (tok.type == tokenize.STRING and previous in starts):
            out += [(tok.start[0] + i, line) for i, line in enumerate(tok.string.splitlines())]
        if tok.type not in (tokenize.COMMENT, tokenize.NL):
            previous = tok.type
        elif tok.type == tokenize.NL and previous in starts:
            previous = tokenize.NL
    return out


def names(text: str) -> list[tuple[int, str]]:
    """(line, name) of every identifier of a Python file (a test named after an issue counts as one)."""
    return [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(text).readline)
            if t.type == tokenize.NAME]


def _code_files() -> list[str]:
    tracked = subprocess.run(["git", "-C", str(ROOT), "ls-files"], capture_output=True, text=True, check=True).stdout
    return [n for n in tracked.split() if n.endswith(CODE_SUFFIXES) and not n.startswith(UNCHECKED)
            and (ROOT / n).is_file()]


def test_no_issue_numbers_or_work_items_in_code_or_tests() -> None:
    found = []
    for name in _code_files():
        text = (ROOT / name).read_text(errors="replace")
        lines = prose(name, text) + (names(text) if name.endswith(".py") else [])
        found += [f"{name}:{n}: {line.strip()}" for n, line in lines if TRACKER.search(line)]
    assert found == []


def test_comments_say_what_the_code_does_not_its_history() -> None:
    found = [f"{name}:{n}: {line.strip()}" for name in _code_files()
             for n, line in prose(name, (ROOT / name).read_text(errors="replace"))
             if HISTORY.search(line) and (name, line.strip()) not in HASHED_PROSE]
    assert found == []


@pytest.mark.parametrize(("source", "hits"), [
    ('def f():\n    """Fixes issue 13."""\n', 1),
    ("x = 1  # see #22\n", 1),
    ("# --- item 3: no pass without proof\n", 1),
    ("def test_issue13_cold_start():\n    pass\n", 1),
    ('s = "frame #0: c10::Error"  # a traceback line\n', 0),
    ('# BuildKit prints "#8 ERROR: ..." and ``#7 [3/9] RUN``\n', 0),
    ("# reissue 3 requests\n", 0),
])
def test_the_tracker_pattern(source: str, hits: int) -> None:
    lines = prose("x.py", source) + names(source)
    assert sum(bool(TRACKER.search(line)) for _, line in lines) == hits


@pytest.mark.parametrize(("comment", "flagged"), [
    ("# the clients no longer retry", True),
    ("# it used to compile with /usr/local/cuda", True),
    ("# previously the lock was per cell", True),
    ("# timeout (was: 60 s)", True),
    ("# this flag is used to select the backend", False),
    ("# the target holds the old content or the new", False),
    ("# the image was built before the run started", False),
])
def test_the_history_pattern(comment: str, flagged: bool) -> None:
    assert bool(HISTORY.search(comment)) is flagged

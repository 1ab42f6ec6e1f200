"""The repository stands alone: nothing in it cites design notes or research files that are not in it."""

from __future__ import annotations

import re
import subprocess

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

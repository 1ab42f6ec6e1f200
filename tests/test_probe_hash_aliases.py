"""The probe-hash alias table (checks/results/probe_hash_aliases.json) proven from the repository's history.

Each entry says: at commit C, that commit's own hashing code gave the probe file P the entry's key, and this
checkout's hashing code gives the same file the entry's ``hash``. Both sides are recomputed here from
``git archive C``: the key by running C's ``checks.results.provenance`` on C's tree in a subprocess, the
``hash`` by this checkout's ``probe_hash`` on the same files. An entry whose commit the clone lacks is skipped
with the reason, and fails instead where STACKPROBE_REQUIRE_HISTORY=1 (.ci/run sets it: CI must run on a
clone that holds those commits).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from checks.results import provenance
from checks.results.provenance import Alias, read_aliases
from tests.checks_helpers import ROOT

REQUIRE_HISTORY = os.environ.get("STACKPROBE_REQUIRE_HISTORY") == "1"
# What the subprocess runs in the tree of commit C: that commit's own probe hash of each file asked for, and
# where its helpers folder was (this checkout's hashing needs it to find the same helpers).
_OLD_HASH = """
import json, sys
from pathlib import Path
from checks.results import provenance
assert Path(provenance.__file__).resolve().is_relative_to(Path.cwd().resolve()), provenance.__file__
print(json.dumps({"helpers": str(provenance.HELPERS.resolve().relative_to(Path.cwd().resolve())),
                  "hashes": {p: provenance.probe_hash(Path(p)) for p in sys.argv[1:]}}))
"""


def _git(*args: str, text: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=text, timeout=120)


def has_commit(commit: str) -> bool:
    return _git("cat-file", "-e", f"{commit}^{{commit}}").returncode == 0


def tree_at(commit: str, dest: Path) -> Path:
    """The code trees and pyproject.toml of ``commit``, unpacked under ``dest``."""
    listed = _git("ls-tree", "--name-only", commit).stdout.split()
    wanted = [p for p in ("inenv", "common", "checks", "provision", "pyproject.toml") if p in listed]
    archive = _git("archive", "--format=tar", commit, *wanted, text=False)
    assert archive.returncode == 0, archive.stderr
    with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
        tar.extractall(dest, filter="data")
    return dest


def old_hashes(tree: Path, probes: list[str]) -> tuple[Path, dict[str, str]]:
    """(helpers folder, probe file -> hash) as the code of ``tree`` itself computes them."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH", "PYTHONHOME")}
    proc = subprocess.run([sys.executable, "-c", _OLD_HASH, *probes], cwd=tree, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return tree / out["helpers"], out["hashes"]


def problems(aliases: list[Alias], tmp: Path) -> list[str]:
    """One line per entry that history does not prove ([] when all are proven). Every commit they name must
    be in this clone (the caller skips otherwise)."""
    out = []
    for commit in sorted({a.commit for a in aliases}):
        mine = [a for a in aliases if a.commit == commit]
        tree = tree_at(commit, tmp / commit)
        present = [a for a in mine if (tree / a.probe).is_file()]
        out += [f"{a.old}: {a.probe} is not a file at {commit}" for a in mine if a not in present]
        if not present:
            continue
        helpers, hashed = old_hashes(tree, sorted({a.probe for a in present}))
        for a in present:
            if hashed[a.probe] != a.old:
                out.append(f"{a.old}: the code of {commit[:12]} hashes {a.probe} to {hashed[a.probe]}, not {a.old}")
            now = provenance.probe_hash(tree / a.probe, helpers)
            if now != a.new:
                out.append(f"{a.old}: this checkout hashes {a.probe} as it was at {commit[:12]} to {now}, "
                           f"not {a.new}")
    return out


def _need(commits: set[str]) -> None:
    missing = sorted(c for c in commits if not has_commit(c))
    if missing and not REQUIRE_HISTORY:
        pytest.skip(f"this clone lacks commit(s) {', '.join(missing)} the alias table names (a shallow clone?): "
                    "`git fetch --unshallow` proves them")
    assert not missing, f"the clone lacks commit(s) the alias table names: {', '.join(missing)}"


def test_every_alias_is_proven_from_the_commit_it_names(tmp_path: Path) -> None:
    entries = read_aliases()
    assert entries, "checks/results/probe_hash_aliases.json is missing or unreadable"
    malformed = [e for e in entries if not isinstance(e, Alias)]
    assert malformed == [], f"alias entries without a well-formed hash, probe and commit: {malformed}"
    aliases = [e for e in entries if isinstance(e, Alias)]
    _need({a.commit for a in aliases})
    assert problems(aliases, tmp_path) == []


def test_a_hand_added_alias_fails_the_proof(tmp_path: Path) -> None:
    """An entry nobody's code computed (any key, mapped to inventory's hash now) is refused: the commit it
    names hashes the probe to something else; an entry naming no commit is not read as an alias at all."""
    real = [e for e in read_aliases() if isinstance(e, Alias)]
    assert real
    commit = real[0].commit
    _need({commit})
    current = provenance.current_probe_hashes()["inventory"]
    forged = Alias("deadbeefdeadbeef", current, "inenv/probes/inventory.py", commit)
    found = problems([forged], tmp_path)
    assert found and found[0].startswith("deadbeefdeadbeef: the code of "), found
    table = tmp_path / "aliases.json"
    table.write_text(json.dumps({"deadbeefdeadbeef": current,
                                 "0123456789abcdef": {"hash": current, "probe": "inenv/probes/inventory.py"}}))
    assert read_aliases(table) == ["0123456789abcdef", "deadbeefdeadbeef"]


def test_an_alias_makes_the_old_hash_name_the_new_code(monkeypatch: pytest.MonkeyPatch) -> None:
    """A result recorded with an aliased hash is current exactly when the alias maps it to the hash now."""
    monkeypatch.setattr(provenance, "_aliases", lambda: {"0ld0ld0ld0ld0ld0": "n3wn3wn3wn3wn3wn"})
    assert provenance.same_code("0ld0ld0ld0ld0ld0", "n3wn3wn3wn3wn3wn")
    assert provenance.same_code("n3wn3wn3wn3wn3wn", "n3wn3wn3wn3wn3wn")
    assert not provenance.same_code("0ld0ld0ld0ld0ld0", "0therc0de0therc0")
    assert not provenance.same_code("0ld0ld0ld0ld0ld0", None)

"""Which code made a result: probe source hashes through real imports, and git state of real checkouts."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import tomllib
from pathlib import Path

from checks.results import provenance
from checks.results.provenance import Provenance, checkout, helper_imports, probe_hash, probe_sources
from tests.checks_helpers import ROOT


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(cwd), *args], check=True, capture_output=True, text=True).stdout


def test_helper_imports_reads_every_import_form() -> None:
    src = ("import os\nimport inenv.kit._a\nfrom inenv.kit import _b\nfrom inenv.probes import inventory\n"
           "from inenv.kit._c import thing\nfrom inenv.probe import outcome\nfrom . import _d\n"
           "def run():\n    from inenv.kit import _e as e\n")
    assert helper_imports(src) == {"_a", "_b", "_c", "_e"}  # a relative import outside inenv/kit names no helper
    assert helper_imports(src, in_helpers=True) == {"_a", "_b", "_c", "_d", "_e"}


def _helpers(tmp: Path) -> tuple[Path, Path]:
    helpers = tmp / "inenv" / "kit"
    helpers.mkdir(parents=True)
    (tmp / "inenv" / "probes").mkdir()
    (helpers / "_a.py").write_text("from . import _b\n")
    (helpers / "_b.py").write_text("from inenv.kit._c import x\n")
    (helpers / "_c.py").write_text("x = 1\n")
    (helpers / "_unused.py").write_text("y = 2\n")
    probe = tmp / "inenv" / "probes" / "myprobe.py"
    probe.write_text("from inenv.kit import _a\n")
    return helpers, probe


def test_probe_hash_follows_helpers_transitively(tmp_path: Path) -> None:
    helpers, probe = _helpers(tmp_path)
    assert [p.name for p in probe_sources(probe, helpers)] == ["myprobe.py", "_a.py", "_b.py", "_c.py"]
    before = probe_hash(probe, helpers)
    (helpers / "_unused.py").write_text("y = 3\n")
    assert probe_hash(probe, helpers) == before  # a helper the probe does not import changes nothing
    (helpers / "_c.py").write_text("x = 2\n")
    changed = probe_hash(probe, helpers)
    assert changed != before  # two imports away
    moved = tmp_path / "elsewhere"
    shutil.copytree(tmp_path / "inenv", moved / "inenv")
    assert probe_hash(moved / "inenv" / "probes" / "myprobe.py", moved / "inenv" / "kit") == changed


def test_probe_hash_covers_the_checks_modules_it_uses_but_not_the_probe_api(tmp_path: Path) -> None:
    helpers, probe = _helpers(tmp_path)
    (helpers.parent / "toolkit.py").write_text("from inenv import dists\n")
    (helpers.parent / "dists.py").write_text("TABLE = 1\n")
    (helpers.parent / "probe.py").write_text("def outcome(): ...\n")
    (helpers / "_c.py").write_text("from inenv.toolkit import find\nfrom inenv.probe import outcome\n")
    names = [p.name for p in probe_sources(probe, helpers)]
    assert names == ["myprobe.py", "_a.py", "_b.py", "_c.py", "dists.py", "toolkit.py"]
    before = probe_hash(probe, helpers)
    (helpers.parent / "probe.py").write_text("def outcome(): return 1\n")
    assert probe_hash(probe, helpers) == before  # the probe API is every probe's: it marks none stale
    (helpers.parent / "dists.py").write_text("TABLE = 2\n")
    assert probe_hash(probe, helpers) != before  # a fact module two imports away decides verdicts too


def test_real_probe_hash_covers_the_helpers_it_imports() -> None:
    fi_jit = ROOT / "inenv" / "probes" / "fi_jit.py"
    names = {p.name for p in probe_sources(fi_jit)}
    imported = helper_imports(fi_jit.read_text())
    assert imported and {f"{n}.py" for n in imported} <= names
    assert len(probe_hash(fi_jit)) == provenance.HASH_CHARS


def test_checkout_of_this_repository() -> None:
    c = checkout(ROOT)
    assert c.commit == _git(ROOT, "rev-parse", "HEAD").strip()
    assert isinstance(c.dirty, bool)
    assert c.version == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def test_checkout_dirty_flag_and_no_checkout(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "inenv").mkdir(parents=True)
    (repo / "inenv" / "probe.py").write_text("a = 1\n")
    (repo / "README.md").write_text("x\n")
    _git(tmp_path, "init", "-q", str(repo))
    _git(repo, "add", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
    assert checkout(repo).dirty is False and len(checkout(repo).commit) == 40
    (repo / "README.md").write_text("y\n")
    assert checkout(repo).dirty is False  # only the code trees (checks/, inenv/, common/) make verdicts
    for tree in ("inenv", "checks", "common"):
        (repo / tree).mkdir(exist_ok=True)
        (repo / tree / "new_module.py").write_text("b = 2\n")
        assert checkout(repo).dirty is True, tree  # an untracked module counts, in every code tree
        (repo / tree / "new_module.py").unlink()
        assert checkout(repo).dirty is False
    (repo / "inenv" / "probe.py").write_text("a = 2\n")
    assert checkout(repo).dirty is True
    assert checkout(repo / "inenv").commit == "unknown"  # inside a checkout, not its top: not this code's commit
    plain = tmp_path / "plain"
    plain.mkdir()
    assert (checkout(plain).commit, checkout(plain).dirty) == ("unknown", None)


def test_provenance_json_round_trip() -> None:
    p = Provenance("0.1.0", "abc", None, "0123456789abcdef")
    assert Provenance.from_json(p.to_json()) == p
    assert Provenance.from_json({"version": "0.1.0", "commit": "abc", "dirty": "yes", "probe_hash": "x"}) is None
    assert Provenance.from_json(None) is None


def _layout(root: Path, helpers: str) -> Path:
    """The probe, its helper and two fact modules under ``root/inenv``, the helper in ``inenv/<helpers>``."""
    pkg = root / "inenv"
    (pkg / "probes").mkdir(parents=True)
    (pkg / helpers).mkdir()
    (pkg / "probes" / "myprobe.py").write_text(
        f"from inenv.{helpers} import _a\nfrom inenv.probe import outcome\n\n"
        f"# helpers in inenv/{helpers}/_a.py; catalogue in common/reasons.yaml\n")
    (pkg / helpers / "_a.py").write_text("from inenv import toolkit\n")
    (pkg / "toolkit.py").write_text("from inenv import dists\n")
    (pkg / "dists.py").write_text("TABLE = 1\n")
    return pkg


def test_probe_hash_is_the_same_whichever_package_the_modules_sit_in(tmp_path: Path) -> None:
    """A probe and helper that only changed package (their imports, paths and import order follow the new
    names) hash alike: the hash is of the text with every module reduced to its own name, written out here by
    hand, so no folder of either layout reaches it and no rule is needed for a move."""
    flat = "checks"  # the canonical package, kept out of literal module paths that a rewriting tool would change
    old = tmp_path / "old" / flat / "probes"
    old.mkdir(parents=True)
    old_probe = (f"from {flat}.probe import outcome\nfrom {flat}.probes import _a\n\n"
                 f"# helpers in {flat}/probes/_a.py; catalogue in {flat}/reasons.yaml\n")
    old_helper, old_toolkit = f"from {flat} import toolkit\n", f"from {flat} import dists\n"
    (old / "myprobe.py").write_text(old_probe)
    (old / "_a.py").write_text(old_helper)
    (old.parent / "toolkit.py").write_text(old_toolkit)
    (old.parent / "dists.py").write_text("TABLE = 1\n")
    new = _layout(tmp_path / "new", "kit")
    # the layout-free text of each file, in the order probe, helpers, fact modules
    h = hashlib.sha256()
    for name, text in (("myprobe.py", "from . import _a\nfrom . import outcome\n\n"
                                      "# helpers in _a.py; catalogue in reasons.yaml\n"),
                       ("_a.py", "from . import toolkit\n"), ("dists.py", "TABLE = 1\n"),
                       ("toolkit.py", "from . import dists\n")):
        h.update(name.encode() + b"\0" + text.encode() + b"\0")
    expected = h.hexdigest()[:16]
    assert probe_hash(old / "myprobe.py", old) == expected
    assert probe_hash(new / "probes" / "myprobe.py", new / "kit") == expected
    moved = _layout(tmp_path / "moved", "helpers")  # a move no spelling rule knows: the helpers in inenv/helpers
    assert probe_hash(moved / "probes" / "myprobe.py", moved / "helpers") == expected
    (new / "dists.py").write_text("TABLE = 2\n")
    assert probe_hash(new / "probes" / "myprobe.py", new / "kit") != expected  # a real change still counts

"""The caches an installed wheel runs code from: the probes' copy of the in-environment package under the working
folder is compared file by file with the installed package before each use (a planted, changed, linked or extra
file is never imported: the copy is written again whole), and the caches whose content cannot be compared (built
libraries, bytecode, venv cells) live in a folder of the user's alone, checked at each command's start. Real
folders, links, modes and owners; the planted module is imported by a real interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from common import home

PLANTED = "import sys\nsys.stdout.write('PLANTED RAN\\n')\n"


@pytest.fixture
def site(tmp_path: Path) -> Path:
    """An installed package: site-packages holding inenv (with a sub-package) and a host-side package."""
    code = tmp_path / "site"
    (code / "inenv" / "kit").mkdir(parents=True)
    (code / "inenv" / "__init__.py").write_text("WHO = 'installed'\n")
    (code / "inenv" / "kit" / "__init__.py").write_text("")
    (code / "inenv" / "kit" / "x.py").write_text("X = 1\n")
    (code / "checks").mkdir()
    return code


def imported_by_a_probe_process(folder: Path) -> str:
    """What a process given ``folder`` on PYTHONPATH prints when it imports inenv."""
    proc = subprocess.run([sys.executable, "-c", "import inenv, inenv.kit.x; print(inenv.WHO, inenv.kit.x.X)"],
                          env={**os.environ, "PYTHONPATH": str(folder)}, cwd=folder.parent, capture_output=True,
                          text=True, timeout=60)
    return proc.stdout + proc.stderr


def writable(folder: Path) -> None:
    for p in folder.rglob("*"):
        if not p.is_symlink():
            p.chmod(0o755 if p.is_dir() else 0o644)


def test_a_changed_file_of_the_copy_is_written_again_before_use(site: Path, tmp_path: Path) -> None:
    cache = tmp_path / "work" / ".cache"
    first = home.in_env_root(site, cache, checkout=False)
    assert imported_by_a_probe_process(first).strip() == "installed 1"
    writable(first)
    (first / "inenv" / "__init__.py").write_text(PLANTED + "WHO = 'planted'\n")  # same name, other content
    again = home.in_env_root(site, cache, checkout=False)
    assert again == first
    out = imported_by_a_probe_process(again)
    assert "PLANTED" not in out and out.strip() == "installed 1"
    assert (again / "inenv" / "__init__.py").read_text() == "WHO = 'installed'\n"
    assert not [p for p in (cache / "code").iterdir() if p.name.startswith(".")]  # nothing left beside it


def test_a_planted_copy_under_the_right_name_is_never_imported(site: Path, tmp_path: Path) -> None:
    """The folder a cloned repository carries at the digest this wheel would use: its name is no proof."""
    cache = tmp_path / "work" / ".cache"
    name = home.in_env_root(site, tmp_path / "probe-name", checkout=False).name
    planted = cache / "code" / name / "inenv"
    (planted / "kit").mkdir(parents=True)
    (planted / "__init__.py").write_text(PLANTED + "WHO = 'planted'\n")
    (planted / "kit" / "__init__.py").write_text("")
    (planted / "kit" / "x.py").write_text("X = 666\n")
    folder = home.in_env_root(site, cache, checkout=False)
    assert folder == cache / "code" / name
    assert imported_by_a_probe_process(folder).strip() == "installed 1"


@pytest.mark.parametrize("plant", ["module", "pycache", "file-link", "folder-link", "digest-link", "fifo"])
def test_anything_more_or_linked_in_the_copy_is_replaced(site: Path, tmp_path: Path, plant: str) -> None:
    cache = tmp_path / "work" / ".cache"
    folder = home.in_env_root(site, cache, checkout=False)
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "inenv" / "kit").mkdir(parents=True)
    (elsewhere / "inenv" / "__init__.py").write_text(PLANTED + "WHO = 'planted'\n")
    (elsewhere / "inenv" / "kit" / "__init__.py").write_text("")
    (elsewhere / "inenv" / "kit" / "x.py").write_text("X = 666\n")
    writable(folder)
    pkg = folder / "inenv"
    if plant == "module":  # a probe module the registry would find
        (pkg / "kit" / "evil.py").write_text(PLANTED)
    elif plant == "pycache":  # bytecode Python prefers to the source when its header matches
        (pkg / "__pycache__").mkdir()
        (pkg / "__pycache__" / f"__init__.{sys.implementation.cache_tag}.pyc").write_bytes(b"\0" * 32)
    elif plant == "file-link":
        (pkg / "kit" / "x.py").unlink()
        (pkg / "kit" / "x.py").symlink_to(elsewhere / "inenv" / "kit" / "x.py")
    elif plant == "folder-link":
        import shutil

        shutil.rmtree(pkg / "kit")
        (pkg / "kit").symlink_to(elsewhere / "inenv" / "kit")
    elif plant == "digest-link":  # the digest folder itself a link to a folder someone else fills
        import shutil

        shutil.rmtree(folder)
        folder.symlink_to(elsewhere)
    elif plant == "fifo":
        os.mkfifo(pkg / "kit" / "y.py")
    again = home.in_env_root(site, cache, checkout=False)
    assert again == folder and not again.is_symlink()
    assert not any(p.is_symlink() for p in again.rglob("*"))
    assert sorted(p.relative_to(again).as_posix() for p in again.rglob("*")) == [
        "inenv", "inenv/__init__.py", "inenv/kit", "inenv/kit/__init__.py", "inenv/kit/x.py"]
    assert imported_by_a_probe_process(again).strip() == "installed 1"
    assert (elsewhere / "inenv" / "kit" / "x.py").read_text() == "X = 666\n"  # what a link named is left alone


def test_a_linked_cache_or_code_folder_is_refused_with_one_line(site: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for linked in (".cache", ".cache/code"):
        work = tmp_path / f"work-{linked.count('/')}"
        (work / linked).parent.mkdir(parents=True, exist_ok=True)
        (work / linked).symlink_to(elsewhere)
        with pytest.raises(home.CacheError) as err:
            home.in_env_root(site, work / ".cache", checkout=False)
        line = err.value.line()
        assert "\n" not in line and line.startswith(str(work / linked)) and "is a link" in line
        assert list(elsewhere.iterdir()) == []


def test_check_private_makes_the_folder_the_users_alone(tmp_path: Path) -> None:
    root = tmp_path / "xdg" / "stackprobe"
    assert home.check_private(root, checkout=False) is None
    assert root.is_dir() and root.stat().st_mode & 0o777 == 0o700
    assert home.check_private(tmp_path / "nowhere", checkout=True) is None  # a checkout's caches are its own
    assert not (tmp_path / "nowhere").exists()


@pytest.mark.parametrize("kind", ["link", "file", "group-writable", "other-writable", "other-user", "open-parent"])
def test_a_cache_folder_others_can_fill_is_refused_with_one_line(tmp_path: Path, kind: str) -> None:
    root = tmp_path / "xdg" / "stackprobe"
    root.parent.mkdir()
    if kind == "link":
        (tmp_path / "theirs").mkdir()
        root.symlink_to(tmp_path / "theirs")
    elif kind == "file":
        root.write_text("")
    else:
        root.mkdir(mode=0o700)
    if kind == "group-writable":
        root.chmod(0o770)
    elif kind == "other-writable":
        root.chmod(0o707)
    elif kind == "other-user":
        if os.getuid() != 0:
            pytest.skip("giving a folder to another user needs root")
        os.chown(root, 4242, 4242)
    elif kind == "open-parent":
        root.parent.chmod(0o777)  # anyone may rename the cache folder away and put theirs in its place
    line = home.check_private(root, checkout=False)
    assert line is not None and "\n" not in line and line.startswith(str(root)), line
    want = {"link": "is a link", "file": "is not a folder", "group-writable": "others may write it",
            "other-writable": "others may write it", "other-user": "belongs to another user",
            "open-parent": "lets others rename it"}[kind]
    assert want in line and "XDG_CACHE_HOME" in line


def test_the_wheel_keeps_its_caches_in_the_users_cache_folder(tmp_path: Path) -> None:
    assert home.user_cache_root({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "stackprobe"
    assert home.user_cache_root({"XDG_CACHE_HOME": "relative/x"}) == Path.home() / ".cache" / "stackprobe"
    assert home.user_cache_root({}) == Path.home() / ".cache" / "stackprobe"
    # a checkout: its caches are its own; the work folder's cache is the code copy's and the Slurm jobs' place
    assert home.CHECKOUT and home.CACHE_ROOT == home.WORK_CACHE == home.WORK_ROOT / ".cache"

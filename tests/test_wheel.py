"""stackprobe installed, not cloned: the wheel `uv build` makes runs `checks run --backend local --python PY` from
an empty folder through `uvx`, writes its results and table only there and its caches in the user's cache folder,
and its probe processes import the in-environment package from that folder's .cache/code, with none of
stackprobe's own dependencies on their path. Real: the wheel is built here, uvx installs it, the target is this
checkout's venv (CPU torch, real gloo ranks)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from common import home
from tests.checks_helpers import FIXTURES, ROOT

UV = shutil.which("uv")
pytestmark = pytest.mark.skipif(UV is None, reason="uv is not on PATH")

# A probe that reports what its process imports: where inenv came from, and every folder on sys.path.
WHERE = '''
import sys

import inenv
from inenv.probe import ProbeSpec, RankContext, outcome

SPEC = ProbeSpec(id="t-where", title="where", feature="what a probe process imports", needs_gpu=False,
                 timeout_s=60)


def run(ctx: RankContext) -> dict:
    return outcome("pass", evidence={"inenv_file": inenv.__file__, "sys_path": list(sys.path)})
'''


def tree(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``folder`` with its size and modification time."""
    if not folder.is_dir():
        return {}
    return {p.relative_to(folder).as_posix(): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in folder.rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dist = tmp_path_factory.mktemp("dist")
    proc = subprocess.run([str(UV), "build", "--wheel", "-o", str(dist), str(ROOT)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    [whl] = dist.glob("stackprobe-*.whl")
    return whl


def uvx_checks(whl: Path, cwd: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``checks ARGS`` of the wheel in ``cwd``, its user's cache folder (XDG_CACHE_HOME) beside ``cwd`` unless
    ``env`` names one; uv keeps its own cache and says nothing of its own (quiet: whether it installs the
    tool's environment depends on which test ran first)."""
    uv_cache = subprocess.run([str(UV), "cache", "dir"], capture_output=True, text=True).stdout.strip()
    run_env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    run_env.update({"UV_CACHE_DIR": uv_cache, "XDG_CACHE_HOME": str(cwd.parent / "xdg")})
    run_env.update(env or {})
    return subprocess.run([str(UV), "--quiet", "tool", "run", "--from", str(whl), "checks", *args], cwd=cwd,
                          env=run_env, capture_output=True, text=True, timeout=900)


def results_of(folder: Path) -> list[dict]:
    return [json.loads(line) for f in sorted(folder.glob("results/*/*.jsonl")) for line in f.read_text().splitlines()
            if line.strip()]


def test_the_wheel_carries_the_default_data(wheel: Path) -> None:
    import zipfile

    names = set(zipfile.ZipFile(wheel).namelist())
    for wanted in ("common/packaged/matrix.yaml", "common/packaged/dockerfiles/cell.Dockerfile.j2",
                   "common/catalog.yaml", "common/reasons.yaml", "checks/report/launch_flags.yaml",
                   "checks/report/templates/compatibility.md.j2", "checks/results/probe_hash_aliases.json",
                   "inenv/worker.py", "inenv/selfcheck.py"):
        assert wanted in names, wanted
    assert not any(n.startswith(("tests/", "results/", "envs/")) for n in names)


def test_uvx_runs_every_probe_from_an_empty_folder_and_writes_only_there(wheel: Path, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    before = {name: tree(ROOT / name) for name in ("results", "docs", "envs")}
    proc = uvx_checks(wheel, work, "run", "--backend", "local", "--python", sys.executable, "--all")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {name: tree(ROOT / name) for name in before} == before  # the clone's folders are untouched
    assert not (ROOT / ".cache" / "code").exists()  # a checkout's workers import the checkout itself
    rows = results_of(work)
    inventory = [r for r in rows if r["probe_id"] == "inventory"]
    assert inventory and all(r["status"] == "pass" for r in inventory), inventory
    assert {r["cell_id"] for r in rows} == {r["cell_id"] for r in inventory}
    assert rows[0]["cell_id"].startswith("local-") and "torch2.11.0" in rows[0]["cell_id"]
    assert (work / "results" / "compatibility.md").is_file() and (work / "results" / "compatibility.html").is_file()
    assert "inventory" in (work / "results" / "compatibility-archive.md").read_text()  # a local cell: archived
    assert not (work / "docs").exists()  # an installed wheel writes no docs/ into a user's folder
    # the probes' copy of the in-environment package, and nothing else, is cached there
    assert [p.name for p in (work / ".cache").iterdir()] == ["code"]
    [copy] = (work / ".cache" / "code").iterdir()
    assert [p.name for p in copy.iterdir()] == ["inenv"]
    # the caches whose content runs (here the JIT libraries' store) are in the user's cache folder, mode 700
    xdg = tmp_path / "xdg" / "stackprobe"
    assert xdg.is_dir() and xdg.stat().st_mode & 0o777 == 0o700 and (xdg / "compile").is_dir()


def test_a_cache_folder_others_may_write_stops_every_command_with_one_line(wheel: Path, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    shared = tmp_path / "shared"
    (shared / "stackprobe").mkdir(parents=True)
    (shared / "stackprobe").chmod(0o777)
    proc = uvx_checks(wheel, work, "run", "--backend", "local", "--python", sys.executable, "--probe", "inventory",
                      env={"XDG_CACHE_HOME": str(shared)})
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip() == (f"checks: {shared / 'stackprobe'}: others may write it (mode 777); stackprobe "
                                   "runs code it keeps there only from a folder of this user's alone: remove it, "
                                   "or set XDG_CACHE_HOME to a folder of yours (mode 700)")
    assert not (work / "results").exists() and not (work / ".cache").exists()


def test_probe_processes_import_the_copy_and_no_host_side_package(wheel: Path, tmp_path: Path) -> None:
    work = tmp_path / "work"
    probes = tmp_path / "probes"
    work.mkdir()
    probes.mkdir()
    (probes / "t_where.py").write_text(WHERE)
    proc = uvx_checks(wheel, work, "run", "--backend", "local", "--python", sys.executable, "--probe", "t-where",
                      "--probe", "t-gloo-allreduce", "--results", str(tmp_path / "elsewhere"),
                      env={"STACKPROBE_PROBE_PATH": os.pathsep.join([str(FIXTURES), str(probes)])})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (work / "results").exists()  # --results decides where results go
    rows = [json.loads(line) for f in (tmp_path / "elsewhere").glob("*/*.jsonl") for line in f.read_text().splitlines()]
    gloo = [r for r in rows if r["probe_id"] == "t-gloo-allreduce"]
    assert {r["variant"] for r in gloo} == {"ranks=2", "ranks=3"} and all(r["status"] == "pass" for r in gloo)
    where = next(r for r in rows if r["probe_id"] == "t-where")
    evidence = where["evidence"]
    assert Path(evidence["inenv_file"]).resolve().is_relative_to((work / ".cache" / "code").resolve())
    # only the target's own site-packages holds a host-side dependency of stackprobe (rich)
    holding = [p for p in evidence["sys_path"] if p and (Path(p) / "rich").is_dir()]
    assert all(Path(p).resolve().is_relative_to(Path(sys.prefix).resolve()) for p in holding), holding


def test_in_env_root_copies_the_in_environment_package_once(tmp_path: Path) -> None:
    code = tmp_path / "site"
    (code / "inenv" / "kit").mkdir(parents=True)
    (code / "inenv" / "__init__.py").write_text("")
    (code / "inenv" / "kit" / "x.py").write_text("X = 1\n")
    (code / "checks").mkdir()
    first = home.in_env_root(code, tmp_path / "cache", checkout=False)
    assert sorted(p.relative_to(first).as_posix() for p in first.rglob("*")) == [
        "inenv", "inenv/__init__.py", "inenv/kit", "inenv/kit/x.py"]
    assert home.in_env_root(code, tmp_path / "cache", checkout=False) == first
    (code / "inenv" / "kit" / "x.py").write_text("X = 2\n")  # new content, new copy beside the old
    second = home.in_env_root(code, tmp_path / "cache", checkout=False)
    assert second != first and (second / "inenv" / "kit" / "x.py").read_text() == "X = 2\n"
    assert [p.name for p in (tmp_path / "cache" / "code").iterdir() if p.name.startswith(".")] == []
    assert home.in_env_root(code, tmp_path / "cache", checkout=True) == code


def test_a_checkout_is_told_from_site_packages(tmp_path: Path) -> None:
    assert home.is_checkout(ROOT) and home.CHECKOUT and home.WORK_ROOT == ROOT and home.DATA_ROOT == ROOT
    (tmp_path / "common").mkdir()
    assert not home.is_checkout(tmp_path)
    (tmp_path / "pyproject.toml").write_text("")
    (tmp_path / "matrix.yaml").write_text("")
    assert home.is_checkout(tmp_path)

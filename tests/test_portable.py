"""The tracked docs do not depend on where the clone lives, and what a user reads is a sentence: a result's
words name no folder of the machine that made them, the committed results give the same page in any clone
folder, and `checks run` says why no Docker daemon answers without a Python exception's repr."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from checks.results import portable
from checks.results.result import ProbeResult, Verdict
from checks.run import container
from inenv.status import Status
from tests.checks_helpers import FIXTURES, ROOT, committed, fixture_env


@pytest.mark.parametrize(("said", "written"), [
    ("FAILED: [code=127] /tmp/stackprobe-fi-jit-9rgz6_6b/jit-cache/.cache/flashinfer/0.6.16/120f/cached_ops/x.o",
     "FAILED: [code=127] $TMPDIR/stackprobe-fi-jit-*/jit-cache/.cache/flashinfer/0.6.16/120f/cached_ops/x.o"),
    ("python at /srv/clones/stackprobe/.cache/venvs/cu130-x/bin/python failed",
     "python at .cache/venvs/cu130-x/bin/python failed"),
    ("/home/alice/src/stackprobe/.venv/bin/python", ".venv/bin/python"),
    ("wheel in /root/.cache/uv/archive-v0/ab12", "wheel in ~/.cache/uv/archive-v0/ab12"),
    ("see /home/bob/logs/x.log", "see ~/logs/x.log"),
    ("kept in /tmp/build.log and /var/tmp/tmpk3j_9x2a/out", "kept in $TMPDIR/build.log and $TMPDIR/tmp*/out"),
    ("/tmp/abcdefgh/x", "$TMPDIR/abcdefgh/x"),  # eight letters: a name, not mkdtemp's
    ("built for another Python than this cpython 3.11.7, which",
     "built for another Python than this cpython 3.11, which"),
    ("nvcc: /usr/local/cuda/bin/nvcc not found; see https://example.org/tmp/page",
     "nvcc: /usr/local/cuda/bin/nvcc not found; see https://example.org/tmp/page"),
    ("torch 2.11.0 and CUDA 13.0.2", "torch 2.11.0 and CUDA 13.0.2"),
    ("requires Python 3.10.2 or later", "requires Python 3.10.2 or later"),  # a floor's patch release is the fact
])
def test_a_results_words_name_no_folder_of_this_machine(said: str, written: str) -> None:
    assert portable.text(said) == written


def test_the_clone_folder_given_at_record_time_is_written_from_the_clone_top() -> None:
    r = ProbeResult("r1", "cpu-00000000", "cell", "p", "ranks=1",
                    Verdict(Status.FAIL, "x", note="read /srv/a b/checks/x.py and /srv/a b/.cache/compile/k",
                            remediation="rerun from /srv/a b"), "2026-12-04T00:00:00Z", None)
    out = portable.result(r, "/srv/a b")
    assert out.verdict.note == "read checks/x.py and .cache/compile/k"
    assert out.verdict.remediation == "rerun from /srv/a b"  # the folder alone, not a path inside it
    untouched = ProbeResult("r1", "cpu-00000000", "cell", "p", "ranks=1", Verdict(Status.PASS, note="fine"),
                            "2026-12-04T00:00:00Z", None)
    assert portable.result(untouched, "/srv/a b") is untouched


PARTS = ("checks", "common", "inenv", "provision", "results", "matrices", "matrix.yaml", "pyproject.toml")


def _clone(where: Path) -> Path:
    where.mkdir(parents=True)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in PARTS:
        src = committed() if name == "results" else ROOT / name
        if src.is_dir():
            shutil.copytree(src, where / name, ignore=skip)
        elif src.exists():
            shutil.copy2(src, where / name)
    return where


def _report(clone: Path) -> tuple[bytes, bytes]:
    out = clone / "docs" / "compatibility.md"
    p = subprocess.run([sys.executable, "-m", "checks.cli", "report", "--results", "results", "--out",
                        str(out.relative_to(clone))], cwd=clone, capture_output=True, text=True, timeout=300,
                       env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(clone), "HOME": str(clone.parent)})
    assert p.returncode == 0, p.stderr
    return out.read_bytes(), out.with_suffix(".html").read_bytes()


def test_the_committed_results_give_the_same_docs_in_any_clone_folder(tmp_path: Path) -> None:
    one = _report(_clone(tmp_path / "one"))
    other = _report(_clone(tmp_path / "deeper" / "another-clone"))
    assert one == other
    for page in one:
        assert not re.search(rb"/tmp/|/home/|/root/", page)
        assert str(tmp_path).encode() not in page


def test_the_tracked_page_names_no_folder_of_a_machine() -> None:
    md = (ROOT / "docs" / "compatibility.md").read_text()
    assert not re.findall(r"/tmp/|/home/|/root/", md)


@pytest.mark.parametrize(("host", "said"), [
    ("unix:///nonexistent/stackprobe-test-docker.sock", "no socket at unix:///nonexistent/stackprobe-test-docker.sock"),
    ("tcp://127.0.0.1:1", "nothing listens at tcp://127.0.0.1:1"),
])
def test_no_docker_daemon_is_said_in_a_sentence(host: str, said: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real Docker SDK against a socket that does not exist and a port nothing listens on."""
    monkeypatch.setenv("DOCKER_HOST", host)
    assert container.unreachable() == said


def test_the_nccl_library_a_rank_mapped_is_recorded_from_its_environment() -> None:
    """Where the in-environment side records it: the library inside the interpreter's prefix as $PREFIX/...,
    inside a home folder as ~/..., a system library as it is."""
    code = ("import json, sys\nfrom inenv.probes.inventory import env_path\n"
            "print(json.dumps([sys.prefix, env_path(sys.prefix + '/lib/python3.12/site-packages/nvidia/nccl/lib/"
            "libnccl.so.2'), env_path('/usr/lib/x86_64-linux-gnu/libnccl.so.2'), env_path(sys.prefix + 'x/l.so')]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60,
                         env={"HOME": "/home/someone", "PATH": "/usr/bin"})
    prefix, inside, system, beside = json.loads(out.stdout)
    assert inside == "$PREFIX/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2"
    assert system == "/usr/lib/x86_64-linux-gnu/libnccl.so.2"
    assert beside == prefix + "x/l.so"  # a folder whose name only starts like the prefix is not inside it
    code = "from inenv.probes.inventory import env_path\nprint(env_path('/home/someone/venvs/t/lib/libnccl.so.2'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60,
                         env={"HOME": "/home/someone", "PATH": "/usr/bin"})
    assert out.stdout.strip() == "~/venvs/t/lib/libnccl.so.2"


def test_the_command_a_local_result_records_names_no_folder_of_this_machine(tmp_path: Path) -> None:
    """A real local run of this checkout's environment: its interpreter is written from the clone's top."""
    proc = subprocess.run([sys.executable, "-m", "checks.cli", "run", "--backend", "local", "--python", sys.executable,
                           "--probe", "t-gloo-allreduce", "--results", str(tmp_path / "r"), "--json"],
                          capture_output=True, text=True, cwd=ROOT, timeout=600,
                          env={**fixture_env(), "STACKPROBE_PROBE_PATH": str(FIXTURES)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(proc.stdout)
    python = Path(sys.executable).relative_to(ROOT)
    assert rows and all(r["evidence"]["command"] == f"{python} -m inenv.worker t-gloo-allreduce" for r in rows)

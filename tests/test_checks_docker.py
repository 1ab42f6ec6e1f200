"""The worker inside a real container: an image built here FROM the registry-free base, with a venv that
holds nothing GPU-related, so GPU probes must `skip` honestly. Nothing may be left running."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from checks import reasons
from checks.container import LABEL, DockerExecutor, client
from checks.probe import Variant
from checks.store import read_file
from tests.checks_helpers import FIXTURES, ROOT, fixture_env

pytestmark = pytest.mark.docker
TAG = "stackprobe-checks-test/venv:1"
CAT = reasons.default()


@pytest.fixture(scope="module")
def venv_image(base_image: str, docker_available: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    ctx = tmp_path_factory.mktemp("ctx")
    (ctx / "Dockerfile").write_text(f"FROM {base_image}\nRUN python3 -m venv /opt/venv\nENV PATH=/opt/venv/bin:$PATH\n")
    proc = subprocess.run([docker_available, "build", "-q", "-t", TAG, str(ctx)], capture_output=True, text=True,
                          env={**os.environ, "DOCKER_BUILDKIT": "1"})
    assert proc.returncode == 0, proc.stderr
    return TAG


@pytest.fixture
def executor(venv_image: str, monkeypatch: pytest.MonkeyPatch) -> DockerExecutor:
    monkeypatch.setenv("STACKPROBE_PROBE_PATH", str(FIXTURES))
    ex = DockerExecutor(image=venv_image)
    yield ex
    assert ex.leftovers() == []


def test_trivial_probe_runs_two_ranks_in_a_container(executor: DockerExecutor) -> None:
    r = executor.run(Variant("t-trivial", 2), 0, 60, CAT)
    assert r.status == "pass", r
    assert [x["status"] for x in r.evidence["ranks"]] == ["pass", "pass"]
    assert r.evidence["env"]["python"].startswith("3.11")  # Debian bookworm's, not the host's venv
    assert "torch" not in r.evidence["env"]
    assert r.evidence["image"] == TAG and r.evidence["image_id"].startswith("sha256:")


def test_gpu_and_torch_probes_skip_honestly(executor: DockerExecutor) -> None:
    gloo = executor.run(Variant("t-gloo-allreduce", 2), 0, 60, CAT)
    assert gloo.status == "skip" and gloo.reason_code == "missing-package"
    assert "torch" in gloo.note
    gpu = executor.run(Variant("t-gpu"), 0, 60, CAT)
    assert gpu.status == "skip"  # torch is missing, checked before the GPU
    assert gpu.remediation


def test_checks_code_is_mounted_read_only(executor: DockerExecutor) -> None:
    p = executor._run(["python3", "-c", "open('/opt/stackprobe-code/checks/x', 'w')"], 60)
    assert p.returncode == 1 and "Read-only file system" in p.stderr_tail


def test_hang_in_container_is_killed_and_removed(executor: DockerExecutor) -> None:
    r = executor.run(Variant("t-hang", 2), 0, 2, CAT)
    assert r.status == "hang"
    assert "sleep_forever" in json.dumps(r.evidence)  # the stacks came back


def test_host_timeout_kills_container(executor: DockerExecutor) -> None:
    p = executor._run(["sleep", "600"], 3)
    assert p.timed_out and p.duration_s < 30


def test_segfault_in_container_is_crash(executor: DockerExecutor) -> None:
    r = executor.run(Variant("t-segv"), 0, 30, CAT)
    assert r.status == "crash" and "SIGSEGV" in r.note
    p = executor._run(["python3", "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"], 30)
    assert p.signal_name == "SIGSEGV"


def test_inspect_in_container(executor: DockerExecutor) -> None:
    info = executor.inspect()
    assert info["versions"]["python"].startswith("3.11")
    assert info["gpus"] == [] and "torch is not installed" in info["torch_error"]


def test_checks_run_docker_mode_end_to_end(venv_image: str, tmp_path: Path) -> None:
    """Cells from provision.api: an unavailable one, one whose build failed, one whose build.json names an
    image. The image here is the small test image, so its results describe that image (evidence.env)."""
    from provision.api import plan_cells

    cells = plan_cells()
    unavailable = next(c for c in cells if c.status == "unavailable")
    resolved = [c for c in cells if c.status == "resolved"][:2]
    assert len(resolved) == 2
    envs = tmp_path / "envs"
    for c, body in zip(resolved, ({"status": "built", "tag": venv_image},
                                  {"status": "failed", "tag": None, "reason": "uv: no solution"}), strict=True):
        (envs / c.cell_id).mkdir(parents=True)
        (envs / c.cell_id / "build.json").write_text(json.dumps(body))
    only = [a for c in (unavailable, *resolved) for a in ("--only", c.cell_id)]
    p = subprocess.run([sys.executable, "-m", "checks.cli", "run", "--probe", "t-trivial", "--probe", "t-gpu",
                        *only, "--envs", str(envs), "--results", str(tmp_path / "res"), "--json"],
                       capture_output=True, text=True, env=fixture_env(), cwd=ROOT, timeout=300)
    assert p.returncode == 0, p.stderr
    [path] = sorted((tmp_path / "res").glob("*/*.jsonl"))
    stored, warnings = read_file(path)
    assert warnings == []
    by = {r.key: r for r in stored}
    built, failed = resolved
    assert by[(built.cell_id, "t-trivial", "ranks=2")].verdict.status == "pass"
    assert by[(built.cell_id, "t-trivial", "ranks=1")].verdict.evidence["image"] == venv_image
    assert by[(built.cell_id, "t-gpu", "ranks=1")].verdict.status == "skip"
    assert {r.verdict.status for k, r in by.items() if k[0] == failed.cell_id} == {"not-run"}
    assert by[(failed.cell_id, "t-trivial", "ranks=1")].verdict.note == "uv: no solution"
    assert by[(failed.cell_id, "t-trivial", "ranks=1")].verdict.reason_code == "image-failed"
    un = by[(unavailable.cell_id, "t-trivial", "ranks=1")]
    assert un.verdict.status == "unavailable" and un.verdict.note == unavailable.reason
    names = {r.verdict.evidence["container"] for r in stored if "container" in r.verdict.evidence}
    assert len(names) == 2  # one container per variant that ran (t-gpu is decided without running)
    existing = {n.lstrip("/") for c in client().api.containers(all=True) for n in c["Names"]}  # no inspect race
    assert not names & existing


def test_ctrl_c_in_docker_mode_removes_the_running_container(venv_image: str, tmp_path: Path) -> None:
    from provision.api import plan_cells

    cell = next(c for c in plan_cells() if c.status == "resolved")
    (tmp_path / "envs" / cell.cell_id).mkdir(parents=True)
    (tmp_path / "envs" / cell.cell_id / "build.json").write_text(json.dumps({"status": "built", "tag": venv_image}))

    def all_slow() -> set[str]:
        # by the executor's label, not `ancestor`: another xdist worker may re-tag venv_image meanwhile, and
        # `ancestor` resolves the tag to whatever image it names now
        # one list call, no per-container inspect: another worker's container may vanish in between
        return {c["Id"] for c in client().api.containers(all=True, filters={"label": LABEL})
                if "t-zz-slow" in c.get("Command", "")}

    others = all_slow()  # a concurrent test's containers are not this run's

    proc = subprocess.Popen([sys.executable, "-m", "checks.cli", "run", "--probe", "t-zz-slow", "--only", cell.cell_id,
                             "--envs", str(tmp_path / "envs"), "--results", str(tmp_path / "res")],
                            env=fixture_env(), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def slow_containers() -> list[str]:
        return sorted(all_slow() - others)

    deadline = time.monotonic() + 120
    while not slow_containers() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.3)
    if not slow_containers():
        proc.kill()
        _, err = proc.communicate(timeout=30)
        recorded = [p.read_text()[-1500:] for p in (tmp_path / "res").rglob("*.jsonl")]
        pytest.fail(f"the slow probe's container never started (runner exit {proc.returncode}): {err[-1500:]} "
                    f"recorded: {recorded}")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert slow_containers() == []


def test_interrupt_before_create_returns_leaves_no_container(venv_image: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C can land after the daemon created the container but before the SDK handed it back; the
    executor removes it by the name it chose, though it never held a handle."""
    from docker.models.containers import ContainerCollection

    real_create = ContainerCollection.create

    def create_then_interrupt(self: ContainerCollection, *args: object, **cfg: object) -> object:
        real_create(self, *args, **cfg)
        raise KeyboardInterrupt

    monkeypatch.setattr(ContainerCollection, "create", create_then_interrupt)
    ex = DockerExecutor(image=venv_image)
    with pytest.raises(KeyboardInterrupt):
        ex._run(["python3", "-c", "pass"], 30)
    assert ex.last_container.startswith("stackprobe-")
    assert ex.leftovers() == []

"""The worker inside a real container: an image built here FROM the registry-free base, with a venv that
holds nothing GPU-related, so GPU probes must `skip` honestly. Nothing may be left running."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from checks.results.store import read_file
from checks.run import container
from checks.run.container import DockerExecutor, client
from common import reasons
from inenv.probe import Variant
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


def test_the_ranks_bytecode_outlives_the_container(venv_image: str, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STACKPROBE_PROBE_PATH", str(FIXTURES))
    monkeypatch.setattr(container, "BYTECODE_ROOT", tmp_path / "pycache")
    ex = DockerExecutor(image=venv_image)
    assert ex.run(Variant("t-trivial", 2), 0, 60, CAT).status == "pass"
    [folder] = (tmp_path / "pycache").iterdir()  # one folder per image id
    assert folder.name == ex.image_id.removeprefix("sha256:")[:16] and (folder.stat().st_mode & 0o777) == 0o700
    kept = {p.relative_to(folder).as_posix() for p in folder.rglob("*.pyc")}
    # the ranks compiled the in-environment code they import (mounted from this repository) into it
    assert any(k.endswith(".pyc") and "/inenv/" in k for k in kept), sorted(kept)[:10]
    assert ex.run(Variant("t-trivial", 2), 0, 60, CAT).status == "pass"  # and the next container reads it
    assert ex.leftovers() == []


def test_a_container_takes_turns_on_the_hosts_gpu_lock(venv_image: str, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The lock file is mounted: a worker in a container waits for the lock the host holds, gives up after its
    wait (`not-run gpus-busy`), and runs once the host lets go."""
    import dataclasses
    import fcntl

    from inenv import gpugate
    from tests.test_worker_floor import FLOOR_FIXTURES

    monkeypatch.setenv("STACKPROBE_PROBE_PATH", os.pathsep.join([str(FIXTURES), str(FLOOR_FIXTURES)]))
    lock = tmp_path / "gpu.lock"
    lock.touch()
    ex = dataclasses.replace(DockerExecutor(image=venv_image), run_env=((gpugate.ENV, str(lock)),))
    with open(lock) as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        busy = ex.run(Variant("t-gated", 2), 2, 60, CAT, queue_s=1.0)
    assert busy.status == "not-run" and busy.reason_code == "gpus-busy", busy
    free = ex.run(Variant("t-gated", 2), 2, 60, CAT, queue_s=30.0)
    assert free.status == "pass", free
    assert free.evidence["phases"]["queued"] < 5
    assert ex.leftovers() == []


def test_gpu_and_torch_probes_skip_honestly(executor: DockerExecutor) -> None:
    gloo = executor.run(Variant("t-gloo-allreduce", 2), 0, 60, CAT)
    assert gloo.status == "skip" and gloo.reason_code == "missing-package"
    assert "torch" in gloo.note
    gpu = executor.run(Variant("t-gpu"), 0, 60, CAT)
    assert gpu.status == "skip"  # torch is missing, checked before the GPU
    assert gpu.remediation


def test_in_environment_code_is_mounted_read_only(executor: DockerExecutor) -> None:
    p = executor._run(["python3", "-c", "open('/opt/stackprobe-code/inenv/x', 'w')"], 60)
    assert p.returncode == 1 and "Read-only file system" in p.stderr_tail
    p = executor._run(["python3", "-c", "import os; print(sorted(os.listdir('/opt/stackprobe-code')))"], 60)
    assert "'checks'" not in p.stdout_tail and "'provision'" not in p.stdout_tail  # the host side stays outside


def test_hang_in_container_is_killed_and_removed(executor: DockerExecutor) -> None:
    r = executor.run(Variant("t-hang", 2), 0, 2, CAT)
    assert r.status == "hang"
    assert "sleep_forever" in json.dumps(r.evidence)  # the stacks came back


def test_host_timeout_kills_container(executor: DockerExecutor) -> None:
    p = executor._run(["sleep", "600"], 3)
    assert p.timed_out and p.duration_s < 600  # ended by the host's 3 s limit, long before the sleep would


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
    """Cells from common.api: an unavailable one, one whose build failed, one whose build.json names an
    image. The image here is the small test image, so its results describe that image (evidence.env)."""
    from common.api import plan_cells

    matrix = tmp_path / "m.yaml"  # two cells of the default matrix and one that cannot exist (no cu128 nightly)
    matrix.write_text("matrix:\n  cuda: ['13.0']\n  torch: [stable]\n  sgl_kernel: ['0.4.10']\n"
                      "  flashinfer: ['0.6.16', '0.6.17']\n  include:\n"
                      "    - {cuda: '12.8', torch: nightly, sgl_kernel: none, flashinfer: '0.7.4'}\n")
    cells = plan_cells(matrix)
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
                        *only, "--matrix", str(matrix), "--envs", str(envs), "--results", str(tmp_path / "res"),
                        "--json", "--level", "full"],  # one pass: one run file
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
    ran = [r for r in stored if "container" in r.verdict.evidence]
    assert len(ran) == 2  # t-gpu is decided without running
    names = {r.verdict.evidence["container"] for r in ran}
    assert all(n.startswith("stackprobe-") for n in names)  # each names the (serving) container it ran in
    existing = {n.lstrip("/") for c in client().api.containers(all=True) for n in c["Names"]}  # no inspect race
    assert not names & existing


def _wait(what: Callable[[], object], proc: subprocess.Popen[str], timeout: float) -> float | None:
    """Seconds until ``what()`` is true, or None when the runner exited or ``timeout`` passed first."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if what():
            return time.monotonic() - t0
        if proc.poll() is not None:
            return None
        time.sleep(0.3)
    return None


@pytest.mark.parametrize(("flags", "command"), [(["--cold-ranks"], "t-zz-slow"), ([], "inenv.warm")],
                         ids=["one-shot", "warm"])
def test_ctrl_c_in_docker_mode_removes_the_running_container(venv_image: str, tmp_path: Path, container_sweep: str,
                                                              flags: list[str], command: str) -> None:
    """Ctrl-C while the variant's container runs: exit 130 and no container left.

    It failed once on a fresh clone ("the slow probe's container never started (runner exit -9)", a
    container left in Created state): the test gave the container 120 s to appear and then SIGKILLed the
    runner. Creating a container waits for the daemon, which on a first run is busy with the other xdist
    worker's image builds and removals (multi-GB layers), and a SIGKILLed runner cannot remove the
    container the daemon finishes creating after it died. Now the test waits for the runner to say it
    started the variant, then as long as the daemon needs, and never kills the runner: a Ctrl-C is what is
    tested, and it removes the container by name even while its create is in flight."""
    from common.api import plan_cells

    cell = next(c for c in plan_cells() if c.status == "resolved")
    (tmp_path / "envs" / cell.cell_id).mkdir(parents=True)
    (tmp_path / "envs" / cell.cell_id / "build.json").write_text(json.dumps({"status": "built", "tag": venv_image}))

    def slow_containers() -> list[str]:
        # this session's label, one list call (no per-container inspect: another test's container may vanish
        # meanwhile); by label, not `ancestor`: another xdist worker may re-tag venv_image
        return sorted(c["Id"] for c in client().api.containers(all=True, filters={"label": container_sweep})
                      if command in c.get("Command", ""))

    proc = subprocess.Popen([sys.executable, "-m", "checks.cli", "run", "--probe", "t-zz-slow", "--only", cell.cell_id,
                             "--envs", str(tmp_path / "envs"), "--results", str(tmp_path / "res"), "--no-report",
                             *flags],
                            env=fixture_env(), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    err: list[str] = []
    assert proc.stderr is not None
    drain = threading.Thread(target=lambda: err.extend(proc.stderr or ()), daemon=True)  # a full pipe blocks the runner
    drain.start()
    started = _wait(lambda: any(ln.startswith("  start ") and " t-zz-slow " in ln for ln in err), proc, 300)
    running = _wait(slow_containers, proc, 600) if started is not None else None
    proc.send_signal(signal.SIGINT)  # never SIGKILL: a killed runner cannot remove its container
    proc.wait(timeout=120)
    drain.join(timeout=30)
    assert slow_containers() == []
    assert started is not None and running is not None, (
        f"the slow variant {'started' if started is not None else 'never started'} and its container "
        f"{'never appeared' if running is None else 'appeared'} (runner exit {proc.returncode}): "
        f"{''.join(err)[-1500:]}")
    assert proc.returncode == 130, "".join(err)


def test_interrupt_before_create_returns_leaves_no_container(venv_image: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C can land after the daemon created the container but before the SDK handed it back; the
    executor removes it by the name it chose, though it never held a handle."""
    from docker.models.containers import ContainerCollection

    real_create = ContainerCollection.create
    created: list[str] = []

    def create_then_interrupt(self: ContainerCollection, *args: object, **cfg: object) -> object:
        real_create(self, *args, **cfg)
        created.append(str(cfg["name"]))
        raise KeyboardInterrupt

    monkeypatch.setattr(ContainerCollection, "create", create_then_interrupt)
    ex = DockerExecutor(image=venv_image)
    with pytest.raises(KeyboardInterrupt):
        ex._run(["python3", "-c", "pass"], 30)
    assert len(created) == 1 and created[0].startswith("stackprobe-")
    assert ex.leftovers() == []


def test_containers_carry_the_session_label_and_the_sweep_removes_leftovers(venv_image: str,
                                                                            container_sweep: str) -> None:
    """What a failed or killed test leaves is removed at the end of the session: every container this
    session makes carries its label (in-process executors and the runners tests start alike)."""
    from tests.conftest import docker_cli, sweep_containers

    key, value = container_sweep.split("=", 1)
    assert DockerExecutor(image=venv_image)._config(["true"])["labels"][key] == value
    left = f"stackprobe.test-sweep={os.getpid()}-{time.monotonic_ns()}"  # not this session's label
    subprocess.run([docker_cli(), "create", "--label", left, venv_image, "true"], check=True, capture_output=True)
    names = sweep_containers(left)
    assert len(names) == 1
    listed = subprocess.run([docker_cli(), "ps", "-a", "--filter", f"label={left}", "-q"], capture_output=True,
                            text=True, check=True).stdout
    assert listed.strip() == ""


def test_variants_of_one_cell_at_once_each_own_their_container(executor: DockerExecutor) -> None:
    """Four variants of one cell run at once on its one executor, ending at different times: each gets its own
    logs and result (its own ``n``), names its own container, and no container is left behind."""
    seconds = {1: "6", 2: "0", 3: "3", 4: "1"}
    got: dict[int, object] = {}

    def one(n: int) -> None:
        got[n] = executor.run(Variant("t-echo", 1, (("seconds", seconds[n]), ("n", str(n)))), 0, 60, CAT)

    threads = [threading.Thread(target=one, args=(n,)) for n in seconds]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert sorted(got) == [1, 2, 3, 4]
    for n, r in got.items():
        assert r.status == "pass", r
        assert r.metrics == {"n": n}
    names = [r.evidence["container"] for r in got.values()]
    assert len(set(names)) == 4 and all(n.startswith("stackprobe-") for n in names)
    assert executor.leftovers() == []


def running_containers(ex: DockerExecutor, which: Callable[[dict[str, object]], bool] = lambda c: True,
                       timeout_s: float = 60) -> list[dict[str, object]]:
    """The executor's running containers that ``which`` accepts, as soon as there is one (or none after
    ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    found: list[dict[str, object]] = []
    while time.monotonic() < deadline and not found:
        time.sleep(0.2)
        running = ex.docker.api.containers(filters={"label": f"{container.LABEL}={ex.run_label}", "status": "running"})
        found = [c for c in running if which(c)]
    return found


def test_a_container_removed_from_outside_is_that_variants_result(executor: DockerExecutor) -> None:
    """Someone else removes a running variant's container: that variant says so (not-run container-lost) and
    the one running beside it on the same executor passes."""
    beside: dict[str, object] = {}
    th = threading.Thread(target=lambda: beside.update(r=executor.run(
        Variant("t-echo", 1, (("seconds", "8"), ("n", "2"))), 0, 60, CAT)))
    lost_box: dict[str, object] = {}
    victim = threading.Thread(target=lambda: lost_box.update(r=executor.run(
        Variant("t-echo", 1, (("seconds", "30"), ("n", "1"))), 0, 60, CAT)))
    th.start()
    victim.start()
    slow = running_containers(executor, lambda c: '["seconds", "30"]' in str(c.get("Command")))
    assert len(slow) == 1, slow
    time.sleep(2)  # its worker and rank are under way
    executor.docker.api.remove_container(slow[0]["Id"], force=True)
    victim.join(90)
    th.join(90)
    lost = lost_box["r"]
    assert lost.status == "not-run" and lost.reason_code == "container-lost", lost
    assert lost.evidence["container"] in lost.note and lost.remediation
    assert beside["r"].status == "pass" and beside["r"].metrics == {"n": 2}
    assert executor.leftovers() == []


# The stand-ins of tests/probes_fixtures that need no torch (the image has none), with the verdict each must get
WARM_SUITE: list[tuple[str, int, str, str]] = [
    ("t-trivial", 2, "pass", ""),
    ("t-segv", 1, "crash", ""),
    ("t-trivial", 1, "pass", ""),
    ("t-trivial", 2, "pass", ""),
    ("t-hang", 2, "hang", "hang"),
    ("t-trivial", 2, "pass", ""),
    ("t-harness-fail", 1, "not-run", "harness-error"),
    ("t-exit", 1, "fail", ""),
    ("t-raise", 1, "fail", ""),
    ("t-missing", 1, "skip", "missing-package"),
    ("t-abort", 1, "crash", ""),
    ("t-trivial", 1, "pass", ""),
]


@pytest.fixture
def warm_executor(venv_image: str, monkeypatch: pytest.MonkeyPatch) -> DockerExecutor:
    monkeypatch.setenv("STACKPROBE_PROBE_PATH", str(FIXTURES))
    ex = DockerExecutor(image=venv_image).with_run_env((), warm=True)
    yield ex
    ex.close()
    assert ex.leftovers() == []


def test_the_stand_in_suite_gets_the_same_verdicts_in_one_shot_and_serving_containers(
        executor: DockerExecutor, warm_executor: DockerExecutor) -> None:
    """Each stand-in's verdict, one container per variant and on a serving container kept between variants:
    the same, and the ones the stand-ins' behaviour must get."""
    got: dict[str, list[tuple[str, str]]] = {"one-shot": [], "warm": []}
    for way, ex in (("one-shot", executor), ("warm", warm_executor)):
        for probe, ranks, _, _ in WARM_SUITE:
            v = ex.run(Variant(probe, ranks), 0, 60, CAT)
            got[way].append((v.status.value, v.reason_code))
    assert got["one-shot"] == got["warm"]
    assert got["warm"] == [(status, code) if code else (status, got["warm"][i][1])
                           for i, (_, _, status, code) in enumerate(WARM_SUITE)]


def test_a_serving_container_keeps_its_ranks_and_a_crash_ends_them(warm_executor: DockerExecutor) -> None:
    """Two variants in a row run on the same rank processes of one container; a crash ends that group, the next
    variant gets fresh ranks in the same container, which is gone once the executor closes."""
    first = warm_executor.run(Variant("t-trivial", 2), 0, 60, CAT)
    second = warm_executor.run(Variant("t-trivial", 2), 0, 60, CAT)
    crash = warm_executor.run(Variant("t-segv", 2), 0, 60, CAT)
    after = warm_executor.run(Variant("t-trivial", 2), 0, 60, CAT)
    assert [v.status for v in (first, second, crash, after)] == ["pass", "pass", "crash", "pass"]
    assert first.evidence["warm"]["reused"] is False and second.evidence["warm"]["reused"] is True
    assert second.evidence["warm"]["pids"] == first.evidence["warm"]["pids"]
    assert after.evidence["warm"]["reused"] is False
    assert first.evidence["container"] == second.evidence["container"] == after.evidence["container"]
    assert first.evidence["container"] in warm_executor.leftovers()  # kept for the next variant
    warm_executor.close()
    assert warm_executor.leftovers() == []


def test_a_serving_container_removed_from_outside_is_its_variants_result(warm_executor: DockerExecutor) -> None:
    """Someone removes the serving container while its variant runs: that variant is not-run container-lost,
    and the next variant gets a new container and passes."""
    box: dict[str, object] = {}
    th = threading.Thread(target=lambda: box.update(r=warm_executor.run(
        Variant("t-echo", 1, (("seconds", "30"), ("n", "1"))), 0, 60, CAT)))
    th.start()
    names = [n.lstrip("/") for c in running_containers(warm_executor) for n in c["Names"]]
    assert len(names) == 1
    time.sleep(3)  # its server and rank are under way
    warm_executor.docker.api.remove_container(names[0], force=True)
    th.join(90)
    lost = box["r"]
    assert lost.status == "not-run" and lost.reason_code == "container-lost", lost
    assert names[0] in lost.note and lost.remediation
    after = warm_executor.run(Variant("t-echo", 1, (("seconds", "0"), ("n", "2"))), 0, 60, CAT)
    assert after.status == "pass" and after.metrics == {"n": 2}
    assert after.evidence["container"] != names[0]

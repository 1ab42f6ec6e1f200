"""The long kernel builds after `provision build` returns (``python -m provision.kernels``) and the wait for them
(common.build.kernelstage): the stage is a real process, its lines reach whoever waits, at least one line a tick
while it is silent, and its state file names it only while it lives."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from common.build import backend, kernelstage
from provision import kernels


def _stand_in(folder: Path, script: str, **kw: object) -> subprocess.Popen[bytes]:
    """A process whose command line names the stage's module and ``folder``'s job file (as the real one's
    does), running ``script``."""
    return subprocess.Popen([sys.executable, "-c", script, kernelstage.MARKER, str(kernelstage.job_path(folder))],
                            cwd=folder, **kw)  # type: ignore[call-overload]


def test_wait_shows_the_stage_lines_and_ticks_while_it_is_silent(tmp_path: Path) -> None:
    log = tmp_path / "stage.log"
    log.write_text("")
    script = (f"import time\nlog = open({str(log)!r}, 'a')\nlog.write('23:00:00 c kernels: [1/2] trtllm_comm\\n')\n"
              "log.flush()\ntime.sleep(2.5)\nlog.write('23:00:03 c kernels: trtllm_comm carried\\n')\nlog.flush()\n")
    proc = _stand_in(tmp_path, script)
    kernelstage.write_state(kernelstage.Stage(proc.pid, time.time(), log, 2), tmp_path)
    assert kernelstage.running(tmp_path) is not None
    said: list[str] = []
    assert kernelstage.wait(said.append, tmp_path, tick_s=1.0, poll_s=0.2) is True
    proc.wait()
    assert said[0].startswith(f"waiting for the kernel stage `provision build` started (pid {proc.pid}, 2 module")
    assert "23:00:03 c kernels: trtllm_comm carried" in said
    assert any(s.startswith("the kernel stage is still running") for s in said)  # the silent second was said
    assert kernelstage.running(tmp_path) is None and kernelstage.wait(said.append, tmp_path) is False


def test_a_wait_that_begins_late_says_where_the_stage_stands_then_each_new_line(tmp_path: Path) -> None:
    log = tmp_path / "stage.log"
    log.write_text("23:00:00 c kernels: [1/2] trtllm_comm\n23:00:30 c kernels: 0/2 done, compiling trtllm_comm\n"
                   "23:01:00 c kernels: 0/2 done, compiling trtllm_comm (1m00s)\n")
    script = (f"import time\ntime.sleep(1.0)\nlog = open({str(log)!r}, 'a')\n"
              "log.write('23:01:05 c kernels: trtllm_comm carried\\n')\nlog.flush()\n")
    proc = _stand_in(tmp_path, script)
    kernelstage.write_state(kernelstage.Stage(proc.pid, time.time(), log, 2), tmp_path)
    said: list[str] = []
    assert kernelstage.wait(said.append, tmp_path, tick_s=5.0, poll_s=0.1) is True
    proc.wait()
    assert said[1:] == ["23:01:00 c kernels: 0/2 done, compiling trtllm_comm (1m00s)",
                        "23:01:05 c kernels: trtllm_comm carried"]


def test_a_state_file_of_another_process_is_not_a_stage(tmp_path: Path) -> None:
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    try:
        kernelstage.write_state(kernelstage.Stage(other.pid, time.time(), tmp_path / "log", 1), tmp_path)
        assert kernelstage.running(tmp_path) is None  # a live pid, but not the stage (a reused pid)
    finally:
        other.kill()
        other.wait()
    (tmp_path / kernelstage.STATE).write_text("{not json")
    assert kernelstage.running(tmp_path) is None


def test_the_stage_process_builds_records_and_clears_its_state(tmp_path: Path) -> None:
    envs = tmp_path / "envs"
    (envs / "cellx").mkdir(parents=True)
    rec = {"cell_id": "cellx", "status": "built", "backend": backend.VENV, "python": sys.executable,
           "base_python": sys.executable, "versions": {"flashinfer": "0.7.4", "torch_cuda": "13.0"}}
    (envs / "cellx" / backend.RECORD_NAMES[backend.VENV]).write_text(json.dumps(rec))
    job = {"cells": ["cellx"], "backend": backend.VENV, "jobs": 1, "envs": str(envs), "archs": {"cellx": ["9.0a"]},
           "modules": ["moe_a2a"], "builds": 1, "kernels_root": str(tmp_path / "kernels"),
           "cache": str(tmp_path / "cache")}
    stage = kernels.start(job, tmp_path / "state")
    said: list[str] = []
    assert kernelstage.wait(said.append, tmp_path / "state", poll_s=0.2)
    assert any("kernels: [1/1] moe_a2a for 9.0a" in line for line in said), said
    assert any("the stage ended" in line for line in said), said
    assert not (tmp_path / "state" / kernelstage.STATE).exists() and stage.pid > 0
    after = json.loads((envs / "cellx" / backend.RECORD_NAMES[backend.VENV]).read_text())
    row = after["kernels"]["modules"]["moe_a2a"]
    # no flashinfer in this environment: the builder says so, a failure of the cell's own (not retried)
    assert (row["carried"], row["reason_code"]) == (False, "fi-jit-error") and "flashinfer" in row["line"]
    assert not kernels.retried(row["reason_code"])
    assert after["kernels"]["identity"]["torch"] and "source_hash" in after["kernels"]["identity"]


def test_the_stage_says_which_module_and_target_cpu_spent_and_time_left() -> None:
    todo = [kernels.Job("a", "trtllm_comm", ("9.0a", "12.0a"), "0.7.4", "13.0", 1900.0),
            kernels.Job("a", "moe_a2a", ("9.0a", "12.0a"), "0.7.4", "13.0", 680.0)]
    prior = kernels.StageProgress(todo, 1, {})
    assert prior.left_text().endswith("(by fi-jit's declared build costs: no build of these modules here yet)")
    learned = kernels.StageProgress(todo, 1, {"trtllm_comm": 100.0, "moe_a2a": 50.0})
    seconds, basis = learned.left_s()
    cores = max(1, min(2, __import__("os").cpu_count() or 1))
    assert seconds == (200.0 + 100.0) / cores and basis == "by this host's earlier kernel builds"
    learned.begin(todo[0])
    line = learned.tick_line(75.0)
    assert line.startswith("kernels: 0/2 done, compiling [1/2] trtllm_comm for 9.0a 12.0a in a (")
    assert "CPU-s spent in 1m15s" in line and "left (by this host's earlier kernel builds)" in line
    learned.end(todo[0])
    assert learned.tick_line(80.0).startswith("kernels: 1/2 done, compiling between builds")
    # builds in containers: the running ones' CPU comes from their cgroups; when unreadable, the line says so
    boxed = kernels.StageProgress(todo, 1, {}, live=lambda: 30.0)
    boxed.spent(120.0, todo[0])
    assert "; 150 CPU-s spent in 1m15s; about" in boxed.tick_line(75.0)
    unread = kernels.StageProgress(todo, 1, {}, live=lambda: None)
    unread.spent(120.0, todo[0])
    assert "; 120 CPU-s spent by the builds that ended (a running container's could not be read), 1m15s in;" \
        in unread.tick_line(75.0)


def test_a_containers_cpu_is_read_from_its_cgroup(tmp_path: Path) -> None:
    v1 = tmp_path / "v1" / "cpuacct" / "docker" / "abc123"
    v1.mkdir(parents=True)
    (v1 / "cpuacct.usage").write_text("2500000000\n")
    assert kernels.container_cpu_s("abc123", tmp_path / "v1") == 2.5
    v2 = tmp_path / "v2" / "system.slice" / "docker-abc123.scope"
    v2.mkdir(parents=True)
    (v2 / "cpu.stat").write_text("usage_usec 1500000\nuser_usec 1000000\nsystem_usec 500000\n")
    assert kernels.container_cpu_s("abc123", tmp_path / "v2") == 1.5
    assert kernels.container_cpu_s("abc123", tmp_path / "none") is None
    assert kernels.container_cpu_s("../x", tmp_path / "v1") is None


def test_the_time_left_learns_from_the_builds_that_finish_in_the_stage() -> None:
    """Declared costs three times too high: once one build ends, the rest are scaled by what it measured,
    and a module built once in the stage is estimated by that build alone."""
    todo = [kernels.Job("a", "trtllm_comm", ("9.0a",), "0.7.4", "13.0", 900.0),
            kernels.Job("b", "trtllm_comm", ("9.0a", "12.0a"), "0.7.4", "13.0", 1800.0),
            kernels.Job("a", "moe_a2a", ("9.0a",), "0.7.4", "13.0", 600.0)]
    progress = kernels.StageProgress(todo, 1, {})
    cores = max(1, min(2, __import__("os").cpu_count() or 1))
    assert progress.left_s()[0] == (900.0 + 1800.0 + 600.0) / cores
    progress.begin(todo[0])
    progress.end(todo[0])
    progress.spent(300.0, todo[0])  # a third of its declared 900
    seconds, basis = progress.left_s()
    # b's trtllm_comm: 300 per target measured here, two targets; moe_a2a: 600 declared x (300 / 900)
    assert seconds == (600.0 + 200.0) / cores
    assert basis == ("by this host's builds for 1, fi-jit's declared build costs x0.33 as this stage's "
                     "finished builds ran for 1")
    progress.spent(0.0, todo[1])  # a cached build teaches nothing
    assert progress.left_s()[0] == seconds


def test_a_build_flashinfer_refused_some_targets_of_is_measured_per_target_built() -> None:
    """trtllm_comm asked for three targets, built for one (the gate refused 12.0a and 12.0f) in 300 CPU-s:
    300 per target, and the declared costs' scale is 300 over one target's estimate, not three."""
    todo = [kernels.Job("a", "trtllm_comm", ("9.0a", "12.0a", "12.0f"), "0.6.16", "13.0", 2850.0),
            kernels.Job("a", "moe_a2a", ("9.0a", "12.0a", "12.0f"), "0.6.16", "13.0", 1020.0),
            kernels.Job("b", "trtllm_comm", ("9.0a", "12.0a"), "0.7.4", "13.0", 1900.0)]
    progress = kernels.StageProgress(todo, 1, {})
    progress.begin(todo[0])
    progress.end(todo[0])
    progress.spent(300.0, todo[0], built=1)
    cores = max(1, min(2, __import__("os").cpu_count() or 1))
    assert progress.scale() == 300.0 / 950.0
    assert progress.left_s()[0] == (1020.0 * 300.0 / 950.0 + 2 * 300.0) / cores


def test_a_scale_learnt_before_a_build_is_not_applied_twice_when_it_ends() -> None:
    """The main job on this machine: the quick module's builds scale fi-jit's declared costs by 0.32 (vllm_comm,
    4.5 CPU-s a target against 14 declared); the first long build to end was trtllm_comm for one target of
    three (flashinfer 0.6.16's gate refused 12.0a and 12.0f) in 394.6 CPU-s. The declared costs' scale is then
    394.6 over one target's declared 950 (0.415), not over the estimate the 0.32 scale had made of it (which
    gave 1.30 x declared, and an estimate twice the real time left)."""
    archs = ("9.0a", "12.0a", "12.0f")
    todo = [kernels.Job("old", "trtllm_comm", archs, "0.6.16", "13.0", 2850.0),
            kernels.Job("new", "trtllm_comm", archs, "0.7.4", "13.0", 2850.0),
            kernels.Job("new", "moe_a2a", archs, "0.7.4", "13.0", 1020.0)]
    progress = kernels.StageProgress(todo, 1, {"vllm_comm": 4.48})
    assert progress.scale() == 4.48 / 14.0
    progress.begin(todo[0])
    progress.end(todo[0])
    progress.spent(394.6, todo[0], built=1)
    assert progress.scale() == 394.6 / 950.0
    cores = max(1, min(2, __import__("os").cpu_count() or 1))
    assert progress.left_s()[0] == (3 * 394.6 + 1020.0 * 394.6 / 950.0) / cores


def test_before_any_long_build_ends_the_quick_modules_builds_scale_the_declared_costs() -> None:
    """fi-jit declares 14 CPU-s per target for vllm_comm and 950 for trtllm_comm; this host built vllm_comm
    (the quick module, in `provision build`) at 7 per target, so trtllm_comm's prior is halved."""
    todo = [kernels.Job("a", "trtllm_comm", ("9.0a", "12.0a"), "0.7.4", "13.0", 1900.0)]
    progress = kernels.StageProgress(todo, 1, {"vllm_comm": 7.0})
    seconds, basis = progress.left_s()
    cores = max(1, min(2, __import__("os").cpu_count() or 1))
    assert seconds == 950.0 / cores
    assert basis == "by fi-jit's declared build costs x0.50 as this host's builds of vllm_comm ran"


def test_learned_costs_come_from_this_hosts_records(tmp_path: Path) -> None:
    """Read by the one build-record reader: each cell's records (an image's and a venv cell's), a venv cell's
    build.json once, a row of another shape and any other JSON file of the folder left out."""
    for cid, cpu, name in (("a", 300.0, "build.json"), ("b", 500.0, "build-venv.json"), ("c", 100.0, "build.json")):
        (tmp_path / cid).mkdir()
        (tmp_path / cid / name).write_text(json.dumps({"backend": "venv" if cid == "c" else "docker",
                                                       "kernels": {"modules": {
            "moe_a2a": {"carried": True, "compile_cpu_s": cpu, "targets": 2},
            "vllm_comm": {"carried": True},  # reused: no CPU recorded, nothing learned
            "trtllm_comm": {"compile_cpu_s": "9", "targets": True}}}}))  # not numbers: left out
    (tmp_path / "a" / "cell.json").write_text(json.dumps({"kernels": {"modules": {
        "moe_a2a": {"compile_cpu_s": 10_000.0, "targets": 1}}}}))  # not a build record
    assert kernels.learned_costs(tmp_path) == {"moe_a2a": 150.0}


def test_provision_build_carries_the_quick_module_then_starts_the_long_stage_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel part of `provision build` on a venv cell of this environment (no flashinfer here, so each
    build says so fast): the quick module in the command, the long modules in a stage of their own; a second
    build of the unchanged cell starts no stage (every long module's answer is kept) and `checks run` has
    nothing to wait for."""
    from types import SimpleNamespace

    from common.resolve import RESOLVED
    from provision import buildsession
    from provision.options import BuildOptions

    monkeypatch.setattr(kernelstage, "FOLDER", tmp_path / "state")
    monkeypatch.setattr(kernels.jobs, "KERNELS", tmp_path / "kernels")
    monkeypatch.setenv("STACKPROBE_COMPILE_CACHE", str(tmp_path / "cache"))
    envs = tmp_path / "envs"
    (envs / "cellx").mkdir(parents=True)
    rec = {"cell_id": "cellx", "status": "built", "backend": backend.VENV, "python": sys.executable,
           "base_python": sys.executable, "versions": {"flashinfer": "0.7.4", "torch_cuda": "13.0"}}
    record_file = envs / "cellx" / backend.RECORD_NAMES[backend.VENV]
    record_file.write_text(json.dumps(rec))
    opts = BuildOptions(tmp_path / "matrix.yaml", envs=envs, kernel_archs=("9.0a",), kernel_jobs=1)
    cells = [SimpleNamespace(cell_id="cellx", status=RESOLVED)]
    said: list[str] = []
    monkeypatch.setattr(buildsession, "reporter", lambda o: lambda cid, msg: said.append(msg))
    out = buildsession.carry_kernels(cells, [rec], opts, None)  # type: ignore[arg-type]
    assert out[0]["kernels"]["modules"]["vllm_comm"]["reason_code"] == "fi-jit-error"  # the quick part, here
    assert [m for m in said if m.startswith("kernels: [1/1] vllm_comm for 9.0a")]
    started = [m for m in said if "go on after this command" in m]
    assert started and started[0].startswith("kernels: 4 build(s) of the long modules")
    assert kernelstage.wait(said.append, poll_s=0.2)  # what `checks run` does before its full level
    after = json.loads(record_file.read_text())
    assert sorted(after["kernels"]["modules"]) == sorted(kernels.QUICK_MODULES + kernels.LONG_MODULES)
    # the next `provision build`: the cell unchanged, every answer kept, so nothing is started
    said.clear()
    again = buildsession.carry_kernels(cells, [{**after, "status": "skipped-unchanged"}], opts, None)  # type: ignore[arg-type]
    assert not [m for m in said if "go on after this command" in m or m.startswith("kernels: [")], said
    assert any("nothing more to build" in m for m in said) and kernelstage.running() is None
    assert again[0]["kernels"]["modules"]["trtllm_comm"]["carried"] is False


BEHIND_PROBE = ("import json, os, sys; os.nice(int(sys.argv[1])); from provision.kernels.carriers import behind; "
                "print(json.dumps([os.nice(0), behind()]))")


def _behind(nice: int) -> tuple[int, list[str]]:
    out = subprocess.run([sys.executable, "-c", BEHIND_PROBE, str(nice)], capture_output=True, text=True,
                         timeout=120, cwd=Path(__file__).resolve().parent.parent, check=True)
    level, opts = json.loads(out.stdout)
    return level, opts


def test_a_build_container_started_by_a_niced_stage_asks_for_the_lowest_cpu_weight() -> None:
    """The detached stage runs niced; its containers do not inherit that, so `docker run` is given cpu shares of 2
    (of Docker's default 1024) there, and nothing in a process that is not niced (the quick modules' builds,
    which `provision build` waits for)."""
    level, opts = _behind(10)
    assert level >= 10 and opts == ["--cpu-shares", "2"]
    level, opts = _behind(0)
    assert opts == ([] if level == 0 else ["--cpu-shares", "2"])


@pytest.mark.docker
def test_a_container_given_the_behind_options_gets_that_cpu_weight(base_image: str, container_sweep: str) -> None:
    """What the options do in a real container: the daemon holds the low weight for it (HostConfig.CpuShares 2),
    and where its cgroup's CPU weight can be read inside it, that is the low one (cgroup v1 cpu.shares 2; cgroup v2
    cpu.weight 1, Docker's mapping of 2 shares)."""
    from provision.dockercli import Docker

    level, opts = _behind(10)
    assert opts
    cli = Docker().cli
    script = "cat /sys/fs/cgroup/cpu/cpu.shares 2>/dev/null || cat /sys/fs/cgroup/cpu.weight 2>/dev/null || echo none"
    made = subprocess.run([cli, "create", *opts, "--label", container_sweep, "--network", "none", base_image, "sh",
                           "-c", script], capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    cid = made.stdout.strip()
    try:
        shares = subprocess.run([cli, "inspect", "-f", "{{.HostConfig.CpuShares}}", cid], capture_output=True,
                                text=True, timeout=60)
        assert shares.stdout.strip() == "2", shares.stdout + shares.stderr
        ran = subprocess.run([cli, "start", "-a", cid], capture_output=True, text=True, timeout=120)
        assert ran.returncode == 0, ran.stderr
        assert ran.stdout.strip() in ("2", "1", "none"), ran.stdout
    finally:
        subprocess.run([cli, "rm", "-f", cid], capture_output=True, timeout=120)


@pytest.mark.docker
def test_a_running_build_containers_cpu_is_counted_while_it_runs(tmp_path: Path, base_image: str,
                                                                 container_sweep: str) -> None:
    """A real container spinning on one core: the Docker carrier's reading of its cgroup grows while it runs
    (a kernel build in a container is not this process's child, so /proc's tree holds none of its CPU)."""
    import subprocess
    import time

    from provision.dockercli import Docker

    cidfile = tmp_path / "cid"
    cli = Docker().cli
    started = subprocess.run([cli, "run", "-d", "--rm", "--cidfile", str(cidfile), "--label", container_sweep,
                              "--network", "none", base_image, "sh", "-c", "while :; do :; done"],
                             capture_output=True, text=True, timeout=120)
    assert started.returncode == 0, started.stderr
    try:
        carrier = kernels.DockerCarrier({"cell_id": "c"}, None, Docker(), running={"moe_a2a": cidfile})
        first = carrier.running_cpu_s()
        time.sleep(1.5)
        later = carrier.running_cpu_s()
        assert first is not None and later is not None, "the container's cgroup could not be read"
        assert later - first >= 0.5, (first, later)
    finally:
        subprocess.run([cli, "rm", "-f", cidfile.read_text().strip()], capture_output=True, timeout=120)


def test_the_time_left_grows_while_a_running_build_overruns_and_never_jumps_when_it_ends() -> None:
    """Two builds declared at 100 CPU-s each, the first running alone on the stage's CPU readings: below its
    estimate the time left falls by what it spends; past it, the build counts a quarter of what it has spent as
    still to come and scales the other's declared cost by spent / estimate, so the figure grows as it overruns
    and its end moves the other's estimate by nothing (the same spent / estimate, now measured)."""
    todo = [kernels.Job("a", "trtllm_comm", ("9.0a",), "0.7.4", "13.0", 100.0),
            kernels.Job("a", "moe_a2a", ("9.0a",), "0.7.4", "13.0", 100.0)]
    cores = max(1, min(2, __import__("os").cpu_count() or 1))
    readings = iter([40.0, 100.0, 200.0, 300.0])
    progress = kernels.StageProgress(todo, 1, {}, live=lambda: next(readings))
    progress.cpu0 = float("inf")  # the stage's CPU is what the readings say (no process tree of ours here)
    progress.begin(todo[0])
    left = [progress.left_s(progress.live())[0] * cores for _ in range(4)]
    assert left == [60.0 + 100.0,  # 40 of 100 spent; the other as declared
                    0.0 + 100.0,  # at its estimate
                    0.25 * 200.0 + 100.0 * 2.0,  # twice its estimate: 50 to come, the other scaled x2
                    0.25 * 300.0 + 100.0 * 3.0]
    assert left[3] > left[2] > left[1]
    progress.end(todo[0])
    progress.spent(300.0, todo[0])
    after, basis = progress.left_s(0.0)
    assert after * cores == 100.0 * 3.0  # the same scale as the reading before it ended: no jump
    assert basis == "by fi-jit's declared build costs x3.00 as this stage's finished builds ran"


# --- the stage's state is untrusted; one stage per folder; a stopped stage stops its builds ---------------------
def _raw(lines: list[str]) -> list[str]:
    return [line for line in lines if any(c in line for c in "\x1b\x07\x9b\u202e\u200b\r")]


def test_every_log_line_reaches_the_terminal_escaped(tmp_path: Path) -> None:
    log = tmp_path / kernelstage.LOG
    log.write_text("")
    script = (f"import time\nlog = open({str(log)!r}, 'a')\n"
              "log.write('c kernels: \\x1b]0;owned\\x07\\x1b[2J\\u202eevil\\u200b done\\rX\\u2028Y\\r\\n')\n"
              "log.flush()\n"
              "time.sleep(1.0)\n")
    proc = _stand_in(tmp_path, script)
    kernelstage.write_state(kernelstage.Stage(proc.pid, time.time(), log, 1), tmp_path)
    said: list[str] = []
    assert kernelstage.wait(said.append, tmp_path, poll_s=0.1)
    proc.wait()
    assert _raw(said) == []
    assert "c kernels: \\x1b]0;owned\\x07\\x1b[2J\\u202eevil\\u200b done\\rX\\u2028Y" in said, said


@pytest.mark.parametrize("kind", ["fifo", "device", "system-device", "link", "outside", "folder"])
def test_a_log_that_is_not_a_regular_file_of_the_folder_is_refused_with_one_line_never_read(
        tmp_path: Path, kind: str) -> None:
    folder = tmp_path / "kernels"
    folder.mkdir()
    log = folder / kernelstage.LOG
    if kind == "fifo":  # a reader would block on it for ever
        os.mkfifo(log)
    elif kind == "device":  # a device would fill the terminal (here: /dev/zero's)
        try:
            os.mknod(log, stat.S_IFCHR | 0o600, os.makedev(1, 5))
        except PermissionError:
            pytest.skip("making a device file needs CAP_MKNOD")
    elif kind == "link":
        (tmp_path / "secret").write_text("\x1b[2Jsecret\n")
        log.symlink_to(tmp_path / "secret")
    elif kind == "system-device":  # a terminal-filling device named where it is
        log = Path("/dev/zero")
    elif kind == "outside":
        log = tmp_path / "elsewhere.log"
        log.write_text("elsewhere\n")
    elif kind == "folder":
        log.mkdir()
    proc = _stand_in(folder, "import time; time.sleep(30)")
    try:
        kernelstage.write_state(kernelstage.Stage(proc.pid, time.time(), log, 1), folder)
        said: list[str] = []
        done = threading.Event()

        def waiter() -> None:
            said.append(str(kernelstage.wait(said.append, folder, poll_s=0.1)))
            done.set()

        threading.Thread(target=waiter, daemon=True).start()
        assert done.wait(10), "the wait blocked"
        assert kernelstage.running(folder) is None
    finally:
        proc.kill()
        proc.wait()
    [line, returned] = said
    assert returned == "False"
    want = {"fifo": "is a FIFO", "device": "is a device", "system-device": f"is not in {folder}", "link": "is a link",
            "outside": f"is not in {folder}", "folder": "is not a regular file"}[kind]
    assert line.startswith(f"{kernelstage.state_path(folder)}: its log {log} {want}; not read"), line
    assert "\n" not in line and "secret" not in line and "elsewhere\n" not in line


def test_a_state_naming_a_stage_of_another_folder_or_odd_values_is_no_stage(tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    proc = _stand_in(other, "import time; time.sleep(30)")  # a live stage, of another checkout's folder
    try:
        log = tmp_path / kernelstage.LOG
        log.write_text("")
        kernelstage.write_state(kernelstage.Stage(proc.pid, time.time(), log, 1), tmp_path)
        assert kernelstage.running(tmp_path) is None
        for bad in ({"pid": True, "started": 1.0, "log": str(log)}, {"pid": str(proc.pid), "started": 1, "log": "x"},
                    {"pid": proc.pid, "started": "now", "log": str(log)}, {"pid": proc.pid, "started": 1.0,
                    "log": ["x"]}, [proc.pid], {"pid": -1, "started": 1.0, "log": str(log)}):
            kernelstage.state_path(tmp_path).write_text(json.dumps(bad))
            assert kernelstage.stage_of(tmp_path) is None, bad
        kernelstage.state_path(tmp_path).unlink()
        kernelstage.state_path(tmp_path).symlink_to(other / "state.json")  # a linked state file is not read
        (other / "state.json").write_text(json.dumps({"pid": proc.pid, "started": 1.0, "log": str(log)}))
        assert kernelstage.stage_of(tmp_path) is None
    finally:
        proc.kill()
        proc.wait()


def test_a_second_start_while_a_stage_holds_the_lock_writes_nothing(tmp_path: Path) -> None:
    folder = tmp_path / "state"
    folder.mkdir()
    (folder / kernelstage.LOG).write_text("the running stage's lines\n")
    lock = kernelstage.take_lock(folder)
    try:
        with pytest.raises(kernelstage.StageBusy):
            kernels.start({"cells": [], "builds": 0}, folder)
        assert (folder / kernelstage.LOG).read_text() == "the running stage's lines\n"  # not truncated
        assert not kernelstage.job_path(folder).exists() and not kernelstage.state_path(folder).exists()
        assert kernelstage.locked(folder)
    finally:
        os.close(lock)
    assert not kernelstage.locked(folder)


def test_two_builds_at_once_run_one_stage_after_the_other_and_say_so(tmp_path: Path) -> None:
    """The first build's stage holds the lock for its life (a stand-in that inherits it, as the real one does);
    the second build says it waits, shows the first stage's lines, then starts its own with its own log."""
    from provision import buildsession

    folder = tmp_path / "state"
    lock = kernelstage.take_lock(folder)
    log = folder / kernelstage.LOG
    log.write_text("")
    script = f"import time\nlog = open({str(log)!r}, 'a')\nlog.write('first stage: building\\n')\nlog.flush()\n" \
             "time.sleep(2)\n"
    first = _stand_in(folder, script, pass_fds=(lock,))
    kernelstage.write_state(kernelstage.Stage(first.pid, time.time(), log, 1), folder)
    os.close(lock)  # the first stage holds it now
    envs = tmp_path / "envs"
    envs.mkdir()
    said: list[str] = []
    stage = buildsession.start_stage({"cells": [], "backend": backend.VENV, "jobs": 1, "envs": str(envs),
                                      "archs": {}, "modules": [], "builds": 0}, said.append, folder)
    assert first.poll() is not None  # the second started only once the first had ended
    assert said[0] == "kernels: another `provision build` runs the kernel stage; waiting for it before starting " \
                      "this one's"
    assert said[1].startswith(f"waiting for the kernel stage `provision build` started (pid {first.pid}")
    assert "first stage: building" in said
    assert stage.pid != first.pid and kernelstage.wait(said.append, folder, poll_s=0.1)
    assert "first stage: building" not in log.read_text()  # the second stage's own log
    assert not kernelstage.locked(folder)  # released when the second stage ended


STOPPING_PROBE = """
import json, sys
from pathlib import Path
from provision.kernels import carriers
from provision.kernels.jobs import Job

class NoDocker:
    def run(self, *args, **kw):
        raise AssertionError(f"docker {args[0]} after the stage stopped")

first = carriers.register(Path("/nonexistent/cid-1"), NoDocker())
given = [str(c) for c, _ in carriers.stopping()]
later = carriers.register(Path("/nonexistent/cid-2"), NoDocker())
carrier = carriers.DockerCarrier({"cell_id": "c", "tag": "t"}, None, NoDocker())
out = carrier.compile(Job("c", "moe_a2a", ("9.0a",), "0.7.4", "13.0", 1.0), Path(sys.argv[1]))
print(json.dumps([first, given, later, out]))
"""


def test_once_the_stage_is_stopping_no_build_container_starts(tmp_path: Path) -> None:
    """A worker whose build the stop killed goes on to its next job: from the moment the stage stops, entering a
    build refuses and the Docker carrier answers without running docker; what was entered before is given to
    the stop to kill."""
    got = subprocess.run([sys.executable, "-c", STOPPING_PROBE, str(tmp_path / "out")], capture_output=True,
                         text=True, timeout=120, cwd=Path(__file__).resolve().parent.parent)
    assert got.returncode == 0, got.stderr
    first, given, later, out = json.loads(got.stdout)
    assert first is True and given == ["/nonexistent/cid-1"] and later is False
    assert out["ok"] is False and out["line"] == "the kernel stage was stopped"


@pytest.mark.docker
def test_a_stopped_stage_removes_its_labelled_build_containers_running_or_never_started(
        base_image: str, container_sweep: str) -> None:
    """The stop's last sweep: a running build container and one created but never started (its `docker run` was
    killed between create and start), both labelled as this process's stage, are removed; another stage's
    container (another pid in the label) is left alone."""
    from provision.dockercli import Docker
    from provision.kernels import detached
    from provision.kernels.carriers import STAGE_LABEL, stage_label

    cli = Docker().cli
    common = ["--label", container_sweep, "--network", "none", base_image, "sleep", "300"]
    ours = [subprocess.run([cli, verb, *(["-d"] if verb == "run" else []), "--label", stage_label(), *common],
                           capture_output=True, text=True, timeout=120) for verb in ("run", "create")]
    other = subprocess.run([cli, "create", "--label", f"{STAGE_LABEL}=1", *common], capture_output=True, text=True,
                           timeout=120)
    assert all(r.returncode == 0 for r in (*ours, other)), [r.stderr for r in (*ours, other)]
    try:
        assert detached.sweep(Docker()) == 2
        left = subprocess.run([cli, "ps", "-aq", "--filter", f"label={stage_label()}"], capture_output=True,
                              text=True, timeout=60).stdout.split()
        assert left == []
        assert subprocess.run([cli, "inspect", other.stdout.strip()], capture_output=True, timeout=60).returncode == 0
    finally:
        subprocess.run([cli, "rm", "-f", other.stdout.strip(), *(r.stdout.strip() for r in ours)],
                       capture_output=True, timeout=120)


STAND_IN_PYTHON = """#!/bin/sh
# A cell interpreter whose every build is a process tree that runs on: a compiler in the build's group, one in a
# session of its own, and a grandchild of each.
sh -c 'sleep 300 & exec sleep 301' &
setsid sh -c 'sleep 302 & exec sleep 303' &
echo started >> "$STAND_IN_MARK"
wait
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_stage_stops_every_build_and_compiler_it_started(tmp_path: Path, sig: signal.Signals) -> None:
    from inenv import lifetime

    python = tmp_path / "python"
    python.write_text(STAND_IN_PYTHON)
    python.chmod(0o755)
    mark = tmp_path / "mark"
    envs = tmp_path / "envs"
    (envs / "cellx").mkdir(parents=True)
    rec = {"cell_id": "cellx", "status": "built", "backend": backend.VENV, "python": str(python),
           "base_python": str(python), "versions": {"flashinfer": "0.7.4", "torch_cuda": "13.0"}}
    (envs / "cellx" / backend.RECORD_NAMES[backend.VENV]).write_text(json.dumps(rec))
    job = {"cells": ["cellx"], "backend": backend.VENV, "jobs": 1, "envs": str(envs), "archs": {"cellx": ["9.0a"]},
           "modules": ["moe_a2a"], "builds": 1, "kernels_root": str(tmp_path / "kernels"),
           "cache": str(tmp_path / "cache")}
    os.environ["STAND_IN_MARK"] = str(mark)
    try:
        stage = kernels.start(job, tmp_path / "state")
    finally:
        del os.environ["STAND_IN_MARK"]
    deadline = time.monotonic() + 60
    tree: set[int] = set()
    try:
        while time.monotonic() < deadline and len(tree) < 5:  # the interpreter and two shells, each with a child
            time.sleep(0.2)
            tree = lifetime.below(stage.pid)
        assert len(tree) >= 5, tree
        os.kill(stage.pid, sig)
        deadline = time.monotonic() + 30
        # the stage clears its state file before its process ends and lets the folder's lock go
        while time.monotonic() < deadline and (kernelstage.running(tmp_path / "state") or _live(tree | {stage.pid})):
            time.sleep(0.2)
        assert _live(tree) == set(), "builds outlived their stopped stage"
        assert _live({stage.pid}) == set(), "the stopped stage did not end"
    finally:  # whatever the outcome, nothing of this test runs on
        for pid in _live(tree | {stage.pid}):
            os.kill(pid, signal.SIGKILL)
    assert not kernelstage.state_path(tmp_path / "state").exists()
    assert not kernelstage.locked(tmp_path / "state")
    text = (tmp_path / "state" / kernelstage.LOG).read_text()
    assert f"kernels: the stage was stopped ({sig.name}): " in text, text


def _live(pids: set[int]) -> set[int]:
    out = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(") ", 1)[1].startswith("Z"):
                    continue
        except OSError:
            continue
        out.add(pid)
    return out

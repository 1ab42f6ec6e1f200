"""The provision command line as a newcomer meets it: `provision doctor` on recorded machine states, a
mistyped option answered with the usage of its own subcommand, a mistyped version answered with the
version meant."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest

from common.errors import suggest
from provision import doctor
from tests.checks_helpers import ROOT

GB = doctor.GB
# recorded from real machines
NO_DAEMON = "Cannot connect to the Docker daemon at unix:///var/run/docker.sock. Is the docker daemon running?"
DENIED = ("permission denied while trying to connect to the Docker daemon socket at unix:///var/run/docker.sock: "
          "Get \"http://%2Fvar%2Frun%2Fdocker.sock/v1.24/info\": dial unix /var/run/docker.sock: connect: "
          "permission denied")
NO_GPU_DRIVER = 'docker: Error response from daemon: could not select device driver "" with capabilities: [[gpu]].'
MEMLOCK = ("docker: Error response from daemon: failed to create shim task: OCI runtime create failed: runc create "
           "failed: unable to start container process: error during container init: error setting rlimits for ready "
           "process: error setting rlimit type 8: operation not permitted: unknown.")
READY = doctor.Facts(docker_cli="/usr/bin/docker", daemon_version="20.10.24", buildkit=True,
                     docker_root="/var/lib/docker", free_bytes=200 * GB, debootstrap="/usr/sbin/debootstrap",
                     torch_stacks=2, cells_to_build=5, cells_total=5, gpus=2, runtimes=("nvidia", "runc"),
                     probe_image="stackprobe/base:bookworm", gpu_in_container="", memlock_in_container="",
                     uv="/usr/local/bin/uv (uv 0.13.9)", cc="/usr/bin/gcc", venv_root="/root/.cache/uv",
                     venv_free_bytes=100 * GB, venv_torch_stacks=2, venv_cells_to_build=5)
# a 2-core Debian VM with uv and gcc, a docker CLI and no daemon, nothing built yet (the default matrix)
NO_DOCKER = doctor.Facts(docker_cli="/usr/bin/docker", daemon_error=NO_DAEMON, uv="/usr/local/bin/uv (uv 0.13.9)",
                         cc="/usr/bin/gcc", venv_root="/root/.cache/uv", venv_free_bytes=67 * GB, cells_total=5,
                         venv_torch_stacks=3, venv_cells_to_build=5, gpu_error="nvidia-smi not found")


def by_name(facts: doctor.Facts) -> dict[str, doctor.Check]:
    return {c.name: c for c in doctor.diagnose(facts)}


def test_doctor_on_a_ready_gpu_host_says_ready() -> None:
    checks = doctor.diagnose(READY)
    assert {c.status for c in checks} == {"ok"} and doctor.exit_code(checks) == 0
    docker_disk = next(c for c in checks if c.name == "disk" and c.backend == "docker")
    assert docker_disk.detail == ("200 GB free under /var/lib/docker; 5 of 5 cells still to build (2 torch "
                                  "build(s) of 5.5 GB + 1 GB per cell) need about 17 GB")
    assert doctor.auto_backend(READY) == ("docker", "a Docker daemon answers (version 20.10.24)")
    lines = doctor.report(checks, *doctor.auto_backend(READY))
    assert lines[-2:] == ["`--backend auto` builds Docker images here: a Docker daemon answers (version 20.10.24)",
                          "ready: `uv run provision build && uv run checks run --all` (Docker images)"]


def test_doctor_without_a_docker_daemon_names_venv_cells_and_exits_0() -> None:
    """Docker's missing engine and debootstrap are information when `auto` builds venv cells."""
    checks = doctor.diagnose(NO_DOCKER)
    status = {(c.backend, c.name): c.status for c in checks}
    assert status[("docker", "Docker engine")] == "FAIL" and status[("docker", "debootstrap")] == "FAIL"
    assert status[("venv", "uv")] == status[("venv", "C compiler")] == status[("venv", "disk")] == "ok"
    backend, why = doctor.auto_backend(NO_DOCKER)
    assert (backend, why) == ("venv", f"no Docker daemon answers ({NO_DAEMON})")
    assert doctor.exit_code(checks, "venv") == 0 and doctor.exit_code(checks, "docker") == 1
    lines = doctor.report(checks, backend, why)
    assert lines[0] == "Docker images (--backend docker):"
    assert "venv cells, virtual environments (--backend venv):" in lines
    assert lines[-2] == f"`--backend auto` builds venv cells here: no Docker daemon answers ({NO_DAEMON})"
    assert lines[-1] == ("ready: `uv run provision build && uv run checks run --all` (venv cells); the 2 FAIL(s) under "
                         "Docker images (--backend docker) matter only for --backend docker")
    venv_disk = next(c for c in checks if c.name == "disk" and c.backend == "venv")
    assert venv_disk.detail.startswith("67 GB free under /root/.cache/uv; 5 of 5 cells still to build (3 torch "
                                       "build(s) of 5.5 GB + 0.6 GB per cell")
    assert venv_disk.detail.endswith("need about 20 GB")  # 3 x 5.5 + 5 x 0.6 = 19.5 GB; measured 18.5 GB
    got = doctor.to_json(checks, backend, why)
    assert got["backend"] == "venv" and got["ready"] is True
    assert {"backend": "venv", "name": "uv", "status": "ok", "detail": "/usr/local/bin/uv (uv 0.13.9) (locks the cells "
            "and installs them from its cache)", "fix": ""} in got["checks"]


@pytest.mark.parametrize(("facts", "backend", "name", "status", "code", "fix"), [
    (replace(NO_DOCKER, uv=None), "venv", "uv", "FAIL", 1, "install uv"),
    (replace(NO_DOCKER, cc=None), "venv", "C compiler", "warn", 0, "apt-get install gcc"),
    (replace(NO_DOCKER, venv_free_bytes=12 * GB), "venv", "disk", "FAIL", 1, "provision prune"),
    (replace(NO_DOCKER, venv_free_bytes=25 * GB), "venv", "disk", "warn", 0, ""),
    (replace(READY, uv=None), "docker", "uv", "FAIL", 0, "install uv"),  # Docker builds: uv's absence is information
    (replace(READY, venv_free_bytes=1 * GB), "docker", "disk", "FAIL", 0, "uv cache prune"),
])
def test_doctor_fails_only_on_what_the_backend_it_uses_lacks(facts: doctor.Facts, backend: str, name: str,
                                                             status: str, code: int, fix: str) -> None:
    checks = doctor.diagnose(facts)
    assert doctor.auto_backend(facts)[0] == backend
    check = next(c for c in checks if c.name == name and c.backend == "venv")
    assert check.status == status and fix in check.fix
    assert doctor.exit_code(checks, backend) == code


@pytest.mark.parametrize(("facts", "name", "status", "detail", "fix"), [
    (doctor.Facts(), "docker CLI", "FAIL", "not found", "apt-get install docker.io"),
    (doctor.Facts(docker_cli="/usr/bin/docker", daemon_error=NO_DAEMON), "Docker engine", "FAIL",
     "Is the docker daemon running?", "systemctl start docker"),
    (doctor.Facts(docker_cli="/usr/bin/docker", daemon_error=DENIED), "Docker engine", "FAIL", "permission denied",
     "usermod -aG docker"),
    (replace(READY, buildkit=False), "BuildKit", "warn", "without the host's CA bundle", "buildx"),
    (replace(READY, debootstrap=None), "debootstrap", "FAIL", "not found", "apt-get install debootstrap"),
    (replace(READY, base_images=("stackprobe/base:bookworm-20aff611",), debootstrap=None), "debootstrap",
     "ok", "not needed now", ""),
    (replace(READY, apt_mirror_error="no Debian mirror in /etc/apt/sources.list(.d): configure apt first"),
     "debootstrap", "FAIL", "no Debian mirror", "sources.list"),
    (replace(READY, free_bytes=12 * GB), "disk", "FAIL", "12 GB free", "docker builder prune"),
    (replace(READY, free_bytes=20 * GB), "disk", "warn", "little room left", ""),
    (replace(READY, runtimes=("runc",), gpu_in_container=None), "GPUs in containers", "FAIL",
     "no NVIDIA runtime or CDI spec", "nvidia-ctk runtime configure"),
    (replace(READY, gpu_in_container=doctor._daemon_error(NO_GPU_DRIVER)), "GPUs in containers", "FAIL",
     'could not select device driver "" with capabilities: [[gpu]]', "NVIDIA Container Toolkit"),
    (replace(READY, gpu_in_container=None, probe_image=None), "GPUs in containers", "info",
     "not tried (no local image yet)", ""),
    (replace(READY, gpus=0, gpu_error="nvidia-smi not found"), "GPUs", "info", "GPU probes will skip", ""),
    (replace(READY, memlock_in_container=doctor._daemon_error(MEMLOCK)), "memlock in containers", "warn",
     "refused (error setting rlimits for ready process: error setting rlimit type 8: operation not permitted)",
     "--ulimit memlock=-1"),
])
def test_doctor_names_each_missing_prerequisite_and_its_fix(facts: doctor.Facts, name: str, status: str,
                                                            detail: str, fix: str) -> None:
    checks = doctor.diagnose(facts)
    check = next(c for c in checks if c.name == name)  # Docker's disk before the venv cells'
    assert check.status == status and detail in check.detail and fix in check.fix
    assert doctor.exit_code(checks) == (1 if any(c.status == "FAIL" for c in checks) else 0)
    if status == "FAIL":
        assert doctor.report(checks)[-1].endswith("to fix before `provision build`")


def test_doctor_runs_here_and_exits_0_when_the_backend_auto_takes_can_build() -> None:
    p = subprocess.run([sys.executable, "-m", "provision.cli", "doctor"], capture_output=True, text=True, cwd=ROOT,
                       timeout=300)
    assert p.returncode in (0, 1), p.stderr
    lines = p.stdout.splitlines()
    assert lines[0] == "Docker images (--backend docker):" and lines[1].split()[1:3] == ["docker", "CLI"]
    assert "venv cells, virtual environments (--backend venv):" in lines
    assert lines[-2].startswith(("`--backend auto` builds Docker images here: a Docker daemon answers",
                                 "`--backend auto` builds venv cells here: no Docker daemon answers"))
    assert lines[-1].startswith("ready:" if p.returncode == 0 else tuple(f"{n} problem" for n in range(1, 9)))
    j = subprocess.run([sys.executable, "-m", "provision.cli", "doctor", "--json"], capture_output=True, text=True,
                       cwd=ROOT, timeout=300)
    got = json.loads(j.stdout)
    assert j.returncode == p.returncode and got["ready"] is (p.returncode == 0)
    assert got["backend"] == ("docker" if "builds Docker images" in lines[-2] else "venv")
    failed = {(c["backend"], c["name"]) for c in got["checks"] if c["status"] == "FAIL"}
    assert bool({(b, n) for b, n in failed if b in ("host", got["backend"])}) is (p.returncode == 1)


def test_a_mistyped_option_gets_the_usage_of_its_subcommand_and_the_option_meant() -> None:
    p = subprocess.run([sys.executable, "-m", "provision.cli", "build", "--dryrun"], capture_output=True, text=True,
                       cwd=ROOT)
    assert p.returncode == 2
    assert p.stderr.startswith("usage: provision build ")
    assert p.stderr.strip().endswith("provision build: error: unrecognized arguments: --dryrun "
                                     "(did you mean '--dry-run'?)")


def test_a_version_typed_with_a_letter_o_suggests_the_version_meant() -> None:
    cuda = ["12.6", "12.8", "12.9", "13.0", "13.2"]
    assert suggest("13.O", cuda) == " (did you mean '13.0'?)"
    assert suggest("12.7", cuda) == " (did you mean '12.8'?)"  # as near in spelling and number: the newer
    assert suggest("nigthly", ["stable", "nightly"]) == " (did you mean 'nightly'?)"
    assert suggest("xyz", ["stable", "nightly"]) == ""
    p = subprocess.run([sys.executable, "-m", "provision.cli", "plan", "--no-reach-check", "--cuda", "13.O"],
                       capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 2 and "no cell matches --cuda 13.O (did you mean '13.0'?)" in p.stderr


def test_prune_refuses_an_empty_matrix_name_in_one_line() -> None:
    p = subprocess.run([sys.executable, "-m", "provision.cli", "prune", "--matrix=", "--dry-run"],
                       capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        "provision: --matrix '': give a matrix file whose cells stay, or leave the option out"]


def test_the_reach_check_flag_says_what_it_skips_and_the_earlier_name_still_works() -> None:
    helped = subprocess.run([sys.executable, "-m", "provision.cli", "plan", "--help"], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout
    assert "--no-reach-check" in helped and "--offline" not in helped
    assert "still use the network" in " ".join(helped.split())
    plans = [subprocess.run([sys.executable, "-m", "provision.cli", "plan", flag, "--json"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout for flag in ("--no-reach-check",
                                                                                            "--offline")]
    assert plans[0] == plans[1] and json.loads(plans[0])

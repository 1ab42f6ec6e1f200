"""The provision command line as a newcomer meets it: `provision doctor` on recorded machine states, a
mistyped option answered with the usage of its own subcommand, a mistyped version answered with the
version meant."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest

from provision import doctor
from provision.errors import suggest
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
                     probe_image="stackprobe/base:bookworm", gpu_in_container="", memlock_in_container="")


def by_name(facts: doctor.Facts) -> dict[str, doctor.Check]:
    return {c.name: c for c in doctor.diagnose(facts)}


def test_doctor_on_a_ready_gpu_host_says_ready() -> None:
    checks = doctor.diagnose(READY)
    assert {c.status for c in checks} == {"ok"} and doctor.exit_code(checks) == 0
    assert by_name(READY)["disk"].detail == ("200 GB free under /var/lib/docker; 5 of 5 cells still to build (2 torch "
                                             "build(s) of 6 GB + 3 GB per cell) need about 28 GB")
    assert doctor.report(checks)[-1] == "ready: `uv run provision build && uv run checks run --all`"


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
    (replace(READY, free_bytes=27 * GB), "disk", "FAIL", "27 GB free", "docker builder prune"),
    (replace(READY, free_bytes=40 * GB), "disk", "warn", "little room left", ""),
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
    check = {c.name: c for c in checks}[name]
    assert check.status == status and detail in check.detail and fix in check.fix
    assert doctor.exit_code(checks) == (1 if any(c.status == "FAIL" for c in checks) else 0)
    if status == "FAIL":
        assert doctor.report(checks)[-1].endswith("to fix before `provision build`")


def test_doctor_runs_here_and_exits_0_or_1() -> None:
    p = subprocess.run([sys.executable, "-m", "provision.cli", "doctor"], capture_output=True, text=True, cwd=ROOT,
                       timeout=300)
    assert p.returncode in (0, 1), p.stderr
    names = [ln.split()[1] for ln in p.stdout.splitlines()[:2]]
    assert names == ["docker", "docker"] or names[0] == "docker"
    assert p.stdout.splitlines()[-1].startswith(("ready:", "1 problem", "2 problem", "3 problem"))


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
    p = subprocess.run([sys.executable, "-m", "provision.cli", "plan", "--offline", "--cuda", "13.O"],
                       capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 2 and "no cell matches --cuda 13.O (did you mean '13.0'?)" in p.stderr

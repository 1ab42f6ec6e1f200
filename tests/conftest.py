"""Shared fixtures. Docker tests skip only when Docker is truly absent, and fail instead when
STACKPROBE_REQUIRE_DOCKER=1 (set by .ci/run)."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

REQUIRE_DOCKER = os.environ.get("STACKPROBE_REQUIRE_DOCKER") == "1"


def docker_cli() -> str:
    """Debian's CLI speaks BuildKit (DOCKER_BUILDKIT=1); prefer it over a newer CLI without buildx."""
    return "/usr/bin/docker" if os.path.exists("/usr/bin/docker") else (shutil.which("docker") or "docker")


def _docker_problem() -> str | None:
    if shutil.which("docker") is None and not os.path.exists("/usr/bin/docker"):
        return "docker CLI not installed"
    proc = subprocess.run([docker_cli(), "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True)
    if proc.returncode != 0:
        return f"Docker daemon not reachable: {proc.stderr.strip()[:200]}"
    return None


def need_docker() -> None:
    problem = _docker_problem()
    if problem is None:
        return
    if REQUIRE_DOCKER:
        pytest.fail(f"STACKPROBE_REQUIRE_DOCKER=1 but {problem}")
    pytest.skip(problem)


@pytest.fixture(scope="session")
def docker_available() -> str:
    need_docker()
    return docker_cli()


@pytest.fixture(scope="session")
def base_image(docker_available: str) -> str:
    """A registry-free Debian base image (debootstrap + docker import), built once and kept."""
    from provision.baseimage import ensure_base

    if shutil.which("debootstrap") is None:
        if REQUIRE_DOCKER:
            pytest.fail("debootstrap missing: apt-get install -y debootstrap")
        pytest.skip("debootstrap missing")
    return ensure_base(docker=docker_available)

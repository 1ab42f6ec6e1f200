"""Shared fixtures. Docker tests skip only when Docker is truly absent, and fail instead when
STACKPROBE_REQUIRE_DOCKER=1 (set by .ci/run)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest

from checks.container import LABELS_ENV

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


def sweep_containers(label: str) -> list[str]:
    """Remove every container carrying ``label`` (KEY=VALUE); the names removed. Nothing when there is no
    docker CLI or no daemon: then no test made a container either."""
    if shutil.which("docker") is None and not os.path.exists("/usr/bin/docker"):
        return []
    try:
        listed = subprocess.run([docker_cli(), "ps", "-a", "--filter", f"label={label}", "--format", "{{.Names}}"],
                                capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return []
    names = listed.stdout.split() if listed.returncode == 0 else []
    if names:
        subprocess.run([docker_cli(), "rm", "-f", *names], capture_output=True, text=True, timeout=300)
    return names


@pytest.fixture(scope="session", autouse=True)
def container_sweep() -> Iterator[str]:
    """Every container this session starts carries its own label (the executor adds the labels in
    STACKPROBE_CONTAINER_LABELS, and the runners tests start inherit it); whatever a failed, interrupted or
    timed-out test left behind is removed when the session ends, and said on stderr. Each xdist worker is
    a session of its own: it sweeps only its own containers, never a concurrent run's."""
    label = f"stackprobe.test-session={uuid.uuid4().hex[:12]}"
    before = os.environ.get(LABELS_ENV)
    os.environ[LABELS_ENV] = label
    try:
        yield label
    finally:
        if before is None:
            os.environ.pop(LABELS_ENV, None)
        else:
            os.environ[LABELS_ENV] = before
        left = sweep_containers(label)
        if left:
            print(f"\nconftest: removed {len(left)} container(s) tests left behind: {', '.join(left)}",
                  file=sys.stderr)

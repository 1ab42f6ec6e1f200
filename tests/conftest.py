"""Shared fixtures. A test that needs a Docker daemon carries the ``docker`` marker (collection refuses one
that asks for a Docker fixture without it); it skips only when Docker is truly absent, and fails instead
when STACKPROBE_REQUIRE_DOCKER=1 (set by .ci/run). Every other test passes on a machine without Docker:
.ci/run runs them once with the daemon hidden (DOCKER_HOST naming no socket) before it starts dockerd."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest

from checks.run.container import LABELS_ENV
from inenv.probe import LEVEL_ENV, QUICK

REQUIRE_DOCKER = os.environ.get("STACKPROBE_REQUIRE_DOCKER") == "1"

# Tests send Ctrl-C (SIGINT) to the runs they start. A test session started in the background by a
# non-interactive shell inherits SIGINT ignored, and an ignored signal stays ignored across exec, so those runs
# would never see it: give this process a handler, which exec resets to the default in every child.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


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


_problem: list[str | None] = []  # asked once per session: a daemon does not come and go within one


def need_docker() -> None:
    if not _problem:
        _problem.append(_docker_problem())
    problem = _problem[0]
    if problem is None:
        return
    if REQUIRE_DOCKER:
        pytest.fail(f"STACKPROBE_REQUIRE_DOCKER=1 but {problem}")
    pytest.skip(problem)


DOCKER_FIXTURES = frozenset({"docker_available", "base_image"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test that uses a Docker fixture must say so with the marker, so `-m "not docker"` is the set of
    tests that pass without a daemon."""
    unmarked = [it.nodeid for it in items if DOCKER_FIXTURES & set(getattr(it, "fixturenames", ()))
                and it.get_closest_marker("docker") is None]
    if unmarked:
        raise pytest.UsageError("these tests use a Docker fixture but lack @pytest.mark.docker: "
                                + ", ".join(unmarked))


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test marked docker skips (or, under STACKPROBE_REQUIRE_DOCKER=1, fails) before it starts when no
    daemon answers, whether or not it asks for a Docker fixture."""
    if item.get_closest_marker("docker") is not None:
        need_docker()


@pytest.fixture(params=["full", "quick"])
def level(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each probe level in turn, as a rank reads it (inenv.probe.LEVEL_ENV)."""
    if request.param == QUICK:
        monkeypatch.setenv(LEVEL_ENV, QUICK)
    else:
        monkeypatch.delenv(LEVEL_ENV, raising=False)
    return str(request.param)


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

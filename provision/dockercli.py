"""The docker CLI as `provision` drives it (build, image inspect, run): one class for every command that builds
or looks at images (build, doctor, prune)."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.errors import InputError

CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
NO_CLI = "docker CLI not found"


def docker_cli() -> str:
    """Debian's CLI speaks BuildKit with DOCKER_BUILDKIT=1; a newer CLI without buildx does not."""
    return "/usr/bin/docker" if os.path.exists("/usr/bin/docker") else (shutil.which("docker") or "docker")


@dataclass
class Docker:
    """The docker CLI; counts build invocations so callers can prove a no-op."""

    cli: str = field(default_factory=docker_cli)
    builds: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self, *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.run([self.cli, *args], capture_output=True, text=True, **kw)

    def check_daemon(self) -> None:
        """InputError saying why Docker cannot build here and how to make it, for `--backend docker`."""
        problem = self.unreachable()
        if problem is None:
            return
        if problem == NO_CLI:
            what, hint = problem, "install Docker (Debian: apt-get install docker.io)"
        else:
            what = f"cannot talk to the Docker daemon ({problem})"
            hint = "run as a member of the docker group" if "permission denied" in problem else "start dockerd"
        raise InputError(f"{what}: {hint}, or leave out --backend docker to build venv cells instead")

    def unreachable(self) -> str | None:
        """Why this CLI cannot build (no CLI, or the daemon's refusal as the CLI prints it), or None when it
        can: the reason alone, no fix."""
        if shutil.which(self.cli) is None and not os.path.exists(self.cli):
            return NO_CLI
        proc = self.run("info", "--format", "{{.ServerVersion}}")
        if proc.returncode != 0:
            return (proc.stderr.strip().splitlines() or ["no answer"])[-1]
        return None

    def buildkit(self) -> bool:
        """BuildKit is reachable through this CLI (DOCKER_BUILDKIT=1 build with --secret)."""
        proc = self.run("build", "--help", env=dict(os.environ, DOCKER_BUILDKIT="1"))
        return "--secret" in proc.stdout

    def image_id(self, ref: str) -> str | None:
        proc = self.run("image", "inspect", "--format", "{{.Id}}", ref)
        return proc.stdout.strip() if proc.returncode == 0 else None

    def build(self, dockerfile: Path, context: Path, tag: str, buildkit: bool, log: Path,
              on_line: Callable[[str], None]) -> int:
        with self._lock:
            self.builds += 1
        cmd = [self.cli, "build", "-f", str(dockerfile), "-t", tag]
        env = dict(os.environ, DOCKER_BUILDKIT="1" if buildkit else "0")
        if buildkit:
            cmd += ["--progress=plain"]
            if CA_BUNDLE.exists():
                cmd += ["--secret", f"id=cacert,src={CA_BUNDLE}"]
        cmd.append(str(context))
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
            assert proc.stdout is not None
            for line in proc.stdout:
                out.write(line)
                if line.strip():
                    on_line(line.strip())
            return proc.wait()

"""The tool that makes venv cells and installs into them: uv, or else the base interpreter's own pip.

uv links files from its cache into each environment (hard links where cache and target share a file
system), so cells with the same packages share their bytes. pip is the fallback for hosts that have a
Python environment but no uv (lent GPU machines); it needs a base interpreter with pip 22.3 or newer
(``pip --python``, to install into another interpreter's environment).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from common.errors import InputError
from provision.lock import uv_bin


@dataclass(frozen=True)
class Installer:
    kind: str  # "uv" | "pip"
    tool: tuple[str, ...]  # ("/usr/bin/uv",) or (base python, "-m", "pip")

    def venv_cmd(self, path: Path, python: str) -> list[str]:
        if self.kind == "uv":
            return [*self.tool, "venv", "--quiet", "--python", python, str(path)]
        return [python, "-m", "venv", "--without-pip", str(path)]

    def install_cmd(self, python: str, requirements: Path, *, wheels: Path | None = None,
                    indexes: Sequence[str] = (), prerelease: bool = False, hashes: bool = False,
                    target: Path | None = None) -> list[str]:
        """Install exactly the entries of ``requirements`` (no dependencies resolved) into ``python``'s
        environment, or into folder ``target``; from ``wheels`` alone when given, else from the index."""
        if self.kind == "uv":
            cmd = [*self.tool, "pip", "install", "--quiet", "--python", python, "--no-deps", "-r", str(requirements)]
            cmd += [a for u in indexes for a in ("--index", u)] + (["--prerelease", "allow"] if prerelease else [])
        else:
            # --ignore-installed: pip run by an overlay's interpreter sees the base's packages through the .pth
            # file and would otherwise skip a version the base has, or try to remove the base's copy
            cmd = [*self.tool, "--disable-pip-version-check", *([] if target else ["--python", python]), "install",
                   "--quiet", "--no-deps", "--no-compile", "--ignore-installed", "-r", str(requirements)]
            cmd += [a for u in indexes for a in ("--extra-index-url", u)] + (["--pre"] if prerelease else [])
        if wheels is not None:
            cmd += ["--no-index", "--find-links", str(wheels)]
        if hashes:
            cmd += ["--require-hashes"]
        if target is not None:
            cmd += ["--target", str(target)]
        return cmd


def env() -> dict[str, str]:
    """The environment installs run in: no virtual environment or path of the caller leaks in."""
    out = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    out.update(NO_COLOR="1", UV_NO_PROGRESS="1", PIP_NO_INPUT="1")
    return out


def run(cmd: Sequence[str], timeout: float = 3600) -> tuple[int, str]:
    """(exit status, the last useful output line) of one installer command."""
    try:
        proc = subprocess.run(list(cmd), capture_output=True, text=True, env=env(), timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 1, f"{cmd[0]}: {exc}"
    lines = [ln.strip() for ln in (proc.stderr + "\n" + proc.stdout).splitlines()
             if ln.strip() and not ln.lstrip().startswith("warning:")]
    first = next((i for i, ln in enumerate(lines) if ln.lower().startswith("error")), None)
    text = " ".join(lines[first:]) if first is not None else (lines or [""])[-1]  # the error and its causes
    return proc.returncode, text[:400]


def uv() -> str | None:
    found = uv_bin()
    return found if (os.sep in found and os.access(found, os.X_OK)) or shutil.which(found) else None


def find(base_python: str | None) -> Installer:
    """uv when it is here; else the base interpreter's pip; InputError when neither is."""
    found = uv()
    if found:
        return Installer("uv", (found,))
    if base_python:
        proc = subprocess.run([base_python, "-m", "pip", "--version"], capture_output=True, text=True, env=env())
        if proc.returncode == 0:
            return Installer("pip", (base_python, "-m", "pip"))
    where = f"and {base_python} has no pip" if base_python else "(pip is used only with --base-python)"
    raise InputError(f"no uv on PATH {where}: install uv to build venv cells")

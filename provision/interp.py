"""What an existing Python interpreter holds, read by running it: the facts a venv cell is built from.

The reader runs inside the interpreter as a standard-library script (the interpreter may have none of
stackprobe's dependencies) and prints one JSON object: its executable, version, the site directories on
its path (what an overlay must see), its scripts folder, every installed distribution with its version,
and the values PEP 508 markers are evaluated against (so the host can tell which lock entries apply).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.errors import InputError

_READER = r"""
import importlib.metadata as md, json, os, platform, re, sys, sysconfig
dists = {}
for d in md.distributions():
    name = d.metadata["Name"]
    if name:
        dists.setdefault(re.sub(r"[-_.]+", "-", name).lower(), d.version)
sites = [p for p in sys.path if p and os.path.basename(p) in ("site-packages", "dist-packages") and os.path.isdir(p)]
v = sys.implementation.version
impl = f"{v.major}.{v.minor}.{v.micro}" + ("" if v.releaselevel == "final" else v.releaselevel[0] + str(v.serial))
markers = {"implementation_name": sys.implementation.name, "implementation_version": impl,
           "os_name": os.name, "platform_machine": platform.machine(), "platform_release": platform.release(),
           "platform_system": platform.system(), "platform_version": platform.version(),
           "python_full_version": platform.python_version(),
           "platform_python_implementation": platform.python_implementation(),
           "python_version": ".".join(platform.python_version_tuple()[:2]), "sys_platform": sys.platform}
print(json.dumps({"executable": sys.executable, "version": platform.python_version(), "prefix": sys.prefix,
                  "site_dirs": sites, "scripts": sysconfig.get_path("scripts"), "dists": dists, "markers": markers}))
"""


@dataclass(frozen=True)
class Interpreter:
    """An interpreter as it is installed: ``dists`` maps normalised distribution names to versions."""

    python: str  # as given, resolved to an absolute path
    executable: str  # sys.executable
    version: str
    prefix: str
    site_dirs: tuple[str, ...]
    scripts: str
    dists: dict[str, str] = field(default_factory=dict)
    markers: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"python": self.python, "executable": self.executable, "version": self.version,
                "prefix": self.prefix, "site_dirs": list(self.site_dirs), "scripts": self.scripts}


def norm(name: str) -> str:
    """A distribution name as package indexes compare them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def resolve(python: str) -> str:
    """An absolute path for ``python`` (a path, or a name looked up on PATH); InputError when none runs."""
    found = python if os.sep in python else shutil.which(python)
    if not found or not os.access(found, os.X_OK):
        raise InputError(f"--base-python {python}: no such executable interpreter")
    return str(Path(found).absolute())  # not resolved: a venv's python is a link to another interpreter


def read(python: str) -> Interpreter:
    """The facts of ``python``; InputError when it cannot be run or answers nothing readable."""
    path = resolve(python)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    try:
        proc = subprocess.run([path, "-c", _READER], capture_output=True, text=True, timeout=120, env=env)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise InputError(f"{path}: cannot run it ({exc})") from None
    try:
        raw = json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise InputError(f"{path}: cannot read its packages ({last})") from None
    return Interpreter(path, raw["executable"], raw["version"], raw["prefix"], tuple(raw["site_dirs"]),
                       raw["scripts"], dict(raw["dists"]), dict(raw["markers"]))

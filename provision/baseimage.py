"""A base image made without any container registry: debootstrap a Debian root, `docker import` it.

Needed where `docker pull` cannot work (air-gapped hosts, an intercepting proxy without registry
access). The mirror is read from the machine's own apt sources, never hard-coded.
"""

from __future__ import annotations

import fcntl
import hashlib
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

# libnuma1: sgl-kernel's extension links libnuma.so.1, and without it `import sgl_kernel` fails in the cell
# for a reason that has nothing to do with the stack under test.
PACKAGES = ("python3", "python3-venv", "ca-certificates", "libnuma1")
# The base of registry-free cell images: nvcc needs a host compiler, and flashinfer's JIT needs one too.
DEV_PACKAGES = PACKAGES + ("gcc", "g++", "libc6-dev", "make")


def _tag(name: str, packages: tuple[str, ...]) -> str:
    """The tag names its package set, so a changed set makes a new base instead of reusing a stale one."""
    return f"{name}:bookworm-{hashlib.sha256(' '.join(packages).encode()).hexdigest()[:8]}"


DEFAULT_TAG = _tag("stackprobe/base", PACKAGES)
DEV_TAG = _tag("stackprobe/base-dev", DEV_PACKAGES)


class BaseImageError(RuntimeError):
    pass


def apt_mirror(sources_dir: Path = Path("/etc/apt")) -> str:
    """First Debian mirror URI configured on this machine (deb822 or one-line format)."""
    files = sorted(sources_dir.glob("sources.list.d/*")) + [sources_dir / "sources.list"]
    for f in files:
        if not f.is_file():
            continue
        text = f.read_text(errors="replace")
        for m in re.finditer(r"^(?:URIs:\s*(\S+)|deb\s+(?:\[[^\]]*\]\s+)?(\S+))", text, re.M):
            uri = m.group(1) or m.group(2)
            if uri and "security" not in uri:
                return uri
    raise BaseImageError("no Debian mirror in /etc/apt/sources.list(.d): configure apt first")


def image_exists(tag: str, docker: str = "docker") -> bool:
    return subprocess.run([docker, "image", "inspect", tag], capture_output=True).returncode == 0


def ensure_base(tag: str = DEFAULT_TAG, suite: str = "bookworm", docker: str = "docker",
                packages: tuple[str, ...] = PACKAGES) -> str:
    """Return `tag`, creating it with debootstrap if it does not exist yet (about 40 s)."""
    if image_exists(tag, docker):
        return tag
    if shutil.which("debootstrap") is None:
        raise BaseImageError("debootstrap not found: apt-get install -y debootstrap")
    lock_path = Path(tempfile.gettempdir()) / f"stackprobe-baseimage-{re.sub(r'[^A-Za-z0-9]', '_', tag)}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # parallel test workers build it once
        if image_exists(tag, docker):
            return tag
        with tempfile.TemporaryDirectory(prefix="stackprobe-rootfs-") as root:
            cmd = [
                "debootstrap", "--variant=minbase", f"--include={','.join(packages)}",
                suite, root, apt_mirror(),
            ]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:]
                raise BaseImageError(f"debootstrap failed: {' '.join(tail)}")
            tar = subprocess.Popen(["tar", "-C", root, "-c", "."], stdout=subprocess.PIPE)
            imp = subprocess.run([docker, "import", "-", tag], stdin=tar.stdout, capture_output=True, text=True)
            tar.wait()
            if imp.returncode != 0:
                raise BaseImageError(f"docker import failed: {imp.stderr.strip()}")
    return tag


def ensure_dev(docker: str = "docker") -> str:
    """The registry-free base for cell images: the plain base plus a C/C++ toolchain."""
    return ensure_base(DEV_TAG, docker=docker, packages=DEV_PACKAGES)


def ensure_all(docker: str = "docker") -> list[str]:
    return [ensure_base(docker=docker), ensure_dev(docker=docker)]

"""What the Slurm site offers, read from its own commands: the GPUs a partition's nodes have and whether
its srun can start a container image (parsers are pure; ``survey`` runs the commands).

Container images need the pyxis plugin, which adds ``--container-image`` to srun (its options are listed
under srun's help). Slurm's own ``--container`` takes an unpacked OCI bundle directory, not an image, so
its presence does not make images usable; without pyxis a run uses the cells' interpreters.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass

SINFO_FORMAT = "%P|%G"  # partition (a trailing * marks the default), generic resources of its nodes
_GPU_GRES = re.compile(r"(?:^|,)gpu(?::[^:,(]+)?:(\d+)")
_PYXIS = re.compile(r"--container-image[=\s]")
_OCI_BUNDLE = re.compile(r"--container[=\s]")


class SiteError(RuntimeError):
    """Slurm is not usable from here, or the partition or container request cannot be met: one line."""


def gres_gpus(gres: str) -> int:
    """GPUs per node in sinfo's %G, e.g. ``gpu:h200:8(S:0-1),nic:1`` -> 8, ``(null)`` -> 0."""
    return max((int(n) for n in _GPU_GRES.findall(gres)), default=0)


def partition_gpus(sinfo: str, partition: str | None) -> tuple[str, int] | None:
    """(partition, most GPUs of one of its nodes) from ``sinfo -h -o '%P|%G'``: the named partition, or
    the default one. None when it is not there."""
    best: dict[str, int] = {}
    default = None
    for line in sinfo.splitlines():
        name, _, gres = line.strip().partition("|")
        if not name:
            continue
        if name.endswith("*"):
            name = name[:-1]
            default = name
        best[name] = max(best.get(name, 0), gres_gpus(gres))
    chosen = partition or default
    return (chosen, best[chosen]) if chosen in best else None


def container_images(srun_help: str) -> bool:
    return bool(_PYXIS.search(srun_help))


def no_images_reason(srun_help: str) -> str:
    why = "this site's srun has no --container-image option (the pyxis plugin is not installed)"
    if _OCI_BUNDLE.search(srun_help):
        why += "; its --container takes an unpacked OCI bundle directory, not an image"
    return f"--container-image needs Slurm's container support for images: {why}. Run venv cells (--python) instead"


@dataclass(frozen=True)
class Site:
    partition: str
    gpus_per_node: int
    images: bool


def _run(cmd: list[str]) -> str:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SiteError(f"{cmd[0]}: {exc}") from None
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        raise SiteError(f"`{' '.join(cmd)}` failed: {last}")
    return proc.stdout


def survey(partition: str | None) -> Site:
    for tool in ("sbatch", "squeue", "scancel", "sinfo"):
        if shutil.which(tool) is None:
            raise SiteError(f"{tool} not found: --backend slurm runs on a host with Slurm's client commands "
                            "(a login node); tools/slurm_local.sh starts a one-node cluster on this machine")
    found = partition_gpus(_run(["sinfo", "-h", "-o", SINFO_FORMAT]), partition)
    if found is None:
        raise SiteError(f"partition {partition!r} not found (sinfo)" if partition else
                        "no default partition (sinfo): name one with --partition")
    help_text = _run(["srun", "--help"])
    return Site(found[0], found[1], container_images(help_text))


def srun_help() -> str:
    return _run(["srun", "--help"])

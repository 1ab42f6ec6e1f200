"""Which GPUs a timed variant runs on when several run at once (pure; host side).

A variant that times something has its GPUs alone. On a host whose GPUs are every pair joined by NVLink (each
pair ``NV#`` in the topology matrix of ``nvidia-smi topo -m`` the host facts record: an NVSwitch, or a full
mesh of direct links), the traffic of one pair of GPUs shares no link with another pair's, so timed variants on
disjoint GPU sets measure what each would alone: the runner starts them side by side, each worker seeing only
its own GPUs (``CUDA_VISIBLE_DEVICES``). On PCIe or partly-NVLink hosts the GPUs' traffic meets at a shared
root complex or bridge, so timed variants stay one at a time.

A variant of N ranks (a GPU each) takes N GPUs; a variant of one rank (it reads facts of every GPU) or one whose
params name GPUs by index (host-p2p's ``pair``) takes every GPU, alone.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from inenv import gpugate
from inenv.probe import Variant

VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"
LANE = "gpu_lane"  # evidence key: the GPUs a timed variant ran on and the timed variants beside it
NAMES_GPUS = ("pair",)  # params that name GPUs by their index on the host: such a variant sees every GPU
_NVLINK = re.compile(r"NV\d+")


def topology_links(topology: str | None, count: int) -> list[list[str]] | None:
    """The ``count`` x ``count`` link matrix of ``nvidia-smi topo -m`` (``X`` on the diagonal), or None when the
    text holds no row for every GPU."""
    rows: dict[int, list[str]] = {}
    for line in (topology or "").splitlines():
        m = re.match(r"\s*GPU(\d+)\s+(.*)", line)
        if m is None:
            continue
        cells = m.group(2).split()
        if len(cells) >= count:
            rows[int(m.group(1))] = cells[:count]
    if count < 1 or any(i not in rows for i in range(count)):
        return None
    return [rows[i] for i in range(count)]


def switched(facts: Mapping[str, Any] | None) -> bool:
    """Whether the host facts say every pair of the host's GPUs is joined by NVLink (two or more GPUs)."""
    facts = facts or {}
    try:
        count = int(facts.get("gpu_count") or 0)
    except (TypeError, ValueError):
        return False
    topology = facts.get("topology")
    links = topology_links(topology if isinstance(topology, str) else None, count) if count >= 2 else None
    if links is None:
        return False
    return all(_NVLINK.fullmatch(links[a][b]) is not None for a in range(count) for b in range(count) if a != b)


def needs(variant: Variant, gpus: int) -> int:
    """How many of the host's ``gpus`` a timed variant takes: one a rank, or every GPU (see the module
    docstring)."""
    if variant.ranks <= 1 or variant.share_gpu or any(variant.param(p) is not None for p in NAMES_GPUS):
        return gpus
    return min(variant.ranks, gpus)


def devices(variant: Variant, busy: Iterable[int], gpus: int) -> tuple[int, ...] | None:
    """The lowest-numbered GPUs of the host's ``gpus`` that no running variant holds (``busy``) and that
    ``variant`` needs, or None when too few are free."""
    taken = set(busy)
    free = [g for g in range(gpus) if g not in taken]
    n = needs(variant, gpus)
    return tuple(free[:n]) if len(free) >= n else None


def lane_env(gpus: tuple[int, ...]) -> tuple[tuple[str, str], ...]:
    """What a worker placed on ``gpus`` is given over its cell's run environment: only its GPUs visible, and no
    GPU lock (the runner holds the host's lock for every variant placed so: inenv.gpugate's lock serves one
    variant at a time, which is what placing them side by side replaces)."""
    return ((VISIBLE_ENV, ",".join(str(g) for g in gpus)), (gpugate.ENV, ""))


@dataclass(frozen=True)
class Free:
    """The host's ``gpus`` and those no running variant holds: what :func:`checks.run.runner.pick` may place a
    timed variant on."""

    gpus: int
    busy: frozenset[int] = frozenset()

    def fits(self, variant: Variant) -> bool:
        return devices(variant, self.busy, self.gpus) is not None

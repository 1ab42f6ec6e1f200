"""Which GPUs a timed variant runs on when several run at once (pure; host side).

A variant that times something has its GPUs alone. On a host whose GPUs are every pair joined by NVLink (each
pair ``NV#`` in the topology matrix of ``nvidia-smi topo -m`` the host facts record: an NVSwitch, or a full
mesh of direct links), the traffic of one pair of GPUs shares no link with another pair's, so timed variants on
disjoint GPU sets measure what each would alone: the runner starts them side by side, each worker seeing only
its own GPUs (``CUDA_VISIBLE_DEVICES``). On PCIe or partly-NVLink hosts the GPUs' traffic meets at a shared
root complex or bridge, so timed variants stay one at a time.

A variant of N ranks (a GPU each) takes N GPUs, the lowest-numbered free ones; a variant whose params name GPUs
by their index on the host (host-p2p's ``pair=A-B``) takes exactly those, and its worker is told which host GPUs
its devices are (``inenv.probe.LANE_GPUS_ENV``); a variant of one rank (it reads facts of every GPU) takes every
GPU, alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from checks.results import hostfacts
from inenv import gpugate
from inenv.probe import LANE_GPUS_ENV, Variant

VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"
LANE = "gpu_lane"  # evidence key: the GPUs a timed variant ran on and the timed variants beside it
NAMES_GPUS = ("pair",)  # params that name GPUs by their index on the host ("A-B"): such a variant takes those


def switched(facts: Mapping[str, Any] | None) -> bool:
    """Whether the host facts say every pair of the host's GPUs is joined by NVLink (two or more GPUs)."""
    facts = facts or {}
    try:
        count = int(facts.get("gpu_count") or 0)
    except (TypeError, ValueError):
        return False
    topology = facts.get("topology")
    return hostfacts.all_nvlink(topology if isinstance(topology, str) else None, count) is not None


def named(variant: Variant, gpus: int) -> tuple[int, ...] | None:
    """The host GPUs a variant's params name (:data:`NAMES_GPUS`, ``A-B``), or None: no such param, or one that
    names a GPU twice or one the host's ``gpus`` lack (the variant then sees every GPU and says so itself)."""
    for p in NAMES_GPUS:
        text = variant.param(p)
        if text is None:
            continue
        try:
            got = tuple(int(g) for g in text.split("-"))
        except ValueError:
            return None
        return got if len(set(got)) == len(got) and all(0 <= g < gpus for g in got) else None
    return None


def wants(variant: Variant, gpus: int) -> int | tuple[int, ...]:
    """What a timed variant takes of the host's ``gpus``: the GPUs its params name, else how many (one a rank,
    or every GPU: see the module docstring)."""
    if (chosen := named(variant, gpus)) is not None and variant.ranks == len(chosen):
        return chosen
    if variant.ranks <= 1 or variant.share_gpu or any(variant.param(p) is not None for p in NAMES_GPUS):
        return gpus
    return min(variant.ranks, gpus)


def needs(variant: Variant, gpus: int) -> int:
    """How many of the host's ``gpus`` a timed variant takes (:func:`wants`)."""
    got = wants(variant, gpus)
    return len(got) if isinstance(got, tuple) else got


def take(want: int | tuple[int, ...], busy: Iterable[int], gpus: int) -> tuple[int, ...] | None:
    """The GPUs of the host's ``gpus`` that no running variant holds (``busy``) given to what a variant
    :func:`wants`: the GPUs it names when all are free, else the lowest-numbered free ones; None when they are
    not free."""
    taken = set(busy)
    if isinstance(want, tuple):
        return want if not taken & set(want) else None
    free = [g for g in range(gpus) if g not in taken]
    return tuple(free[:want]) if len(free) >= want else None


def devices(variant: Variant, busy: Iterable[int], gpus: int) -> tuple[int, ...] | None:
    """The GPUs ``variant`` runs on beside the running variants' ``busy`` ones, or None when they are not free
    (:func:`take`)."""
    return take(wants(variant, gpus), busy, gpus)


def lane_env(gpus: tuple[int, ...]) -> tuple[tuple[str, str], ...]:
    """What a worker placed on ``gpus`` is given over its cell's run environment: only its GPUs visible, which
    host GPUs they are (a variant that names GPUs by their host index finds its devices by it:
    inenv.probe.visible_index), and no GPU lock (the runner holds the host's lock for every variant placed so:
    inenv.gpugate's lock serves one variant at a time, which is what placing them side by side replaces)."""
    spelled = ",".join(str(g) for g in gpus)
    return ((VISIBLE_ENV, spelled), (LANE_GPUS_ENV, spelled), (gpugate.ENV, ""))


@dataclass(frozen=True)
class Free:
    """The host's ``gpus`` and those no running variant holds: what :func:`checks.run.runner.pick` may place a
    timed variant on."""

    gpus: int
    busy: frozenset[int] = frozenset()

    def fits(self, variant: Variant) -> bool:
        return devices(variant, self.busy, self.gpus) is not None

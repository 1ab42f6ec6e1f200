"""Which GPUs a timed variant runs on when several run at once (pure; host side).

A variant that times something has its GPUs alone. On a host whose GPUs are every pair joined by NVLink (each
pair ``NV#`` in the topology matrix of ``nvidia-smi topo -m`` the host facts record: an NVSwitch, or a full
mesh of direct links), the traffic of one pair of GPUs shares no link with another pair's, so timed variants on
disjoint GPU sets measure what each would alone: the runner starts them side by side, each worker seeing only
its own GPUs (``CUDA_VISIBLE_DEVICES``).

On a PCIe host whose GPUs sit in groups behind PCIe switches (every pair of a group ``PIX``: one bridge between
them, with peer access both ways, so NCCL and the IPC backends move their data GPU to GPU inside the switch), a
variant inside one group uses only that switch's links: the groups are :func:`islands`, and a timed variant
takes GPUs of islands no other timed variant holds, so variants in different switches run side by side. A
variant whose GPUs span islands crosses the host bridge, which every such variant shares: one at a time. On a
PCIe host of two or more CPU sockets without such switch groups, the GPUs of each socket (every pair of them a
path inside the socket, ``NODE``/``PHB``/``PXB``/``PIX``, every pair across sockets ``SYS``) are the islands: a
variant inside one socket uses that socket's PCIe root complex alone, and one in the other socket shares no link,
bridge or root complex with it. A PCIe host whose GPUs all hang off one socket's root ports without switches, or
one partly NVLink, keeps timed variants one at a time.

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


Islands = tuple[tuple[int, ...], ...]


def islands(facts: Mapping[str, Any] | None) -> Islands:
    """The host's GPUs by the PCIe switch they sit behind (hostfacts.switch_groups), else by the CPU socket they
    hang off (hostfacts.socket_groups), a group kept whole only when the facts' ``peer_access`` says every pair
    of it reaches the other both ways (else its GPUs are groups of one: their traffic goes through host memory);
    () unless two groups of two GPUs or more are left (nothing would run side by side), or on a host whose every
    pair is NVLink (:func:`switched`)."""
    facts = facts or {}
    try:
        count = int(facts.get("gpu_count") or 0)
    except (TypeError, ValueError):
        return ()
    topology = facts.get("topology")
    if switched(facts) or not isinstance(topology, str):
        return ()
    peer = facts.get("peer_access")

    def reaches(a: int, b: int) -> bool:
        try:
            return peer[a][b] is True and peer[b][a] is True  # type: ignore[index]
        except (IndexError, KeyError, TypeError):
            return False

    for groups in (hostfacts.switch_groups(topology, count), hostfacts.socket_groups(topology, count)):
        out: list[tuple[int, ...]] = []
        for group in groups:
            if len(group) > 1 and all(reaches(a, b) for a in group for b in group if a != b):
                out.append(group)
            else:
                out.extend((g,) for g in group)
        if sum(1 for g in out if len(g) > 1) >= 2:
            return tuple(sorted(out))
    return ()


def side_by_side(facts: Mapping[str, Any] | None) -> bool:
    """Whether the host facts let timed variants run side by side: every GPU pair NVLink, or PCIe
    :func:`islands` (switches or sockets)."""
    return switched(facts) or bool(islands(facts))


def spans(on: Iterable[int], within: Islands) -> bool:
    """Whether GPUs ``on`` lie in more than one of the islands ``within``."""
    gpus = set(on)
    return sum(1 for i in within if gpus & set(i)) > 1


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


def take(want: int | tuple[int, ...], busy: Iterable[int], gpus: int, within: Islands = (),
         crossing: bool = False) -> tuple[int, ...] | None:
    """The GPUs of the host's ``gpus`` that no running variant holds (``busy``) given to what a variant
    :func:`wants`: the GPUs it names when all are free, else the lowest-numbered free ones; None when they are
    not free. With :func:`islands` (``within``), as the module docstring says: only GPUs of islands no running
    variant holds, one island when one fits (the smallest), else several but only while no running variant
    spans islands (``crossing``)."""
    taken = set(busy)
    if within:
        return _take_islands(want, taken, within, crossing)
    if isinstance(want, tuple):
        return want if not taken & set(want) else None
    free = [g for g in range(gpus) if g not in taken]
    return tuple(free[:want]) if len(free) >= want else None


def _take_islands(want: int | tuple[int, ...], taken: set[int], within: Islands,
                  crossing: bool) -> tuple[int, ...] | None:
    free = [i for i in within if not taken & set(i)]
    if isinstance(want, tuple):
        touched = [i for i in within if set(i) & set(want)]
        if any(taken & set(i) for i in touched) or (len(touched) > 1 and crossing):
            return None
        return want
    fitting = [i for i in free if len(i) >= want]
    if fitting:
        return min(fitting, key=lambda i: (len(i), i))[:want]
    if crossing:
        return None
    got = [g for i in free for g in i]
    return tuple(sorted(got)[:want]) if len(got) >= want else None


def devices(variant: Variant, busy: Iterable[int], gpus: int, within: Islands = (),
            crossing: bool = False) -> tuple[int, ...] | None:
    """The GPUs ``variant`` runs on beside the running variants' ``busy`` ones, or None when they are not free
    (:func:`take`)."""
    return take(wants(variant, gpus), busy, gpus, within, crossing)


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
    timed variant on; with ``within`` (:func:`islands`), whether a running variant spans islands (``crossing``)."""

    gpus: int
    busy: frozenset[int] = frozenset()
    within: Islands = ()
    crossing: bool = False

    def place(self, variant: Variant) -> tuple[int, ...] | None:
        """The GPUs ``variant`` runs on here, or None when they are not free (:func:`devices`)."""
        return devices(variant, self.busy, self.gpus, self.within, self.crossing)

    def fits(self, variant: Variant) -> bool:
        return self.place(variant) is not None


def free(placed: Iterable[tuple[int, ...]], gpus: int, within: Islands = ()) -> Free:
    """What the running timed variants (the GPUs each was placed on) leave of the host's ``gpus``."""
    held = list(placed)
    return Free(gpus, frozenset(g for d in held for g in d), within, any(spans(d, within) for d in held))

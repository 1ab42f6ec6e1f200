"""What an MoE all-to-all does, on CPU tensors, for the stand-in flashinfer packages beside this file.

Dispatch: source rank s sends each of its tokens once to every distinct rank owning one of its experts
(experts [r*E/ep, (r+1)*E/ep) live on rank r); on target t the rows from s fill slots 0.. of block s, in
token order. The rows after them are padding, deliberately filled with a copy of a real row: only the
API's sanitising step (expert ids set to the invalid id) tells them apart. Combine: token i of rank s comes
back as the sum over its target ranks t of what t put in the slot the token had landed in.

Simulated ranks run one after another in one process, while the real kernels of all ranks run at once and
wait for each other; so steps that need every rank's data (sanitising, combining) are held until the last
rank's call and then applied in place, which is what the caller sees after its device wait.

The stand-in also holds the caller to what those spinning kernels demand of one GPU (:class:`Deadlock`): a
round (every rank's dispatch, or every rank's combine) finishes only once every rank's kernel is in flight,
so until the last rank's launch nothing else may be queued (another call would wait behind a kernel that
cannot finish, or, as a kernel's first launch, for the whole device to go idle), no two ranks may share a
stream, and the host may not wait for the device. :class:`Lanes` stands in for the probe's one stream per
simulated rank and tells the fabric which one the caller is on.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

DEFAULT_LANE = "default stream"
QUEUED = "it waits behind a kernel that cannot finish, or, as a kernel's first launch, for the whole device"


class Deadlock(RuntimeError):
    """What the caller did would hang the real kernels on a GPU."""


class Lanes:
    """Stand-in of inenv.kit._device.Lanes: which stream the caller queues on, and the host's waits."""

    current: Any = DEFAULT_LANE
    waits = 0

    def __init__(self, count: int) -> None:
        self.count = count

    @contextmanager
    def on(self, index: int) -> Iterator[None]:
        assert 0 <= index < self.count
        before, Lanes.current = Lanes.current, index
        try:
            yield
        finally:
            Lanes.current = before

    def wait(self, deadline_s: float) -> None:
        host_wait(f"wait of {deadline_s:.0f} s")


def targets_of(experts: torch.Tensor, ep: int, num_experts: int) -> list[list[int]]:
    per = num_experts // ep
    return [sorted({e // per for e in row if 0 <= e < num_experts}) for row in experts.tolist()]


def placement(all_experts: list[torch.Tensor], ep: int, num_experts: int) -> dict[tuple[int, int], list[int]]:
    """(target, source) -> the source's local token indices in the slots they fill on the target."""
    out: dict[tuple[int, int], list[int]] = {}
    for src, experts in enumerate(all_experts):
        tg = targets_of(experts, ep, num_experts)
        for t in range(ep):
            out[(t, src)] = [i for i, ranks in enumerate(tg) if t in ranks]
    return out


def fill_received(views: list[torch.Tensor], src: int, payloads: list[torch.Tensor], slots: list[int]) -> None:
    """Write source ``src``'s routed rows into ``views`` ([ep, tpr, cols] each), then padding garbage."""
    tpr = views[0].shape[1]
    for view, payload in zip(views, payloads, strict=True):
        for slot, i in enumerate(slots):
            view[src, slot] = payload[i]
        for slot in range(len(slots), tpr):
            view[src, slot] = payload[0]  # looks like a real token until sanitised


def sanitize(experts_view: torch.Tensor, counts: dict[int, int], invalid: int) -> None:
    for src, n in counts.items():
        experts_view[src, n:] = invalid


def combine_rows(
    local: int,
    src: int,
    place: dict[tuple[int, int], list[int]],
    payloads: dict[int, torch.Tensor],
    ep: int,
    out: torch.Tensor,
) -> None:
    """Token i of rank ``src``: the sum over target ranks of their payload rows for it, in fp32, then rounded."""
    acc = torch.zeros(out.shape, dtype=torch.float32)
    for t in range(ep):
        for slot, i in enumerate(place[(t, src)]):
            acc[i] += payloads[t][src, slot].float()
    out.copy_(acc[:local].to(out.dtype))


class Fabric:
    """One shared workspace of ``ep`` simulated ranks: what each rank dispatched and what waits for the rest."""

    def __init__(self, ep: int, num_experts: int) -> None:
        self.ep, self.num_experts = ep, num_experts
        self.experts: dict[int, torch.Tensor] = {}
        self.pending_sanitize: list[tuple[torch.Tensor, int, int]] = []
        self.pending_combine: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}
        self.round = ""  # "dispatch" or "combine" while some but not all ranks' kernels are in flight
        self.round_lanes: dict[int, Any] = {}  # rank -> stream its kernel of the open round is on

    def launch(self, kind: str, rank: int) -> None:
        """Rank ``rank``'s spinning kernel of round ``kind`` is queued on the caller's current lane."""
        lane = Lanes.current
        if self.round and self.round != kind:
            self.refuse(f"rank {rank}'s {kind} queued")
        if rank in self.round_lanes:
            raise Deadlock(f"rank {rank}'s {kind} queued twice in one round")
        for other, used in self.round_lanes.items():
            if used == lane:
                raise Deadlock(
                    f"ranks {other} and {rank} queue their {kind} on one stream ({lane}): the second waits behind "
                    "the first, which waits for it"
                )
        self.round = kind
        self.round_lanes[rank] = lane
        if len(self.round_lanes) == self.ep:  # every kernel in flight: the round can finish
            self.round, self.round_lanes = "", {}

    def refuse(self, what: str, why: str = QUEUED) -> None:
        """Nothing but the open round's kernels may be queued, and the host may not wait, until its last rank's
        kernel is queued."""
        if self.round:
            missing = sorted(set(range(self.ep)) - set(self.round_lanes))
            raise Deadlock(
                f"{what} while the {self.round} of ranks {sorted(self.round_lanes)} waits for ranks {missing}, "
                f"not launched yet: {why}"
            )

    def dispatched(self, rank: int, experts: torch.Tensor) -> None:
        self.experts[rank] = experts.clone()
        self._flush()

    def place(self) -> dict[tuple[int, int], list[int]]:
        return placement([self.experts[r] for r in range(self.ep)], self.ep, self.num_experts)

    def sanitize_later(self, view: torch.Tensor, rank: int, invalid: int) -> None:
        self.pending_sanitize.append((view, rank, invalid))
        self._flush()

    def combine_later(self, rank: int, payload: torch.Tensor, out: torch.Tensor, local: int) -> None:
        self.pending_combine[rank] = (payload.clone(), out, local)
        if len(self.pending_combine) == self.ep:
            place = self.place()
            payloads = {r: p for r, (p, _, _) in self.pending_combine.items()}
            for r, (_, o, n) in self.pending_combine.items():
                combine_rows(n, r, place, payloads, self.ep, o)
            self.pending_combine.clear()

    def _flush(self) -> None:
        if len(self.experts) < self.ep:
            return
        place = self.place()
        for view, rank, invalid in self.pending_sanitize:
            sanitize(view, {src: len(place[(rank, src)]) for src in range(self.ep)}, invalid)
        self.pending_sanitize.clear()


FABRICS: dict[int, Fabric] = {}


def host_wait(what: str) -> None:
    """The host waits for the device: never returns while a round waits for a rank not yet launched."""
    Lanes.waits += 1
    for f in FABRICS.values():
        f.refuse(f"the host's {what}", "the host waits for kernels that wait for it")


def initialised(workspace: torch.Tensor, rank: int) -> None:
    """Rank ``rank``'s slice of ``workspace`` is initialised, which in 0.6.18 zeroes it and then synchronises
    the stream (a host wait). Rank 0's starts a fresh fabric: a new workspace may sit where a freed one was."""
    if rank == 0:
        FABRICS.pop(workspace.data_ptr(), None)
    host_wait(f"moe_a2a_initialize of rank {rank}")


def queued(what: str, workspace: torch.Tensor) -> None:
    """A call on ``workspace`` that is not a rank's all-to-all kernel (initialising, sanitising)."""
    f = FABRICS.get(workspace.data_ptr())
    if f is not None:
        f.refuse(f"{what} queued")


def fabric(workspace: torch.Tensor, ep: int, num_experts: int) -> Fabric:
    key = workspace.data_ptr()
    if key not in FABRICS:
        FABRICS[key] = Fabric(ep, num_experts)
    return FABRICS[key]


def exchange(group: Any, value: Any) -> list[Any]:
    """Every rank's ``value`` over a gloo group (the stand-in for NVLink loads and stores across processes).
    Pickled bytes travel as uint8 tensors: all_gather_object needs numpy, which this environment may lack."""
    import pickle

    import torch.distributed as dist

    world = dist.get_world_size(group)
    data = torch.tensor(list(pickle.dumps(value)), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([data.numel()]), group=group)
    longest = max(int(s) for s in sizes)
    bufs = [torch.zeros(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(bufs, torch.cat([data, torch.zeros(longest - data.numel(), dtype=torch.uint8)]), group=group)
    return [pickle.loads(bytes(b[: int(n)].tolist())) for b, n in zip(bufs, sizes, strict=True)]


def ranks_dispatch(
    group: Any, rank: int, ep: int, num_experts: int, experts: torch.Tensor, payloads: list[torch.Tensor], tpr: int
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Across processes: this rank's received [ep, tpr, cols] payloads (padding garbage included), and every
    rank's expert ids (for the combine that follows)."""
    everyone = exchange(group, (experts, payloads))
    all_experts = [e for e, _ in everyone]
    place = placement(all_experts, ep, num_experts)
    views = [torch.zeros(ep, tpr, p.shape[1], dtype=p.dtype) for p in payloads]
    for src, (_, pl) in enumerate(everyone):
        fill_received(views, src, pl, place[(rank, src)])
    return views, all_experts


def ranks_combine(
    group: Any, rank: int, ep: int, num_experts: int, all_experts: list[torch.Tensor], payload: torch.Tensor, local: int
) -> torch.Tensor:
    payloads = dict(enumerate(exchange(group, payload)))
    out = torch.empty(local, payload.shape[-1], dtype=payload.dtype)
    combine_rows(local, rank, placement(all_experts, ep, num_experts), payloads, ep, out)
    return out

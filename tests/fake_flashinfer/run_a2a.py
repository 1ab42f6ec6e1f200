"""Drive inenv.probes.epmoe against whichever stand-in flashinfer is first on sys.path, on CPU tensors.

    python run_a2a.py sim EP[,EP...]  every rank simulated in this process, for each EP
    python run_a2a.py ranks EP        EP gloo processes, one per rank

Prints one JSON line: the generation found, and per EP and rank what an independent oracle (written here, not
the probe's own check) says about what the adapter returned."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any

import _a2a_fabric as fab
import torch

from inenv.probes import ep_a2a as probe
from inenv.probes import epmoe

TPR, HIDDEN = 5, 16


def shape(ep: int) -> epmoe.Shape:
    return epmoe.Shape(ep, TPR, HIDDEN, probe.TOP_K, ep * probe.EXPERTS_PER_RANK)


def inputs(rank: int, route: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids = torch.arange(rank * TPR, (rank + 1) * TPR, dtype=torch.int32)
    experts = torch.tensor(route[rank * TPR : (rank + 1) * TPR], dtype=torch.int32)
    return experts, probe.hidden_rows(ids, HIDDEN, "cpu"), (ids + 1).unsqueeze(1).contiguous()


def oracle(recv: epmoe.Received, combined: torch.Tensor, rank: int, ep: int, route: list[list[int]]) -> dict:
    per = probe.EXPERTS_PER_RANK
    bad: list[str] = []
    for src in range(ep):
        want = sorted(g + 1 for g in range(src * TPR, (src + 1) * TPR) if rank in probe.targets(route[g]))
        rows = [i for i in range(TPR) if int(recv.ids[src, i])]
        got = sorted(int(recv.ids[src, i]) for i in rows)
        if got != want:
            bad.append(f"from {src}: ids {got} want {want}")
        for i in rows:
            g = int(recv.ids[src, i]) - 1
            if not torch.equal(recv.hidden[src, i], probe.hidden_rows(torch.tensor([g]), HIDDEN, "cpu")[0]):
                bad.append(f"from {src}: hidden row of token {g}")
            picks = {int(e) for e in recv.experts[src, i] if int(e) != epmoe.INVALID_EXPERT}
            mine = {e for e in route[g] if e // per == rank}
            if not (mine <= picks <= set(route[g])):
                bad.append(f"from {src}: experts {sorted(picks)} of token {g}, route {route[g]}")
    ref = probe.combine_reference(rank, TPR, HIDDEN, route, "cpu")
    own = probe.check_received(recv, rank, ep, TPR, route)  # the probe's own check must agree with the oracle
    return {"dispatch": bad, "probe_check": own, "combine_exact": bool(torch.equal(combined, ref))}


def run_sim(gen: Any, ep: int) -> list[dict]:
    """Through the adapter's own ordering of simulated ranks, each on a stand-in lane the fabric checks."""
    route = probe.routing(ep, TPR)
    a2a = epmoe.open_sim(gen, shape(ep), torch.device("cpu"))
    lanes = fab.Lanes(ep)
    recv = epmoe.dispatch_all(a2a, [inputs(r, route) for r in range(ep)], lanes, 60)
    payloads = [(recv[r].hidden.float() * (r + 1)).to(torch.bfloat16) for r in range(ep)]
    combined = epmoe.combine_all(a2a, payloads, lanes, 60)
    return [{"workspace_bytes": a2a.workspace_bytes, **oracle(recv[r], combined[r], r, ep, route)} for r in range(ep)]


def _rank(rank: int, ep: int, init: str, queue: Any) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=ep)
    gen = epmoe.detect()
    route = probe.routing(ep, TPR)
    a2a = epmoe.open_ranks(gen, shape(ep), rank, dist.group.WORLD)
    recv = a2a.dispatch(*inputs(rank, route))
    combined = a2a.combine((recv.hidden.float() * (rank + 1)).to(torch.bfloat16))
    queue.put((rank, {"workspace_bytes": a2a.workspace_bytes, **oracle(recv, combined, rank, ep, route)}))
    dist.destroy_process_group()


def run_ranks(ep: int) -> list[dict]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    init = os.path.join(tempfile.mkdtemp(), "init")
    procs = [ctx.Process(target=_rank, args=(r, ep, init, queue)) for r in range(ep)]
    for p in procs:
        p.start()
    got = sorted(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    return [o for _, o in got]


if __name__ == "__main__":
    mode, eps = sys.argv[1], [int(x) for x in sys.argv[2].split(",")]
    found = epmoe.detect()
    results = {ep: run_sim(found, ep) if mode == "sim" else run_ranks(ep) for ep in eps}
    print(json.dumps({"generation": found.name, "ranks": results}))

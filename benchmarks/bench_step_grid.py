"""What the step probe's full grid costs with a GPU per rank, measured on one GPU: the floor under the seconds a
step variant at a deep world size takes, which no host of ours has run (the cost model guesses such a variant at
checks.run.cost.budget.UNTIMED_S).

    python3 benchmarks/bench_step_grid.py [--world 2] [--json OUT]      # on a GPU host, the machine's torch

One process, one rank: torch.distributed over NCCL with a world of one, and the step probe's own code
(inenv.probes.stepmodel, stepcomm's NCCL adapter, the agreement cases) run as a variant with a GPU per rank runs
it at ``--world`` ranks: every model shape at that world size's widths (inenv.probes.stepmodel.shapes), every
decode and verify case, each captured, checked on two inputs, profiled once and timed (stepmodel.REPLAYS replays
of the step, the baseline and the allreduces alone), then the agreement cases of every dtype. Everything a rank
of a real variant does but wait for its peers: a world of one's allreduce is a copy on the GPU, so what is left
out is the links' time, which the run adds as an estimate from the allreduce calls it counts (``--link-us`` per
call, default 20 us: an NVLink allreduce of decode sizes; PCIe is slower) and prints apart.

Prints per shape and case the seconds spent, the step's whole grid, the agreement cases, the count of allreduce
calls and the estimate with the links' time; ``--json`` writes the same.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def allreduces(blocks: int, replays: int) -> int:
    """The allreduces one rank makes across its peers in one case of a real variant (inenv.probes.stepmodel
    .run_case): the step graph's eager warm-up, two checked replays, one profiled and ``replays`` timed, and the
    allreduces-alone graph's warm-up and ``replays`` timed, ``blocks`` allreduces each."""
    return blocks * (1 + 2 + 1 + replays + 1 + replays)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2, help="the world size whose widths the shapes take (default 2)")
    ap.add_argument("--link-us", type=float, default=20.0, help="an allreduce's time across real links, per call")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    import torch
    import torch.distributed as dist

    from inenv.kit import _agree, _device, _timing
    from inenv.probes import step, stepcomm, stepmodel

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    t0 = time.monotonic()
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    gloo = dist.new_group(backend="gloo")
    group = dist.group.WORLD
    setup_s = time.monotonic() - t0
    wanted = stepmodel.shapes(args.world)
    max_numel = max(stepmodel.MAX_TOKENS * max(s.hidden for s in wanted), _agree.max_numel())
    comm = stepcomm.make_comm("nccl", 0, 1, device, group, max_numel, stepmodel.MAX_TOKENS)
    flat = {k: torch.empty(max_numel, device=device, dtype=torch.bfloat16)
            for k in ("res0", "res_a", "res_b", "norm", "out")}
    barrier = _timing.stream_barrier(device, group)
    rows: list[dict[str, object]] = []
    t_grid = time.monotonic()
    with _timing.side_stream(device):
        for shape in wanted:
            comm.for_model(shape.hidden)
            model = stepmodel.Model(shape, 0, 1, device, comm, flat)
            for case in stepmodel.CASES:
                t = time.monotonic()
                r = stepmodel.run_case(model, case, gloo, barrier, timed=True)
                _device.wait_device(60.0)
                rows.append({"shape": shape.name, "case": case.key, "verdict": r.get("verdict"),
                             "s": round(time.monotonic() - t, 3),
                             "allreduces": allreduces(shape.blocks, stepmodel.REPLAYS)})
            del model
            torch.cuda.empty_cache()
        grid_s = time.monotonic() - t_grid
        t_agree = time.monotonic()
        agreed = _agree.run_cases(stepmodel.agreement_bind(comm, 0, 1, flat),
                                  step.agreement_cases(False, comm.dtypes), gloo, lambda _m: None)
        agree_s = time.monotonic() - t_agree
    calls = sum(int(str(r["allreduces"])) for r in rows)
    links_s = calls * args.link_us / 1e6
    out = {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__, "world_widths": args.world,
           "shapes": len(wanted), "cases": len(stepmodel.CASES), "replays": stepmodel.REPLAYS,
           "setup_s": round(setup_s, 2), "grid_s": round(grid_s, 2), "agreement_s": round(agree_s, 2),
           "agreement_cases": len(agreed), "allreduces": calls,
           "link_us": args.link_us, "links_s": round(links_s, 2),
           "estimate_s": round(grid_s + agree_s + links_s, 2), "rows": rows}
    for row in rows:
        print(f"{row['shape']:>24} {row['case']:>14} {row['verdict']:>8} {row['s']:>7.2f} s "
              f"{row['allreduces']:>6} allreduces")
    bad = sorted({str(r["verdict"]) for r in rows} - {"ok"})
    print(f"{out['gpu']}, torch {out['torch']}: the step's grid at {args.world} ranks' widths ({len(wanted)} shapes x "
          f"{len(stepmodel.CASES)} cases) took {grid_s:.1f} s on one rank, its agreement cases {agree_s:.1f} s, "
          f"{calls} allreduces; with {args.link_us:g} us of links per call: about {out['estimate_s']} s a variant "
          f"(process start and rendezvous apart){'; verdicts other than ok: ' + ', '.join(bad) if bad else ''}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

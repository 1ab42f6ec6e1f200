"""The step probe's full grid run as one rank of a variant with a GPU per rank runs it, on one GPU: what
benchmarks/bench_step_grid.py measures (its docstring says how and why). Not a probe and imported by none: a
host tool's in-environment side, so it reaches the kit's helpers as the probes do.

In-environment side: the standard library and torch.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

# The parts of a case phases() times apart (stepmodel's own functions, wrapped for the run).
PHASES = ("capture", "load", "check", "kernels", "timing")


def allreduces(blocks: int, replays: int) -> int:
    """The allreduces one rank makes across its peers in one case of a real variant (inenv.probes.stepmodel
    .run_case): the step graph's eager warm-up, two checked replays and ``replays`` timed, and the allreduces-alone
    graph's warm-up and ``replays`` timed (its kernels are read from the graph, not a replay), ``blocks``
    allreduces each."""
    return blocks * (1 + 2 + replays + 1 + replays)


@contextlib.contextmanager
def phases() -> Iterator[dict[str, float]]:
    """Seconds spent in each of PHASES while the block runs, summed over every case: stepmodel's graph capture,
    input loading, exact checks, reading the allreduces' kernels and timed replays, each wrapped with a device sync
    either side so a phase's queued work is its own. The wrapped functions are put back on exit."""
    import torch

    from inenv.kit import _device, _timing
    from inenv.probes import stepmodel

    spent = dict.fromkeys(PHASES, 0.0)

    def timer(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            torch.cuda.synchronize()
            t = time.monotonic()
            try:
                return fn(*args, **kwargs)
            finally:
                torch.cuda.synchronize()
                spent[name] += time.monotonic() - t
        return wrapped

    targets = [(_device, "capture", "capture"), (stepmodel.Model, "load", "load"), (stepmodel, "_check", "check"),
               (stepmodel, "kernels_of", "kernels"), (_timing, "timed_across_ranks", "timing")]
    saved = [(obj, attr, getattr(obj, attr)) for obj, attr, _ in targets]
    for obj, attr, name in targets:
        setattr(obj, attr, timer(name, getattr(obj, attr)))
    try:
        yield spent
    finally:
        for obj, attr, fn in saved:
            setattr(obj, attr, fn)


def measure(world: int, link_us: float) -> dict[str, Any]:
    """The grid at ``world`` ranks' widths on this process's GPU 0 over NCCL with a world of one: per shape and
    case its seconds and verdict, the whole grid, the agreement cases, and the estimate with ``link_us`` of links
    per allreduce."""
    import torch
    import torch.distributed as dist

    from inenv.kit import _agree, _device, _timing
    from inenv.probes import step, stepcomm, stepmodel
    from inenv.worker import reserved_port

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    t0 = time.monotonic()
    with reserved_port() as port:  # held, so nothing takes it before the store binds it
        os.environ.setdefault("MASTER_PORT", str(port))
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
        gloo = dist.new_group(backend="gloo")
    group = dist.group.WORLD
    setup_s = time.monotonic() - t0
    wanted = stepmodel.shapes(world)
    max_numel = max(stepmodel.MAX_TOKENS * max(s.hidden for s in wanted), _agree.max_numel())
    comm = stepcomm.make_comm("nccl", 0, 1, device, group, max_numel, stepmodel.MAX_TOKENS)
    flat = {k: torch.empty(max_numel, device=device, dtype=torch.bfloat16)
            for k in ("res0", "res_a", "res_b", "norm", "out")}
    barrier = _timing.stream_barrier(device, group)
    rows: list[dict[str, object]] = []
    t_grid = time.monotonic()
    with _timing.side_stream(device), phases() as spent:
        for shape in wanted:
            comm.for_model(shape.hidden)
            model = stepmodel.Model(shape, 0, 1, device, comm, flat)
            spent_s: dict[str, float] = {}

            def one(case: stepmodel.Case, model: stepmodel.Model = model,
                    spent_s: dict[str, float] = spent_s) -> dict[str, Any]:
                t = time.monotonic()
                r = stepmodel.run_case(model, case, gloo, barrier)
                _device.wait_device(60.0)
                spent_s[case.key] = time.monotonic() - t
                return r

            # the probe's own loop over the cases: a case of a token count measured before is not run again
            for key, r in step.measure_cases(stepmodel.CASES, one).items():
                ran = key in spent_s
                rows.append({"shape": shape.name, "case": key,
                             "verdict": r.get("verdict") if ran else f"same_graph_as {r.get('same_graph_as')}",
                             "s": round(spent_s.get(key, 0.0), 3),
                             "allreduces": allreduces(shape.blocks, stepmodel.REPLAYS) if ran else 0})
            del model, one
            torch.cuda.empty_cache()
        grid_s = time.monotonic() - t_grid
        grid_phases = dict(spent)  # the agreement cases below are timed as a whole
        t_agree = time.monotonic()
        agreed = _agree.run_cases(stepmodel.agreement_bind(comm, 0, 1, flat),
                                  step.agreement_cases(False, comm.dtypes), gloo, lambda _m: None)
        agree_s = time.monotonic() - t_agree
    calls = sum(int(str(r["allreduces"])) for r in rows)
    links_s = calls * link_us / 1e6
    out = {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__, "world_widths": world,
           "shapes": len(wanted), "cases": len(stepmodel.CASES), "replays": stepmodel.REPLAYS,
           "setup_s": round(setup_s, 2), "grid_s": round(grid_s, 2), "agreement_s": round(agree_s, 2),
           "agreement_cases": len(agreed), "allreduces": calls,
           "link_us": link_us, "links_s": round(links_s, 2),
           "estimate_s": round(grid_s + agree_s + links_s, 2),
           "phases_s": {k: round(v, 2) for k, v in grid_phases.items()}, "rows": rows}
    dist.destroy_process_group()
    return out

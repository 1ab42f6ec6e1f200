"""The records the packaged prior is made from: every timed result of a results root, as (host class, shape,
seconds) (host side; ``tools/make_prior.py`` writes checks/run/cost/prior.json from them).

Only timed results count (checks.run.runprogress.timed: not carried from an earlier run, not decided without
running). A record whose world size exceeds its host's GPU count without saying its ranks share GPUs is left
out: such keys come from runs made before shared placement was part of a variant's key, and their seconds
would read as a GPU per rank. Folders and files that are links are not followed (the one results reader's rules
apply to each file).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

from checks.results.store import read_file, read_manifest
from checks.run import runprogress
from checks.run.cost import model
from inenv.probe import key_parts
from inenv.status import Status

MAX_GRID_BYTES = 1 << 20
MAX_GRID_WORLD = 64
STEP_GRID_GLOB = "benchmarks/results/*/step-grid-*.json"


def records(root: Path, build_params: Mapping[str, str],
            leave_out: frozenset[str] = frozenset()) -> Iterator[model.Record]:
    """The :data:`model.Record` of every timed result under ``root`` (one folder per host) but those of the hosts
    in ``leave_out``; ``build_params``: each probe's build parameter (fi-jit: module), part of the shape. A run is
    quiet when none of its timed results of a probe with a build parameter measured a compile."""
    folders = sorted(p for p in root.iterdir() if p.is_dir() and not p.is_symlink()
                     and p.name not in leave_out) if root.is_dir() else []
    for folder in folders:
        for path in sorted(p for p in folder.glob("*.jsonl") if not p.is_symlink()):
            made = read_manifest(path.with_name(path.name.removesuffix(".jsonl") + ".manifest.json"))[0] or {}
            cls = runprogress.host_class(made.get("facts"))
            if cls is None:
                continue
            label = model.host_label(cls.gpu_name, cls.gpu_count)
            results = [(r, bool(build_params.get(r.probe_id)) and _positive(r.verdict.metrics.get("compile_s")))
                       for r in read_file(path)[0] if runprogress.timed(r)]
            quiet = not any(compiled for _, compiled in results)
            for r, compiled in results:
                if shape := shape_of(r.probe_id, r.variant, build_params, compiled):
                    if cls.gpu_count and shape.ranks > cls.gpu_count and not shape.shared:
                        continue
                    yield (label, shape, r.verdict.duration_s, path.name.removesuffix(".jsonl"),
                           r.verdict.status is not Status.SKIP, quiet, r.code.probe_hash if r.code else "")


def shape_of(probe: str, variant_key: str, build_params: Mapping[str, str],
             compiled: bool = False) -> model.Shape | None:
    """The shape of a recorded variant key (``ranks=2,placement=shared,gpus=1,backend=nccl``; ``compiled``: its
    result measured a compile, ``metrics.compile_s``); None when its world size is not a number."""
    params = dict(key_parts(variant_key))
    ranks = params.get("ranks", "1")
    if not ranks.isdigit():
        return None
    build = build_params.get(probe, "")
    return model.Shape(probe, int(ranks), params.get("placement") == "shared", params.get(build, "") if build else "",
                       compiled, params.get("depth") == "setup")


def _positive(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


def committed_step_grids(root: Path) -> list[Path]:
    """The JSONs benchmarks/bench_step_grid.py wrote that the repository under ``root`` holds, oldest folder
    first (the folders are named by date), as :func:`step_grids` takes them."""
    return sorted(root.glob(STEP_GRID_GLOB))


def step_grids(paths: Iterable[Path]) -> dict[str, dict[model.Shape, float]]:
    """Per GPU name, the step's GPU-per-rank shapes benchmarks/bench_step_grid.py measured as one rank (its JSON:
    ``gpu``, ``world_widths``, ``estimate_s``), a later path of the same GPU and world size standing over an
    earlier one (the benchmark's folders are named by date). A file that is a link, too large, unreadable or not of
    that form is left out: these files are data."""
    out: dict[str, dict[model.Shape, float]] = {}
    for path in paths:
        try:
            if path.is_symlink() or path.stat().st_size > MAX_GRID_BYTES:
                continue
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(data, dict):
            continue
        gpu, world, seconds = data.get("gpu"), data.get("world_widths"), data.get("estimate_s")
        if not isinstance(gpu, str) or not gpu.strip() or len(gpu) > 200 or not gpu.isprintable() \
                or type(world) is not int or not 2 <= world <= MAX_GRID_WORLD \
                or not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not math.isfinite(seconds) \
                or not 0 < seconds <= model.MAX_SECONDS:
            continue
        out.setdefault(gpu, {})[model.Shape("step", world, False)] = float(seconds)
    return out

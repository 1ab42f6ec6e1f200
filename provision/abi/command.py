"""`provision abi`: index what the catalogue lists, judge every pair, print the grid (or JSON), and keep the
grid as the page's data (docs/abi-grid.json) when the whole catalogue was asked for."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from common import abi
from common.catalog import Catalog
from inenv import atomic
from provision.abi import index, view


@dataclass(frozen=True)
class AbiOptions:
    catalog: Catalog
    packages: tuple[str, ...] = ()  # narrow the extensions to these distributions
    json: bool = False
    detail: bool = False
    offline: bool = False  # only indexes already made
    variants: bool = False  # also the torch releases' other CUDA builds, from the PyTorch index
    index_url: str | None = None
    root: Path = abi.ABI_CACHE
    page_data: Path | None = abi.GRID_DATA  # where the grid is kept for `checks report`; None: nowhere


def run(opts: AbiOptions) -> int:
    start = time.monotonic()
    made = index.ensure(index.wants(opts.catalog, opts.packages, opts.variants), opts.root, opts.index_url,
                        offline=opts.offline)
    torches = [m.index for m in made if isinstance(m.index, abi.TorchIndex)]
    exts = [m.index for m in made if isinstance(m.index, abi.ExtensionIndex)]
    g = abi.grid(torches, exts)
    seconds = time.monotonic() - start
    timing = opts.root / "timing.json"
    new = [m for m in made if m.index is not None and m.origin != "cache"]
    if new:
        atomic.write_json(timing, {"seconds": round(seconds, 1), "made": len(new),
                                   "streamed": sum(m.read_bytes for m in new)})
    try:
        cold = json.loads(timing.read_text())
    except (OSError, ValueError):
        cold = None
    data = {**abi.grid_json(g), "unlinked": sorted(e.label for e in exts if e not in g.extensions),
            "not_indexed": {m.want.key: m.why for m in made if m.index is None}}
    whole = not opts.packages and not any(m.why == index.NOT_YET for m in made)  # the page's grid is never partial
    if opts.page_data is not None and whole and torches:
        abi.save_grid_data(data, opts.page_data)
    if opts.json:
        print(json.dumps({**data, "seconds": round(seconds, 2), "cold": cold}, indent=1))
    else:
        lines = view.grid_lines(g, opts.detail)
        if data["unlinked"]:
            lines.append(f"no torch linkage (not in the grid): {', '.join(data['unlinked'])}")
        print("\n".join(lines + view.summary(made, seconds, cold if not new else None)))
    return 0

"""Write checks/run/prior.json: the median seconds of each variant shape (probe, world size, placement, build
module) per class of host, from the committed results under results/ (or --results DIR).

    uv run python tools/make_prior.py [--results results] [--out checks/run/prior.json]

Only timed results count (checks.run.runprogress.timed: not carried from an earlier run, not decided without
running). A record whose world size exceeds its host's GPU count without saying its ranks share GPUs is left
out: such keys come from runs made before shared placement was part of a variant's key, and their seconds
would read as a GPU per rank.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from checks.results.store import read_file, read_manifest  # noqa: E402
from checks.run import costmodel, runprogress  # noqa: E402
from inenv import atomic, registry  # noqa: E402


def records(root: Path) -> Iterator[tuple[str, costmodel.Shape, float]]:
    build = {pid: mod.SPEC.build_param for pid, (_, mod) in registry.discover().items()}
    for folder in sorted(p for p in root.iterdir() if p.is_dir() and not p.is_symlink()):
        for path in sorted(folder.glob("*.jsonl")):
            made = read_manifest(path.with_name(path.name.removesuffix(".jsonl") + ".manifest.json"))[0] or {}
            cls = runprogress.host_class(made.get("facts"))
            if cls is None:
                continue
            label = costmodel.host_label(cls.gpu_name, cls.gpu_count)
            for r in read_file(path)[0]:
                if not runprogress.timed(r):
                    continue
                params = dict(p.partition("=")[::2] for p in r.variant.split(","))
                ranks = int(params.get("ranks", "1") or 1) if params.get("ranks", "1").isdigit() else 1
                shared = params.get("placement") == "shared"
                if cls.gpu_count and ranks > cls.gpu_count and not shared:
                    continue
                module = params.get(build.get(r.probe_id) or "", "") if build.get(r.probe_id) else ""
                yield label, costmodel.Shape(r.probe_id, ranks, shared, module), r.verdict.duration_s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", type=Path, default=ROOT / "results")
    ap.add_argument("--out", type=Path, default=costmodel.PRIOR_PATH)
    args = ap.parse_args(argv)
    data = costmodel.derive(records(args.results))
    atomic.write_json(args.out, data)
    n = sum(len(v) for v in data["classes"].values())
    print(f"{args.out}: {n} shape(s) in {len(data['classes'])} host class(es): {', '.join(data['classes'])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

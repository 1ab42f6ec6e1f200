"""Freezes the recorded results the advise/estimate/diff goldens are made from (run once; the output is committed).

Every line is a real result from results/ as committed: the 2x H200 host's runs (the allreduce-path probes) and
the no-GPU host's fi-jit runs (cells that differ in one axis, for nearest green). Only evidence that none of the
decision code reads is dropped (per-size timing records, log tails), to keep the files small; statuses,
metrics and the evidence of exactness are kept as measured.

    uv run python tests/golden/advise/make_fixture.py
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
OUT = Path(__file__).resolve().parent / "results"
KEEP = {"h200x2-5bce98f7": {"ar-latency", "custom-ar", "symm-mem", "nccl-graphs", "fi-fusion"},
        "cpu-5bce98f7": {"fi-jit"}}
DROP = ("per_size", "nccl_per_size", "log_tail", "transports", "algorithms_chosen", "nccl_warnings", "env",
        "runtime", "clocks")


def main() -> None:
    shutil.rmtree(OUT, ignore_errors=True)
    for host, probes in KEEP.items():
        (OUT / host).mkdir(parents=True)
        for src in sorted((ROOT / "results" / host).glob("*.jsonl")):
            lines = []
            for raw in src.read_text().splitlines():
                obj = json.loads(raw)
                if obj["probe_id"] in probes:
                    obj["evidence"] = {k: v for k, v in obj["evidence"].items() if k not in DROP}
                    lines.append(json.dumps(obj, sort_keys=True, separators=(",", ":")))
            if lines:
                (OUT / host / src.name).write_text("\n".join(lines) + "\n")
                manifest = src.with_name(src.name[: -len(".jsonl")] + ".manifest.json")
                shutil.copyfile(manifest, OUT / host / manifest.name)


if __name__ == "__main__":
    main()

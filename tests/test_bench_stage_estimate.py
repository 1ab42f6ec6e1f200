"""bench_stage_estimate's reading of a stage log and its replay through the estimator (no stage is run)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.checks_helpers import benchmark

ROOT = Path(__file__).resolve().parent.parent
LOG = """10:00:00 kernels: 3 module build(s) in 2 cell(s), 2 at a time, longest first; about 10m00s left (by x)
10:00:00 c1 kernels: [1/3] trtllm_comm for 9.0a 12.0a
10:00:00 c1 kernels: [2/3] moe_a2a for 9.0a 12.0a
10:00:00 c2 kernels: [3/3] moe_a2a for 9.0a 12.0a copied from c1's build of the same inputs: nothing compiled
10:00:30 kernels: 0/3 done, compiling [1/3] ...; 10 CPU-s spent in 30 s; about 9m30s left (by x)
10:01:00 kernels: 0/3 done, compiling [1/3] ...; 10 CPU-s spent in 30 s; about 1h02m left (by x)
10:01:20 c1 kernels: moe_a2a carried for 9.0a 12.0a (1.0 MB, 80 s)
10:01:30 kernels: 1/3 done, compiling [1/3] ...; 10 CPU-s spent in 30 s; about 5m00s left (by x)
10:02:30 c1 kernels: trtllm_comm carried for 9.0a (1.0 MB, 150 s); refused by flashinfer's gate: 12.0a (fi-arch-gate)
"""
COMPILED = [{"cell": "c1", "module": "moe_a2a", "compile_cpu_s": 80, "arch_list": "9.0a 12.0a"},
            {"cell": "c1", "module": "trtllm_comm", "compile_cpu_s": 150, "arch_list": "9.0a 12.0a"},
            {"cell": "c0", "module": "vllm_comm", "compile_cpu_s": 12, "arch_list": "9.0a 12.0a 12.0f"}]


def _bench():
    return benchmark("bench_stage_estimate")


def test_a_stage_log_is_read_and_replayed_tick_by_tick(tmp_path: Path) -> None:
    bench = _bench()
    (tmp_path / "stage.log").write_text(LOG)
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps(r) for r in COMPILED))
    parsed = bench.parse(tmp_path / "stage.log", tmp_path / "c.jsonl")
    jobs = parsed["jobs"]
    assert jobs[("c1", "trtllm_comm")]["built"] == 1 and jobs[("c1", "moe_a2a")]["built"] == 2
    assert jobs[("c2", "moe_a2a")]["copied"] and jobs[("c2", "moe_a2a")]["end"] == jobs[("c2", "moe_a2a")]["begin"]
    assert parsed["ticks"] == [(36030.0, 570.0), (36060.0, 3720.0), (36090.0, 300.0)]
    assert parsed["learned"] == 4.0  # the quick module's 12 CPU-s over three targets
    replayed = bench.replay(parsed, 2)
    # at the first tick: fi-jit declares 950 and 340 CPU-s a target, 14 for vllm_comm, which ran here at 4 a
    # target; each running build has spent 30 of its CPU seconds (spread evenly over its wall time)
    scale = 4.0 / 14.0
    cores = max(1, min(4, os.cpu_count() or 1))
    assert replayed[0] == (36030.0, pytest.approx((950 * 2 * scale - 30 + 340 * 2 * scale - 30) / cores))
    # after moe_a2a ended (80 CPU-s against 680 declared), trtllm_comm still counts from the estimate it began with
    assert replayed[2] == (36090.0, pytest.approx((950 * 2 * scale - 90) / cores))
    (tmp_path / "cut.log").write_text(LOG.rsplit("\n", 2)[0])  # the stage's last build never ended
    with pytest.raises(SystemExit, match="had not ended"):
        bench.parse(tmp_path / "cut.log", tmp_path / "c.jsonl")

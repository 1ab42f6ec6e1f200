"""The headline of a passing variant: the one key measurement the table, `checks diff` and the change notes
show for it (pure)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from checks.footnotes import clean as _clean
from checks.result import is_number


def headline(metrics: Mapping[str, Any]) -> str:
    """The key measurement of a passing variant: the probe's own `headline`, else a latency ratio to NCCL,
    else a latency range, else an all-to-all workspace size or a compile time."""
    if isinstance(metrics.get("headline"), str):
        return _clean(metrics["headline"], 80)
    ratio = metrics.get("ratio_vs_nccl")
    lat, base = metrics.get("latency_us"), metrics.get("nccl_latency_us")
    if not ratio and isinstance(lat, dict) and isinstance(base, dict):  # probes that store both sides only
        ratio = {k: float(v) / float(base[k]) for k, v in lat.items() if is_number(v) and is_number(base.get(k))
                 and float(base[k]) > 0}
    if isinstance(ratio, dict) and ratio:
        vals = sorted(float(v) for v in ratio.values() if isinstance(v, int | float))
        if vals:
            return f"{vals[0]:.2f}–{vals[-1]:.2f}× NCCL time" if len(vals) > 1 else f"{vals[0]:.2f}× NCCL time"
    lat = metrics.get("latency_us")
    if isinstance(lat, dict) and lat:
        vals = sorted(float(v) for v in lat.values() if isinstance(v, int | float))
        if vals:
            return f"{vals[0]:.1f}–{vals[-1]:.1f} µs"
    ws = metrics.get("workspace_bytes_per_rank")
    if is_number(ws):
        return f"{ws / 2**20:.1f} MiB workspace/rank"
    compile_s = metrics.get("compile_s")
    if is_number(compile_s):
        return f"compiled in {compile_s:.0f} s"
    return ""

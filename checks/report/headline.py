"""The headline of a passing variant: the one key measurement the table, `checks diff` and the change notes
show for it, read through the metrics its probe declares (pure)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from checks.report.footnotes import clean as _clean
from checks.results.result import is_number
from inenv.probe import Declared, Role


def headline(metrics: Mapping[str, Any], fields: Declared) -> str:
    """The key measurement of a passing variant, from the metrics its probe declares (``fields``): the probe's
    own headline, else a latency ratio to NCCL, else a latency range, else a workspace size or a compile time."""
    def get(role: Role) -> Any:
        key = fields.metric(role)
        return metrics.get(key) if key is not None else None

    if isinstance(text := get(Role.HEADLINE), str):
        return _clean(text, 80)
    ratio = get(Role.RATIO_VS_NCCL)
    lat, base = get(Role.LATENCY), get(Role.NCCL_LATENCY)
    if not ratio and isinstance(lat, dict) and isinstance(base, dict):  # probes that store both sides only
        ratio = {k: float(v) / float(base[k]) for k, v in lat.items() if is_number(v) and is_number(base.get(k))
                 and float(base[k]) > 0}
    if isinstance(ratio, dict) and ratio:
        vals = sorted(float(v) for v in ratio.values() if isinstance(v, int | float))
        if vals:
            return f"{vals[0]:.2f}–{vals[-1]:.2f}× NCCL time" if len(vals) > 1 else f"{vals[0]:.2f}× NCCL time"
    if isinstance(lat, dict) and lat:
        vals = sorted(float(v) for v in lat.values() if isinstance(v, int | float))
        if vals:
            return f"{vals[0]:.1f}–{vals[-1]:.1f} µs"
    ws = get(Role.WORKSPACE)
    if is_number(ws):
        return f"{ws / 2**20:.1f} MiB workspace/rank"
    compile_s = get(Role.COMPILE_TIME)
    if is_number(compile_s):
        return f"compiled in {compile_s:.0f} s"
    return ""

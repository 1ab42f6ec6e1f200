"""Integer-valued inputs and exact checks for collectives.

- Inputs are small integers (-4..4) stored in bf16, so any sum over up to 32 ranks is exact and the
  reference is computed locally on every rank from the formula (no collective checks a collective).
- Outputs are pre-filled with a sentinel that no correct result can contain, so a kernel that did
  nothing is told apart from one that computed the wrong numbers.
- The residual add + RMSNorm of a fused allreduce is compared with a reference computed as the kernel does (fp32,
  one rounding to bf16), within one bf16 ulp.

In-environment side: standard library at module level, torch inside the functions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

SENTINEL = 111.0  # exactly representable in bf16, outside every possible sum of -4..4 inputs over <= 27 ranks
HIDDEN = 7168  # DeepSeek-V3 / Kimi hidden size: the decode allreduce that serving engines run


def pattern(shape: Sequence[int], rank: int, seed: int, device: Any = "cpu", dtype: Any = None) -> Any:
    """Deterministic small integers in -4..4 that differ per rank, per seed and per element."""
    import torch

    dtype = dtype or torch.bfloat16
    n = math.prod(shape)
    idx = torch.arange(n, device=device, dtype=torch.int64)
    vals = (idx * 5 + rank * 3 + seed * 7 + (idx // 13) * rank) % 9 - 4
    return vals.to(dtype).reshape(tuple(shape))


def pattern_sum(shape: Sequence[int], world_size: int, seed: int, device: Any = "cpu", dtype: Any = None) -> Any:
    """The exact allreduce(sum) of :func:`pattern` over ranks 0..world_size-1, summed in int64."""
    import torch

    dtype = dtype or torch.bfloat16
    total = sum(pattern(shape, r, seed, device, torch.int64) for r in range(world_size))
    return total.to(dtype)


def filled(shape: Sequence[int], value: float = SENTINEL) -> Any:
    """A CPU tensor holding what a sentinel-filled output buffer held before the call."""
    import torch

    return torch.full(tuple(shape), value, dtype=torch.float64)


@dataclass(frozen=True)
class Check:
    """Result of comparing a collective's output with its exact reference."""

    verdict: str  # exact | close | no-op | zero | wrong
    mismatches: int = 0
    numel: int = 0
    max_abs_err: float = 0.0
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.verdict == "exact"

    def to_json(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            "mismatches": self.mismatches,
            "numel": self.numel,
            "max_abs_err": self.max_abs_err,
            "detail": self.detail,
        }


def equal_exactly(out: Any, expected: Any) -> bool:
    """Whether ``out`` holds exactly the finite values of ``expected``, compared where both live (a GPU
    compares millions of elements in microseconds; copying them to the host and comparing there took
    seconds per variant). False says nothing more: :func:`check_exact` then names the kind of mismatch."""
    import torch

    if out.device != expected.device or out.numel() != expected.numel():
        return False
    ref = expected.detach().reshape(-1).to(torch.float64)
    return bool(torch.isfinite(ref).all()) and bool(torch.equal(out.detach().reshape(-1).to(torch.float64), ref))


def check_exact(
    out: Any,
    expected: Any,
    *,
    prior: Any = None,
    own_input: Any = None,
    atol: float = 0.0,
) -> Check:
    """Compare exactly first; a tolerance, if given, is only a second, reported level.

    ``prior`` is what the output buffer held before the call (the sentinel fill) and ``own_input``
    this rank's contribution: an output equal to either, when the reference differs from it, is a
    silent no-op rather than a wrong result.
    """
    import torch

    if equal_exactly(out, expected):
        return Check("exact", 0, expected.numel(), 0.0)
    got = out.detach().to("cpu", torch.float64).reshape(-1)
    ref = expected.detach().to("cpu", torch.float64).reshape(-1)
    numel = ref.numel()
    if got.numel() != numel:
        return Check("wrong", numel, numel, math.inf, f"shape {tuple(out.shape)} vs {tuple(expected.shape)}")
    diff = (got - ref).abs()
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, math.inf), diff)
    mismatches = int((diff != 0).sum())
    max_err = float(diff.max()) if numel else 0.0
    if mismatches == 0:
        return Check("exact", 0, numel, 0.0)
    for name, before in (("prior contents", prior), ("own input", own_input)):
        if before is None:
            continue
        b = before.detach().to("cpu", torch.float64).reshape(-1)
        if b.numel() == numel and bool(torch.equal(got, b)) and not bool(torch.equal(b, ref)):
            return Check("no-op", mismatches, numel, max_err, f"output equals its {name}")
    if bool((got == 0).all()) and not bool((ref == 0).all()):
        return Check("zero", mismatches, numel, max_err, "output is all zero")
    if atol > 0 and max_err <= atol:
        return Check("close", mismatches, numel, max_err, f"within atol {atol}, not exact")
    return Check("wrong", mismatches, numel, max_err, f"{mismatches}/{numel} elements differ")


# --- the residual add + RMSNorm flashinfer's fused allreduce computes, as a reference, and how close a result must
# come to it: shared by the fusion's own probe, the step's fused backend and its agreement check
EPS = 1e-6


def reference(inp_sum: Any, residual: Any, gamma: Any) -> tuple[Any, Any]:
    """(residual_out, norm_out) as the kernel computes them: bf16 sum, then RMSNorm in fp32."""
    import torch

    res_out = (inp_sum.float() + residual.float()).to(torch.bfloat16)
    x = res_out.float()
    rms = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + EPS)
    return res_out, (x * rms * gamma.float()).to(torch.bfloat16)


def norm_check(got: Any, ref: Any) -> dict[str, Any]:
    """Bit-exact fraction, and the pass level: every element within one bf16 ulp of the reference."""
    import torch

    g = got.float().cpu()
    r = ref.float().cpu()
    diff = (g - r).abs()
    ulp = torch.clamp(r.abs(), min=2.0**-10) * 2.0**-7
    sentinel = bool((g == SENTINEL).all())
    return {
        "exact_fraction": round(float((diff == 0).float().mean()), 6),
        "max_abs_err": float(diff.max()),
        "within_1ulp": bool((diff <= ulp).all()) and not sentinel,
        "untouched": sentinel,
    }

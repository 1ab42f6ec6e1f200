"""The residual add + RMSNorm that flashinfer's fused allreduce computes, as a reference, and how close a result
must come to it: shared by the fusion's own probe, the step's fused backend and its agreement check."""

from __future__ import annotations

from typing import Any

from inenv.kit import _data

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
    sentinel = bool((g == _data.SENTINEL).all())
    return {
        "exact_fraction": round(float((diff == 0).float().mean()), 6),
        "max_abs_err": float(diff.max()),
        "within_1ulp": bool((diff <= ulp).all()) and not sentinel,
        "untouched": sentinel,
    }

"""Clamped SwiGLU with the routing weight folded in, then the FP8 requant that feeds the L2 GEMM.

    g = min(gate, clamp);  u = clamp(up, -clamp, clamp)
    v = silu(g) * u  with  silu(g) = g * (1 / (1 + exp(-g)))            # FP32
    vw = v * topk_weight                                                # before the requant
    per token, per G channels:  amax = max |vw|
        pow2_ceil:   sf = 2**ceil(log2(amax * fl32(1/448)))   (amax 0 -> sf 0, values 0)
        continuous:  sf = max(amax, floor) * fl32(1/448)
        div448:      sf = max(fl32(amax / 448), fl32(1e-30))   (Humming: an IEEE division)
    q = e4m3_rn_satfinite(vw * (1 / sf))

The kernels use a fast-math sigmoid (approximate exp and reciprocal). ``silu_exp="fast-math"`` models the
exp as CUDA's __expf computes it, ex2.approx(fl32(-g * fl32(log2 e))): the rounded product is most of its
error; the approximate ex2 itself (a few ulps) is modelled by exp2 in float64 rounded once, and rcp.approx by
IEEE division. What is left can flip an FP8 code where vw / sf lies on a rounding boundary.
"""

from __future__ import annotations

import torch

from ..formats import E4M3_MAX, e4m3_satfinite, e8m0_to_float, float_to_e8m0
from ..layouts.staging import fp8_scale_div448, reciprocal_rn

_INV_448 = torch.tensor(1.0 / E4M3_MAX, dtype=torch.float32)
_LOG2E_F32 = 1.4426950408889634  # __expf multiplies its argument by fl32(log2 e) in FP32


def swiglu(h: torch.Tensor, clamp: float, gate_up_bf16: bool = False, silu_exp: str = "fp32") -> torch.Tensor:
    """h [M, 2I] (gate columns then up columns; the logical order, not a kernel's interleave) -> v [M, I].
    ``silu_exp``: "fp32" (exp in h's dtype), "fp64-rounded" (exp in float64, rounded once to h's dtype) or
    "fast-math" (__expf: the argument times fl32(log2 e) rounded to h's dtype, then exp2 in float64 rounded)."""
    i = h.shape[-1] // 2
    g, u = h[..., :i], h[..., i:]
    if gate_up_bf16:
        g, u = g.to(torch.bfloat16).to(h.dtype), u.to(torch.bfloat16).to(h.dtype)
    g = g.clamp(max=clamp)
    u = u.clamp(min=-clamp, max=clamp)
    if silu_exp == "fast-math":
        e = torch.exp2((-g * torch.tensor(_LOG2E_F32, dtype=g.dtype)).double()).to(g.dtype)
    elif silu_exp == "fp64-rounded":
        e = torch.exp(-g.double()).to(g.dtype)
    else:
        e = torch.exp(-g)
    return g * (1.0 / (1.0 + e)) * u


def requant_fp8(
    vw: torch.Tensor, group: int, rule: str = "pow2_ceil", amax_floor: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """vw fp32 [M, I] -> (e4m3 [M, I], fp32 sf [M, I/group])."""
    *lead, i = vw.shape
    if i % group:
        raise ValueError(f"I={i} must be a multiple of the requant group {group}")
    v3 = vw.float().reshape(*lead, i // group, group)
    amax = v3.abs().amax(dim=-1)  # [..., M, I/G]
    y = amax * _INV_448.to(vw.device)
    if rule == "pow2_ceil":
        pos = y > 0
        sf_bytes = float_to_e8m0(torch.where(pos, y, torch.ones_like(y)), rounding="ceil")
        sf = torch.where(pos, e8m0_to_float(sf_bytes), torch.zeros_like(y))
    elif rule == "continuous":
        sf = amax.clamp(min=amax_floor) * _INV_448.to(vw.device)
    elif rule == "div448":
        sf = fp8_scale_div448(amax)
        return e4m3_satfinite(v3 * reciprocal_rn(sf).unsqueeze(-1)).reshape(*lead, i), sf
    else:
        raise ValueError(f"rule must be 'pow2_ceil', 'continuous' or 'div448', got {rule!r}")
    inv = torch.where(sf > 0, torch.reciprocal(sf), torch.zeros_like(sf))
    q = e4m3_satfinite(v3 * inv.unsqueeze(-1)).reshape(*lead, i)
    return q, sf

"""The expert GEMMs with per-K-block promotion of the activation scale, as the SM90 kernels do it.

For each K block kb (``promote_k`` wide, ascending):
    partial[m, n] = sum_{k in kb} a[m, k] * b[n, k]        # the FP8 tensor-core product
    acc[m, n]     = fma(a_sf[m, kb] * b_sf[n, kb], partial[m, n], acc[m, n])     # FP32

a and b hold e4m3 values (as float32), so every product is exact and a 128-term sum of them
spans at most 43 bits: in float64 it is exact, whatever the order. The reference therefore
computes ``partial`` exactly and rounds it once to FP32; what a real tensor core does inside the
block (its own rounding) is the one residual the reference does not model. The FP32 FMA is
emulated in float64 (the product of two FP32 numbers is exact there) then rounded once.
"""

from __future__ import annotations

import torch


def promoted_gemm(
    a: torch.Tensor,
    a_sf: torch.Tensor,
    b: torch.Tensor,
    b_sf: torch.Tensor | None,
    promote_k: int,
    mma: str = "exact-block",
) -> torch.Tensor:
    """a [..., M, K] (e4m3 values), a_sf fp32 [..., M, K/ga], b [..., N, K] (e4m3 values), b_sf fp32
    [..., N/128, K/128] or None -> fp32 [..., M, N]. Leading dims batch experts: each output row
    depends only on its own inputs, so batching never changes a bit.

    ``promote_k`` is the promotion block; it must divide the activation-scale group ga and 128.
    ``mma`` names the block-sum model (``megamoe.reference.tensorcore``): "exact-block" (exact, one
    FP32 rounding) or "sm90-fp8-tc" (the H200 tensor cores' own accumulation, emulated).
    """
    *lead, m, k = a.shape
    n = b.shape[-2]
    if b.shape[-1] != k or tuple(b.shape[:-2]) != tuple(lead):
        raise ValueError(f"a is {tuple(a.shape)} but b is {tuple(b.shape)} (want [..., N, {k}])")
    if k % promote_k:
        raise ValueError(f"K={k} must be a multiple of promote_k={promote_k}")
    ga = k // a_sf.shape[-1]
    if ga % promote_k:
        raise ValueError(f"activation scale group {ga} must be a multiple of promote_k={promote_k}")
    nkb = k // promote_k
    if m == 0:
        return torch.zeros(*lead, 0, n, dtype=torch.float32, device=a.device)
    # [..., KB, M, pk] @ [..., KB, pk, N] -> [..., KB, M, N], exact in float64, then one rounding to FP32.
    a3 = a.double().reshape(*lead, m, nkb, promote_k).movedim(-2, -3)
    b3 = b.double().reshape(*lead, n, nkb, promote_k).movedim(-2, -3).transpose(-1, -2)
    if mma == "exact-block":
        partial = torch.matmul(a3, b3).float()
        del a3, b3
    else:
        from .tensorcore import MODELS, tc_dot

        model = MODELS[mma]
        a4, b4 = a3.reshape(-1, nkb, m, promote_k), b3.reshape(-1, nkb, promote_k, n)
        partial = torch.stack(
            [torch.stack([tc_dot(a4[j, kb], b4[j, kb].T, model) for kb in range(nkb)]) for j in range(a4.shape[0])]
        ).reshape(*lead, nkb, m, n)
    acc = torch.zeros(*lead, m, n, dtype=torch.float32, device=a.device)
    rows = torch.arange(n, device=a.device) // 128
    for kb in range(nkb):
        scale = a_sf[..., (kb * promote_k) // ga].unsqueeze(-1)  # [..., M, 1]
        if b_sf is not None:
            scale = scale * b_sf[..., rows, (kb * promote_k) // 128].unsqueeze(-2)  # FP32 product [..., M, N]
        acc = (scale.double() * partial[..., kb, :, :].double() + acc.double()).float()
    return acc


def exact_gemm(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Plain a [..., M, K] @ b[..., N, K]^T in ``dtype`` (the ``exact`` recipe)."""
    return a.to(dtype) @ b.to(dtype).transpose(-1, -2)

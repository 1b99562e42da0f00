"""The expert GEMMs with per-K-block promotion of the activation scale, as the SM90 kernels do it.

For each K block kb (``promote_k`` wide, ascending):
    partial[m, n] = sum_{k in kb} a[m, k] * b[n, k]        # the FP8 tensor-core product
    acc[m, n]     = fma(a_sf[m, kb] * b_sf[n, kb], partial[m, n], acc[m, n])     # FP32

a and b hold e4m3 values (as float32), so every product is exact and a 128-term sum of them
spans at most 43 bits: in float64 it is exact, whatever the order. The reference therefore
computes ``partial`` exactly and rounds it once to FP32; what a real tensor core does inside the
block (its own rounding) is the one residual the reference does not model. The FP32 FMA is
emulated in float64 (the product of two FP32 numbers is exact there) then rounded once.

``accumulate`` names how the block sums are combined (what the kernel's epilogue does with them):

    promote        acc = fma(s_kb, block_kb, acc)                 a fresh tensor-core block per kb, then FFMA
                   (FlashInfer; DeepGEMM's kReuseAccumAsFinal=false configurations)
    rescale        acc = fl(tc(fl(acc * fl(1 / s_kb)), block_kb) * s_kb)
                   the running sum stays in the tensor-core accumulator, divided by the block's scale
                   before the block's MMAs and multiplied back after (DeepGEMM SM90 FP8,
                   kReuseAccumAsFinal=true with hidden < 7168: ``prescale`` / ``postscale``)
    rescale-ratio  acc = tc(fl(acc * r_kb), block_kb), r_kb = fl(s_{kb-1} * fl(1 / s_kb)), times the last
                   scale at the end (the same flag with hidden >= 7168; read from source, never run)

with s_kb = a_sf * b_sf (FP32). In the rescale modes the tensor cores' own rounding applies to the whole
running sum, not to one block, which is why those configurations sit further from an exact-block
reference (measured on the H200: docs/kernel-numerics.md). ``1 / s`` models the kernel's
``rcp.approx.ftz`` as the correctly rounded reciprocal.
"""

from __future__ import annotations

import torch

from ..recipe import ACCUMULATE_MODES


def promoted_gemm(
    a: torch.Tensor,
    a_sf: torch.Tensor,
    b: torch.Tensor,
    b_sf: torch.Tensor | None,
    promote_k: int,
    mma: str = "exact-block",
    accumulate: str = "promote",
) -> torch.Tensor:
    """a [..., M, K] (e4m3 values), a_sf fp32 [..., M, K/ga], b [..., N, K] (e4m3 values), b_sf fp32
    [..., N/128, K/128] or None -> fp32 [..., M, N]. Leading dims batch experts: each output row
    depends only on its own inputs, so batching never changes a bit.

    ``promote_k`` is the promotion block; it must divide the activation-scale group ga and 128.
    ``mma`` names the block-sum model (``megamoe.reference.tensorcore``): "exact-block" (exact, one
    FP32 rounding) or a tensor-core model ("sm90-fp8-tc-operands": the H200's own accumulation, bit for bit).
    ``accumulate`` is one of ACCUMULATE_MODES (module docstring).
    """
    if accumulate not in ACCUMULATE_MODES:
        raise ValueError(f"accumulate must be one of {ACCUMULATE_MODES}, got {accumulate!r}")
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
    if accumulate != "promote":
        return _rescaled_gemm(a, a_sf, b, b_sf, promote_k, ga, mma, accumulate)
    # [..., KB, M, pk] @ [..., KB, pk, N] -> [..., KB, M, N], exact in float64, then one rounding to FP32.
    # One float64 copy each, written straight in the layout the batched matmul reads (no second copy).
    as_f64 = dict(dtype=torch.float64, memory_format=torch.contiguous_format)
    a3 = a.reshape(*lead, m, nkb, promote_k).movedim(-2, -3).to(**as_f64)
    b3 = b.reshape(*lead, n, nkb, promote_k).movedim(-2, -3).transpose(-1, -2).to(**as_f64)
    if mma == "exact-block":
        partial = torch.matmul(a3, b3).float()
        del a3, b3
    else:
        from .tensorcore import MODELS, tc_dot

        model = MODELS[mma]
        a4, b4 = a3.reshape(-1, nkb, m, promote_k), b3.reshape(-1, nkb, promote_k, n)
        partial = torch.stack([tc_dot(a4[:, kb], b4[:, kb].transpose(-1, -2), model) for kb in range(nkb)], dim=1)
        partial = partial.reshape(*lead, nkb, m, n)
    # s_kb for every block at once, FP32 products held in float64 (exact) so that each step is one FMA.
    scale = _block_scales(a_sf, b_sf, nkb, promote_k, ga, n).double()  # [..., KB, M, N or 1]
    acc = torch.zeros(*lead, m, n, dtype=torch.float64, device=a.device)
    for kb in range(nkb):
        # fma(s, block, acc) in FP32: s * block is exact in float64, so one float64 add then one
        # rounding to FP32 is the FP32 FMA's single rounding.
        acc = torch.addcmul(acc, scale[..., kb, :, :], partial[..., kb, :, :].double()).float().double()
    return acc.float()


def _block_scales(a_sf, b_sf, nkb: int, promote_k: int, ga: int, n: int) -> torch.Tensor:
    """s_kb = a_sf * b_sf for kb < nkb, FP32 [..., KB, M, N] (or [..., KB, M, 1] without weight scales)."""
    kb = torch.arange(nkb, device=a_sf.device)
    scale = a_sf[..., (kb * promote_k) // ga].transpose(-1, -2).unsqueeze(-1)  # [..., KB, M, 1]
    if b_sf is not None:
        rows = torch.arange(n, device=a_sf.device) // 128
        b_cols = b_sf[..., (kb * promote_k) // 128][..., rows, :]  # [..., N, KB]
        scale = scale * b_cols.transpose(-1, -2).unsqueeze(-2)  # FP32 product [..., KB, M, N]
    return scale


def _rescaled_gemm(a, a_sf, b, b_sf, promote_k: int, ga: int, mma: str, accumulate: str) -> torch.Tensor:
    """The ``rescale`` / ``rescale-ratio`` modes: one running accumulator through every block."""
    from .tensorcore import MODELS, tc_dot

    model = MODELS[mma]
    *lead, m, k = a.shape
    n = b.shape[-2]
    nkb = k // promote_k
    a2, b2 = a.reshape(-1, m, k), b.reshape(-1, n, k)
    sa = a_sf.reshape(-1, m, a_sf.shape[-1])
    sb = None if b_sf is None else b_sf.reshape(-1, *b_sf.shape[-2:])
    acc = torch.zeros(a2.shape[0], m, n, dtype=torch.float32, device=a.device)
    prev = None
    scales = _block_scales(sa, sb, nkb, promote_k, ga, n)
    for kb in range(nkb):
        s = scales[:, kb].expand(a2.shape[0], m, n)
        if kb == 0:
            c = acc  # the kernel skips the first prescale: the accumulator is still zero
        elif accumulate == "rescale":
            c = (acc.double() * torch.reciprocal(s).double()).float()
        else:
            c = (acc.double() * (prev.double() * torch.reciprocal(s).double()).float().double()).float()
        blk = slice(kb * promote_k, (kb + 1) * promote_k)
        acc = tc_dot(a2[..., blk], b2[..., blk], model, c=c)
        if accumulate == "rescale":
            acc = (acc.double() * s.double()).float()
        prev = s
    if accumulate == "rescale-ratio" and prev is not None:
        acc = (acc.double() * prev.double()).float()
    return acc.reshape(*lead, m, n)


def exact_gemm(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Plain a [..., M, K] @ b[..., N, K]^T in ``dtype`` (the ``exact`` recipe)."""
    return a.to(dtype) @ b.to(dtype).transpose(-1, -2)


def group_scaled_gemm(a: torch.Tensor, a_sf: torch.Tensor, b: torch.Tensor, b_group_sf: torch.Tensor, promote_k: int,
                      mma: str) -> torch.Tensor:
    """The tensor-core decode recipe (``megamoe-decode-tc``): a fresh MMA per 32-K weight scale group.

    a [..., M, K] e4m3 values, a_sf fp32 [..., M, K/ga]; b [..., N, K] the e4m3 values the MMA reads
    (e2m1 * 2**-6), b_group_sf fp32 [..., N, K/32] powers of two (2**(s - 121)) -> fp32 [..., M, N]:

        d_g   = tc(a_g, b_g) with a zero accumulator       (``mma``: the tensor cores' k32 sum)
        d'_g  = fl32(d_g * sf_g)                           (exact: a power of two, no subnormal, no overflow)
        blk   = fl32 sum of d'_g over the block's groups, ascending K
        acc   = fl32(acc + fl32(a_sf * blk))               (a promotion block of ``promote_k``, ascending K)

    Groups go one at a time through the model (its [..., M, N, 32] float64 products fit in memory)."""
    from .tensorcore import MODELS, tc_dot

    *lead, m, k = a.shape
    n = b.shape[-2]
    if b.shape[-1] != k or b_group_sf.shape[-1] * 32 != k or k % promote_k or promote_k % 32:
        raise ValueError(f"a {tuple(a.shape)}, b {tuple(b.shape)}, b_group_sf {tuple(b_group_sf.shape)}: want "
                         f"b [..., N, K], b_group_sf [..., N, K/32], K a multiple of promote_k={promote_k} (32 | it)")
    ga = k // a_sf.shape[-1]
    if ga % promote_k:
        raise ValueError(f"activation scale group {ga} must be a multiple of promote_k={promote_k}")
    model = MODELS[mma]
    acc = torch.zeros(*lead, m, n, dtype=torch.float32, device=a.device)
    if m == 0:
        return acc
    per_block = promote_k // 32
    for kb in range(k // promote_k):
        blk = None
        for g in range(kb * per_block, (kb + 1) * per_block):
            ks = slice(32 * g, 32 * (g + 1))
            d = tc_dot(a[..., ks].float(), b[..., ks].float(), model)  # [..., M, N] fp32
            dg = d * b_group_sf[..., g].unsqueeze(-2)  # fp32 product, exact
            blk = dg if blk is None else blk + dg
        s = a_sf[..., (kb * promote_k) // ga].unsqueeze(-1)  # [..., M, 1] fp32
        acc = acc + s * blk  # two FP32 roundings: the kernel's mul.rn is never fused into the add
    return acc

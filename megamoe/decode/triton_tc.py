"""The decode path's tensor-core GEMVs (Triton, FP8 MMAs with the weights as the 64-row operand and the
tokens as N = 16 columns); their twins are ``tc.l1_tc_torch`` / ``tc.l2_tc_torch``.

    l1_tc_kernel  grid (W, I / 32):  work item j's expert, gate and up channels [32 t, 32 t + 32) (64 MMA
                  rows) over all H; then SwiGLU, the routing weight and the FP8 requant of those 32 channels
    l2_tc_kernel  grid (W, H / 64):  the same expert's output rows [64 t, 64 t + 64) over all I -> bf16

A program exits at once when j >= num_touched. Its tokens go in passes of 16 (the expert's pool rows), or,
with PACK and at most 4 rows, in one packed pass: a 128-K block's four groups of up to 4 tokens in the 16
columns of one MMA (``_packed_mma``; the same bits). Each loop iteration takes four groups (L1: one 128-K
block; L2: four promotion blocks), their four code blocks in one load (``_load4``): Triton software-pipelines
the code and x tiles, and the scale bytes and activation scales are loaded one iteration ahead by hand.

Numerics (recipe ``megamoe-decode-tc``; ``megamoe.reference.gemm.group_scaled_gemm``), per 32-K group g:
    decode  each byte -> two e4m3 bytes worth e2m1 * 2**-6 (``_decode_block``; exact)
    d_g     tl.dot of the group's [64, 32] weights and [32, 16] x codes, a fresh accumulator: the tensor
            cores' own k32 sum (modelled bit for bit by ``sm90-fp8-tc-operands``)
    d'_g    d_g * 2**(s - 121) in FP32 (exact for scale bytes 20..236, checked at prepare)
    blk     L1: the FP32 sum of the 4 groups of a 128-K block in ascending K; L2: the group itself
    acc     fl32(acc + fl32(x_sf * blk)), blocks in ascending K (two FP32 roundings, no FMA)
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..staging.triton_stage import _e4m3_rtne_bits
from .triton_gemv import _bf16_bits
from .triton_pdl import pdl_release, pdl_wait

NTOK = tl.constexpr(16)  # tokens per pass: the MMA's N


@triton.jit
def _nibbles_to_e4m3(p, ASM: tl.constexpr):
    """Stored bytes (``layout_tc.pack_pair``) -> (lo, hi), each the e4m3 byte worth e2m1 * 2**-6 of one code of
    the pair. On the GPU four bytes per 32-bit register at once, five operations (two shifts, three LOP3)."""
    if ASM:
        lo, hi = tl.inline_asm_elementwise(
            "{ .reg .b32 a, b; and.b32 $0, $2, 0x9c9c9c9c; shl.b32 a, $2, 2; and.b32 a, a, 0x8c8c8c8c; "
            "shr.b32 b, $2, 2; and.b32 b, b, 0x10101010; or.b32 $1, a, b; }",
            "=r,=r,r", [p], dtype=(tl.float8e4nv, tl.float8e4nv), is_pure=True, pack=4)
    else:
        lo = (p & 0x9C).to(tl.float8e4nv, bitcast=True)
        hi = (((p << 2) & 0x8C) | ((p >> 2) & 0x10)).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
    return lo, hi


@triton.jit
def _decode_block(p, ASM: tl.constexpr):
    """One (tile, group) block of codes, uint8 [4, 8, 4, 2, 4] (w, ri, lq, kh, i; layout_tc.py) -> the MMA's A,
    float8e4nv [64, 32], A[16 w + 8 h + ri, 16 kh + 4 lq + i] = the nibble h of byte (w, ri, lq, kh, i) as
    e2m1 * 2**-6: sign to bit 7, magnitude bits (e1 e0 m) to bits 4..2. The block's order is the order in
    which the wgmma register fragment holds A, so that each thread loads its 8 bytes at once and the
    reshapes below move no data. On the GPU four bytes per 32-bit register at once."""
    lo, hi = _nibbles_to_e4m3(p, ASM)
    a = tl.permute(tl.join(lo, hi), (0, 5, 1, 3, 2, 4))  # (w, h, ri, kh, lq, i)
    return tl.reshape(a, (64, 32))


@triton.jit
def _factor(word, g: tl.constexpr):
    """Byte g of each row's scale word, s + 6 (``layout_tc.FACTOR_BIAS``) -> fp32 2**(s - 121): the byte is the
    factor's exponent field (bytes 26..242: normal floats)."""
    return (((word >> (8 * g)) & 0xFF) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _load4(wp):
    """The four consecutive 1,024-byte code blocks at wp as one [4, 1024] load (see ``_blocks4``)."""
    return tl.load(wp + tl.arange(0, 4)[:, None] * 1024 + tl.arange(0, 1024)[None, :])


@triton.jit
def _blocks4(wp):
    """The four consecutive 1,024-byte code blocks at wp, each as [4, 8, 4, 2, 4] (``_decode_block``'s input).

    One [4, 1024] load: along the 1,024 bytes the offsets are contiguous, so the compiler copies 16 bytes per
    thread into shared memory, and each thread's registers then hold bytes [8 i, 8 i + 8) of each block (its
    fragment share); the group split is in registers. Offsets written as a 5-D tensor in the block's own
    order hid that contiguity: the copies walked a block 256 bytes apart per lane (~28 sectors per warp
    request, 5.7 bank-conflicted wavefronts per copy, Nsight Compute on the H200) and made the L1 the
    bottleneck."""
    p = tl.reshape(_load4(wp), (2, 2, 4, 8, 4, 2, 4))
    p = tl.permute(p, (2, 3, 4, 5, 6, 0, 1))  # [..., g // 2, g % 2]
    even, odd = tl.split(p)
    b0, b2 = tl.split(even)
    b1, b3 = tl.split(odd)
    return b0, b1, b2, b3


@triton.jit
def _mma(p, f, xg, ASM: tl.constexpr):
    """One 32-K group: its code block p [4, 8, 4, 2, 4] (``_blocks4``), its factors f [64] (``_factors4``), x [32,
    NTOK] e4m3 -> d' fp32 [64, NTOK] = (tensor-core sum) * 2**(s - 121)."""
    d = tl.dot(_decode_block(p, ASM), xg, out_dtype=tl.float32)
    return d * f[:, None]


@triton.jit
def _factors4(sp):
    """A 128-K block's 64 scale words at sp (int32, ``layout_tc.scale_words``: row r's four group bytes) -> the
    factors of its four groups, fp32 [64] each. One 32-bit load per row, not four byte loads."""
    word = tl.load(sp + tl.arange(0, 64))
    return _factor(word, 0), _factor(word, 1), _factor(word, 2), _factor(word, 3)


@triton.jit
def _block_sum(wp, f0, f1, f2, f3, xp, tok, valid, k0, LD: tl.constexpr, ASM: tl.constexpr):
    """L1: one 128-K block = four groups from the code blocks at wp, K [k0, k0 + 128) -> their d' summed in
    FP32 in ascending K [64, NTOK]."""
    p0, p1, p2, p3 = _blocks4(wp)
    blk = _mma(p0, f0, _x_group(xp, tok, valid, k0, LD), ASM)
    blk += _mma(p1, f1, _x_group(xp, tok, valid, k0 + 32, LD), ASM)
    blk += _mma(p2, f2, _x_group(xp, tok, valid, k0 + 64, LD), ASM)
    blk += _mma(p3, f3, _x_group(xp, tok, valid, k0 + 96, LD), ASM)
    return blk


@triton.jit
def _x_group(x_ptr, rows, valid, k0, LD: tl.constexpr):
    """x (e4m3) of the pass's tokens, K [k0, k0 + 32): [32, NTOK] (columns past the pass zero)."""
    k = k0 + tl.arange(0, 32)
    v = tl.load(x_ptr + rows[:, None] * LD + k[None, :], mask=valid[:, None], other=0.0)
    return tl.trans(v)


@triton.jit
def _mul_rn(a, b, ASM: tl.constexpr):
    """fl32(a * b), never fused into a following add (PTX mul.rn is not contracted)."""
    if ASM:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return a * b


@triton.jit
def _promote(acc, blk, sf, ASM: tl.constexpr):
    """acc fp32 [R, NTOK], blk fp32 [R, NTOK], sf fp32 [NTOK] -> fl32(acc + fl32(sf * blk))."""
    return acc + _mul_rn(blk, sf[None, :], ASM)


@triton.jit
def _decode4(wp, ASM: tl.constexpr):
    """Four consecutive code blocks at wp -> one A operand, float8e4nv [64, 128]: group g at K [32 g, 32 g + 32)
    (``_decode_block`` for each, side by side)."""
    p = tl.reshape(_load4(wp), (4, 4, 8, 4, 2, 4))  # (g, w, ri, lq, kh, i)
    lo, hi = _nibbles_to_e4m3(p, ASM)
    a = tl.permute(tl.join(lo, hi), (1, 6, 2, 0, 4, 3, 5))  # (w, h, ri, g, kh, lq, i)
    return tl.reshape(a, (64, 128))


@triton.jit
def _packed_columns(row_token_ptr, start, count, GATHER: tl.constexpr):
    """The 16 MMA columns of a packed pass (up to 4 tokens, all four groups of a 128-K block in one MMA): column
    c = 8 gh + 2 n + gl is token n at group g = 2 gh + gl. -> (x's row of each column [16]: the pool row's token
    (GATHER, L1) or the pool row (L2); its group [16]; whether n is in the pass [16]). With this order the
    accumulator columns each thread holds (2q, 2q + 1, 8 + 2q, 9 + 2q) are the four groups of one token.
    Computed once per pass, outside the K loop."""
    c = tl.arange(0, 16)
    n = (c % 8) // 2
    valid = n < count
    if GATHER:
        xrow = tl.load(row_token_ptr + start + tl.where(valid, n, 0), mask=valid, other=0).to(tl.int64)
    else:
        xrow = (start + tl.where(valid, n, 0)).to(tl.int64)
    return xrow, 2 * (c // 8) + c % 2, valid


@triton.jit
def _x_packed(x_ptr, xrow, grp, valid, k0, LD: tl.constexpr):
    """B of a packed pass, e4m3 [128, 16]: column c holds its token's x at its group's 32 K and zeros at the
    other 96 (and zeros for columns past the pass); (xrow, grp, valid) from ``_packed_columns``."""
    k = tl.arange(0, 128)
    own = valid[:, None] & (k[None, :] // 32 == grp[:, None])
    return tl.trans(tl.load(x_ptr + xrow[:, None] * LD + k0 + k[None, :], mask=own, other=0.0))


@triton.jit
def _packed_mma(wp, f0, f1, f2, f3, x_ptr, cols, k0, LD: tl.constexpr, ASM: tl.constexpr):
    """Four 32-K groups of up to 4 tokens (columns ``cols``) in one m64n16k128 MMA -> d'_g fp32 [64, 4] for g = 0..3: group g's
    column collects its products at k32 step g and zeros at the other three, which leave an FP32 accumulator
    unchanged (all their terms are zero; checked bit for bit on the H200 with four groups per MMA in run 3), so
    it is group g's sum from a zero accumulator, as a fresh k32 MMA: the same bits as ``_mma``, one wait."""
    xrow, grp, valid = cols  # _packed_columns
    d = tl.dot(_decode4(wp, ASM), _x_packed(x_ptr, xrow, grp, valid, k0, LD), out_dtype=tl.float32)
    f = tl.permute(tl.join(tl.join(f0, f1), tl.join(f2, f3)), (0, 2, 1))  # [64, gh, gl]
    d = tl.permute(tl.reshape(d, (64, 2, 4, 2)) * f[:, :, None, :], (0, 2, 1, 3))  # (r, n, gh, gl)
    even, odd = tl.split(d)  # gl = 0, 1
    d0, d2 = tl.split(even)
    d1, d3 = tl.split(odd)
    return d0, d1, d2, d3


@triton.jit
def _item(j, touched_ptr, seg_start_ptr, seg_count_ptr):
    """Work item j -> (its expert, its first pool row, its number of rows)."""
    return tl.load(touched_ptr + j).to(tl.int64), tl.load(seg_start_ptr + j), tl.load(seg_count_ptr + j)


@triton.jit
def _pass(start, m0, count, W: tl.constexpr = NTOK):
    """Pool rows of the pass's W tokens (token c -> row start + m0 + c) and which are real."""
    c = tl.arange(0, W)
    valid = m0 + c < count
    return (start + tl.where(valid, m0 + c, 0)).to(tl.int64), valid


@triton.jit
def l1_tc_kernel(
    w_ptr, s_ptr,  # uint8 [E, I/32, H/32, 1024], int32 [E, I/32, H/128, 64] (layout_tc.py: scale words)
    x_ptr, xsf_ptr,  # e4m3 [C, H], fp32 [C, H/128]
    num_touched_ptr, touched_ptr, seg_start_ptr, seg_count_ptr, row_token_ptr, row_weight_ptr,
    l1_ptr, q_ptr, sf2_ptr,  # fp32 [S, 2I] (STORE_L1), uint8 [S, I], fp32 [S, I/32]
    clamp,
    H: tl.constexpr, I: tl.constexpr, STORE_L1: tl.constexpr, ASM: tl.constexpr,
    PDL: tl.constexpr = False, EARLY: tl.constexpr = False, PACK: tl.constexpr = False,
):
    pdl_wait(PDL)
    if EARLY:
        pdl_release(PDL)
    j = tl.program_id(0)
    t = tl.program_id(1)
    if j < tl.load(num_touched_ptr):
        NG: tl.constexpr = H // 32
        e, start, count = _item(j, touched_ptr, seg_start_ptr, seg_count_ptr)
        tile = e * (I // 32) + t
        sp = s_ptr + tile * (H // 128) * 64
        wp = w_ptr + tile * NG * 1024
        if PACK and count <= 4:  # one packed pass: a block's four groups in one MMA (_packed_mma)
            rows, valid = _pass(start, 0, count, 4)
            acc = _l1_blocks(tl.zeros([64, 4], tl.float32), rows, valid, _packed_columns(row_token_ptr, start, count, True),
                             wp, sp, x_ptr, xsf_ptr, row_token_ptr, H, ASM, True)
            pdl_release(PDL)
            _l1_epilogue(acc, rows, valid, t, row_weight_ptr, l1_ptr, q_ptr, sf2_ptr, clamp, I, STORE_L1, 4)
        else:
            m0 = 0
            while m0 < count:  # a while loop: the interpreter cannot range() over a loaded scalar
                rows, valid = _pass(start, m0, count)
                acc = _l1_blocks(tl.zeros([64, NTOK], tl.float32), rows, valid, None, wp, sp, x_ptr, xsf_ptr,
                                 row_token_ptr, H, ASM, False)
                pdl_release(PDL)  # L2 may start once every program has streamed its weights (later calls: no effect)
                _l1_epilogue(acc, rows, valid, t, row_weight_ptr, l1_ptr, q_ptr, sf2_ptr, clamp, I, STORE_L1, NTOK)
                m0 += NTOK


@triton.jit
def _l1_blocks(acc, rows, valid, cols, wp, sp, x_ptr, xsf_ptr, row_token_ptr, H: tl.constexpr, ASM: tl.constexpr,
               PACKED: tl.constexpr):
    """L1's K loop for one pass: acc fp32 [64, W] promoted block by block in ascending K, a 128-K block's four
    groups per iteration (one packed MMA over ``cols``, or four), each block's scale bytes and x_sf loaded one
    block ahead. The scale bytes and x_sf are plain loads (only the code and x tiles are software-pipelined by
    Triton): loaded ahead, no group waits on global memory for them."""
    NB: tl.constexpr = H // 128
    tok = tl.load(row_token_ptr + rows, mask=valid, other=0).to(tl.int64)
    xsp = xsf_ptr + tok * NB
    f0, f1, f2, f3 = _factors4(sp)
    xsf = tl.load(xsp, mask=valid, other=0.0)
    for kb in range(NB):
        nb = tl.minimum(kb + 1, NB - 1)  # the next block (the last reloads its own)
        n0, n1, n2, n3 = _factors4(sp + nb * 64)
        nxsf = tl.load(xsp + nb, mask=valid, other=0.0)
        if PACKED:
            d0, d1, d2, d3 = _packed_mma(wp + kb * 4096, f0, f1, f2, f3, x_ptr, cols, kb * 128, H, ASM)
            blk = ((d0 + d1) + d2) + d3
        else:
            blk = _block_sum(wp + kb * 4096, f0, f1, f2, f3, x_ptr, tok, valid, kb * 128, H, ASM)
        acc = _promote(acc, blk, xsf, ASM)
        f0, f1, f2, f3, xsf = n0, n1, n2, n3, nxsf
    return acc


@triton.jit
def _l1_epilogue(acc, rows, valid, t, row_weight_ptr, l1_ptr, q_ptr, sf2_ptr, clamp, I: tl.constexpr,
                 STORE_L1: tl.constexpr, W: tl.constexpr):
    """acc fp32 [64, W] (gate rows 0..31, up rows 32..63 of channel tile t) -> SwiGLU, the routing weight and the
    FP8 requant of the tile's 32 channels, stored for the pass's W pool rows."""
    n = t * 32 + tl.arange(0, 32)
    gate, up = tl.split(tl.permute(tl.reshape(acc, (2, 32, W)), (1, 2, 0)))  # [32, W] each
    if STORE_L1:
        tl.store(l1_ptr + rows[None, :] * (2 * I) + n[:, None], gate, mask=valid[None, :])
        tl.store(l1_ptr + rows[None, :] * (2 * I) + I + n[:, None], up, mask=valid[None, :])
    weight = tl.load(row_weight_ptr + rows, mask=valid, other=0.0)
    g = tl.minimum(gate, clamp)
    u = tl.minimum(tl.maximum(up, -clamp), clamp)
    ex = tl.exp((-g).to(tl.float64)).to(tl.float32)
    one = tl.full([32, W], 1.0, tl.float32)
    vw = g * tl.math.div_rn(one, one + ex) * u * weight[None, :]
    floor = tl.full([W], 0x2EDBE6FF, tl.int32).to(tl.float32, bitcast=True)  # fl32(1e-10)
    inv448 = tl.full([W], 0x3B124925, tl.int32).to(tl.float32, bitcast=True)  # fl32(1/448)
    sf = tl.maximum(tl.max(tl.abs(vw), axis=0), floor) * inv448  # [W]
    qv = tl.minimum(tl.maximum(vw * tl.math.div_rn(tl.full([W], 1.0, tl.float32), sf)[None, :], -448.0), 448.0)
    tl.store(q_ptr + rows[None, :] * I + n[:, None], _e4m3_rtne_bits(qv), mask=valid[None, :])
    tl.store(sf2_ptr + rows * (I // 32) + t, sf, mask=valid)


@triton.jit
def l2_tc_kernel(
    w_ptr, s_ptr,  # uint8 [E, H/64, I/32, 1024], int32 [E, H/64, I/128, 64]
    q_ptr, sf2_ptr,  # e4m3 [S, I] (the l2_q codes), fp32 [S, I/32]
    num_touched_ptr, touched_ptr, seg_start_ptr, seg_count_ptr,
    out_ptr,  # int16 (bf16 bits) [S, H]
    H: tl.constexpr, I: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr = False, EARLY: tl.constexpr = False,
    PACK: tl.constexpr = False,
):
    j = tl.program_id(0)
    t = tl.program_id(1)
    pdl_wait(PDL)
    if EARLY:
        pdl_release(PDL)
    if j < tl.load(num_touched_ptr):
        e, start, count = _item(j, touched_ptr, seg_start_ptr, seg_count_ptr)
        tile = (e * (H // 64) + t) * (I // 32)
        n = t * 64 + tl.arange(0, 64)
        if PACK and count <= 4:  # one packed pass (as L1's)
            rows, valid = _pass(start, 0, count, 4)
            acc = _l2_groups(tl.zeros([64, 4], tl.float32), rows, valid, _packed_columns(q_ptr, start, count, False),
                             w_ptr, s_ptr, sf2_ptr, q_ptr, tile, I, ASM, True)
            pdl_release(PDL)
            tl.store(out_ptr + rows[None, :] * H + n[:, None], _bf16_bits(acc), mask=valid[None, :])
        else:
            m0 = 0
            while m0 < count:
                rows, valid = _pass(start, m0, count)
                acc = _l2_groups(tl.zeros([64, NTOK], tl.float32), rows, valid, None, w_ptr, s_ptr, sf2_ptr, q_ptr,
                                 tile, I, ASM, False)
                pdl_release(PDL)  # the combine may start (as in L1)
                tl.store(out_ptr + rows[None, :] * H + n[:, None], _bf16_bits(acc), mask=valid[None, :])
                m0 += NTOK


@triton.jit
def _l2_groups(acc, rows, valid, cols, w_ptr, s_ptr, sf2_ptr, q_ptr, tile, I: tl.constexpr,
               ASM: tl.constexpr, PACKED: tl.constexpr):
    """L2's K loop for one pass: acc fp32 [64, W] promoted group by group in ascending K, four groups per
    iteration (one packed MMA over ``cols``, or four), each group's scales loaded one iteration ahead."""
    NG: tl.constexpr = I // 32
    sp = s_ptr + tile * 16  # tile counts groups: its first 128-K block's 64 words
    cp = sf2_ptr + rows * NG
    f0, f1, f2, f3 = _factors4(sp)
    c0, c1, c2, c3 = (tl.load(cp, mask=valid, other=0.0), tl.load(cp + 1, mask=valid, other=0.0),
                      tl.load(cp + 2, mask=valid, other=0.0), tl.load(cp + 3, mask=valid, other=0.0))
    for it in range(NG // 4):
        g = it * 4
        nx = tl.minimum(it + 1, NG // 4 - 1) * 4  # the next iteration's first group (the last: its own)
        n0, n1, n2, n3 = _factors4(sp + nx * 16)
        o0, o1, o2, o3 = (tl.load(cp + nx, mask=valid, other=0.0), tl.load(cp + nx + 1, mask=valid, other=0.0),
                          tl.load(cp + nx + 2, mask=valid, other=0.0), tl.load(cp + nx + 3, mask=valid, other=0.0))
        wp = w_ptr + (tile + g) * 1024
        if PACKED:
            d0, d1, d2, d3 = _packed_mma(wp, f0, f1, f2, f3, q_ptr, cols, g * 32, I, ASM)
        else:
            p0, p1, p2, p3 = _blocks4(wp)
            d0 = _mma(p0, f0, _x_group(q_ptr, rows, valid, g * 32, I), ASM)
            d1 = _mma(p1, f1, _x_group(q_ptr, rows, valid, g * 32 + 32, I), ASM)
            d2 = _mma(p2, f2, _x_group(q_ptr, rows, valid, g * 32 + 64, I), ASM)
            d3 = _mma(p3, f3, _x_group(q_ptr, rows, valid, g * 32 + 96, I), ASM)
        acc = _promote(acc, d0, c0, ASM)
        acc = _promote(acc, d1, c1, ASM)
        acc = _promote(acc, d2, c2, ASM)
        acc = _promote(acc, d3, c3, ASM)
        f0, f1, f2, f3, c0, c1, c2, c3 = n0, n1, n2, n3, o0, o1, o2, o3
    return acc

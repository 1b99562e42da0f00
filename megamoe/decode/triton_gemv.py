"""The decode path's two weight-streaming kernels (Triton); their twins are in ``gemv.py`` (``l1_torch``, ``l2_torch``).

    l1_kernel   grid (W, I / BN):  work item j (a touched expert e, its M rows), channels [t BN, (t+1) BN)
                of gate and of up over all H; then SwiGLU, the routing weight, the FP8 requant of those
                BN = l2_group channels, written as codes, scale and float32 values for down
    l2_kernel   grid (W, H / BN2): the same expert's rows of [t BN2, (t+1) BN2) over all I -> bf16 per
                (token, slot)

A program exits at once when j >= num_touched (the grid is sized for the most experts a step can touch).
Each K-iteration loads its tile (module ``layout``: 16-byte words of 4 rows) before any arithmetic.

Numerics (all exact until the noted roundings; any summation order gives the same bits):
    decode      two fp16 per masked word: e2m1 * 2**-14 (``layout``)
    4-term sum  x * w over 4 consecutive K in FP32 FMAs: products have <= 6 significant bits on a
                2**-24 grid and |sum| < 0.66 < 2**24 * 2**-24, so every partial sum is exact
    group sum   those 4-term sums in float64 over the 32 K of one scale group, exact; then times
                2**(s - 127 + 14), a power of two (the E8M0 scale and the decode's 2**-14 undone)
    block sum   float64 over the groups of one promotion block (4 for gate/up's 128 K, 1 for down's 32 K),
                exact when the block's scale bytes span <= 24 binades (checked at prepare)
    promote     acc = fl32(fl64(acc + fl64(x_sf) * fl64(fl32(block)))), blocks in ascending K: the
                reference's emulated FMA (megamoe.reference.gemm), bit for bit
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..staging.triton_stage import _e4m3_rtne_bits
from .routing import e4m3_to_f32

SIGN_BITS = tl.constexpr(-0x7FFF8000)  # 0x80008000 as int32: the sign bits of both fp16 halves


@triton.jit
def _pair(w, P: tl.constexpr, ASM: tl.constexpr):
    """int32 words -> (lo, hi) float32: weights K 2P, 2P+1 of each word, e2m1 * 2**-14. The two fp16 halves
    become float32 exactly: on the GPU by one PTX unpack and two cvt (HADD2.F32 on each half register, no
    repacking); under the interpreter by the same bits through integer views."""
    h = ((w << (3 * P)) & 0x0E000E00) | ((w << P) & SIGN_BITS)
    if ASM:
        lo, hi = tl.inline_asm_elementwise(
            "{ .reg .b16 l, h; mov.b32 {l, h}, $2; cvt.f32.f16 $0, l; cvt.f32.f16 $1, h; }",
            "=r,=r,r", [h], dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
    else:
        lo = h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        hi = (h >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def _word_sum(xp, lo0, hi0, lo1, hi1, lo2, hi2, lo3, hi3):
    """sum over the word's 8 K of x * w, exact in float64; xp points at x[K 0 of the word] ([1, G])."""
    a = tl.load(xp) * lo0
    a = a + tl.load(xp + 1) * hi0
    a = a + tl.load(xp + 2) * lo1
    a = a + tl.load(xp + 3) * hi1
    b = tl.load(xp + 4) * lo2
    b = b + tl.load(xp + 5) * hi2
    b = b + tl.load(xp + 6) * lo3
    b = b + tl.load(xp + 7) * hi3
    return a.to(tl.float64) + b.to(tl.float64)


@triton.jit
def _word(w, s0, s1, s2, s3, xp0, xp1, xp2, xp3, BLOCK_M: tl.constexpr, ASM: tl.constexpr):
    """Decode one word of the tile once, add its products into the group sums of up to 4 tokens."""
    lo0, hi0 = _pair(w, 0, ASM)
    lo1, hi1 = _pair(w, 1, ASM)
    lo2, hi2 = _pair(w, 2, ASM)
    lo3, hi3 = _pair(w, 3, ASM)
    s0 += _word_sum(xp0, lo0, hi0, lo1, hi1, lo2, hi2, lo3, hi3)
    if BLOCK_M > 1:
        s1 += _word_sum(xp1, lo0, hi0, lo1, hi1, lo2, hi2, lo3, hi3)
    if BLOCK_M > 2:
        s2 += _word_sum(xp2, lo0, hi0, lo1, hi1, lo2, hi2, lo3, hi3)
        s3 += _word_sum(xp3, lo0, hi0, lo1, hi1, lo2, hi2, lo3, hi3)
    return s0, s1, s2, s3


@triton.jit
def _group_sums(w0, w1, w2, w3, xp0, xp1, xp2, xp3, G: tl.constexpr, BN: tl.constexpr, BLOCK_M: tl.constexpr,
                ASM: tl.constexpr):
    """The four words of each (row, group) -> float64 [BN, G] group sums per token (unused ones zero)."""
    s0 = tl.zeros([BN, G], tl.float64)
    s1 = tl.zeros([BN, G], tl.float64)
    s2 = tl.zeros([BN, G], tl.float64)
    s3 = tl.zeros([BN, G], tl.float64)
    s0, s1, s2, s3 = _word(w0, s0, s1, s2, s3, xp0, xp1, xp2, xp3, BLOCK_M, ASM)
    s0, s1, s2, s3 = _word(w1, s0, s1, s2, s3, xp0 + 8, xp1 + 8, xp2 + 8, xp3 + 8, BLOCK_M, ASM)
    s0, s1, s2, s3 = _word(w2, s0, s1, s2, s3, xp0 + 16, xp1 + 16, xp2 + 16, xp3 + 16, BLOCK_M, ASM)
    s0, s1, s2, s3 = _word(w3, s0, s1, s2, s3, xp0 + 24, xp1 + 24, xp2 + 24, xp3 + 24, BLOCK_M, ASM)
    return s0, s1, s2, s3


@triton.jit
def _scale_factor(sbytes):
    """E8M0 bytes [BN, G] -> float64 2**(s - 127 + 14), built from its exponent bits (exact)."""
    return ((sbytes.to(tl.int64) + 910) << 52).to(tl.float64, bitcast=True)


@triton.jit
def _promote(acc, blk, sf):
    """acc fp32 [BN], blk fp64 [BN] exact block sums, sf fp32 scalar -> fl32(fl64(acc + sf * fl32(blk)))."""
    b = blk.to(tl.float32).to(tl.float64)
    return (acc.to(tl.float64) + sf.to(tl.float64) * b).to(tl.float32)


@triton.jit
def _cols4(x, BN: tl.constexpr):
    """[BN, 4] -> its columns in order (split takes the last axis of size 2: even / odd columns)."""
    e, o = tl.split(tl.reshape(x, (BN, 2, 2)))
    c0, c2 = tl.split(e)
    c1, c3 = tl.split(o)
    return c0, c1, c2, c3


@triton.jit
def _cols8(x, BN: tl.constexpr):
    e, o = tl.split(tl.reshape(x, (BN, 4, 2)))
    e0, e1, e2, e3 = _cols4(e, BN)
    o0, o1, o2, o3 = _cols4(o, BN)
    return e0, o0, e1, o1, e2, o2, e3, o3


@triton.jit
def _cols16(x, BN: tl.constexpr):
    e, o = tl.split(tl.reshape(x, (BN, 8, 2)))
    e0, e1, e2, e3, e4, e5, e6, e7 = _cols8(e, BN)
    o0, o1, o2, o3, o4, o5, o6, o7 = _cols8(o, BN)
    return e0, o0, e1, o1, e2, o2, e3, o3, e4, o4, e5, o5, e6, o6, e7, o7


@triton.jit
def _promote_blocks(acc, blocks, sf_ptr, NB: tl.constexpr, BN: tl.constexpr):
    """Promote NB (1, 2, 4, 8 or 16) block sums [BN, NB] into acc in ascending K; sf_ptr -> their scales."""
    if NB == 1:
        acc = _promote(acc, tl.reshape(blocks, (BN,)), tl.load(sf_ptr))
    else:
        x = blocks
        if NB == 2:
            cols = tl.split(x)
        elif NB == 4:
            cols = _cols4(x, BN)
        elif NB == 8:
            cols = _cols8(x, BN)
        else:
            cols = _cols16(x, BN)
        for b in tl.static_range(NB):
            acc = _promote(acc, cols[b], tl.load(sf_ptr + b))
    return acc


@triton.jit
def _half_step(w0, w1, w2, w3, sb, xp0, xp1, xp2, xp3, a0, a1, a2, a3, sfp0, sfp1, sfp2, sfp3,
               G: tl.constexpr, BN: tl.constexpr, PG: tl.constexpr, BLOCK_M: tl.constexpr, ASM: tl.constexpr):
    """One K-iteration of one weight half for up to 4 tokens: group sums, scales, blocks, promotion."""
    NB: tl.constexpr = G // PG
    f = _scale_factor(sb)
    s0, s1, s2, s3 = _group_sums(w0, w1, w2, w3, xp0, xp1, xp2, xp3, G, BN, BLOCK_M, ASM)
    a0 = _promote_blocks(a0, tl.sum(tl.reshape(s0 * f, (BN, NB, PG)), axis=2), sfp0, NB, BN)
    if BLOCK_M > 1:
        a1 = _promote_blocks(a1, tl.sum(tl.reshape(s1 * f, (BN, NB, PG)), axis=2), sfp1, NB, BN)
    if BLOCK_M > 2:
        a2 = _promote_blocks(a2, tl.sum(tl.reshape(s2 * f, (BN, NB, PG)), axis=2), sfp2, NB, BN)
        a3 = _promote_blocks(a3, tl.sum(tl.reshape(s3 * f, (BN, NB, PG)), axis=2), sfp3, NB, BN)
    return a0, a1, a2, a3


@triton.jit
def _pass_row(start, m0, M: tl.constexpr, count):
    """Pool row of token M of the pass that starts at the expert's row m0; past the expert's count the
    spare token redoes row 0 (computed, never stored)."""
    return (start + tl.where(m0 + M < count, m0 + M, 0)).to(tl.int64)


@triton.jit
def _pass_rows(start, m0, count):
    """The pool rows of the pass's (up to) four tokens (``_pass_row`` 0..3)."""
    return (_pass_row(start, m0, 0, count), _pass_row(start, m0, 1, count), _pass_row(start, m0, 2, count),
            _pass_row(start, m0, 3, count))


@triton.jit
def _work_item(j, touched_ptr, seg_start_ptr, seg_count_ptr, G: tl.constexpr, BN: tl.constexpr):
    """Work item j -> (expert, its first pool row, its row count, gi [1, G] group index, widx [BN, G] the word
    of each (row, group) inside one 4-word block of a tile)."""
    e = tl.load(touched_ptr + j).to(tl.int64)
    start = tl.load(seg_start_ptr + j)
    count = tl.load(seg_count_ptr + j)
    gi = tl.arange(0, G)[None, :]
    widx = tl.arange(0, BN)[:, None] * G + gi
    return e, start, count, gi, widx


@triton.jit
def _tile_words(base, widx, G: tl.constexpr, BN: tl.constexpr):
    """The four consecutive [BN, G] word blocks of a tile at ``base`` (K words 0..3 of each group)."""
    return (tl.load(base + widx), tl.load(base + G * BN + widx), tl.load(base + 2 * G * BN + widx),
            tl.load(base + 3 * G * BN + widx))


@triton.jit
def _gate_up_tile(w_ptr, s_ptr, e, t, i, widx, NT: tl.constexpr, NK: tl.constexpr, G: tl.constexpr, BN: tl.constexpr):
    """K-iteration i of gate/up tile (e, t): the gate and up words (4 blocks each) and their scale bytes."""
    base = w_ptr + ((e * NT + t) * NK + i) * (2 * 4 * G * BN)
    sbase = s_ptr + ((e * NT + t) * NK + i) * (2 * G * BN)
    gw0, gw1, gw2, gw3 = _tile_words(base, widx, G, BN)
    uw0, uw1, uw2, uw3 = _tile_words(base + 4 * G * BN, widx, G, BN)
    return gw0, gw1, gw2, gw3, uw0, uw1, uw2, uw3, tl.load(sbase + widx), tl.load(sbase + G * BN + widx)


@triton.jit
def _down_tile(w_ptr, s_ptr, e, t, i, widx, NT: tl.constexpr, NK: tl.constexpr, G: tl.constexpr, BN: tl.constexpr):
    """K-iteration i of down tile (e, t): 4 word blocks and their scale bytes."""
    w0, w1, w2, w3 = _tile_words(w_ptr + ((e * NT + t) * NK + i) * (4 * G * BN), widx, G, BN)
    return w0, w1, w2, w3, tl.load(s_ptr + ((e * NT + t) * NK + i) * (G * BN) + widx)


@triton.jit
def _bf16_bits(v):
    """float32 -> bfloat16 bits (int16), round to nearest even (finite inputs)."""
    b = v.to(tl.int32, bitcast=True)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).to(tl.int16)


@triton.jit
def _gate_up_epilogue(gate, up, row, weight, clamp, t, l1_ptr, q_ptr, x2_ptr, sf2_ptr,
                      I: tl.constexpr, BN: tl.constexpr, STORE_L1: tl.constexpr):
    """SwiGLU (clamp, sigmoid through a float64 exp rounded once), routing weight, FP8 requant of the
    tile's BN channels (one l2 group): amax -> sf = max(amax, fl32(1e-10)) * fl32(1/448) -> e4m3 RTNE."""
    n = t * BN + tl.arange(0, BN)
    row64 = row.to(tl.int64)
    if STORE_L1:
        tl.store(l1_ptr + row64 * (2 * I) + n, gate)
        tl.store(l1_ptr + row64 * (2 * I) + I + n, up)
    g = tl.minimum(gate, clamp)
    u = tl.minimum(tl.maximum(up, -clamp), clamp)
    e = tl.exp((-g).to(tl.float64)).to(tl.float32)
    one = tl.full([BN], 1.0, tl.float32)
    v = g * tl.math.div_rn(one, one + e) * u
    vw = v * weight
    floor = tl.full([BN], 0x2EDBE6FF, tl.int32).to(tl.float32, bitcast=True)  # fl32(1e-10)
    inv448 = tl.full([BN], 0x3B124925, tl.int32).to(tl.float32, bitcast=True)  # fl32(1/448)
    sf = tl.maximum(tl.max(tl.abs(vw), axis=0), floor) * inv448  # [BN], every entry the group's scale
    q = tl.minimum(tl.maximum(vw * tl.math.div_rn(one, sf), -448.0), 448.0)
    code = _e4m3_rtne_bits(q)
    tl.store(q_ptr + row64 * I + n, code)
    tl.store(x2_ptr + row64 * I + n, e4m3_to_f32(code))
    tl.store(sf2_ptr + row64 * (I // BN) + t + tl.arange(0, BN), sf, mask=tl.arange(0, BN) == 0)


@triton.jit
def gate_up_program(
    j, t,  # work item (touched expert), channel tile
    w_ptr, s_ptr,  # int32 / uint8 tiles (layout.py)
    x_ptr, xsf_ptr,  # fp32 [C, H] (x32), fp32 [C, H/128]
    num_touched_ptr, touched_ptr, seg_start_ptr, seg_count_ptr, row_token_ptr, row_weight_ptr,
    l1_ptr, q_ptr, x2_ptr, sf2_ptr,  # fp32 [S, 2I], uint8 [S, I], fp32 [S, I], fp32 [S, I/BN]
    clamp,
    H: tl.constexpr, I: tl.constexpr, BN: tl.constexpr, G: tl.constexpr,
    BLOCK_M: tl.constexpr, STORE_L1: tl.constexpr, ASM: tl.constexpr, PREFETCH: tl.constexpr = False,
):
    """One gate/up program: gate and up rows [t BN, (t+1) BN) of work item j's expert, all its rows.
    PREFETCH: load K-iteration i + 1's tile before the arithmetic of iteration i (registers; same bits)."""
    if j < tl.load(num_touched_ptr):
        NT: tl.constexpr = I // BN
        NK: tl.constexpr = H // (32 * G)
        PG: tl.constexpr = 4  # groups per 128-K promotion block
        e, start, count, gi, widx = _work_item(j, touched_ptr, seg_start_ptr, seg_count_ptr, G, BN)
        m0 = 0
        while m0 < count:  # a while loop: the interpreter cannot range() over a loaded scalar
            r0, r1, r2, r3 = _pass_rows(start, m0, count)
            t0 = tl.load(row_token_ptr + r0).to(tl.int64)
            t1 = tl.load(row_token_ptr + r1).to(tl.int64)
            t2 = tl.load(row_token_ptr + r2).to(tl.int64)
            t3 = tl.load(row_token_ptr + r3).to(tl.int64)
            g0 = tl.zeros([BN], tl.float32)
            g1 = tl.zeros([BN], tl.float32)
            g2 = tl.zeros([BN], tl.float32)
            g3 = tl.zeros([BN], tl.float32)
            u0 = tl.zeros([BN], tl.float32)
            u1 = tl.zeros([BN], tl.float32)
            u2 = tl.zeros([BN], tl.float32)
            u3 = tl.zeros([BN], tl.float32)
            if PREFETCH:
                nw0, nw1, nw2, nw3, nw4, nw5, nw6, nw7, ns0, ns1 = _gate_up_tile(w_ptr, s_ptr, e, t, 0, widx, NT, NK, G,
                                                                                 BN)
            for i in range(NK):
                if PREFETCH:  # this iteration's tile was loaded by the previous one; load the next (the last
                    # iteration reloads its own: no read past the expert)
                    gw0, gw1, gw2, gw3, uw0, uw1, uw2, uw3, gs, us = nw0, nw1, nw2, nw3, nw4, nw5, nw6, nw7, ns0, ns1
                    nw0, nw1, nw2, nw3, nw4, nw5, nw6, nw7, ns0, ns1 = _gate_up_tile(
                        w_ptr, s_ptr, e, t, tl.minimum(i + 1, NK - 1), widx, NT, NK, G, BN)
                else:
                    gw0, gw1, gw2, gw3, uw0, uw1, uw2, uw3, gs, us = _gate_up_tile(w_ptr, s_ptr, e, t, i, widx, NT,
                                                                                   NK, G, BN)
                k0 = i * (32 * G) + gi * 32  # [1, G] first K of each group
                xp0 = x_ptr + t0 * H + k0
                xp1 = x_ptr + t1 * H + k0
                xp2 = x_ptr + t2 * H + k0
                xp3 = x_ptr + t3 * H + k0
                sb = i * (G // PG)
                sfp0 = xsf_ptr + t0 * (H // 128) + sb
                sfp1 = xsf_ptr + t1 * (H // 128) + sb
                sfp2 = xsf_ptr + t2 * (H // 128) + sb
                sfp3 = xsf_ptr + t3 * (H // 128) + sb
                g0, g1, g2, g3 = _half_step(gw0, gw1, gw2, gw3, gs, xp0, xp1, xp2, xp3, g0, g1, g2, g3,
                                            sfp0, sfp1, sfp2, sfp3, G, BN, PG, BLOCK_M, ASM)
                u0, u1, u2, u3 = _half_step(uw0, uw1, uw2, uw3, us, xp0, xp1, xp2, xp3, u0, u1, u2, u3,
                                            sfp0, sfp1, sfp2, sfp3, G, BN, PG, BLOCK_M, ASM)
            _gate_up_epilogue(g0, u0, r0, tl.load(row_weight_ptr + r0), clamp, t, l1_ptr, q_ptr, x2_ptr, sf2_ptr,
                              I, BN, STORE_L1)
            if BLOCK_M > 1:
                if m0 + 1 < count:
                    _gate_up_epilogue(g1, u1, r1, tl.load(row_weight_ptr + r1), clamp, t, l1_ptr, q_ptr, x2_ptr,
                                      sf2_ptr, I, BN, STORE_L1)
            if BLOCK_M > 2:
                if m0 + 2 < count:
                    _gate_up_epilogue(g2, u2, r2, tl.load(row_weight_ptr + r2), clamp, t, l1_ptr, q_ptr, x2_ptr,
                                      sf2_ptr, I, BN, STORE_L1)
                if m0 + 3 < count:
                    _gate_up_epilogue(g3, u3, r3, tl.load(row_weight_ptr + r3), clamp, t, l1_ptr, q_ptr, x2_ptr,
                                      sf2_ptr, I, BN, STORE_L1)
            m0 += BLOCK_M


@triton.jit
def down_program(
    j, t,  # work item (touched expert), output-row tile
    w_ptr, s_ptr,  # int32 / uint8 tiles (layout.py)
    x2_ptr, sf2_ptr,  # fp32 [S, I] (the down input's e4m3 values), fp32 [S, I/32]
    num_touched_ptr, touched_ptr, seg_start_ptr, seg_count_ptr,
    out_ptr,  # int16 (bf16 bits) [S, H]
    H: tl.constexpr, I: tl.constexpr, BN: tl.constexpr, G: tl.constexpr, L2_GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, ASM: tl.constexpr, PREFETCH: tl.constexpr = False,
):
    """One down program: output rows [t BN, (t+1) BN) of work item j's expert, all its rows -> bf16.
    PREFETCH as in ``gate_up_program``."""
    if j < tl.load(num_touched_ptr):
        NT: tl.constexpr = H // BN
        NK: tl.constexpr = I // (32 * G)
        PG: tl.constexpr = L2_GROUP // 32
        e, start, count, gi, widx = _work_item(j, touched_ptr, seg_start_ptr, seg_count_ptr, G, BN)
        n = t * BN + tl.arange(0, BN)
        m0 = 0
        while m0 < count:  # a while loop: the interpreter cannot range() over a loaded scalar
            r0, r1, r2, r3 = _pass_rows(start, m0, count)
            a0 = tl.zeros([BN], tl.float32)
            a1 = tl.zeros([BN], tl.float32)
            a2 = tl.zeros([BN], tl.float32)
            a3 = tl.zeros([BN], tl.float32)
            if PREFETCH:
                nw0, nw1, nw2, nw3, ns = _down_tile(w_ptr, s_ptr, e, t, 0, widx, NT, NK, G, BN)
            for i in range(NK):
                if PREFETCH:
                    w0, w1, w2, w3, sb = nw0, nw1, nw2, nw3, ns
                    nw0, nw1, nw2, nw3, ns = _down_tile(w_ptr, s_ptr, e, t, tl.minimum(i + 1, NK - 1), widx, NT, NK,
                                                        G, BN)
                else:
                    w0, w1, w2, w3, sb = _down_tile(w_ptr, s_ptr, e, t, i, widx, NT, NK, G, BN)
                k0 = i * (32 * G) + gi * 32
                sg = i * (G // PG)
                a0, a1, a2, a3 = _half_step(
                    w0, w1, w2, w3, sb, x2_ptr + r0 * I + k0, x2_ptr + r1 * I + k0, x2_ptr + r2 * I + k0,
                    x2_ptr + r3 * I + k0, a0, a1, a2, a3, sf2_ptr + r0 * (I // L2_GROUP) + sg,
                    sf2_ptr + r1 * (I // L2_GROUP) + sg, sf2_ptr + r2 * (I // L2_GROUP) + sg,
                    sf2_ptr + r3 * (I // L2_GROUP) + sg, G, BN, PG, BLOCK_M, ASM)
            tl.store(out_ptr + r0 * H + n, _bf16_bits(a0))
            if BLOCK_M > 1:
                if m0 + 1 < count:
                    tl.store(out_ptr + r1 * H + n, _bf16_bits(a1))
            if BLOCK_M > 2:
                if m0 + 2 < count:
                    tl.store(out_ptr + r2 * H + n, _bf16_bits(a2))
                if m0 + 3 < count:
                    tl.store(out_ptr + r3 * H + n, _bf16_bits(a3))
            m0 += BLOCK_M


@triton.jit
def l1_kernel(w_ptr, s_ptr, x_ptr, xsf_ptr, num_touched_ptr, touched_ptr, seg_start_ptr, seg_count_ptr,
              row_token_ptr, row_weight_ptr, l1_ptr, q_ptr, x2_ptr, sf2_ptr, clamp,
              H: tl.constexpr, I: tl.constexpr, BN: tl.constexpr, G: tl.constexpr,
              BLOCK_M: tl.constexpr, STORE_L1: tl.constexpr, ASM: tl.constexpr, PREFETCH: tl.constexpr):
    """grid (W, I / BN): ``gate_up_program`` (j, t) = (program_id 0, program_id 1)."""
    gate_up_program(tl.program_id(0), tl.program_id(1), w_ptr, s_ptr, x_ptr, xsf_ptr, num_touched_ptr, touched_ptr,
                    seg_start_ptr, seg_count_ptr, row_token_ptr, row_weight_ptr, l1_ptr, q_ptr, x2_ptr, sf2_ptr, clamp,
                    H, I, BN, G, BLOCK_M, STORE_L1, ASM, PREFETCH)


@triton.jit
def l2_kernel(w_ptr, s_ptr, x2_ptr, sf2_ptr, num_touched_ptr, touched_ptr, seg_start_ptr, seg_count_ptr, out_ptr,
              H: tl.constexpr, I: tl.constexpr, BN: tl.constexpr, G: tl.constexpr, L2_GROUP: tl.constexpr,
              BLOCK_M: tl.constexpr, ASM: tl.constexpr, PREFETCH: tl.constexpr):
    """grid (W, H / BN): ``down_program`` (j, t) = (program_id 0, program_id 1)."""
    down_program(tl.program_id(0), tl.program_id(1), w_ptr, s_ptr, x2_ptr, sf2_ptr, num_touched_ptr, touched_ptr,
                 seg_start_ptr, seg_count_ptr, out_ptr, H, I, BN, G, L2_GROUP, BLOCK_M, ASM, PREFETCH)

"""The decode path's tensor-core GEMVs (Triton, FP8 MMAs with the weights as the 64-row operand and the
tokens as N = 16 columns); their twins are ``tc.l1_tc_torch`` / ``tc.l2_tc_torch``. Operands and MMAs:
``triton_tc_ops.py``.

    l1_tc_kernel  grid (W, I / 32, SPLIT):  work item j's expert, gate and up channels [32 t, 32 t + 32) (64
                  MMA rows) over all H (part p of SPLIT: the p-th share of the K blocks); then SwiGLU, the
                  routing weight and the FP8 requant of those 32 channels
    l2_tc_kernel  grid (W, H / 64):  the same expert's output rows [64 t, 64 t + 64) over all I -> bf16

With ROUTE (``LaunchConfig.tc_route``) gate/up runs route's work itself: each program finds work item j from the staged
top-k (``routing.route_item``), and one extra program (j = W) writes route's outputs for down and the combine.

A program exits at once when j >= num_touched. Its tokens go in passes of 16 (the expert's pool rows), or,
with PACK and at most 4 rows, in one packed pass: a 128-K block's four groups of up to 4 tokens in the 16
columns of one MMA (``_packed_mma``; the same bits). Each loop iteration takes four groups (gate/up: one 128-K
block; down: four promotion blocks), their four code blocks in one load (``_load4``): Triton software-pipelines
the code and x tiles, and the scale words and activation scales are loaded one iteration ahead by hand.

Split K (gate/up's packed passes, SPLIT > 1): part 0 keeps the running sum of its blocks, the other parts store each
block's term fl32(x_sf * blk); the last part to finish (a self-resetting counter) replays the chain, the same
FP32 additions in the same order (``_replay``), and runs the epilogue. Same bits as SPLIT = 1.

Numerics (recipe ``megamoe-decode-tc``; ``megamoe.reference.gemm.group_scaled_gemm``), per 32-K group g:
    decode  each byte -> two e4m3 bytes worth e2m1 * 2**-6 (``_decode_block``; exact)
    d_g     tl.dot of the group's [64, 32] weights and [32, 16] x codes, a fresh accumulator: the tensor
            cores' own k32 sum (modelled bit for bit by ``sm90-fp8-tc-operands``)
    d'_g    d_g * 2**(s - 121) in FP32 (exact for scale bytes 20..236, checked at prepare)
    blk     gate/up: the FP32 sum of the 4 groups of a 128-K block in ascending K; down: the group itself
    acc     fl32(acc + fl32(x_sf * blk)), blocks in ascending K (two FP32 roundings, no FMA)
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..staging.triton_stage import _e4m3_rtne_bits
from .triton_gemv import _bf16_bits
from .routing import route_item, route_meta, route_rows
from .triton_pdl import pdl_release, pdl_wait
from .triton_tc_ops import (NTOK, _block_sum, _blocks4, _factors4, _mma, _mul_rn, _packed_columns, _packed_mma,
                            _x_group, no_probe)


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
    terms_ptr, cnt_ptr,  # SPLIT > 1: fp32 [S', H/128, 2I], int32 [>= W' * I/32] (moe.DecodeBuffers.split_*)
    idx_ptr, tw_ptr, slot_row_ptr, T, expert_lo, num_local,  # ROUTE: the staged routing; route's other output
    clamp, probe_ptr,  # PROBE's (``triton_tc_ops.no_probe``)
    H: tl.constexpr, I: tl.constexpr, STORE_L1: tl.constexpr, ASM: tl.constexpr,
    PDL: tl.constexpr = False, PACK: tl.constexpr = False, SPLIT: tl.constexpr = 1,
    ROUTE: tl.constexpr = False, K: tl.constexpr = 1, S_PAD: tl.constexpr = 1, E_PAD: tl.constexpr = 1,
    PROBE: tl.constexpr = no_probe,
):
    PROBE(probe_ptr, 1)
    pdl_wait(PDL)
    PROBE(probe_ptr, 2)
    j = tl.program_id(0)
    t = tl.program_id(1)
    part = tl.program_id(2)
    if ROUTE:  # each program finds its work item itself; the extra last j writes route's outputs for down, combine
        n_items, e, start, count, skey = route_item(j, idx_ptr, T, expert_lo, num_local, K, S_PAD, E_PAD)
        if (j == tl.num_programs(0) - 1) & (t == 0) & (part == 0):
            route_meta(idx_ptr, tw_ptr, num_touched_ptr, touched_ptr, seg_start_ptr, seg_count_ptr, row_token_ptr,
                       row_weight_ptr, slot_row_ptr, T, expert_lo, num_local, K, S_PAD, E_PAD)
    else:  # the item's loads go out with the count's, not after it (j < W: always inside route's outputs)
        n_items = tl.load(num_touched_ptr)
        e, start, count = _item(j, touched_ptr, seg_start_ptr, seg_count_ptr)
        skey = 0
    if j < n_items:
        NB: tl.constexpr = H // 128
        PROBE(probe_ptr, 3)
        tile = e * (I // 32) + t
        sp = s_ptr + tile * NB * 64
        wp = w_ptr + tile * NB * 4096
        if PACK and count <= 4:  # one packed pass: a block's four groups in one MMA (_packed_mma)
            rows, valid = _pass(start, 0, count, 4)
            tok, weight = _pass_rows(rows, valid, row_token_ptr, row_weight_ptr, skey, start, 0, count, tw_ptr,
                                     ROUTE, K, S_PAD, 4)
            cols = _packed_columns(tok, count)
            zero = tl.zeros([64, 4], tl.float32)
            if SPLIT == 1:
                acc = _gate_up_blocks(zero, valid, cols, wp, sp, x_ptr, xsf_ptr, tok, 0, NB, None, 1, H, ASM, True,
                                      False)
                PROBE(probe_ptr, 4)
                pdl_release(PDL)
                _gate_up_epilogue(acc, rows, valid, t, weight, l1_ptr, q_ptr, sf2_ptr, clamp, I, STORE_L1, 4)
            else:
                NBP: tl.constexpr = NB // SPLIT
                slots = _slots(terms_ptr, rows, t, NB, 2 * I)
                if part == 0:  # the running sum of the first blocks, kept in slot 0
                    acc = _gate_up_blocks(zero, valid, cols, wp, sp, x_ptr, xsf_ptr, tok, 0, NBP, slots, 2 * I, H, ASM,
                                          True, False)
                    tl.store(slots, acc, mask=valid[None, :])
                else:  # each block's term in its own slot
                    _gate_up_blocks(zero, valid, cols, wp, sp, x_ptr, xsf_ptr, tok, part * NBP, NBP, slots, 2 * I, H,
                                    ASM, True, True)
                PROBE(probe_ptr, 4)
                pdl_release(PDL)
                if _arrive_last(cnt_ptr + j * (I // 32) + t, SPLIT):  # the last part to finish: replay, epilogue
                    acc = _replay(slots, valid, NBP, NB, 2 * I)
                    _gate_up_epilogue(acc, rows, valid, t, weight, l1_ptr, q_ptr, sf2_ptr, clamp, I, STORE_L1, 4)
        elif part == 0:  # passes of 16 rows, never split
            m0 = 0
            while m0 < count:  # a while loop: the interpreter cannot range() over a loaded scalar
                rows, valid = _pass(start, m0, count)
                tok, weight = _pass_rows(rows, valid, row_token_ptr, row_weight_ptr, skey, start, m0, count, tw_ptr,
                                         ROUTE, K, S_PAD, NTOK)
                acc = _gate_up_blocks(tl.zeros([64, NTOK], tl.float32), valid, None, wp, sp, x_ptr, xsf_ptr, tok, 0, NB,
                                      None, 1, H, ASM, False, False)
                PROBE(probe_ptr, 4)  # (each pass: the last one's stays)
                pdl_release(PDL)  # down may start once every program has streamed its weights (later calls: no effect)
                _gate_up_epilogue(acc, rows, valid, t, weight, l1_ptr, q_ptr, sf2_ptr, clamp, I, STORE_L1, NTOK)
                m0 += NTOK
    PROBE(probe_ptr, 5)


@triton.jit
def _pass_rows(rows, valid, row_token_ptr, row_weight_ptr, skey, start, m0, count, tw_ptr, ROUTE: tl.constexpr,
               K: tl.constexpr, S_PAD: tl.constexpr, W: tl.constexpr):
    """The tokens (int64 [W]) and routing weights (fp32 [W]) of a pass's pool rows: route's outputs, or with ROUTE
    the program's own (``routing.route_rows``)."""
    if ROUTE:
        return route_rows(skey, start + m0, count - m0, tw_ptr, K, S_PAD, W)
    else:
        return (tl.load(row_token_ptr + rows, mask=valid, other=0).to(tl.int64),
                tl.load(row_weight_ptr + rows, mask=valid, other=0.0))


@triton.jit
def _gate_up_blocks(acc, valid, cols, wp, sp, x_ptr, xsf_ptr, tok, lo, N: tl.constexpr, slots, STRIDE: tl.constexpr,
                    H: tl.constexpr, ASM: tl.constexpr, PACKED: tl.constexpr, TERMS: tl.constexpr):
    """The gate/up GEMM's K loop for one pass (its tokens tok [W]) over the N 128-K blocks from block lo: acc fp32
    [64, W] promoted block by block in ascending K (or, TERMS, each block's term stored in its slot: ``_take``), a
    block's four groups per iteration (one packed MMA over ``cols``, or four), each block's scale words and x_sf
    loaded one block ahead. The scale words and x_sf are plain loads (only the code and x tiles are
    software-pipelined by Triton): loaded ahead, no group waits on global memory for them."""
    NB: tl.constexpr = H // 128
    xsp = xsf_ptr + tok * NB
    f0, f1, f2, f3 = _factors4(sp + lo * 64)
    xsf = tl.load(xsp + lo, mask=valid, other=0.0)
    for i in range(N):
        kb = lo + i
        nb = lo + tl.minimum(i + 1, N - 1)  # the next block (the last reloads its own)
        n0, n1, n2, n3 = _factors4(sp + nb * 64)
        nxsf = tl.load(xsp + nb, mask=valid, other=0.0)
        if PACKED:
            d0, d1, d2, d3 = _packed_mma(wp + kb * 4096, f0, f1, f2, f3, x_ptr, cols, kb * 128, H, ASM)
            blk = ((d0 + d1) + d2) + d3
        else:
            blk = _block_sum(wp + kb * 4096, f0, f1, f2, f3, x_ptr, tok, valid, kb * 128, H, ASM)
        acc = _take(acc, blk, xsf, slots, kb, valid, STRIDE, TERMS, ASM)
        f0, f1, f2, f3, xsf = n0, n1, n2, n3, nxsf
    return acc


@triton.jit
def _gate_up_epilogue(acc, rows, valid, t, weight, l1_ptr, q_ptr, sf2_ptr, clamp, I: tl.constexpr,
                      STORE_L1: tl.constexpr, W: tl.constexpr):
    """acc fp32 [64, W] (gate rows 0..31, up rows 32..63 of channel tile t) -> SwiGLU, the routing weight and the
    FP8 requant of the tile's 32 channels, stored for the pass's W pool rows (routing weights weight [W])."""
    n = t * 32 + tl.arange(0, 32)
    gate, up = tl.split(tl.permute(tl.reshape(acc, (2, 32, W)), (1, 2, 0)))  # [32, W] each
    if STORE_L1:
        tl.store(l1_ptr + rows[None, :] * (2 * I) + n[:, None], gate, mask=valid[None, :])
        tl.store(l1_ptr + rows[None, :] * (2 * I) + I + n[:, None], up, mask=valid[None, :])
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
    probe_ptr,  # PROBE's (``triton_tc_ops.no_probe``)
    H: tl.constexpr, I: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr = False, PACK: tl.constexpr = False,
    PROBE: tl.constexpr = no_probe,
):
    j = tl.program_id(0)
    t = tl.program_id(1)
    PROBE(probe_ptr, 1)
    pdl_wait(PDL)
    PROBE(probe_ptr, 2)
    n_items = tl.load(num_touched_ptr)
    e, start, count = _item(j, touched_ptr, seg_start_ptr, seg_count_ptr)  # beside the count (as gate/up's)
    if j < n_items:
        PROBE(probe_ptr, 3)
        tile = (e * (H // 64) + t) * (I // 32)
        n = t * 64 + tl.arange(0, 64)
        if PACK and count <= 4:  # one packed pass (as gate/up's)
            rows, valid = _pass(start, 0, count, 4)
            acc = _down_groups(tl.zeros([64, 4], tl.float32), rows, valid, _packed_columns(rows, count),
                               w_ptr, s_ptr, sf2_ptr, q_ptr, tile, I, ASM, True)
            PROBE(probe_ptr, 4)
            pdl_release(PDL)
            tl.store(out_ptr + rows[None, :] * H + n[:, None], _bf16_bits(acc), mask=valid[None, :])
        else:
            m0 = 0
            while m0 < count:
                rows, valid = _pass(start, m0, count)
                acc = _down_groups(tl.zeros([64, NTOK], tl.float32), rows, valid, None, w_ptr, s_ptr, sf2_ptr, q_ptr,
                                   tile, I, ASM, False)
                PROBE(probe_ptr, 4)  # (each pass: the last one's stays)
                pdl_release(PDL)  # the combine may start (as in gate/up)
                tl.store(out_ptr + rows[None, :] * H + n[:, None], _bf16_bits(acc), mask=valid[None, :])
                m0 += NTOK
    PROBE(probe_ptr, 5)


@triton.jit
def _down_groups(acc, rows, valid, cols, w_ptr, s_ptr, sf2_ptr, q_ptr, tile, I: tl.constexpr,
                 ASM: tl.constexpr, PACKED: tl.constexpr):
    """The down GEMM's K loop for one pass: acc fp32 [64, W] promoted group by group in ascending K, four groups per
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
        acc = acc + _mul_rn(d0, c0[None, :], ASM)  # the promotion, group by group
        acc = acc + _mul_rn(d1, c1[None, :], ASM)
        acc = acc + _mul_rn(d2, c2[None, :], ASM)
        acc = acc + _mul_rn(d3, c3[None, :], ASM)
        f0, f1, f2, f3, c0, c1, c2, c3 = n0, n1, n2, n3, o0, o1, o2, o3
    return acc


# ---- a split K that keeps the bits: the promotion chain, replayed by the last part to finish -------------------


@triton.jit
def _take(acc, blk, sf, slots, k, valid, STRIDE: tl.constexpr, TERMS: tl.constexpr, ASM: tl.constexpr):
    """One promotion step, acc + fl32(sf * blk) (blk fp32 [64, W], sf [W]); with TERMS (a part after the first of
    a split K) the term fl32(sf * blk) goes to slot k instead and acc is returned unchanged."""
    term = _mul_rn(blk, sf[None, :], ASM)
    if TERMS:
        tl.store(slots + k * STRIDE, term, mask=valid[None, :])
        return acc
    else:
        return acc + term


@triton.jit
def _slots(terms_ptr, rows, t, NSLOT: tl.constexpr, STRIDE: tl.constexpr):
    """Slot 0 of tile t's 64 outputs for each pass row, [64, W] pointers into terms fp32 [S', NSLOT, STRIDE];
    slot k is ``+ k * STRIDE``."""
    return terms_ptr + rows[None, :] * (NSLOT * STRIDE) + (t * 64 + tl.arange(0, 64))[:, None]


@triton.jit
def _arrive_last(cnt_ptr, SPLIT: tl.constexpr):
    """Count this part in (acq_rel, GPU scope) once every thread's stores are done: True for the last of the
    SPLIT parts, which resets the count for the next launch."""
    tl.debug_barrier()
    last = tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu") == SPLIT - 1
    tl.store(cnt_ptr, 0, mask=last)
    return last


@triton.jit
def _replay(slots, valid, FIRST: tl.constexpr, NSLOT: tl.constexpr, STRIDE: tl.constexpr):
    """The promotion chain of an unsplit pass, replayed: part 0's running sum (slot 0), then the other parts'
    terms (slots FIRST..NSLOT-1) added one by one in ascending K, the same FP32 additions in the same order.
    Loads of what other programs wrote in this launch bypass L1 (``.cg``)."""
    acc = tl.load(slots, mask=valid[None, :], other=0.0, cache_modifier=".cg")
    for k in tl.static_range(FIRST, NSLOT):
        acc = acc + tl.load(slots + k * STRIDE, mask=valid[None, :], other=0.0, cache_modifier=".cg")
    return acc

"""The tensor-core decode step in one launch (``LaunchConfig.tc_fused``, up to 4 tokens): route, L1, L2 and
the combine of ``triton_tc`` / ``triton_combine``, the same programs and the same bits; what changes is who
waits for whom. A 1-D grid, W = the step's most work items, NT1 = I / 32, NT2 = H / 64:

    pid <  W NT1 SPLIT        L1 of work item j = pid // (NT1 SPLIT): channel tile t, K part p (``_l1_packed``);
                              the program that writes the tile's L2 input counts it in done[j] (release)
    pid <  that + W NT2 SPLIT2   L2 of work item j, output tile t, K part p: waits until done[j] == NT1
                              (acquire), streams its tile (``_l2_packed``, or its share of the K groups,
                              ``_l2_split``); the program that stores the tile then, per pool row, adds 1 to
                              tile_count[token, t] (acq_rel): the one that brings it to the token's routed slots
                              combines that token's 64 columns (slots in ascending order, ``combine_tile``)
    the last pid              route's outputs (``routing.route_meta``) for whoever reads them after the step, and
                              zeros in y for the tokens with no local slot

Every program finds its work item from the staged top-k itself (``routing.route_item``), so nothing waits on
the routing. Programs are numbered item by item, so an expert's L2 programs start while the L1 programs of the
experts after it still stream, and no launch boundary separates the two GEMVs or the combine: the DRAM does not
idle in L1's tail. Who writes a tile's L2 input or combines a token's tile changes from run to run; the order of
every sum does not, so neither do the bits.

Progress assumes the GPU dispatches a 1-D grid's programs in increasing order (every L1 program is resident or
finished before an L2 program waits on it), as ``triton_fused.py`` does; a wait gives up after MAX_SPIN polls
and sets the error flag instead of hanging. The counters reset themselves: the last L2 program of item j past
its wait zeroes done[j] and its own count, the combining program its tile count, the last part of a split tile
its parts count. After a launch that set the error flag, zero them (``DecodeBuffers.counters``). Loads of what
other programs wrote in this launch bypass L1 (``.cg``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .routing import route_item, route_meta, route_rows, route_token_slots
from .triton_combine import combine_tile
from .triton_fused import _wait_at_least
from .triton_pdl import pdl_wait
from .triton_tc import _l1_packed, _l2_packed, _l2_split
from .triton_tc_ops import _stamp


@triton.jit
def tc_fused_kernel(
    w1_ptr, s1_ptr, w2_ptr, s2_ptr,  # L1 / L2 codes and scale words (layout_tc.py)
    x_ptr, xsf_ptr, idx_ptr, tw_ptr,  # staged: e4m3 [C, H], fp32 [C, H/128], int64 [C, K], fp32 [C, K]
    num_touched_ptr, touched_ptr, seg_start_ptr, seg_count_ptr, row_token_ptr, row_weight_ptr, slot_row_ptr,
    l1_ptr, q_ptr, q8_ptr, sf2_ptr,  # fp32 [S, 2I] (STORE_L1); L2's input: uint8 [S, I], its e4m3 view, fp32 [S, I/32]
    slot_out_ptr, y_ptr,  # int16 (bf16 bits) [S, H], [C, H]
    terms_ptr, parts_ptr,  # SPLIT > 1: fp32 [S', H/128, 2I], int32 [>= W * NT1] (DecodeBuffers.split_*)
    terms2_ptr, parts2_ptr,  # SPLIT2 > 1: fp32 [S', I/32, H] (DecodeBuffers.split_terms2), int32 [W * NT2]
    done_ptr, passed_ptr, tile_cnt_ptr, err_ptr,  # int32 [W], [W], [C, NT2], [1]: zero before and after a launch
    T, W, expert_lo, num_local, clamp, stamps_ptr,
    H: tl.constexpr, I: tl.constexpr, STORE_L1: tl.constexpr, ASM: tl.constexpr, SPLIT: tl.constexpr,
    K: tl.constexpr, S_PAD: tl.constexpr, E_PAD: tl.constexpr, BH: tl.constexpr, MAX_SPIN: tl.constexpr,
    SPLIT2: tl.constexpr = 1, PDL: tl.constexpr = False, STAMP: tl.constexpr = False,
):
    NT1: tl.constexpr = I // 32
    NT2: tl.constexpr = H // 64
    NB: tl.constexpr = H // 128
    pid = tl.program_id(0)
    n1 = W * (NT1 * SPLIT)
    _stamp(stamps_ptr, 1, STAMP)
    pdl_wait(PDL)  # the staged step, written by the launch before
    _stamp(stamps_ptr, 2, STAMP)
    if pid < n1:
        j = pid // (NT1 * SPLIT)
        t = (pid // SPLIT) % NT1
        n_items, e, start, count, skey = route_item(j, idx_ptr, T, expert_lo, num_local, K, S_PAD, E_PAD)
        if j < n_items:
            _stamp(stamps_ptr, 3, STAMP)
            tile = e * NT1 + t
            ran = _l1_packed(t, pid % SPLIT, start, count, w1_ptr + tile * NB * 4096, s1_ptr + tile * NB * 64,
                             parts_ptr + j * NT1 + t, skey, x_ptr, xsf_ptr, row_token_ptr, row_weight_ptr, tw_ptr,
                             l1_ptr, q_ptr, sf2_ptr, terms_ptr, clamp, stamps_ptr, H, I, STORE_L1, ASM, False, SPLIT,
                             True, K, S_PAD, STAMP)
            if ran:  # the tile's L2 input is written: count it in (every thread's stores first)
                tl.debug_barrier()
                tl.atomic_add(done_ptr + j, 1, sem="release", scope="gpu")
    elif pid < n1 + W * (NT2 * SPLIT2):
        j = (pid - n1) // (NT2 * SPLIT2)
        t = ((pid - n1) // SPLIT2) % NT2
        n_items, e, start, count, skey = route_item(j, idx_ptr, T, expert_lo, num_local, K, S_PAD, E_PAD)
        if j < n_items:
            if not _wait_at_least(done_ptr + j, NT1, MAX_SPIN):
                tl.store(err_ptr, 1)
            if tl.atomic_add(passed_ptr + j, 1, sem="acq_rel", scope="gpu") == NT2 * SPLIT2 - 1:  # item j's last
                tl.store(done_ptr + j, 0)  # L2 program is past its wait: both counts to zero for the next launch
                tl.store(passed_ptr + j, 0)
            _stamp(stamps_ptr, 3, STAMP)
            n = t * 64 + tl.arange(0, 64)
            if SPLIT2 == 1:
                _l2_packed(start, count, (e * NT2 + t) * NT1, n, w2_ptr, s2_ptr, sf2_ptr, q8_ptr, slot_out_ptr,
                           stamps_ptr, H, I, ASM, False, STAMP, ".cg")
                stored = True
            else:
                stored = _l2_split(start, count, (e * NT2 + t) * NT1, n, (pid - n1) % SPLIT2, parts2_ptr + j * NT2 + t,
                                   terms2_ptr, w2_ptr, s2_ptr, sf2_ptr, q8_ptr, slot_out_ptr, H, I, ASM, SPLIT2, ".cg")
                _stamp(stamps_ptr, 4, STAMP)
            tl.debug_barrier()  # every thread's slot_out stores before the counts
            tok4, _ = route_rows(skey, start, count, tw_ptr, K, S_PAD, 4)
            m = 0
            if SPLIT2 > 1:
                m = tl.where(stored, 0, count)  # only the part that stored the tile counts it in
            while m < count:  # a while loop: the interpreter cannot range() over a loaded scalar
                tok = tl.sum(tl.where(tl.arange(0, 4) == m, tok4, 0), axis=0)
                cnt = tile_cnt_ptr + tok * NT2 + t
                if tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu") == route_token_slots(skey, tok, K, S_PAD,
                                                                                          E_PAD) - 1:
                    tl.store(cnt, 0)  # the token's last slot for this tile: combine it, reset the count
                    combine_tile(tok, n, slot_out_ptr, slot_row_ptr, y_ptr, H, K, ".cg", skey, S_PAD, E_PAD, True)
                m += 1
    else:
        _, _, _, _, skey = route_item(0, idx_ptr, T, expert_lo, num_local, K, S_PAD, E_PAD)
        route_meta(idx_ptr, tw_ptr, num_touched_ptr, touched_ptr, seg_start_ptr, seg_count_ptr, row_token_ptr,
                   row_weight_ptr, slot_row_ptr, done_ptr, 0, T, expert_lo, num_local, K, S_PAD, E_PAD, False)
        tok = 0
        while tok < T:  # no combine writes the rows of tokens with no local slot
            if route_token_slots(skey, tok, K, S_PAD, E_PAD) == 0:
                for c0 in tl.static_range(0, H, BH):
                    cols = c0 + tl.arange(0, BH)
                    tl.store(y_ptr + tok.to(tl.int64) * H + cols, tl.zeros([BH], tl.int16), mask=cols < H)
            tok += 1
    _stamp(stamps_ptr, 5, STAMP)

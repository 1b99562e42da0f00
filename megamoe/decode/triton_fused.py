"""The L1 GEMV, the L2 GEMV and the combine in one launch: ``fused_kernel`` (Triton). Same programs, same
bits as the separate launches (``triton_gemv``); what changes is who waits for whom.

    pid <  W * I/BN1      l1_program (j, t) = divmod(pid, I/BN1); then done[j] += 1 (release)
    pid >= W * I/BN1      work item j's L2 programs wait until done[j] == I/BN1 (acquire), run l2_program,
                          then, per row, tile_count[token, t] += 1 (acq_rel): the program that brings it to the
                          token's number of routed slots combines that token's tile (slots in ascending order)

So an expert's L2 starts as soon as its own L1 tiles are done (it fills the L1 tail of the other experts),
and no launch boundary separates L1, L2 and the combine. Who combines a tile changes from run to run; the
order of its sum does not, so the bits do not either.

Progress assumes the GPU dispatches a 1-D grid's programs in increasing order (every L1 program is resident
or finished before any L2 program waits; true of NVIDIA's block scheduler, not promised by CUDA). A wait
gives up after MAX_SPIN polls and sets err[0] = 1 instead of hanging. The counters are zeroed by the routing
launch before each step. Loads of what other programs wrote in this launch bypass L1 (``.cg``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_combine import combine_tile
from .triton_gemv import l1_program, l2_program


@triton.jit
def _wait_at_least(ptr, target, MAX_SPIN: tl.constexpr):
    """Poll *ptr (acquire) until it reaches target; False if MAX_SPIN polls were not enough."""
    n = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
    spins = 0
    while (n < target) & (spins < MAX_SPIN):
        n = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
        spins += 1
    return n >= target


@triton.jit
def fused_kernel(
    w1_ptr, s1_ptr, x_ptr, xsf_ptr, num_touched_ptr, touched_ptr, seg_start_ptr, seg_count_ptr, row_token_ptr,
    row_weight_ptr, l1_ptr, q_ptr, x2_ptr, sf2_ptr, clamp,  # l1_program's
    w2_ptr, s2_ptr, out_ptr,  # l2_program's (with x2_ptr, sf2_ptr, the routing)
    slot_row_ptr, y_ptr, done_ptr, cnt_ptr, err_ptr, W,
    H: tl.constexpr, I: tl.constexpr, BN1: tl.constexpr, G1: tl.constexpr, BN2: tl.constexpr, G2: tl.constexpr,
    K: tl.constexpr, BLOCK_M: tl.constexpr, STORE_L1: tl.constexpr, ASM: tl.constexpr, MAX_SPIN: tl.constexpr,
):
    NT1: tl.constexpr = I // BN1
    NT2: tl.constexpr = H // BN2
    pid = tl.program_id(0)
    if pid < W * NT1:
        j = pid // NT1
        l1_program(j, pid % NT1, w1_ptr, s1_ptr, x_ptr, xsf_ptr, num_touched_ptr, touched_ptr, seg_start_ptr,
                   seg_count_ptr, row_token_ptr, row_weight_ptr, l1_ptr, q_ptr, x2_ptr, sf2_ptr, clamp,
                   H, I, BN1, G1, BLOCK_M, STORE_L1, ASM)
        tl.debug_barrier()  # every thread's stores before the release
        tl.atomic_add(done_ptr + j, 1, sem="release", scope="gpu")
    else:
        q = pid - W * NT1
        j = q // NT2
        t = q % NT2
        if j < tl.load(num_touched_ptr):
            if not _wait_at_least(done_ptr + j, NT1, MAX_SPIN):
                tl.store(err_ptr, 1)
            l2_program(j, t, w2_ptr, s2_ptr, x2_ptr, sf2_ptr, num_touched_ptr, touched_ptr, seg_start_ptr,
                       seg_count_ptr, out_ptr, H, I, BN2, G2, BN1, BLOCK_M, ASM, ".cg")
            tl.debug_barrier()
            start = tl.load(seg_start_ptr + j)
            count = tl.load(seg_count_ptr + j)
            cols = t * BN2 + tl.arange(0, BN2)
            m = 0
            while m < count:
                tok = tl.load(row_token_ptr + start + m)
                routed = 0
                for k in tl.static_range(K):
                    routed += (tl.load(slot_row_ptr + tok * K + k) >= 0).to(tl.int32)
                arrived = tl.atomic_add(cnt_ptr + tok * NT2 + t, 1, sem="acq_rel", scope="gpu")
                if arrived == routed - 1:  # the token's last slot for this tile: combine it
                    combine_tile(tok, cols, out_ptr, slot_row_ptr, y_ptr, H, K, ".cg")
                m += 1

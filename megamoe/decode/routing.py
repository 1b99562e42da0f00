"""Routing metadata on the device (no host sync) and the staged x as float32 values: the decode path's
first launch, ``route`` (Triton) beside ``route_torch`` (its twin, same signature, same outputs).

From the staged step (topk_idx [C, K] int64, -1 = masked; topk_weights fp32 [C, K]; x_q e4m3 [C, H]),
for the first T tokens and the local experts [expert_lo, expert_lo + E_l):

    pool row p (0 <= p < n_valid)   the p-th valid slot in (expert, token, slot) order: the order of
                                    ``megamoe.reference.dispatch.build_layout`` with BLOCK_M 1
    row_token[p], row_weight[p]     its token and routing weight
    slot_row[t * K + k]             the pool row of slot (t, k), -1 when masked or not local
    num_touched[0]                  how many local experts have a slot
    touched[j], seg_start[j], seg_count[j]   work item j < num_touched: the j-th touched expert (local
                                    index, ascending), its first pool row, its number of rows
    x32 [T, H] fp32                 the e4m3 values of x_q (exact)                               (full)

The tensor-core path reads x_q itself, so it routes without x32 (``full=False``): one program, whose sort
covers the step's T K slots (not the buffers' capacity). A token with no local slot needs nothing here: the
combine writes its row of y (zeros).

Entries past these counts are left as they were (the kernels never read them).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_pdl import launch_options, pdl_enter


@triton.jit
def e4m3_to_f32(code):
    """uint8/int32 e4m3fn codes -> their float32 values, exactly: the 7 magnitude bits become an fp16's
    exponent and mantissa (value * 2**-8, subnormals included), then one exact conversion and scaling."""
    c = code.to(tl.int32)
    h = ((c & 0x7F) << 7) | ((c & 0x80) << 8)
    return h.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0


@triton.jit
def route_kernel(
    idx_ptr, tw_ptr, xq_ptr,  # int64 [C, K], fp32 [C, K], uint8 [C, H]
    num_touched_ptr, touched_ptr, seg_start_ptr, seg_count_ptr,  # int32 [1], [W], [W], [W]
    row_token_ptr, row_weight_ptr, slot_row_ptr, x32_ptr,  # int32 [S], fp32 [S], int32 [C * K], fp32 [C, H]
    T, expert_lo, num_local,
    K: tl.constexpr, S_PAD: tl.constexpr, E_PAD: tl.constexpr, H: tl.constexpr, X_BLOCK: tl.constexpr,
    PDL: tl.constexpr = False,
):
    pdl_enter(PDL)
    pid = tl.program_id(0)
    if pid > 0:  # programs 1.. convert x_q to float32 values, X_BLOCK elements each
        offs = (pid - 1).to(tl.int64) * X_BLOCK + tl.arange(0, X_BLOCK)
        m = offs < T * H
        code = tl.load(xq_ptr + offs, mask=m, other=0)
        tl.store(x32_ptr + offs, e4m3_to_f32(code), mask=m)
    else:
        route_meta(idx_ptr, tw_ptr, num_touched_ptr, touched_ptr, seg_start_ptr, seg_count_ptr, row_token_ptr,
                   row_weight_ptr, slot_row_ptr, T, expert_lo, num_local, K, S_PAD, E_PAD)


@triton.jit
def _sorted_slots(idx_ptr, T, expert_lo, num_local, K: tl.constexpr, S_PAD: tl.constexpr, E_PAD: tl.constexpr):
    """The step's T K slots sorted into pool order: keys expert * S_PAD + flat slot, invalid slots last (key
    E_PAD * S_PAD) -> (keys [S_PAD], valid [S_PAD] in the unsorted order, expert [S_PAD] in the unsorted order)."""
    s = tl.arange(0, S_PAD)
    in_step = s < T * K
    e = tl.load(idx_ptr + s, mask=in_step, other=-1).to(tl.int32) - expert_lo
    valid = in_step & (e >= 0) & (e < num_local)
    return tl.sort(tl.where(valid, e * S_PAD + s, E_PAD * S_PAD)), valid, e


@triton.jit
def route_meta(idx_ptr, tw_ptr, num_touched_ptr, touched_ptr, seg_start_ptr, seg_count_ptr, row_token_ptr,
               row_weight_ptr, slot_row_ptr, T, expert_lo, num_local,
               K: tl.constexpr, S_PAD: tl.constexpr, E_PAD: tl.constexpr):
    """Every output of the module docstring but x32, by one program (route's program 0, or the extra program of
    a tensor-core gate/up that routes for itself: ``triton_tc.l1_tc_kernel``'s ROUTE)."""
    s = tl.arange(0, S_PAD)
    in_step = s < T * K
    skey, valid, e = _sorted_slots(idx_ptr, T, expert_lo, num_local, K, S_PAD, E_PAD)
    n_valid = tl.sum(valid.to(tl.int32), axis=0)
    slot = skey % S_PAD
    is_row = s < n_valid
    tl.store(row_token_ptr + s, slot // K, mask=is_row)
    tl.store(row_weight_ptr + s, tl.load(tw_ptr + slot, mask=is_row, other=0.0), mask=is_row)
    tl.store(slot_row_ptr + s, tl.full([S_PAD], -1, tl.int32), mask=in_step)
    tl.debug_barrier()  # the -1 fill lands before the scatter below (other threads' addresses)
    tl.store(slot_row_ptr + slot, s, mask=is_row)
    # Experts: counts (bin E_PAD - 1 >= E_l collects the invalid slots), compacted in ascending order.
    counts = tl.histogram(tl.where(valid, e, E_PAD - 1), E_PAD)
    ex = tl.arange(0, E_PAD)
    touched = (counts > 0) & (ex < num_local)
    j = tl.cumsum(touched.to(tl.int32), 0) - 1
    start = tl.cumsum(counts, 0) - counts
    tl.store(touched_ptr + j, ex, mask=touched)
    tl.store(seg_start_ptr + j, start, mask=touched)
    tl.store(seg_count_ptr + j, counts, mask=touched)
    tl.store(num_touched_ptr, tl.sum(touched.to(tl.int32), axis=0))


@triton.jit
def route_item(j, idx_ptr, T, expert_lo, num_local, K: tl.constexpr, S_PAD: tl.constexpr, E_PAD: tl.constexpr):
    """Work item j of the step from the staged routing alone, as ``route_meta`` orders them: (the number of
    work items, its expert (local index, int64), its first pool row, its number of rows, the pool-order keys
    for ``route_rows``). For a kernel that routes for itself instead of waiting on route's launch (S_PAD of a
    few dozen slots: an [S_PAD, S_PAD] comparison)."""
    s = tl.arange(0, S_PAD)
    skey, _, _ = _sorted_slots(idx_ptr, T, expert_lo, num_local, K, S_PAD, E_PAD)
    ex = skey // S_PAD  # the expert of pool row p (E_PAD past the last row)
    prev = tl.max(tl.where(s[None, :] == s[:, None] - 1, ex[None, :], -1), axis=1)  # ex[p - 1]; -1 at p = 0
    first = (ex != prev) & (ex < E_PAD)  # the first row of each touched expert
    item = tl.cumsum(first.to(tl.int32), 0) - 1
    mine = (item == j) & (ex < E_PAD)
    start = tl.min(tl.where(mine, s, S_PAD), axis=0)
    count = tl.sum(mine.to(tl.int32), axis=0)
    expert = tl.max(tl.where(mine, ex, 0), axis=0)
    return tl.sum(first.to(tl.int32), axis=0), expert.to(tl.int64), start, count, skey


@triton.jit
def route_rows(skey, first_row, rows_left, tw_ptr, K: tl.constexpr, S_PAD: tl.constexpr, W: tl.constexpr):
    """Pool rows first_row .. first_row + W - 1 (those under rows_left) -> (their tokens int64 [W], routing
    weights fp32 [W]); skey from ``route_item``."""
    s = tl.arange(0, S_PAD)
    n = tl.arange(0, W)
    slot = tl.sum(tl.where(s[None, :] == first_row + n[:, None], (skey % S_PAD)[None, :], 0), axis=1)
    real = n < rows_left
    return tl.where(real, slot // K, 0).to(tl.int64), tl.load(tw_ptr + slot, mask=real, other=0.0)


X_BLOCK = 4096


def slot_pad(num_tokens: int, top_k: int) -> int:
    """S_PAD: the step's T K slots, padded to a power of two (the sort's length)."""
    return triton.next_power_of_2(num_tokens * top_k)


def route_pads(num_tokens: int, top_k: int, num_local: int) -> dict:
    """The sort's sizes, as the kernels' constexprs: K, S_PAD (``slot_pad``) and E_PAD, route's histogram bins
    (the local experts and one for invalid slots). For route's launch and for a kernel that routes for itself
    (``route_item``), which must order the pool rows alike."""
    return dict(K=top_k, S_PAD=slot_pad(num_tokens, top_k), E_PAD=triton.next_power_of_2(num_local + 1))


def route(topk_idx, topk_weights, x_q, num_tokens: int, expert_lo: int, num_local: int, out, pdl: bool = False,
          *, full: bool = True) -> None:
    """Launch ``route_kernel`` for the first ``num_tokens`` staged tokens into ``out`` (a DecodeBuffers); ``pdl``:
    programmatic dependent launch (``triton_pdl.py``); ``full``: also x32 (the module docstring; programs 1..)."""
    k = topk_idx.shape[1]
    h = x_q.shape[1]
    if num_tokens == 0:
        return
    grid = (1 + (triton.cdiv(num_tokens * h, X_BLOCK) if full else 0),)
    route_kernel[grid](
        topk_idx, topk_weights, x_q.view(torch.uint8), out.num_touched, out.touched, out.seg_start, out.seg_count,
        out.row_token, out.row_weight, out.slot_row, out.x32, num_tokens, expert_lo, num_local,
        **route_pads(num_tokens, k, num_local), H=h, X_BLOCK=X_BLOCK, PDL=pdl and not out.interpret,
        **launch_options(4, out.interpret, pdl),
    )


def route_torch(topk_idx, topk_weights, x_q, num_tokens: int, expert_lo: int, num_local: int, out) -> None:
    """``route`` in eager PyTorch: the same outputs, bit for bit (a stable sort by expert)."""
    if num_tokens == 0:
        return
    k = topk_idx.shape[1]
    e = topk_idx[:num_tokens].reshape(-1) - expert_lo
    valid = (e >= 0) & (e < num_local)
    flat = torch.arange(e.numel(), device=e.device)
    order = flat[valid][torch.sort(e[valid], stable=True).indices]  # flat slots in pool order
    n = order.numel()
    out.row_token[:n] = (order // k).to(torch.int32)
    out.row_weight[:n] = topk_weights[:num_tokens].reshape(-1)[order]
    out.slot_row[: e.numel()] = -1
    out.slot_row[order] = torch.arange(n, dtype=torch.int32, device=e.device)
    counts = torch.bincount(e[valid], minlength=num_local)
    ex = torch.nonzero(counts).squeeze(1)
    starts = torch.cumsum(counts, 0) - counts
    w = ex.numel()
    out.num_touched[0] = w
    out.touched[:w] = ex.to(torch.int32)
    out.seg_start[:w] = starts[ex].to(torch.int32)
    out.seg_count[:w] = counts[ex].to(torch.int32)
    out.x32[:num_tokens] = x_q[:num_tokens].float()

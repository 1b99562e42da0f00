"""The glue around Humming's two GEMMs, as vLLM's ``HummingIndexedExperts`` runs it: each step a Triton kernel
beside its torch twin (the twin is the specification; the tests run both, the kernels under the interpreter).

    align     topk_idx int64 [m, K] -> sorted_ids int32 [S], expert_ids int32 [B], num_padded int32 [1]
              (vLLM's ``moe_align_block_size`` with ignore_invalid_experts: each expert's slots, padded to a
              multiple of ``block``; padding entries hold m * K; masked slots (-1) appear nowhere)
    swiglu    gate_up bf16 [n, 2I] (gate | up per slot row) -> v bf16 [n, I]
              g = min(gate, clamp), u = clamp(up, -clamp, clamp), v = bf16((g * (1 / (1 + e))) * u) with
              e = fl32(exp64(-g)) and an IEEE division (recipe silu_exp "fp64-rounded", swiglu_bf16)
    combine   slot outputs bf16 [m, K, H], topk_weights fp32 [m, K], topk_idx [m, K] -> y bf16 [m, H]:
              acc = fma(slot, w, acc) in FP32 over the valid slots in ascending order, then bf16 (vLLM's
              ``moe_fused_mul_sum``; recipe routing_weight "at-combine")

Written here rather than imported because vLLM is not a dependency: these are the few lines of its own glue,
and the Humming backend needs them capturable in one CUDA graph with no host sync.

The align counts with atomics (integers: the counts are exact whatever the order) and places each expert's
slots in ascending slot order, one program per expert, as vLLM's CUDA kernel does: the layout is the same on
every launch, so a relaunch that differs is the GEMM's own doing.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the torch twins run without triton
    triton = None


# ------------------------------------------------------------------------------------------------ align
def padded_slots_bound(num_tokens: int, num_topk: int, num_experts: int, block: int) -> int:
    """The most sorted_ids entries ``num_tokens`` tokens can need: sum over experts of the count rounded up to
    ``block`` is at most n + E * (block - 1) with n = num_tokens * num_topk slots (and at most n * block)."""
    n = num_tokens * num_topk
    return min(n + num_experts * (block - 1), n * block)


def align_block_size_torch(topk_idx: torch.Tensor, num_experts: int, block: int):
    """The specification: topk_idx [m, K] -> (sorted_ids int32 [P], expert_ids int32 [P / block], P int) where P
    is the padded total; each expert's slots in ascending slot order, then padding m * K up to the block."""
    flat = topk_idx.reshape(-1)
    n = flat.numel()
    sorted_ids, expert_ids = [], []
    for e in range(num_experts):
        slots = torch.nonzero(flat == e).flatten().to(torch.int32)
        if not slots.numel():
            continue
        pad = -slots.numel() % block
        sorted_ids.append(torch.cat([slots, torch.full((pad,), n, dtype=torch.int32, device=flat.device)]))
        expert_ids += [e] * ((slots.numel() + pad) // block)
    ids = torch.cat(sorted_ids) if sorted_ids else torch.zeros(0, dtype=torch.int32, device=flat.device)
    return ids, torch.tensor(expert_ids, dtype=torch.int32, device=flat.device), int(ids.numel())


if triton is not None:

    @triton.jit
    def _align_count(idx_ptr, counts_ptr, n, E: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        e = tl.load(idx_ptr + offs, mask=offs < n, other=-1)
        ok = (e >= 0) & (e < E)
        tl.atomic_add(counts_ptr + tl.where(ok, e, 0), tl.full([BLOCK], 1, tl.int32), mask=ok)

    @triton.jit
    def _align_layout(counts_ptr, cursor_ptr, sorted_ptr, expert_ids_ptr, num_padded_ptr, n, block,
                      E: tl.constexpr, CHUNK: tl.constexpr):
        """One program: padded segment bounds, the next launch's zero counts, each block's expert, the padding."""
        ex = tl.arange(0, E)
        cnt = tl.load(counts_ptr + ex)
        tl.store(counts_ptr + ex, tl.zeros([E], tl.int32))  # ready for the next launch's atomics
        padded = (cnt + block - 1) // block * block
        end = tl.cumsum(padded, axis=0)
        start = end - padded
        total = tl.sum(padded, axis=0)
        tl.store(cursor_ptr + ex, start)
        tl.store(num_padded_ptr, total)
        # While loops: the interpreter cannot range() over a computed scalar.
        p0 = 0
        while p0 < total:  # every entry padding first; the scatter overwrites the real slots
            p = p0 + tl.arange(0, CHUNK)
            tl.store(sorted_ptr + p, tl.full([CHUNK], 0, tl.int32) + n, mask=p < total)
            p0 += CHUNK
        b0 = 0
        while b0 * block < total:  # block b belongs to the expert whose segment holds entry b * block
            b = b0 + tl.arange(0, CHUNK)
            first = b * block
            owner = tl.sum((end[None, :] <= first[:, None]).to(tl.int32), axis=1)
            tl.store(expert_ids_ptr + b, owner, mask=first < total)
            b0 += CHUNK

    @triton.jit
    def _align_scatter(idx_ptr, cursor_ptr, sorted_ptr, n, E: tl.constexpr, BLOCK: tl.constexpr):
        """Program e: expert e's slots in ascending order into its segment (vLLM's order; no atomics, so the
        layout is the same on every launch)."""
        e = tl.program_id(0)
        pos = tl.load(cursor_ptr + e)
        s0 = 0
        while s0 < n:
            offs = s0 + tl.arange(0, BLOCK)
            mine = tl.load(idx_ptr + offs, mask=offs < n, other=-1) == e
            rank = tl.cumsum(mine.to(tl.int32), axis=0)
            tl.store(sorted_ptr + pos + rank - 1, offs.to(tl.int32), mask=mine)
            pos += tl.sum(mine.to(tl.int32), axis=0)
            s0 += BLOCK


def align_block_size(topk_idx: torch.Tensor, num_experts: int, block: int, *, sorted_ids: torch.Tensor,
                     expert_ids: torch.Tensor, num_padded: torch.Tensor, counts: torch.Tensor,
                     cursor: torch.Tensor) -> None:
    """The Triton align into preallocated buffers (no sync, no allocation): topk_idx int64 [m, K] contiguous;
    sorted_ids int32 [>= padded_slots_bound], expert_ids int32 [>= bound / block], num_padded int32 [1],
    counts / cursor int32 [E] (counts all zero on entry, as this function leaves them; E a power of two)."""
    n = topk_idx.numel()
    if n == 0:
        num_padded.zero_()
        return
    block_n = 1024
    grid = (triton.cdiv(n, block_n),)
    _align_count[grid](topk_idx, counts, n, E=num_experts, BLOCK=block_n)
    _align_layout[(1,)](counts, cursor, sorted_ids, expert_ids, num_padded, n, block, E=num_experts, CHUNK=128)
    _align_scatter[(num_experts,)](topk_idx, cursor, sorted_ids, n, E=num_experts, BLOCK=block_n)


# ------------------------------------------------------------------------------------------------ swiglu
def swiglu_torch(gate_up: torch.Tensor, clamp: float) -> torch.Tensor:
    """gate_up bf16 [n, 2I] -> bf16 [n, I] (module docstring; the reference's swiglu with fp64-rounded exp)."""
    from ..reference.swiglu import swiglu

    return swiglu(gate_up.float(), clamp, gate_up_bf16=True, silu_exp="fp64-rounded").to(torch.bfloat16)


if triton is not None:

    @triton.jit
    def _bf16_rtne_bits(v):
        """float32 -> bfloat16 bits (int16), round to nearest even, spelled out: the interpreter's cast truncates."""
        b = v.to(tl.int32, bitcast=True)
        return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).to(tl.int16)

    @triton.jit
    def _swiglu_kernel(in_ptr, out_ptr, clamp, I: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = c < I
        gate = tl.load(in_ptr + row * (2 * I) + c, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(in_ptr + row * (2 * I) + I + c, mask=mask, other=0.0).to(tl.float32)
        g = tl.minimum(gate, clamp)
        u = tl.minimum(tl.maximum(up, -clamp), clamp)
        e = tl.exp((-g).to(tl.float64)).to(tl.float32)
        one = tl.full([BLOCK], 1.0, tl.float32)
        v = g * tl.math.div_rn(one, one + e) * u
        tl.store(out_ptr + row * I + c, _bf16_rtne_bits(v), mask=mask)  # out_ptr: the bf16 buffer as int16


def swiglu_into(gate_up: torch.Tensor, out: torch.Tensor, clamp: float) -> None:
    """The Triton SwiGLU: gate_up bf16 [n, 2I] contiguous -> out bf16 [n, I] contiguous."""
    n, two_i = gate_up.shape
    if n == 0:
        return
    block = 1024
    _swiglu_kernel[(n, triton.cdiv(two_i // 2, block))](gate_up, out.view(torch.int16), float(clamp), I=two_i // 2,
                                                         BLOCK=block)


# ------------------------------------------------------------------------------------------------ combine
def combine_torch(slots: torch.Tensor, topk_weights: torch.Tensor, topk_idx: torch.Tensor) -> torch.Tensor:
    """slots bf16 [m, K, H], topk_weights fp32 [m, K], topk_idx [m, K] -> y bf16 [m, H] (the reference's
    at-combine rule: one FP32 FMA per valid slot, ascending)."""
    from ..recipe import HUMMING_W4A8
    from ..reference.pipeline import combine

    return combine(slots, topk_idx >= 0, HUMMING_W4A8, topk_weights)


if triton is not None:

    @triton.jit
    def _combine_kernel(slots_ptr, w_ptr, idx_ptr, y_ptr, K: tl.constexpr, H: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = h < H
        acc = tl.zeros([BLOCK], tl.float32)
        for k in tl.static_range(K):
            valid = tl.load(idx_ptr + t * K + k) >= 0
            w = tl.load(w_ptr + t * K + k)
            v = tl.load(slots_ptr + (t * K + k) * H + h, mask=mask & valid, other=0.0).to(tl.float32)
            acc = tl.where(valid, tl.fma(v, w, acc), acc)
        tl.store(y_ptr + t * H + h, _bf16_rtne_bits(acc), mask=mask)  # y_ptr: the bf16 buffer as int16


def combine_into(slots: torch.Tensor, topk_weights: torch.Tensor, topk_idx: torch.Tensor, y: torch.Tensor) -> None:
    """The Triton combine: slots bf16 [m, K, H], topk_weights fp32 [m, K], topk_idx int64 [m, K] (all
    contiguous) -> y bf16 [m, H]."""
    m, k, h = slots.shape
    if m == 0:
        return
    block = 1024
    _combine_kernel[(m, triton.cdiv(h, block))](slots, topk_weights, topk_idx, y.view(torch.int16), K=k, H=h, BLOCK=block)

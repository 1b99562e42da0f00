"""The decode path's combine (Triton); its twin is ``gemv.combine_torch``.

    combine_kernel   grid (T, H / BH): y[token, cols] = bf16 of the FP32 sum of the token's slot outputs in
                     ascending slot order, masked slots skipped (``combine_tile``)
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_gemv import _bf16_bits
from .triton_pdl import pdl_enter


@triton.jit
def combine_tile(tok, cols, slot_out_ptr, slot_row_ptr, y_ptr, H: tl.constexpr, K: tl.constexpr):
    """y[tok, cols] = bf16(sum over slots k ascending of fp32(slot_out[slot_row[tok, k], cols])), masked skipped."""
    acc = tl.zeros(cols.shape, tl.float32)
    for k in tl.static_range(K):
        row = tl.load(slot_row_ptr + tok * K + k)
        v = tl.load(slot_out_ptr + row.to(tl.int64) * H + cols, mask=(cols < H) & (row >= 0), other=0)
        v32 = (v.to(tl.int32) << 16).to(tl.float32, bitcast=True)
        acc = tl.where(row >= 0, acc + v32, acc)
    tl.store(y_ptr + tok.to(tl.int64) * H + cols, _bf16_bits(acc), mask=cols < H)


@triton.jit
def combine_kernel(slot_out_ptr, slot_row_ptr, y_ptr, T, H: tl.constexpr, K: tl.constexpr, BH: tl.constexpr,
                   PDL: tl.constexpr = False):
    """grid (T, H / BH): ``combine_tile`` of token program_id 0, columns tile program_id 1."""
    pdl_enter(PDL)
    combine_tile(tl.program_id(0), tl.program_id(1) * BH + tl.arange(0, BH), slot_out_ptr, slot_row_ptr, y_ptr, H, K)

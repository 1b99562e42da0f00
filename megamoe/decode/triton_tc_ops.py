"""The tensor-core decode kernels' operands and MMAs (``triton_tc.py`` holds the kernels and their K loops):
the code-pair decode, the scale factors, the contiguous code loads, one group's MMA and the packed MMA of four
groups. Layouts: ``layout_tc.py``.
"""

from __future__ import annotations

import triton
import triton.language as tl

NTOK = tl.constexpr(16)  # tokens per pass: the MMA's N


@triton.jit
def no_probe(probe_ptr, point: tl.constexpr):
    """The kernels' PROBE hook unless a caller passes its own: nothing. Each program calls PROBE(probe_ptr, point) at
    point 1 its start, 2 past ``griddepcontrol.wait``, 3 its work item known, 4 its K loop done, 5 its exit (past the
    step's work items: 1, 2 and 5); the lab's timeline (lab/decode/stamps.py) stores when each was reached."""
    pass


@triton.jit
def _pair_to_e4m3(p, ASM: tl.constexpr):
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
    float8e4nv [64, 32], A[16 w + 8 h + ri, 16 kh + 4 lq + i] = code h of the pair in byte (w, ri, lq, kh, i)
    (``layout_tc.pack_pair``) as e2m1 * 2**-6: sign to bit 7, magnitude bits (e1 e0 m) to bits 4..2. The block's
    order is the order in which the wgmma register fragment holds A, so that each thread loads its 8 bytes at
    once and the reshapes below move no data. On the GPU four bytes per 32-bit register at once."""
    lo, hi = _pair_to_e4m3(p, ASM)
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
    request, 5.7 bank-conflicted wavefronts per copy, Nsight Compute on the H200) and made the L1 cache the
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
    """Gate/up GEMM: one 128-K block = four groups from the code blocks at wp, K [k0, k0 + 128) -> their d' summed in
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
def _decode4(wp, ASM: tl.constexpr):
    """Four consecutive code blocks at wp -> one A operand, float8e4nv [64, 128]: group g at K [32 g, 32 g + 32)
    (``_decode_block`` for each, side by side)."""
    p = tl.reshape(_load4(wp), (4, 4, 8, 4, 2, 4))  # (g, w, ri, lq, kh, i)
    lo, hi = _pair_to_e4m3(p, ASM)
    a = tl.permute(tl.join(lo, hi), (1, 6, 2, 0, 4, 3, 5))  # (w, h, ri, g, kh, lq, i)
    return tl.reshape(a, (64, 128))


@triton.jit
def _packed_columns(xrow4, count):
    """The 16 MMA columns of a packed pass (up to 4 tokens, all four groups of a 128-K block in one MMA): column
    c = 8 gh + 2 n + gl is token n at group g = 2 gh + gl. xrow4 [4]: x's row of each of the pass's rows (the
    pool row's token in gate/up, the pool row in down) -> (x's row of each column [16]; its group [16]; whether n is in
    the pass [16]). With this order the accumulator columns each thread holds (2q, 2q + 1, 8 + 2q, 9 + 2q) are
    the four groups of one token. Computed once per pass, outside the K loop."""
    c = tl.arange(0, 16)
    n = (c % 8) // 2
    valid = n < count
    xrow = tl.sum(tl.where(n[:, None] == tl.arange(0, 4)[None, :], xrow4[None, :], 0), axis=1)  # xrow4[n]
    return tl.where(valid, xrow, 0).to(tl.int64), 2 * (c // 8) + c % 2, valid


@triton.jit
def _x_packed(x_ptr, xrow, grp, valid, k0, LD: tl.constexpr):
    """B of a packed pass, e4m3 [128, 16]: column c holds its token's x at its group's 32 K and zeros at the
    other 96 (and zeros for columns past the pass); (xrow, grp, valid) from ``_packed_columns``."""
    k = tl.arange(0, 128)
    own = valid[:, None] & (k[None, :] // 32 == grp[:, None])
    return tl.trans(tl.load(x_ptr + xrow[:, None] * LD + k0 + k[None, :], mask=own, other=0.0))


@triton.jit
def _packed_mma(wp, f0, f1, f2, f3, x_ptr, cols, k0, LD: tl.constexpr, ASM: tl.constexpr):
    """Four 32-K groups of up to 4 tokens (columns ``cols``) in one m64n16k128 MMA -> d'_g fp32 [64, 4] for
    g = 0..3: group g's column collects its products at k32 step g and zeros at the other three, which leave an
    FP32 accumulator unchanged (all their terms are zero; checked bit for bit on the H200 with four groups per
    MMA in run 3), so it is group g's sum from a zero accumulator, as a fresh k32 MMA: the same bits as
    ``_mma``, one wait."""
    xrow, grp, valid = cols  # _packed_columns
    d = tl.dot(_decode4(wp, ASM), _x_packed(x_ptr, xrow, grp, valid, k0, LD), out_dtype=tl.float32)
    f = tl.permute(tl.join(tl.join(f0, f1), tl.join(f2, f3)), (0, 2, 1))  # [64, gh, gl]
    d = tl.permute(tl.reshape(d, (64, 2, 4, 2)) * f[:, :, None, :], (0, 2, 1, 3))  # (r, n, gh, gl)
    even, odd = tl.split(d)  # gl = 0, 1
    d0, d2 = tl.split(even)
    d1, d3 = tl.split(odd)
    return d0, d1, d2, d3

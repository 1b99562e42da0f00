"""The plain reads in Triton behind ``megamoe.bench.ceilings.ReadCeiling``: each reads every int32 word of a buffer
once and writes, per program, the xor of what it read (so no load is dead code and a test can check the words).

    read_all(buf, out)                    the streaming read (the roofline's read until issue 47, now a named
                                          candidate beside the faster ones): grid = (cdiv(n, BLOCK),), program p
                                          loads words [p * BLOCK, (p + 1) * BLOCK), masked at the end
    read_grid_stride(buf, out, hint=...)  the persistent read: grid = (out.numel(),), a few programs per SM, program
                                          p loads tiles p, p + grid, p + 2 grid, ... of TILE words unmasked (so every
                                          thread issues 128-bit loads), and the last program also the masked tail
    grid_stride_programs(n, per_sm, sms)  how many programs the persistent read launches

Why a second read: the streaming read issues 32-bit loads whenever the word count is not a multiple of 16
(Triton vectorises a masked load only where it knows n % 16 == 0; at DeepSeek-V4-Flash's 1, 2 and 4 tokens the
step's bytes, rounded up to 16, are 4, 4 and 8 words past a multiple of 16), and it pays one program's start per
16 KB. The persistent read keeps the mask out of its loop. ``HINTS`` names the load hints it can take: Triton 3.6
emits ``ld.global.cg`` (L2 only, not L1) or ``ld.global.L1::evict_first``, not both (ptxas refuses the pair), and
never the ``.nc`` read-only path, which is the CUDA read's (``read_cuda``). Both are checked for exactness under
Triton's CPU interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

BLOCK = 4096  # int32 words per program of the streaming read: 16 KB
TILE = 2048  # int32 words per step of a persistent program: 4 warps x 32 threads x 4 x 16-byte loads
NUM_WARPS = 4  # the persistent read's threads per program: 128, like the CUDA read's blocks
HINTS = {  # name -> (cache_modifier, eviction_policy) of the persistent read's loads
    "cg": (".cg", ""),  # cache in L2, not L1
    "evict-first": ("", "evict_first"),  # L1 line evicted first
    "plain": ("", ""),
}


@triton.jit
def _xor(a, b):
    return a ^ b


@triton.jit
def _read_kernel(src, out, n, BLOCK: tl.constexpr, WAIT: tl.constexpr = False, RELEASE: tl.constexpr = False):
    """WAIT / RELEASE (off for the ceiling; for reads chained like a kernel's launches, launched with PDL): wait
    on the launch before (griddepcontrol.wait) before the load, let the next start after it."""
    pid = tl.program_id(0)
    if WAIT:
        gdc_wait()
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # int64: a 25 GB read (dsv4-pro, FP8) passes 2**31 words
    words = tl.load(src + offs, mask=offs < n, other=0)
    if RELEASE:
        gdc_launch_dependents()
    tl.store(out + pid, tl.reduce(words, 0, _xor))


@triton.jit
def _grid_stride_kernel(src, out, n, full_tiles, TILE: tl.constexpr, CACHE: tl.constexpr, EVICT: tl.constexpr):
    """Program p of P: the whole tiles p, p + P, ... (``full_tiles`` = n // TILE of them, no mask, so a thread's
    four words of a tile are one 16-byte load), then program P - 1 the words past the last whole tile, masked."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    acc = tl.zeros([TILE], tl.int32)
    tile = pid
    # a while loop, not range(pid, full_tiles, programs): Triton's interpreter cannot take a range over runtime
    # bounds with numpy 2 (int() of a 1-element array); compiled, both are one loop of loads into registers
    while tile < full_tiles:
        offs = tile.to(tl.int64) * TILE + tl.arange(0, TILE)  # int64: past 2**31 words at 8 GB
        acc ^= tl.load(src + offs, cache_modifier=CACHE, eviction_policy=EVICT)
        tile += programs
    if pid == programs - 1:
        offs = (n - n % TILE) + tl.arange(0, TILE)  # from n, not full_tiles: n is int64 past 2**31 words
        acc ^= tl.load(src + offs, mask=offs < n, other=0)
    tl.store(out + pid, tl.reduce(acc, 0, _xor))


def programs(buf: torch.Tensor) -> int:
    """How many programs ``read_all`` launches for ``buf`` (the length ``out`` must have)."""
    return triton.cdiv(buf.numel(), BLOCK)


def grid_stride_programs(n_words: int, per_sm: int, sms: int) -> int:
    """Programs of the persistent read of ``n_words``: ``per_sm`` on each of ``sms`` SMs, but no more than there
    are tiles (a 1 MB read has 128), and at least one."""
    return max(1, min(per_sm * sms, triton.cdiv(n_words, TILE)))


def check_read_args(buf: torch.Tensor, out: torch.Tensor, want_out: int | None = None) -> None:
    """The reads' common argument check, before any launch: ``buf`` a contiguous 1-D int32 tensor on ``out``'s
    device, 16-byte aligned (the 128-bit loads); ``out`` int32 of ``want_out`` entries (when given)."""
    if buf.dtype != torch.int32 or buf.dim() != 1 or not buf.is_contiguous():
        raise ValueError(f"buf must be a contiguous 1-D int32 tensor, got {buf.dtype} of shape {tuple(buf.shape)} "
                         f"(contiguous: {buf.is_contiguous()})")
    if buf.data_ptr() % 16:
        raise ValueError(f"buf must start on a 16-byte boundary (its 128-bit loads), got address % 16 = "
                         f"{buf.data_ptr() % 16}")
    if out.dtype != torch.int32 or out.dim() != 1 or out.device != buf.device:
        raise ValueError(f"out must be a 1-D int32 tensor on buf's device {buf.device}, got {out.dtype} of shape "
                         f"{tuple(out.shape)} on {out.device}")
    if want_out is not None and out.numel() != want_out:
        raise ValueError(f"out must have one entry per program: {want_out}, got {out.numel()}")


def read_all(buf: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Read every int32 word of the contiguous ``buf`` once; ``out`` [programs(buf)] int32 gets each program's
    xor of what it read. Returns ``out``."""
    _read_kernel[(out.numel(),)](buf, out, buf.numel(), BLOCK=BLOCK, num_warps=8)
    return out


def read_grid_stride(buf: torch.Tensor, out: torch.Tensor, hint: str = "cg") -> torch.Tensor:
    """Read every int32 word of ``buf`` [n] once with ``out.numel()`` persistent programs (``grid_stride_programs``
    picks the count) and the load hint ``HINTS[hint]``; ``out`` [programs] int32 gets each program's xor of what
    it read. Returns ``out``. Arguments are checked by ``check_read_args`` first."""
    if hint not in HINTS:
        raise ValueError(f"hint must be one of {sorted(HINTS)}, got {hint!r}")
    cache, evict = HINTS[hint]
    _grid_stride_kernel[(out.numel(),)](buf, out, buf.numel(), buf.numel() // TILE, TILE=TILE, CACHE=cache,
                                        EVICT=evict, num_warps=NUM_WARPS, num_stages=1)
    return out


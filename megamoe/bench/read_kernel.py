"""A plain streaming read in Triton: the size-aware ceiling of ``megamoe.bench.ceilings.ReadCeiling``.

    grid = (cdiv(n, BLOCK),)   program p loads int32 words [p * BLOCK, (p + 1) * BLOCK) of the buffer and
                               writes their xor to ``out[p]`` (so no load is dead code)

Nothing else: its time is what reading n * 4 bytes from HBM costs at this size, launch and ramp-up included.
Checked for exactness (every word read once) under Triton's CPU interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

BLOCK = 4096  # int32 words per program: 16 KB


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


def programs(buf: torch.Tensor) -> int:
    """How many programs ``read_all`` launches for ``buf`` (the length ``out`` must have)."""
    return triton.cdiv(buf.numel(), BLOCK)


def read_all(buf: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Read every int32 word of the contiguous ``buf`` once; ``out`` [programs(buf)] int32 gets each program's
    xor of what it read. Returns ``out``."""
    _read_kernel[(out.numel(),)](buf, out, buf.numel(), BLOCK=BLOCK, num_warps=8)
    return out


read_all.programs = programs  # ReadCeiling sizes ``out`` through the function it calls

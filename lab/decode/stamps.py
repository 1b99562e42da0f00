"""The tensor-core decode launches with their timeline on (lab/decode/timeline.py reads it): the library's kernels
call a PROBE hook at five points (``megamoe.decode.triton_tc_ops.no_probe``, nothing by default); this study's,
``stamp``, stores when each program reached each of them.

    stamps = stamp_buffer(buf, programs)           # lab.decode.timeline: int64 [2, P, 16], -1 everywhere
    y = stamped_step(tw, buf, T, clamp, cfg, stamps)   # moe_decode's Triton launches, each program stamping
    summary = summarize(stamps)                    # lab.decode.timeline

Recording costs a few stores per program: time the launch without it too. GPU only (inline PTX).
"""

from __future__ import annotations

import math
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from lab.decode.timeline import WORDS  # noqa: E402
from megamoe.decode import gemv, routing, tc  # noqa: E402
from megamoe.decode.moe import check_launch  # noqa: E402

STAMP_WORDS = tl.constexpr(WORDS)  # int64 per program: SM id, timer / clock words


@triton.jit
def stamp(stamps_ptr, k: tl.constexpr):
    """The PROBE hook: point k (1..7) of this program, the GPU's nanosecond %globaltimer in word k and its SM's
    %clock64 in word 8 + k of the program's 16; point 1 also stores the SM id in word 0."""
    pid = tl.program_id(0) + tl.num_programs(0) * (tl.program_id(1) + tl.num_programs(1) * tl.program_id(2))
    base = stamps_ptr + pid.to(tl.int64) * STAMP_WORDS
    if k == 1:
        tl.store(base, tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False,
                                                 pack=1).to(tl.int64))
    tl.store(base + k, tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                                 is_pure=False, pack=1))
    tl.store(base + 8 + k, tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64,
                                                     is_pure=False, pack=1))


def check_stamps(stamps: torch.Tensor, launch: int, grid: tuple, interpret: bool) -> torch.Tensor:
    """``stamps[launch]``, the rows of one launch, checked against its grid (a row per program) and the device."""
    programs = math.prod(grid)
    if interpret or stamps.dim() != 3 or stamps.shape[1] < programs or stamps.shape[2] != WORDS:
        raise ValueError(f"stamps must be int64 [2, >= {programs}, {WORDS}] on a GPU (launch {launch}'s grid {grid}), "
                         f"got {tuple(stamps.shape)}{' under the interpreter' * interpret}")
    return stamps[launch]


def stamped_step(tw, buf, num_tokens: int, clamp: float, cfg, stamps: torch.Tensor) -> torch.Tensor:
    """``moe_decode``'s Triton launches for tensor-core weights (route unless the gate/up launch routes for itself,
    gate/up, down, combine; never the 1-token CUDA step), each program of gate/up and down stamping into
    ``stamps`` (``stamp_buffer`` of at least each launch's programs) -> y [num_tokens, H], a view of ``buf.y``."""
    num_tokens, clamp = check_launch(tw, buf, num_tokens, clamp, cfg, "stamped_step")
    grid1, grid2 = tc.launch_grids(tw, buf, num_tokens, cfg)
    hooks = [(stamp, check_stamps(stamps, i, grid, buf.interpret)) for i, grid in enumerate((grid1, grid2))]
    if not cfg.tc_route:
        routing.route(buf.topk_idx, buf.topk_weights, buf.x_q, num_tokens, buf.expert_lo, buf.num_local, buf,
                      cfg.pdl, full=False)
    tc.l1_tc(tw, buf, num_tokens, clamp, cfg, hooks[0])
    tc.l2_tc(tw, buf, num_tokens, cfg, hooks[1])
    gemv.combine(buf, num_tokens, buf.num_topk, cfg)
    return buf.y[:num_tokens]

"""Launchers of the tensor-core decode stages beside their torch twins (same name + ``_torch``, same
signature, the same outputs bit for bit on the GPU). Kernels: ``triton_tc.py``; weights: ``layout_tc.py``;
routing and combine are the CUDA-core path's own (``routing.py``, ``gemv.combine``).

    l1_tc / l1_tc_torch   routing metadata + x_q -> l1_out (optional), l2_q, l2_sf
    l2_tc / l2_tc_torch   l2_q, l2_sf -> slot_out (bf16 per pool row)

A twin computes each touched expert with the reference's own functions (``group_scaled_gemm``, ``swiglu``,
``requant_fp8``) on the operands the tensor cores read (``layout_tc.expert_operands``). Under Triton's
interpreter ``tl.dot`` is a float32 matmul, not the tensor cores' k32 sum: the interpreter matches the twin
bit for bit when the twin uses the ``exact-block`` model and every group sum is exact in FP32 and in the
tensor cores' 13 fraction bits (the CPU tests' inputs are built so).
"""

from __future__ import annotations

import torch

from ..recipe import MEGAMOE_DECODE_TC
from ..reference.gemm import group_scaled_gemm
from ..reference.swiglu import requant_fp8, swiglu
from .gemv import LaunchConfig, _kw, _work_items
from .layout_tc import TCWeights, expert_operands


MAX_ROUTE_SLOTS = 64  # LaunchConfig.tc_route: each gate/up program sorts the step's T K slots (an [S, S] comparison)
ROUTE_SLOTS_FASTER = 24  # ... and gains up to this many (one H200, DeepSeek-V4-Flash: run 27)


def tc_launch_config(num_tokens: int, top_k: int) -> LaunchConfig:
    """The launch the ``megamoe-decode-tc`` backend runs, each part measured side by side on one H200
    (DeepSeek-V4-Flash; bench/results/2026-12-04_nvidia-h200_decode-tc). Same bits whatever the choice.

    - packed passes always (experts with at most 4 rows: four groups per MMA): 55.8 -> 50.3 us at 1 token,
      252.1 -> 188.9 at 8, 988.0 -> 738.1 at 64 (run 17);
    - programmatic dependent launch: 2.0 to 2.9 us less per step at 2..64 tokens (run 16); at 1 token, once gate/up
      routes for itself, 1.0 us less timed as `megamoe bench` times it (43.1 against 44.1), none by the probe's
      clock (run 28);
    - gate/up's K in two parts at 1 token only: gate/up 27.8 -> 23.5-23.9 us of kernel time there, slower from 2
      tokens on (runs 20-21);
    - (LaunchConfig's default) down capped at 72 registers (7 programs per SM, no spill in its K loop), not 96: down's
      kernel time 21.3 -> 17.1 us at 2 tokens, 57.3 -> 55.6 at 8, 166.4 -> 154.3 at 32, unchanged at 1 (run 26);
    - gate/up capped at 72 registers from 16 tokens (80 below): gate/up 186.6 -> 182.3 us at 16 tokens, 313.5 ->
      304.5 at 32, 446.4 -> 440.4 at 64; slower at 4 and 8 (run 26);
    - gate/up routing for itself up to 24 slots (tokens x top-k; no route launch): kernel time 3.0 / 4.7 / 3.6 us
      less at 1 / 2 / 4 tokens of top-6; at 8 tokens (48 slots) the sort in each of gate/up's 3,072 programs made
      gate/up 12 us slower (run 27);
    - not the whole 1-token step in one persistent CUDA launch (``cuda_step.py``, ``LaunchConfig.tc_cuda_step1``):
      the same bits, level with these three launches on the H200 and slower on the H100 (docs/decode-kernel-tc.md,
      "The 1-token CUDA step"), and it builds with nvcc on first use."""
    return LaunchConfig(pdl=True, tc_pack4=True, tc_split=2 if num_tokens == 1 else 1,
                        tc_route=num_tokens * top_k <= ROUTE_SLOTS_FASTER,
                        tc_l1_maxnreg=72 if num_tokens >= 16 else 80)


def _opts(warps: int, stages: int, maxnreg: int | None, interpret: bool, pdl: bool) -> dict:
    """``gemv._kw`` (launch options, none under the interpreter) plus pipeline stages, a register cap and
    programmatic dependent launch (the kernels' ``PDL``)."""
    if interpret:
        return _kw(warps, interpret)
    return {**_kw(warps, interpret, pdl), "num_stages": stages, **({"maxnreg": maxnreg} if maxnreg else {}),
            "PDL": pdl}


def _split(tw: TCWeights, buf, num_tokens: int, cfg: LaunchConfig) -> int:
    """The gate/up GEMM's K parts (``LaunchConfig.tc_split``), checked against the packed passes, the buffers' split
    scratch and its K loop (hidden/128 blocks, a multiple of the parts)."""
    parts = cfg.tc_split
    if parts > 1 and (not cfg.tc_pack4 or num_tokens > buf.split_tokens):
        raise ValueError(f"LaunchConfig.tc_split={parts} needs tc_pack4=True and num_tokens <= the buffers' "
                         f"split_tokens ({buf.split_tokens}; DecodeBuffers.allocate(split_tokens=...)), got "
                         f"tc_pack4={cfg.tc_pack4}, num_tokens={num_tokens}")
    if (tw.hidden // 128) % parts:
        raise ValueError(f"LaunchConfig.tc_split={parts} must divide gate/up's {tw.hidden // 128} K blocks "
                         "(hidden/128)")
    return parts


def _route_slots(buf, num_tokens: int, cfg: LaunchConfig) -> int:
    """The padded slot count gate/up sorts when it routes for itself (``LaunchConfig.tc_route``), 0 when it does
    not."""
    if not cfg.tc_route:
        return 0
    slots = num_tokens * buf.num_topk
    if slots > MAX_ROUTE_SLOTS:
        raise ValueError(f"LaunchConfig.tc_route sorts the step's slots in every gate/up program: num_tokens * top-k "
                         f"must be <= {MAX_ROUTE_SLOTS}, got {num_tokens} * {buf.num_topk} = {slots}")
    from .routing import slot_pad

    return slot_pad(num_tokens, buf.num_topk)


def launch_grids(tw: TCWeights, buf, num_tokens: int, cfg: LaunchConfig) -> tuple[tuple, tuple]:
    """The grids ``l1_tc`` and ``l2_tc`` launch for this step, after their checks: gate/up (W work items, one more
    when it routes for itself; I / 32 channel tiles; its K parts), down (W, H / 64)."""
    w = buf.max_work(num_tokens)
    route = bool(_route_slots(buf, num_tokens, cfg))
    return (w + route, tw.intermediate // 32, _split(tw, buf, num_tokens, cfg)), (w, tw.hidden // 64)


def l1_tc(tw: TCWeights, buf, num_tokens: int, clamp: float, cfg: LaunchConfig, probe: tuple | None = None) -> None:
    """The gate/up GEMM (and, with ``cfg.tc_route``, route's work in the same launch: ``moe_decode`` then skips route).
    ``probe``: (a Triton function, its tensor) for the kernel's PROBE hook (``triton_tc_ops.no_probe``), None for
    none."""
    from .routing import route_pads
    from .triton_tc import l1_tc_kernel

    if num_tokens == 0:
        return
    grid, _ = launch_grids(tw, buf, num_tokens, cfg)
    split = grid[2]
    route = {}
    if grid[0] > buf.max_work(num_tokens):  # gate/up routes for itself: route's sort sizes, as route's launch has them
        route = dict(ROUTE=True, **route_pads(num_tokens, buf.num_topk, buf.num_local))
    hook, probe_ptr = probe or (None, buf.num_touched)
    l1_tc_kernel[grid](
        tw.l1_codes, tw.l1_scales.view(torch.int32), buf.x_q, buf.x_sf, buf.num_touched, buf.touched, buf.seg_start,
        buf.seg_count, buf.row_token, buf.row_weight, buf.l1_out, buf.l2_q, buf.l2_sf,
        buf.split_terms, buf.split_counts, buf.topk_idx, buf.topk_weights, buf.slot_row, num_tokens, buf.expert_lo,
        buf.num_local, float(clamp), probe_ptr, H=tw.hidden, I=tw.intermediate, STORE_L1=cfg.store_l1,
        ASM=not buf.interpret, **_opts(4, cfg.tc_stages, cfg.tc_l1_maxnreg, buf.interpret, cfg.pdl),
        PACK=cfg.tc_pack4, SPLIT=split, **route, **({"PROBE": hook} if hook else {}),
    )


def l2_tc(tw: TCWeights, buf, num_tokens: int, cfg: LaunchConfig, probe: tuple | None = None) -> None:
    """The down GEMM; ``probe`` as in ``l1_tc``."""
    from .triton_tc import l2_tc_kernel

    if num_tokens == 0:
        return
    _, grid = launch_grids(tw, buf, num_tokens, cfg)
    hook, probe_ptr = probe or (None, buf.num_touched)
    l2_tc_kernel[grid](
        tw.l2_codes, tw.l2_scales.view(torch.int32), buf.l2_q.view(torch.float8_e4m3fn), buf.l2_sf, buf.num_touched,
        buf.touched, buf.seg_start, buf.seg_count, buf.slot_out, probe_ptr, H=tw.hidden, I=tw.intermediate,
        ASM=not buf.interpret, **_opts(4, cfg.tc_stages, cfg.tc_l2_maxnreg, buf.interpret, cfg.pdl),
        PACK=cfg.tc_pack4, **({"PROBE": hook} if hook else {}),
    )


def l1_tc_torch(tw: TCWeights, buf, num_tokens: int, clamp: float, cfg: LaunchConfig, mma: str | None = None) -> None:
    """``mma`` overrides the recipe's tensor-core model (``exact-block`` to match the interpreter)."""
    if num_tokens == 0:
        return
    r = MEGAMOE_DECODE_TC
    for e, rows in _work_items(buf):
        w1, sf1, _, _ = expert_operands(tw, e)
        tok = buf.row_token[rows].long()
        h = group_scaled_gemm(buf.x_q[tok].float(), buf.x_sf[tok], w1, sf1, 128, mma or r.mma)  # [M, 2I]
        if cfg.store_l1:
            buf.l1_out[rows] = h
        vw = swiglu(h, clamp, False, r.silu_exp) * buf.row_weight[rows].unsqueeze(1)
        q, sf = requant_fp8(vw, r.l2_group, r.l2_scale, r.l2_amax_floor)
        buf.l2_q[rows] = q.view(torch.uint8)
        buf.l2_sf[rows] = sf


def l2_tc_torch(tw: TCWeights, buf, num_tokens: int, cfg: LaunchConfig, mma: str | None = None) -> None:
    if num_tokens == 0:
        return
    r = MEGAMOE_DECODE_TC
    for e, rows in _work_items(buf):
        _, _, w2, sf2 = expert_operands(tw, e)
        q = buf.l2_q[rows].view(torch.float8_e4m3fn).float()
        out = group_scaled_gemm(q, buf.l2_sf[rows], w2, sf2, r.l2_group, mma or r.mma)
        buf.slot_out[rows] = out.to(torch.bfloat16).view(torch.int16)

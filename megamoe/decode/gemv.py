"""Launchers of the decode path's stages beside their torch twins (same name + ``_torch``, same signature,
the same outputs bit for bit). The kernels are in ``triton_gemv.py``; the buffers in ``moe.py``.

    l1 / l1_torch            routing metadata + x32 -> l1_out (optional), l2_q, l2_x, l2_sf
    l2 / l2_torch            l2_x, l2_sf -> slot_out (bf16 per pool row)
    combine / combine_torch  slot_out, slot_row -> y (bf16 per token)

A twin reads the same routing metadata and writes the same buffers, computing each touched expert with
the reference's own functions (``promoted_gemm``, ``swiglu``, ``requant_fp8``) on the exactly
dequantized weights: a twin is the recipe, written for the kernel's buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..formats import dequantize_mxfp4, pack_e2m1
from ..recipe import MEGAMOE_DECODE
from ..reference.gemm import promoted_gemm
from ..reference.swiglu import requant_fp8, swiglu
from ..validate import as_int
from .layout import DecodeWeights, _untile


COMBINE_BLOCK = 1024  # columns per combine program


@dataclass(frozen=True)
class LaunchConfig:
    """Per-launch knobs that do not change a bit: tokens per program pass, warps per program."""

    block_m: int = 1
    l1_warps: int = 4
    l2_warps: int = 4
    store_l1: bool = False
    # Gate/up and down load the next K-iteration's tile before this one's arithmetic (more registers, same bits)
    l1_prefetch: bool = False
    l2_prefetch: bool = False
    # The tensor-core kernels (triton_tc.py): software-pipeline stages of their K loops (Triton's num_stages);
    # a register cap per gate/up and down program (more resident programs; nothing spills inside the K loops), None for
    # the compiler's choice
    tc_stages: int = 3
    tc_l1_maxnreg: int | None = 80
    tc_l2_maxnreg: int | None = 72
    # Programmatic dependent launch (Hopper, ``triton_pdl.py``): each launch after route waits
    # (griddepcontrol.wait) before it reads what the previous one wrote, so it may be started early. Route and the
    # combine let the next launch start at once; the tensor-core gate/up and down once their K loops are done (at
    # once made the 1-token step 10% slower on the H200: lab/decode/JOURNAL.md, run 15). No bit changes.
    pdl: bool = False
    # The tensor-core gate/up and down: an expert with at most 4 rows takes one packed pass, a 128-K block's four
    # groups of up to 4 tokens in one MMA (triton_tc_ops._packed_mma). Same bits.
    tc_pack4: bool = False
    # The tensor-core gate/up, packed passes only: the K loop in tc_split parts run by as many programs; the last to
    # finish replays the promotion chain in ascending K from the others' stored terms (triton_tc._replay). Same
    # bits; more programs where gate/up waits on latency (1 token). Up to the buffers' ``split_tokens``.
    tc_split: int = 1
    # The tensor-core gate/up routes for itself: each program finds its work item from the staged top-k (one small
    # sort), an extra program writes route's outputs for down and the combine, and there is no route launch. Same
    # bits. Up to 64 slots (tokens x top-k).
    tc_route: bool = False
    # The tensor-core path at 1 token: the whole step in one persistent CUDA launch (``cuda_step.py``) where the
    # machine can build and run it (SM90, nvcc), else the Triton launches. Same bits; level with them on the H200,
    # slower on the H100 (docs/decode-kernel-tc.md, "The 1-token CUDA step"), so off by default.
    tc_cuda_step1: bool = False

    def __post_init__(self) -> None:
        """Every knob checked before any launch (``validate.as_int``: no float, no bool), the errors naming it."""
        who = "LaunchConfig"
        for name, allowed in (("block_m", (1, 2, 4)), ("tc_split", (1, 2, 4)), ("l1_warps", (1, 2, 4, 8, 16)),
                              ("l2_warps", (1, 2, 4, 8, 16))):
            v = as_int(name, getattr(self, name), who=who)
            if v not in allowed:
                raise ValueError(f"{who}: {name} must be one of {allowed}, got {v}")
        as_int("tc_stages", self.tc_stages, lo=1, hi=8, who=who)
        for name in ("tc_l1_maxnreg", "tc_l2_maxnreg"):
            if getattr(self, name) is not None:
                as_int(name, getattr(self, name), lo=24, hi=255, who=who)  # ptxas' register cap range
        for name in ("store_l1", "l1_prefetch", "l2_prefetch", "pdl", "tc_pack4", "tc_route", "tc_cuda_step1"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{who}: {name} must be a bool, got {type(getattr(self, name)).__name__} "
                                f"{getattr(self, name)!r}")


def _kw(warps: int, interpret: bool, pdl: bool = False) -> dict:
    """``triton_pdl.launch_options`` (imported here, like the kernels, only when a launch needs it)."""
    from .triton_pdl import launch_options

    return launch_options(warps, interpret, pdl)


def l1(dw: DecodeWeights, buf, num_tokens: int, clamp: float, cfg: LaunchConfig) -> None:
    from .triton_gemv import l1_kernel

    if num_tokens == 0:
        return
    t1 = dw.l1_tile
    grid = (buf.max_work(num_tokens), dw.intermediate // t1.bn)
    l1_kernel[grid](
        dw.l1_words, dw.l1_scales, buf.x32, buf.x_sf, buf.num_touched, buf.touched, buf.seg_start, buf.seg_count,
        buf.row_token, buf.row_weight, buf.l1_out, buf.l2_q, buf.l2_x, buf.l2_sf, float(clamp),
        H=dw.hidden, I=dw.intermediate, BN=t1.bn, G=t1.groups, BLOCK_M=cfg.block_m,
        STORE_L1=cfg.store_l1, ASM=not buf.interpret, PREFETCH=cfg.l1_prefetch, **_kw(cfg.l1_warps, buf.interpret),
    )


def l2(dw: DecodeWeights, buf, num_tokens: int, cfg: LaunchConfig) -> None:
    from .triton_gemv import l2_kernel

    if num_tokens == 0:
        return
    t2 = dw.l2_tile
    grid = (buf.max_work(num_tokens), dw.hidden // t2.bn)
    l2_kernel[grid](
        dw.l2_words, dw.l2_scales, buf.l2_x, buf.l2_sf, buf.num_touched, buf.touched, buf.seg_start, buf.seg_count,
        buf.slot_out, H=dw.hidden, I=dw.intermediate, BN=t2.bn, G=t2.groups, L2_GROUP=dw.l1_tile.bn,
        BLOCK_M=cfg.block_m, ASM=not buf.interpret, PREFETCH=cfg.l2_prefetch, **_kw(cfg.l2_warps, buf.interpret),
    )


def combine(buf, num_tokens: int, num_topk: int, cfg: LaunchConfig) -> None:
    from .triton_combine import combine_kernel

    if num_tokens == 0:
        return
    h = buf.y.shape[1]
    bh = min(COMBINE_BLOCK, h)
    combine_kernel[(num_tokens, -(-h // bh))](buf.slot_out, buf.slot_row, buf.y.view(torch.int16), num_tokens,
                                              H=h, K=num_topk, BH=bh, PDL=cfg.pdl and not buf.interpret,
                                              **_kw(4, buf.interpret, cfg.pdl))


# ------------------------------------------------------------------------------------------- twins
def expert_dense(dw: DecodeWeights, e: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert e's exact float32 weights from the tiles: (w1 [2I, H] gate | up, w2 [H, I])."""
    c1, s1 = _untile(dw.l1_words[e : e + 1], dw.l1_scales[e : e + 1], 2)
    c2, s2 = _untile(dw.l2_words[e : e + 1], dw.l2_scales[e : e + 1], 1)
    return dequantize_mxfp4(pack_e2m1(c1[0]), s1[0]), dequantize_mxfp4(pack_e2m1(c2[0]), s2[0])


def _work_items(buf):
    """[(local expert, pool rows)] of the touched experts, read from the routing metadata."""
    w = int(buf.num_touched[0])
    out = []
    for j in range(w):
        start, count = int(buf.seg_start[j]), int(buf.seg_count[j])
        out.append((int(buf.touched[j]), torch.arange(start, start + count, device=buf.x32.device)))
    return out


def l1_torch(dw: DecodeWeights, buf, num_tokens: int, clamp: float, cfg: LaunchConfig) -> None:
    if num_tokens == 0:
        return
    r = MEGAMOE_DECODE
    for e, rows in _work_items(buf):
        w1, _ = expert_dense(dw, e)
        tok = buf.row_token[rows].long()
        h = promoted_gemm(buf.x32[tok], buf.x_sf[tok], w1, None, 128)  # [M, 2I]
        if cfg.store_l1:
            buf.l1_out[rows] = h
        vw = swiglu(h, clamp, False, r.silu_exp) * buf.row_weight[rows].unsqueeze(1)
        q, sf = requant_fp8(vw, r.l2_group, r.l2_scale, r.l2_amax_floor)
        buf.l2_q[rows] = q.view(torch.uint8)
        buf.l2_x[rows] = q.float()
        buf.l2_sf[rows] = sf


def l2_torch(dw: DecodeWeights, buf, num_tokens: int, cfg: LaunchConfig) -> None:
    if num_tokens == 0:
        return
    g = MEGAMOE_DECODE.l2_group
    for e, rows in _work_items(buf):
        _, w2 = expert_dense(dw, e)
        out = promoted_gemm(buf.l2_x[rows], buf.l2_sf[rows], w2, None, g)
        buf.slot_out[rows] = out.to(torch.bfloat16).view(torch.int16)


def combine_torch(buf, num_tokens: int, num_topk: int, cfg: LaunchConfig) -> None:
    if num_tokens == 0:
        return
    from ..reference.pipeline import combine as reference_combine

    rows = buf.slot_row[: num_tokens * num_topk].view(num_tokens, num_topk).long()
    filled = rows >= 0
    slots = buf.slot_out.view(torch.bfloat16)[rows.clamp(min=0)]  # [T, K, H]
    buf.y[:num_tokens] = reference_combine(slots, filled, MEGAMOE_DECODE)

"""The whole Mega MoE layer in eager PyTorch, stage by stage, over R expert-parallel ranks.

    stage     x bf16 [T, H] -> x_q e4m3 [T, H], x_sf fp32 [T, H/128]          (recipe.stage_x)
    dispatch  slots -> pool [P, H] per destination rank, BLOCK_M-padded          (dispatch.py)
    L1        pool @ W1[e]^T, per-128-K promotion -> h fp32 [P, 2I] (gate | up)  (gemm.py)
    SwiGLU    clamp, silu(g) * u * topk_weight -> FP8 requant [P, I] + sf         (swiglu.py)
    L2        @ W2[e]^T -> [P, H], bf16 per (token, slot)                         (gemm.py)
    combine   FP32 sum over slots in ascending slot order, skip masked, one bf16 rounding
              (recipe.routing_weight "at-combine": the weight is applied here instead, as an FP32 FMA)

One rank is R = 1; ``moe_forward_ep`` with R ranks gives bit-identical rows for kernel recipes,
because every row's arithmetic is independent of which other rows share its pool (see gemm.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from ..formats import (WEIGHT_DECODERS, dequantize_mxfp4_lookup, e2m1_decode, e8m0_to_float,
                       mxfp4_decode_table, unpack_e2m1, unpack_ue8m0_x4)
from ..geometry import Geometry
from ..inputs import MoEInputs
from ..layouts.staging import per_token_cast_to_fp8, per_token_cast_to_fp8_div448, per_token_cast_to_fp8_ue8m0_packed
from ..recipe import Recipe, get_recipe
from ..weights import FP8BlockWeights, MXFP4Weights
from ..validate import (as_int, check_expert_scales, check_fp8_block_values, check_global_scales, check_output,
                        check_step)
from .dispatch import DispatchLayout, build_layout, dispatch, dispatch_slot_values, undispatch
from .gemm import exact_gemm, group_scaled_gemm, promoted_gemm
from .swiglu import requant_fp8, swiglu


@dataclass
class RankStages:
    """Every intermediate of one destination rank's pool (P rows, padding rows NaN / unused)."""

    layout: DispatchLayout
    pool_x: torch.Tensor  # [P, H] staged activations (e4m3 values as float32, or the exact x)
    pool_x_sf: torch.Tensor | None  # [P, H/gran]
    pool_weight: torch.Tensor  # [P] routing weight of each row
    l1_out: torch.Tensor  # [P, 2I] fp32 (or float64), gate | up, after gs1
    l2_in: torch.Tensor  # [P, I] e4m3 codes (or the unquantized float)
    l2_in_sf: torch.Tensor | None  # [P, I/G]
    l2_out: torch.Tensor  # [P, H] bf16 per (token, slot) (or float)


@dataclass
class MoEResult:
    """Outputs per source rank and the stages per destination rank."""

    y: list[torch.Tensor]  # y[r] [T_r, H]
    ranks: list[RankStages] = field(default_factory=list)


def stage_activations(x: torch.Tensor, recipe: Recipe) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x bf16 [T, H] -> (values the L1 MMA reads as float32 [T, H], scales fp32 [T, H/gran] or None)."""
    if not recipe.stage_x:
        return x.to(recipe.accum), None
    if recipe.x_scale == "fp32":
        cast = per_token_cast_to_fp8_div448 if recipe.fp8_scale_rule == "div448" else per_token_cast_to_fp8
        q, sf = cast(x, gran=recipe.x_gran)
        return q.float(), sf
    q, packed = per_token_cast_to_fp8_ue8m0_packed(x, gran=recipe.x_gran)
    return q.float(), e8m0_to_float(unpack_ue8m0_x4(packed))


def decode_expert(weights, e: int, recipe: Recipe):
    """Expert e as the kernel's MMA sees it: (w1 [2I, H], w1_sf, w2 [H, I], w2_sf, gs1, gs2).

    w*_sf are FP32 [N/128, K/128] block scales (FP8 block weights) or None (scale folded into the
    e4m3 values, as the FP4 decoders do). gs* are per-expert FP32 scalars applied to accumulators.
    """
    return tuple(None if t is None else t[0] for t in decode_experts(weights, [e], recipe))


@functools.lru_cache(maxsize=None)
def _decode_table(weight_decode: str, device: torch.device) -> torch.Tensor:
    return mxfp4_decode_table(WEIGHT_DECODERS[weight_decode], device)


def decode_experts(weights, experts: list[int], recipe: Recipe):
    """``decode_expert`` for B experts at once: (w1 [B, 2I, H], w1_sf [B, 2I/128, H/128] or None,
    w2 [B, H, I], w2_sf or None, gs1 [B] or None, gs2 [B] or None). Every element is decoded on its
    own, so decoding experts together gives the bits of decoding them one by one. The experts' scale bytes (or
    FP8 values) are checked here, each call, as they are read (``check_experts_read``)."""
    check_experts_read(weights, experts)
    if isinstance(weights, FP8BlockWeights):
        if recipe.weight_format != "fp8_block" and recipe.name != "exact":
            raise ValueError(f"recipe {recipe.name!r} reads MXFP4 weights, got FP8 block weights")
        if recipe.name == "exact":
            w1, w2 = zip(*(weights.dequantize_expert(e) for e in experts))
            return torch.stack(w1), None, torch.stack(w2), None, None, None
        idx = torch.tensor(experts, device=weights.device)
        return weights.l1[idx].float(), weights.l1_scale[idx], weights.l2[idx].float(), weights.l2_scale[idx], None, None
    if not isinstance(weights, MXFP4Weights):
        raise TypeError(f"weights must be MXFP4Weights or FP8BlockWeights, got {type(weights).__name__}")
    if recipe.weight_format == "fp8_block":
        raise ValueError(
            f"recipe {recipe.name!r} reads FP8 block weights; convert with megamoe.layouts (to_fp8_block)"
        )
    if recipe.weight_decode == "e4m3_group":
        return _group_operands(weights, experts)
    if recipe.weight_decode == "exact":
        w1, w2 = zip(*(weights.dequantize_expert(e) for e in experts))  # global scales folded in exactly
        return torch.stack(w1), None, torch.stack(w2), None, None, None
    has_gs = weights.l1_global_scale is not None or weights.l2_global_scale is not None
    if has_gs and not recipe.global_scales:
        raise ValueError(f"recipe {recipe.name!r} has no per-expert global scales but the weights carry them")
    # The FP4 decoders: e2m1 * 2**(byte - 127) rounded to e4m3 by the recipe's rule, the global scales
    # left out (the kernel applies them to the accumulators). Outside the recipe's window this models the
    # kernel's lossy decode on purpose (what the kernel would compute); the paths that hand weights to a
    # kernel refuse such bytes or repair them exactly (megamoe.layouts.ranges), and 0xFF never gets here.
    idx = torch.tensor(experts, device=weights.device)
    table = _decode_table(recipe.weight_decode, weights.device)
    w1 = dequantize_mxfp4_lookup(weights.l1[idx], weights.l1_scale[idx], table)
    w2 = dequantize_mxfp4_lookup(weights.l2[idx], weights.l2_scale[idx], table)
    gs1 = None if weights.l1_global_scale is None else weights.l1_global_scale[idx]
    gs2 = None if weights.l2_global_scale is None else weights.l2_global_scale[idx]
    return w1, None, w2, None, gs1, gs2


def check_experts_read(weights, experts: list[int], who: str = "reference") -> None:
    """What a call reads of the weights, checked each call (no memo, so an in-place write made behind torch's
    version counter is seen): MXFP4 scale bytes 0xFF (NaN), FP8 block values NaN and block scales not finite
    or <= 0, of ``experts`` only. The error names the tensor, the expert and the byte, before anything is
    computed with it (the activations are never blamed for it)."""
    if isinstance(weights, FP8BlockWeights):
        check_fp8_block_values(weights, who, experts)
        return
    if not isinstance(weights, MXFP4Weights):
        return  # decode_experts says what it takes
    idx = torch.tensor(experts, dtype=torch.int64, device=weights.device)
    for name in ("l1_scale", "l2_scale"):
        check_expert_scales(f"weights.{name}", getattr(weights, name)[idx], experts, who)


def _group_operands(weights: MXFP4Weights, experts: list[int]):
    """The ``e4m3_group`` decode (megamoe-decode-tc): (w1 [B, 2I, H] e2m1 * 2**-6, sf1 [B, 2I, H/32] fp32
    2**(s - 121), w2, sf2, None, None): the operands the tensor cores read and the factor on each group's sum.
    Byte 0xFF gives a NaN factor (the kernel's prepare refuses it)."""
    if weights.l1_global_scale is not None or weights.l2_global_scale is not None:
        raise ValueError("the e4m3_group decode takes no global scales: fold them into the bytes first "
                         "(megamoe.decode.layout.fold_global_scales)")
    idx = torch.tensor(experts, device=weights.device)

    def operands(packed, scale_bytes):
        vals = e2m1_decode(unpack_e2m1(packed[idx])) * 2.0**-6  # exact: e4m3 values
        return vals, e8m0_to_float(scale_bytes[idx]) * 2.0**6  # 2**(s - 121): exact, NaN for 0xFF

    w1, sf1 = operands(weights.l1, weights.l1_scale)
    w2, sf2 = operands(weights.l2, weights.l2_scale)
    return w1, sf1, w2, sf2, None, None


def experts_forward(
    xa: torch.Tensor, x_sf: torch.Tensor | None, weight: torch.Tensor, weights, experts: list[int], g: Geometry,
    recipe: Recipe,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """B experts at once on M rows each: xa [B, M, H], x_sf [B, M, H/gran], weight [B, M]
    -> (l1_out [B, M, 2I], l2_in [B, M, I], l2_in_sf [B, M, I/G] or None, l2_out [B, M, H]).

    Rows are independent: a row's result does not depend on B, M or the other rows (rows that pad
    an expert's batch are computed and thrown away)."""
    w1, w1_sf, w2, w2_sf, gs1, gs2 = decode_experts(weights, experts, recipe)
    gs1 = None if gs1 is None else gs1.view(-1, 1, 1)
    gs2 = None if gs2 is None else gs2.view(-1, 1, 1)
    grouped = recipe.weight_decode == "e4m3_group"  # w*_sf: per-32 group factors (group_scaled_gemm)
    if x_sf is None:
        h = exact_gemm(xa, w1, recipe.accum)
    elif grouped:
        h = group_scaled_gemm(xa, x_sf, w1, w1_sf, min(recipe.promote_k, recipe.x_gran), recipe.mma)
    else:
        h = promoted_gemm(xa, x_sf, w1, w1_sf, min(recipe.promote_k, recipe.x_gran), recipe.mma, recipe.accumulate)
    del w1
    if gs1 is not None:
        h = h * gs1  # FlashInfer: on the L1 accumulators, before the clamp
    v = swiglu(h, g.clamp, recipe.gate_up_bf16, recipe.silu_exp)
    if recipe.swiglu_bf16:
        v = v.to(torch.bfloat16).to(v.dtype)
    # The routing weight, before the requant (the Mega MoE kernels), or left for the combine.
    vw = v * weight.to(v.dtype).unsqueeze(-1) if recipe.routing_weight == "before-requant" else v
    if recipe.l2_group is None:
        l2_in, l2_sf = vw, None
        out = exact_gemm(vw, w2, recipe.accum)
    else:
        q, l2_sf = requant_fp8(vw, recipe.l2_group, recipe.l2_scale, recipe.l2_amax_floor)
        l2_in = q
        out = group_scaled_gemm(q.float(), l2_sf, w2, w2_sf, min(128, recipe.l2_group), recipe.mma) if grouped else promoted_gemm(q.float(), l2_sf, w2, w2_sf, min(128, recipe.l2_group, recipe.promote_k), recipe.mma,
                             recipe.accumulate)
    if gs2 is not None:
        out = out * gs2  # FlashInfer: on the L2 accumulators, before the bf16 cast
    if recipe.slot_output_bf16:
        out = out.to(torch.bfloat16)
    return h, l2_in, l2_sf, out


def expert_forward(
    xa: torch.Tensor, x_sf: torch.Tensor | None, weight: torch.Tensor, weights, e: int, g: Geometry, recipe: Recipe
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """One expert on its M real rows: xa [M, H], x_sf [M, H/gran], weight [M]
    -> (l1_out [M, 2I], l2_in [M, I], l2_in_sf [M, I/G] or None, l2_out [M, H])."""
    res = experts_forward(xa[None], None if x_sf is None else x_sf[None], weight[None], weights, [e], g, recipe)
    return tuple(None if t is None else t[0] for t in res)


def _batch_budget(device) -> int:
    """Bytes one batch of experts may take: 256 MiB on a CPU; on a GPU an eighth of its memory, at most
    16 GiB (the GPU holds the kernels' own buffers too). Fewer, larger batches launch fewer kernels; the
    bits do not depend on the batching (``experts_forward``)."""
    device = torch.device(device)
    if device.type != "cuda":
        return 256 << 20
    return min(16 << 30, torch.cuda.get_device_properties(device).total_memory // 8)


def _expert_batches(counts: list[int], g: Geometry, recipe: Recipe, budget: int) -> list[list[int]]:
    """Group the non-empty local experts into batches that stay within ``budget`` bytes, counting each
    expert's decoded weights and its [KB, M, N] partial sums (the emulated tensor cores need ~33x
    more per row). The ``exact`` recipe runs one expert at a time: its float64 GEMMs are not exact
    sums, so batching could change its last bits."""
    experts = [e for e, c in enumerate(counts) if c]
    if not recipe.stage_x:
        return [[e] for e in experts]
    n_max = max(2 * g.intermediate, g.hidden)
    emulated = recipe.mma != "exact-block"
    batches, cur, cur_m = [], [], 0
    for e in sorted(experts, key=lambda e: counts[e]):
        m = max(cur_m, counts[e])
        per_expert = _weight_bytes_per_expert(g)
        # float64 matmul output + its float32 copy, for L1 ([KB, M, 2I]) and L2 ([KB, M, H]).
        per_expert += 12 * (g.hidden // 128) * m * n_max
        if emulated:  # tensorcore.tc_step: float64 [M, N, chunk + 1] terms and ~3 temporaries of that size
            per_expert += 8 * 33 * 4 * m * n_max
        if cur and per_expert * (len(cur) + 1) > budget:
            batches.append(cur)
            cur, m = [], counts[e]
        cur.append(e)
        cur_m = m
    if cur:
        batches.append(cur)
    return batches


def _weight_bytes_per_expert(g: Geometry) -> int:
    """An expert's decoded weights (L1 [2I, H] + L2 [H, I]) at their peak in ``promoted_gemm``: the float32
    values, their float64 copy and the matmul's contiguous float64 operand, 20 bytes a weight (600 MB
    an expert on DeepSeek-V4-Flash, where a budget of activations alone once let a batch grow to 28 GiB)."""
    return 20 * 3 * g.intermediate * g.hidden


def combine(slots: torch.Tensor, filled: torch.Tensor, recipe: Recipe,
            topk_weights: torch.Tensor | None = None) -> torch.Tensor:
    """slots [T, K, H] (bf16 per slot), filled bool [T, K] -> y [T, H]: FP32 sum over slots in
    ascending slot order, masked slots skipped, one final rounding (bf16 unless the recipe keeps FP32).
    With ``recipe.routing_weight == "at-combine"`` (topk_weights fp32 [T, K]) each step is one FP32 FMA,
    acc = fl32(slot * w + acc): the product of a bf16 and an FP32 is exact in float64, so one float64 add
    rounded once to FP32 is the FMA's single rounding."""
    acc_dtype = torch.float32 if recipe.combine_bf16 else recipe.accum
    t, k, h = slots.shape
    acc = torch.zeros(t, h, dtype=acc_dtype, device=slots.device)
    weighted = recipe.routing_weight == "at-combine"
    if weighted and topk_weights is None:
        raise ValueError(f"combine: recipe {recipe.name!r} applies the routing weights at the combine; pass topk_weights")
    for s in range(k):
        if weighted:
            fma = (slots[:, s].double() * topk_weights[:, s : s + 1].double() + acc.double()).to(acc_dtype)
            acc = torch.where(filled[:, s : s + 1], fma, acc)
        else:
            acc = torch.where(filled[:, s : s + 1], acc + slots[:, s].to(acc_dtype), acc)
    return acc.to(torch.bfloat16) if recipe.combine_bf16 else acc


def _validate(g: Geometry, weights, inputs: list[MoEInputs], num_ranks: int, block_m) -> None:
    if not isinstance(g, Geometry):
        raise TypeError(f"g must be a Geometry, got {type(g).__name__}")
    if not isinstance(weights, (MXFP4Weights, FP8BlockWeights)):
        raise TypeError(f"weights must be MXFP4Weights or FP8BlockWeights, got {type(weights).__name__}")
    weights.check_geometry(g)
    # The values are checked where they are read (``check_experts_read``: the experts of this step, each call),
    # not scanned whole on every call; the global scales are E floats each.
    if isinstance(weights, MXFP4Weights):
        check_global_scales(weights, "reference")
    g.experts_per_rank(num_ranks)
    as_int("block_m", block_m, lo=1)
    if len(inputs) != num_ranks:
        raise ValueError(f"expected one MoEInputs per rank ({num_ranks}), got {len(inputs)}")
    for r, inp in enumerate(inputs):
        validate_rank_inputs(inp, g, weights.device, f"rank {r}")


def validate_rank_inputs(inp: MoEInputs, g: Geometry, device: torch.device, what: str) -> None:
    """One rank's step, checked before anything runs (``megamoe.validate.check_step``): x bf16 [T, H] on
    ``device``, finite; topk_idx int64 / topk_weights fp32 [T, K] on x's device, ids in range, no
    expert twice in a token, finite weights. Errors start with ``what``."""
    if not isinstance(inp, MoEInputs):
        raise TypeError(f"{what}: inputs must be MoEInputs, got {type(inp).__name__}")
    check_step(inp.x, inp.topk_idx, inp.topk_weights, hidden=g.hidden, num_topk=g.num_topk,
               num_experts=g.num_experts, device=device, who=what, device_label="the weights are on")


# Where a NaN / Inf in a result can come from when every input was finite and accepted.
OVERFLOW_HINT = ("an FP32 accumulator or the SwiGLU overflowed: activations near the bf16 maximum times "
                 "the weights exceed float32 (the kernels would overflow the same way); scale x down")


def moe_forward_ep(
    inputs: list[MoEInputs],
    weights,
    recipe: "Recipe | str",
    g: Geometry,
    *,
    num_ranks: int | None = None,
    block_m: int = 1,
    keep_stages: bool = False,
) -> MoEResult:
    """R simulated expert-parallel ranks; inputs[r] is rank r's step (ragged T_r allowed, 0 too).

    Rank r owns experts [r * E_l, (r + 1) * E_l). Returns y[r] [T_r, H] for every source rank.
    """
    recipe = get_recipe(recipe)
    num_ranks = len(inputs) if num_ranks is None else as_int("num_ranks", num_ranks, lo=1)
    _validate(g, weights, inputs, num_ranks, block_m)
    el = g.experts_per_rank(num_ranks)
    staged = [stage_activations(inp.x, recipe) for inp in inputs]
    idx = [inp.topk_idx for inp in inputs]
    layouts, outs, stages = [], [], []
    for d in range(num_ranks):
        lay = build_layout(idx, d * el, (d + 1) * el, block_m)
        pool_x = dispatch([s[0] for s in staged], lay)
        pool_sf = None if staged[0][1] is None else dispatch([s[1] for s in staged], lay)
        pool_w = dispatch_slot_values([inp.topk_weights for inp in inputs], lay)
        i, h = g.intermediate, g.hidden
        out_dtype = torch.bfloat16 if recipe.slot_output_bf16 else recipe.accum
        l2_out = torch.full((lay.num_pool_rows, h), float("nan"), dtype=out_dtype, device=weights.device)
        if keep_stages:
            l1_out = torch.full((lay.num_pool_rows, 2 * i), float("nan"), dtype=recipe.accum if not recipe.stage_x else torch.float32, device=weights.device)
            l2_in_dtype = recipe.accum if recipe.l2_group is None else torch.float8_e4m3fn
            l2_in = torch.full((lay.num_pool_rows, i), float("nan"), device=weights.device).to(l2_in_dtype)
            l2_sf = None if recipe.l2_group is None else torch.full((lay.num_pool_rows, i // recipe.l2_group), float("nan"), device=weights.device)
        counts = lay.counts.tolist()
        for batch in _expert_batches(counts, g, recipe, _batch_budget(weights.device)):
            m = max(counts[e] for e in batch)
            # [B, M] pool row of each (expert, slot); rows past an expert's count repeat its first row.
            starts = lay.padded_offsets[torch.tensor(batch, device=lay.counts.device)]
            ar = torch.arange(m, device=starts.device)
            valid = ar[None, :] < lay.counts[torch.tensor(batch, device=starts.device)][:, None]
            src = starts[:, None] + torch.where(valid, ar[None, :], torch.zeros_like(ar)[None, :])
            sf_rows = None if pool_sf is None else pool_sf[src]
            w_rows = torch.where(valid, pool_w[src], torch.zeros_like(pool_w[src]))
            res = experts_forward(pool_x[src], sf_rows, w_rows, weights, [d * el + e for e in batch], g, recipe)
            dst = src[valid]
            l2_out[dst] = res[3][valid].to(l2_out.dtype)
            if keep_stages:
                l1_out[dst], l2_in[dst] = res[0][valid].to(l1_out.dtype), res[1][valid].to(l2_in.dtype)
                if l2_sf is not None:
                    l2_sf[dst] = res[2][valid].to(l2_sf.dtype)
        layouts.append(lay)
        outs.append(l2_out)
        if keep_stages:
            stages.append(RankStages(lay, pool_x, pool_sf, pool_w, l1_out, l2_in, l2_sf, l2_out))
    ys = []
    for r, inp in enumerate(inputs):
        slots, filled = undispatch(outs, layouts, r, inp.num_tokens, g.num_topk)
        ys.append(combine(slots, filled, recipe, inp.topk_weights))
        check_output(f"y of rank {r}", ys[-1], f"reference ({recipe.name})", OVERFLOW_HINT)
    return MoEResult(ys, stages)


def moe_forward(
    inputs: MoEInputs, weights, recipe: "Recipe | str", g: Geometry, *, block_m: int = 1, keep_stages: bool = False
) -> "torch.Tensor | MoEResult":
    """One rank: y [T, H] (bf16 for kernel recipes, float64 for ``exact``). With keep_stages, the
    MoEResult with every intermediate."""
    res = moe_forward_ep([inputs], weights, recipe, g, num_ranks=1, block_m=block_m, keep_stages=keep_stages)
    return res if keep_stages else res.y[0]

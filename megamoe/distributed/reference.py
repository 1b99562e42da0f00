"""The eager reference over real torch.distributed ranks: one process per EP rank.

Each rank holds its own step (T_r tokens, 0 allowed) and owns experts [r * E_l, (r + 1) * E_l).
Only rows move; the arithmetic is the single-process reference's own (stage_activations,
build_layout, dispatch, expert_forward, combine), so y is bit-identical to ``moe_forward_ep`` on the
same global inputs: every pool row's arithmetic is independent of the other rows (gemm.py), each
expert sees its rows in the same (source rank, token, slot) order, and the slot-ordered FP32 combine
runs on the source rank over the same bf16 slot values.

Schemes (the wire carries e4m3 codes + FP32 scales, as the kernels' dispatch does):

    allgather_reducescatter
        dispatch  all-gather every rank's token records                 uint8 [sum T_s (padded), B]
        combine   each rank scatters its experts' slot outputs into a zero [R * T_max, K, H] tensor;
                  a sum reduce-scatter hands rank s its [T_max, K, H]. Each (token, slot) is owned by
                  exactly one rank, so every sum is v + 0 + ... + 0 = v exactly in any order (a -0.0
                  may come back +0.0, which the combine cannot see: its accumulator starts at +0.0
                  and adding a signed zero to it leaves it unchanged).
    all_to_all
        dispatch  rank s sends rank d only the tokens with a slot on d's experts (+ token ids)
        combine   rank d sends each slot output back to its source as (token, slot, row) records

Legend: T tokens on this rank, K slots, H hidden, R ranks, E_l experts per rank, B record bytes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..geometry import Geometry
from ..inputs import MoEInputs
from ..recipe import Recipe, get_recipe
from ..reference.dispatch import build_layout, dispatch, dispatch_slot_values
from ..reference.pipeline import OVERFLOW_HINT, combine, expert_forward, stage_activations, validate_rank_inputs
from ..validate import as_int, check_output, check_weights
from ..weights import FP8BlockWeights, MXFP4Weights
from .agreement import check_same_setup, local_check, setup_fingerprint
from .comm import FieldSpec, _reduce_scatter_single, all_gather_counts, all_gather_ragged, all_to_all_ragged, comm_device, pack_rows, unpack_rows

SCHEMES = ("allgather_reducescatter", "all_to_all")


def _validate_local(inputs: MoEInputs, weights, recipe, g: Geometry, scheme: str, block_m, rank: int, world: int) -> None:
    """This rank's own arguments, by the single-process reference's checks (``megamoe.validate``)."""
    get_recipe(recipe)
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
    if not isinstance(g, Geometry):
        raise TypeError(f"g must be a Geometry, got {type(g).__name__}")
    if not isinstance(weights, (MXFP4Weights, FP8BlockWeights)):
        raise TypeError(f"weights must be MXFP4Weights or FP8BlockWeights, got {type(weights).__name__}")
    el = g.experts_per_rank(world)
    what = f"rank {rank}"
    as_int("block_m", block_m, lo=1, who=what)
    check_weights(weights, f"{what}: weights")
    validate_rank_inputs(inputs, g, weights.device, what)
    if weights.hidden != g.hidden or weights.intermediate != g.intermediate:
        raise ValueError(f"{what}: weights are (H, I) = {(weights.hidden, weights.intermediate)} but geometry "
                         f"{g.name!r} expects {(g.hidden, g.intermediate)}")
    if weights.num_experts not in (g.num_experts, el):
        raise ValueError(f"{what}: weights must hold all {g.num_experts} experts or this rank's {el}, "
                         f"got {weights.num_experts}")


def agree_on_setup(inputs: MoEInputs, weights, recipe, g: Geometry, scheme: str, block_m, group) -> None:
    """Before the first collective: every rank checks its own arguments, then one exchange says whether
    every rank passed and holds the same geometry, recipe, scheme and weights (bytes too when every rank
    holds all E experts). Raises RankInputError / SetupMismatchError on every rank alike."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    error = local_check(_validate_local, inputs, weights, recipe, g, scheme, block_m, rank, world)
    fp = {}
    if error is None:
        full = weights.num_experts == g.num_experts
        fp = setup_fingerprint(g, recipe, weights, weight_bytes=full, scheme=scheme,
                               weights_held="all experts" if full else "this rank's experts only")
    check_same_setup(group, fp, error)


def _token_specs(g: Geometry, recipe: Recipe) -> list[FieldSpec]:
    """x on the wire (e4m3 codes, or bf16 x when the recipe does not stage), x_sf, topk_idx, topk_weights."""
    specs = [FieldSpec(torch.float8_e4m3fn if recipe.stage_x else torch.bfloat16, (g.hidden,))]
    if recipe.stage_x:
        specs.append(FieldSpec(torch.float32, (g.hidden // recipe.x_gran,)))
    return specs + [FieldSpec(torch.int64, (g.num_topk,)), FieldSpec(torch.float32, (g.num_topk,))]


def _token_records(inputs: MoEInputs, recipe: Recipe) -> torch.Tensor:
    """This rank's tokens as uint8 records [T, B]: staged here, as the kernels stage before dispatch."""
    xa, sf = stage_activations(inputs.x, recipe)
    if recipe.stage_x:
        return pack_rows([xa.to(torch.float8_e4m3fn), sf, inputs.topk_idx, inputs.topk_weights])  # e4m3 values: exact
    return pack_rows([inputs.x, inputs.topk_idx, inputs.topk_weights])


def _decode_tokens(rec: torch.Tensor, g: Geometry, recipe: Recipe):
    """records [N, B] -> (xa [N, H] as the L1 MMA reads it, x_sf [N, H/gran] or None, idx [N, K], w [N, K])."""
    parts = unpack_rows(rec, _token_specs(g, recipe))
    if recipe.stage_x:
        xq, sf, idx, w = parts
        return xq.float(), sf, idx, w
    x, idx, w = parts
    return x.to(recipe.accum), None, idx, w


def _run_local_experts(xa, sf, idx, w, weights, g: Geometry, recipe: Recipe, rank: int, el: int, block_m: int):
    """Lists over source ranks (xa[s] [N_s, H], ...) -> (layout, l2_out [P, H]) of this rank's experts."""
    lo = rank * el
    lay = build_layout(idx, lo, lo + el, block_m)
    pool_x = dispatch(xa, lay)
    pool_sf = None if sf[0] is None else dispatch(sf, lay)
    pool_w = dispatch_slot_values(w, lay)
    out_dtype = torch.bfloat16 if recipe.slot_output_bf16 else recipe.accum
    l2_out = torch.full((lay.num_pool_rows, g.hidden), float("nan"), dtype=out_dtype, device=xa[0].device)
    offset = 0 if weights.num_experts == g.num_experts else lo  # full weights: global index
    for e in range(el):
        rows = lay.rows_of(e)
        if rows.stop == rows.start:
            continue
        res = expert_forward(pool_x[rows], None if pool_sf is None else pool_sf[rows], pool_w[rows],
                             weights, lo + e - offset, g, recipe)
        l2_out[rows] = res[3]
    return lay, l2_out


def moe_forward_dist(
    inputs: MoEInputs,
    weights,
    recipe: "Recipe | str",
    g: Geometry,
    *,
    group=None,
    scheme: str = "allgather_reducescatter",
    block_m: int = 1,
) -> torch.Tensor:
    """This rank's step through the distributed reference: inputs x [T, H] -> y [T, H].

    weights: all E experts (every rank the same) or only this rank's E_l experts. Collective: every
    rank of ``group`` must call it, each with its own T (0 allowed), the same geometry, recipe, scheme and
    weights: ``agree_on_setup`` checks that first, and every rank raises the same error otherwise. A NaN /
    Inf in y from finite inputs raises ``validate.NonFiniteOutputError`` on the ranks that hold it.
    """
    agree_on_setup(inputs, weights, recipe, g, scheme, block_m, group)  # before the first collective
    recipe = get_recipe(recipe)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    el = g.experts_per_rank(world)
    rec = _token_records(inputs, recipe)  # [T, B]
    t, k, h = inputs.num_tokens, g.num_topk, g.hidden
    out_dtype = torch.bfloat16 if recipe.slot_output_bf16 else recipe.accum
    filled = inputs.topk_idx >= 0  # [T, K]: every valid slot lives on exactly one rank's experts

    if scheme == "allgather_reducescatter":
        counts = all_gather_counts(t, group)
        per_src = all_gather_ragged(rec, group, counts)  # [rec_s [T_s, B]]
        dec = [_decode_tokens(r, g, recipe) for r in per_src]
        lay, l2_out = _run_local_experts(*(list(z) for z in zip(*dec)), weights, g, recipe, rank, el, block_m)
        t_max = max(counts)
        dev = comm_device(group)
        if t_max == 0:
            return combine(torch.zeros(0, k, h, dtype=out_dtype, device=inputs.x.device), filled, recipe,
                           inputs.topk_weights)
        slots_all = torch.zeros(world, t_max, k, h, dtype=out_dtype, device=dev)  # [R, T_max, K, H]
        real = lay.is_real
        slots_all[lay.src_rank[real], lay.src_token[real], lay.src_slot[real]] = l2_out[real].to(dev)
        mine = torch.empty(t_max, k, h, dtype=out_dtype, device=dev)
        _reduce_scatter_single(mine, slots_all.view(world * t_max, k, h), op=dist.ReduceOp.SUM, group=group)
        slots = mine[:t].to(inputs.x.device)
        return _checked(combine(slots, filled, recipe, inputs.topk_weights), recipe, rank)

    # all_to_all: send rank d the tokens with a slot on its experts, with their token ids.
    tok_ids = torch.arange(t, dtype=torch.int64, device=inputs.x.device)
    idx = inputs.topk_idx
    send = []
    for d in range(world):
        sel = ((idx >= d * el) & (idx < (d + 1) * el)).any(dim=1)
        send.append(pack_rows([rec[sel], tok_ids[sel, None]]))
    recv = all_to_all_ragged(send, group)
    rec_specs = [FieldSpec(torch.uint8, (rec.shape[1],)), FieldSpec(torch.int64, (1,))]
    src_recs, src_ids = zip(*(unpack_rows(r, rec_specs) for r in recv))
    dec = [_decode_tokens(r, g, recipe) for r in src_recs]
    lay, l2_out = _run_local_experts(*(list(z) for z in zip(*dec)), weights, g, recipe, rank, el, block_m)
    back = []
    for s in range(world):
        r = (lay.src_rank == s).nonzero(as_tuple=True)[0]
        orig_tok = src_ids[s][:, 0][lay.src_token[r]]
        back.append(pack_rows([orig_tok[:, None], lay.src_slot[r, None], l2_out[r]]))
    got = all_to_all_ragged(back, group)
    slots = torch.zeros(t, k, h, dtype=out_dtype, device=inputs.x.device)
    seen = torch.zeros(t, k, dtype=torch.bool, device=inputs.x.device)
    back_specs = [FieldSpec(torch.int64, (1,)), FieldSpec(torch.int64, (1,)), FieldSpec(out_dtype, (h,))]
    for r in got:
        tok, slot, rows = unpack_rows(r, back_specs)
        tok, slot = tok[:, 0], slot[:, 0]
        if seen[tok, slot].any():
            raise AssertionError(f"rank {rank}: a slot came back from two ranks")
        slots[tok, slot] = rows
        seen[tok, slot] = True
    if not torch.equal(seen, filled):
        raise AssertionError(f"rank {rank}: {int((seen != filled).sum())} routed slots did not come back")
    return _checked(combine(slots, filled, recipe, inputs.topk_weights), recipe, rank)


def _checked(y: torch.Tensor, recipe: Recipe, rank: int) -> torch.Tensor:
    """y, unless it holds NaN / Inf from the finite inputs every rank accepted (an overflow)."""
    check_output(f"y of rank {rank}", y, f"distributed reference ({recipe.name})", OVERFLOW_HINT)
    return y

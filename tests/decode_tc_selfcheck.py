"""Checks of the tensor-core decode path (``megamoe.decode.tc``, recipe ``megamoe-decode-tc``), on a GPU or under
Triton's interpreter:

    stages   l1_tc and l2_tc against their twins bit for bit, from the same inputs
    whole    moe_decode (TCWeights) against the eager reference (recipe megamoe-decode-tc): calc_diff and the
             bitwise agreement of y; rows past the step still poisoned; a second launch bit-identical
    broken   a scale byte off by one must be caught by the reference comparison
    order    l1_tc and l2_tc on weights whose K groups hold 2**24, 1, -2**24: the FP32 sum is 0 in ascending K and
             1 in the reverse, so a wrong order of the K groups (or 128-K blocks) fails here too (``run_order_case``)

On the GPU the twins and the reference use the recipe's tensor-core model and real inputs. Under the
interpreter ``tl.dot`` is a float32 matmul, so the inputs are built so that every group sum is exact (x codes
are small integers and one 448 per 128 block; the L2 stage is fed small-integer codes) and the twins use the
``exact-block`` model; the whole path then differs from the reference only by the L2 group sums the
interpreter rounds, and is held to calc_diff < 1e-6 instead of bit equality.

A support module of the tests (``test_decode_tc.py``) and of the lab's decode probes, like ``decode_selfcheck.py``:

    TRITON_INTERPRET=1 PYTHONPATH=$PWD python3 tests/decode_tc_selfcheck.py --device cpu    -> JSON rows
    ... --order: only the order patterns (``run_order_case``: inputs on which the order of the K groups shows)
"""

from __future__ import annotations

import dataclasses
import time

import torch

from decode_selfcheck import (ORDER_A as A, ORDER_GEOMETRY, ORDER_SF, STAGE_FIELDS, DecodeCase, case_weights,
                              copy_staged, geometry_of, order_buffers, order_by_hand, order_l2_inputs, order_weights,
                              selfcheck_main, written)
from megamoe.decode import routing, tc
from megamoe.decode.layout_tc import prepare_tc_weights
from megamoe.decode.gemv import LaunchConfig
from megamoe.decode.moe import DecodeBuffers, moe_decode
from megamoe.inputs import make_inputs
from megamoe.recipe import MEGAMOE_DECODE_TC
from megamoe.testing import calc_diff, first_mismatch

ROUTE_FIELDS = tuple(f for f in STAGE_FIELDS["route"] if f != "x32")  # what L1-L2 read

CPU_CASES = (
    DecodeCase("tiny", 1, seed=11),
    DecodeCase("tiny", 5, routing="masked", seed=12),
    DecodeCase("tiny", 20, routing="skewed", seed=13),  # one expert past 16 tokens: two passes
    DecodeCase("wide", 3, routing="allmasked", seed=14),
    DecodeCase("tiny", 3, broken="l2-scale-off-by-one", seed=15),
)
# L1's split K (``LaunchConfig.tc_split``) needs as many K blocks as parts: H = 512 gives four.
SPLIT_CASES = (DecodeCase("wide", 2, seed=16), DecodeCase("wide", 3, routing="allmasked", seed=14))
# The other choice of ``LaunchConfig.tc_route`` than the backend's launch makes (it routes inside L1 up to 24
# slots), so that both L1-routes-for-itself and the route launch are checked: packed passes; tiny 20 skewed also
# takes passes of 16 rows
ROUTE_CASES = tuple(c for c in CPU_CASES if not c.broken)


def flipped_route(case: DecodeCase) -> bool:
    """``tc_route`` opposite to the backend's launch for this case."""
    return not tc.tc_launch_config(case.tokens, geometry_of(case.geometry).num_topk).tc_route


def _exact_friendly(inp, seed: int):
    """Inputs whose staged x codes are small integers and one 448 per 128 block, times a power of two per
    token (module docstring): every L1 group sum is then exact in FP32 and in the tensor cores' 13 bits."""
    gen = torch.Generator().manual_seed(seed)
    t, h = inp.x.shape
    x = torch.randint(-4, 5, (t, h), generator=gen).float()
    x.view(t, h // 128, 128)[:, :, 0] = 448.0
    x = x * torch.exp2(torch.randint(-6, 6, (t, 1), generator=gen).float())
    return dataclasses.replace(inp, x=x.to(torch.bfloat16).to(inp.x.device))


def run_tc_case(case: DecodeCase, device="cpu", pack: bool | None = None, split: int | None = None,
                route: bool | None = None) -> dict:
    """``pack``, ``split`` and ``route`` override the launch's packed passes, K parts and whether L1 routes for
    itself (``LaunchConfig.tc_pack4``, ``tc_split``, ``tc_route``; None: the backend's launch)."""
    from megamoe.reference import moe_forward
    from megamoe.staging import stage_into

    t0 = time.time()
    interp = torch.device(device).type == "cpu"
    g = geometry_of(case.geometry)
    w = case_weights(case.geometry, str(device))
    tw = prepare_tc_weights(w)
    if case.broken:
        tw = dataclasses.replace(tw, l2_scales=(tw.l2_scales + 1).contiguous())
    inp = make_inputs(g, case.tokens, seed=2000 + case.seed, outlier_channels=4, **case.routing_kwargs()).to(device)
    if interp:
        inp = _exact_friendly(inp, case.seed)
    t = case.tokens
    buf = DecodeBuffers.allocate(g, t, device, split_tokens=t)
    stage_into(inp.x, inp.topk_idx, inp.topk_weights, buf.x_q, buf.x_sf, buf.topk_idx, buf.topk_weights, t,
               num_experts=g.num_experts, backend="torch")
    recipe = MEGAMOE_DECODE_TC.with_(mma="exact-block") if interp else MEGAMOE_DECODE_TC
    cfg = dataclasses.replace(tc.tc_launch_config(t, g.num_topk), store_l1=True)  # the backend's launch
    if pack is not None:  # the split K runs on packed passes only
        cfg = dataclasses.replace(cfg, tc_pack4=pack, tc_split=cfg.tc_split if pack else 1)
    if split is not None:
        cfg = dataclasses.replace(cfg, tc_split=split)
    if route is not None:
        cfg = dataclasses.replace(cfg, tc_route=route)
    suffix = ("" if pack is None else f"-pack{int(pack)}") + ("" if split is None else f"-split{split}") + (
        "" if route is None else f"-route{int(route)}")
    row = {"case": case.id + suffix, "tc": True, "pack": cfg.tc_pack4, "split": cfg.tc_split,
           "route_in_l1": cfg.tc_route, **dataclasses.asdict(case)}
    ref = moe_forward(inp, w, recipe, g)
    if case.broken:
        row["calc_diff"] = calc_diff(moe_decode(tw, buf, t, g.clamp, cfg), ref)
        return row
    twin = DecodeBuffers.allocate(g, t, device, split_tokens=t)
    copy_staged(buf, twin)
    buf.poison_()
    twin.poison_()
    # route as moe_decode runs it for this path (no x32, nothing zeroed; or inside L1's launch) against its twin,
    # on the metadata L1-L2 read
    if cfg.tc_route:
        tc.l1_tc(tw, buf, t, g.clamp, cfg)
    else:
        routing.route(buf.topk_idx, buf.topk_weights, buf.x_q, t, buf.expert_lo, buf.num_local, buf, full=False)
    routing.route_torch(twin.topk_idx, twin.topk_weights, twin.x_q, t, twin.expert_lo, twin.num_local, twin)
    row["route"] = "; ".join(f"{f}: {m}" for f in ROUTE_FIELDS if (m := first_mismatch(written(buf, f, t),
                                                                                       written(twin, f, t))))
    if not cfg.tc_route:
        tc.l1_tc(tw, buf, t, g.clamp, cfg)
    tc.l1_tc_torch(tw, twin, t, g.clamp, cfg, mma=recipe.mma)
    row["l1"] = "; ".join(f"{f}: {m}" for f in ("l1_out", "l2_q", "l2_sf")
                          if (m := first_mismatch(written(buf, f, t), written(twin, f, t))))
    n = int((buf.slot_row[: t * g.num_topk] >= 0).sum())
    if interp:  # small-integer L2 codes (every group sum exact), the same in both
        gen = torch.Generator().manual_seed(case.seed)
        small = torch.tensor([0x00, 0x38, 0x40, 0x44, 0x48, 0xB8, 0xC0, 0xC4, 0xC8], dtype=torch.uint8)  # 0, +-1..4
        codes = small[torch.randint(0, len(small), (n, g.intermediate), generator=gen)].to(device)
        buf.l2_q[:n] = codes
        twin.l2_q[:n] = codes
    tc.l2_tc(tw, buf, t, cfg)
    tc.l2_tc_torch(tw, twin, t, cfg, mma=recipe.mma)
    row["l2"] = first_mismatch(written(buf, "slot_out", t), written(twin, "slot_out", t)) or ""
    buf.poison_()
    y = moe_decode(tw, buf, t, g.clamp, cfg).clone()
    row["poison_kept"] = bool(torch.isnan(buf.y[t:].float()).all() and (buf.l2_q[n:] == 0x7F).all())
    row["calc_diff"] = calc_diff(y, ref)
    row["bitwise_frac"] = float((y.view(torch.int16) == ref.view(torch.int16)).float().mean())
    row["nan"] = int(torch.isnan(y.float()).sum())
    buf.poison_()
    row["repeat_identical"] = not first_mismatch(moe_decode(tw, buf, t, g.clamp, cfg), y)
    row["interpreter"] = interp
    row["seconds"] = round(time.time() - t0, 2)
    return row


def passed_tc(row: dict) -> bool:
    """Stages equal to their twins; the whole path bit-identical to the reference on the GPU, within 1e-6
    under the interpreter; repeatable, poison kept. A broken case passes when the reference catches it."""
    if row["broken"]:
        return row["calc_diff"] > 1e-3
    whole = row["calc_diff"] < 1e-6 if row["interpreter"] else row["bitwise_frac"] == 1.0
    stages = not row["route"] and not row["l1"] and not row["l2"]
    return stages and whole and row["repeat_identical"] and row["poison_kept"] and not row["nan"]


# ------------------------------------------------------------------------------------ the order of the K groups
# The patterns (decode_selfcheck.py, "the order of the K blocks"): a row of groups A, 1, -A is 0 in ascending K
# and 1 added in reverse. Here a 128-K block is the FP32 sum of its groups, so the order shows inside a block too.
L1_ORDER_ROWS = (  # L1: H = 512, four 128-K blocks of four groups (the split parts: blocks {0, 1}, {2, 3} or one each)
    ({0: A, 1: 1.0, 2: -A}, 0.0),  # groups of block 0
    ({1: A, 2: 1.0, 3: -A}, 0.0),  # ... the last three (pairs (0 + 1) + (2 + 3) give 1 too)
    ({0: -A, 1: 1.0, 2: A}, 1.0),  # the mirror
    ({0: A, 4: 1.0, 8: -A}, 0.0),  # blocks 0, 1, 2
    ({4: A, 8: 1.0, 12: -A}, 0.0),  # blocks 1, 2, 3: across the split parts
    ({4: -A, 8: 1.0, 12: A}, 1.0),  # the mirror
)
L2_ORDER_ROWS = (  # L2: I = 256, eight groups, four per K iteration
    ({0: A, 1: 1.0, 2: -A}, 0.0),  # in iteration 0
    ({1: A, 2: 1.0, 3: -A}, 0.0),
    ({1: -A, 2: 1.0, 3: A}, 1.0),  # the mirror
    ({3: A, 4: 1.0, 5: -A}, 0.0),  # across iterations 0 and 1
    ({2: A, 5: 1.0, 7: -A}, 0.0),
    ({3: -A, 4: 1.0, 5: A}, 1.0),  # the mirror
)
ORDER_CONFIGS = ((False, 1), (True, 1), (True, 2), (True, 4))  # (packed passes, L1's K parts)


def run_order_case(device="cpu", pack: bool = True, split: int = 1) -> dict:
    """The tensor-core L1 and L2 on the order patterns (two tokens, one expert), each against its twin (the
    recipe's group_scaled_gemm, ``exact-block`` under the interpreter) bit for bit and against the values the
    tables give (``order_by_hand``). '' where they agree, else the first mismatch."""
    t0 = time.time()
    g = ORDER_GEOMETRY
    t = len(ORDER_SF)
    tw = prepare_tc_weights(order_weights(L1_ORDER_ROWS, L2_ORDER_ROWS).to(device))
    interp = torch.device(device).type == "cpu"
    mma = "exact-block" if interp else MEGAMOE_DECODE_TC.mma  # one product per group: exact in both
    cfg = LaunchConfig(store_l1=True, tc_pack4=pack, tc_split=split)  # route: route_torch's (order_buffers)
    buf, twin = order_buffers(device, split_tokens=t)
    row = {"case": f"order-pack{int(pack)}-split{split}", "pack": pack, "split": split, "interpreter": interp}
    tc.l1_tc(tw, buf, t, g.clamp, cfg)
    tc.l1_tc_torch(tw, twin, t, g.clamp, cfg, mma=mma)
    row["l1"] = "; ".join(f"{f}: {m}" for f in ("l1_out", "l2_q", "l2_sf")
                          if (m := first_mismatch(written(buf, f, t), written(twin, f, t))))
    order_l2_inputs(buf, twin)
    tc.l2_tc(tw, buf, t, cfg)
    tc.l2_tc_torch(tw, twin, t, cfg, mma=mma)
    row["l2"] = first_mismatch(written(buf, "slot_out", t), written(twin, "slot_out", t))
    row.update(order_by_hand(buf, twin, L1_ORDER_ROWS, L2_ORDER_ROWS))
    row["seconds"] = round(time.time() - t0, 2)
    return row


def case_rows(device) -> list[dict]:
    """The self-check's rows: every case unpacked and packed, L1's K split in 2 and 4, and L1's routing either way."""
    rows = [run_tc_case(c, device, pack) for c in CPU_CASES for pack in (False, True)]
    rows += [run_tc_case(c, device, True, split) for c in SPLIT_CASES for split in (2, 4)]
    rows += [run_tc_case(c, device, True, route=flipped_route(c)) for c in ROUTE_CASES]
    rows += [run_tc_case(c, device, True, 2, route=flipped_route(c)) for c in SPLIT_CASES]
    return rows


def main(argv=None) -> int:
    return selfcheck_main(argv, __doc__, run_order_case, ORDER_CONFIGS, case_rows, passed_tc)


if __name__ == "__main__":
    raise SystemExit(main())

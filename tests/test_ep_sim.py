"""Simulated expert parallelism: R ranks with ragged token counts give the one-rank result, bit for bit.

Every case concatenates the ranks' steps into one rank's step and runs that once; each rank's rows of
the EP result must equal the matching rows of the one-rank result bitwise (kernel recipes), whatever
R, BLOCK_M, the per-rank token counts (0 included), empty experts and masked slots.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from megamoe.inputs import MoEInputs, make_inputs
from megamoe.reference import build_layout, moe_forward, moe_forward_ep
from megamoe.reference.routing import expert_histogram
from megamoe.testing import assert_bitwise_equal, assert_close_diff


@dataclass
class EPCase:
    name: str
    preset: str
    tokens: tuple[int, ...]  # per rank; len = R
    block_m: int
    recipe: str = "flashinfer-mxfp4"
    empty_experts: tuple[int, ...] = ()
    mask_prob: float = 0.0
    fully_masked: bool = False  # one token per nonempty rank has every slot masked
    skew: float = 0.0

    def __str__(self) -> str:
        return self.name

    @property
    def ranks(self) -> int:
        return len(self.tokens)


CASES = [
    EPCase("tiny-R1-T5-bm1", "tiny", (5,), 1),
    EPCase("tiny-R2-T0,7-bm8", "tiny", (0, 7), 8),
    EPCase("tiny-R2-T1,1-bm64-empty3", "tiny", (1, 1), 64, empty_experts=(3,)),
    EPCase("tiny-R4-T0,1,9,4-bm8-masked", "tiny", (0, 1, 9, 4), 8, mask_prob=0.3, fully_masked=True),
    EPCase("tiny-R4-T3,0,0,11-bm1-skew-empty", "tiny", (3, 0, 0, 11), 1, empty_experts=(0, 6), skew=1.5),
    EPCase("small-R4-T13,2,0,5-bm64-masked", "small", (13, 2, 0, 5), 64, "deepgemm-sm90-fp4", (1, 2, 15), 0.25, True),
    EPCase("small-R2-T17,6-bm8-fp8", "small", (17, 6), 8, "deepgemm-sm90-fp8", (4,), 0.1),
    EPCase("tiny-R4-T2,5,0,3-bm64-sm100", "tiny", (2, 5, 0, 3), 64, "deepgemm-sm100-fp4", (5,), 0.2, True),
]


def rank_inputs(case: EPCase, g, seed: int = 0) -> list[MoEInputs]:
    out = []
    for r, t in enumerate(case.tokens):
        fm = (t // 2,) if case.fully_masked and t else ()
        out.append(make_inputs(g, t, seed=1000 * seed + r, empty_experts=case.empty_experts, mask_prob=case.mask_prob,
                               fully_masked_tokens=fm, skew=case.skew, outlier_channels=2))
    return out


def concat(inputs: list[MoEInputs]) -> MoEInputs:
    return MoEInputs(*(torch.cat([getattr(i, f) for i in inputs]) for f in ("x", "topk_idx", "topk_weights")))


@pytest.mark.parametrize("case", CASES, ids=str)
def test_ep_bit_identical_to_one_rank(case, weights_for):
    g, w = weights_for(case.preset, recipe=case.recipe)
    inputs = rank_inputs(case, g)
    one = concat(inputs)
    # The concatenated step routes to every non-empty expert, and none to the empty ones.
    hist = expert_histogram(one.topk_idx, g.num_experts)
    assert all(hist[e] == 0 for e in case.empty_experts)
    res = moe_forward_ep(inputs, w, case.recipe, g, block_m=case.block_m, keep_stages=True)
    assert len(res.y) == case.ranks
    y_one = moe_forward(one, w, case.recipe, g, block_m=1)  # one rank, no padding
    lo = 0
    for r, t in enumerate(case.tokens):
        assert res.y[r].shape == (t, g.hidden), f"rank {r}: output shape"
        assert_bitwise_equal(res.y[r], y_one[lo : lo + t], f"{case}: rank {r} (T={t}) vs one rank at BLOCK_M 1")
        lo += t
    # Tokens with every slot masked give exact zero rows.
    for r, inp in enumerate(inputs):
        dead = (inp.topk_idx < 0).all(dim=1)
        assert (res.y[r][dead] == 0).all(), f"rank {r}: a fully masked token has a nonzero output row"
        assert not torch.isnan(res.y[r].float()).any(), f"rank {r}: NaN leaked from padding rows"
    # Each destination pool holds exactly its experts' rows, padded per BLOCK_M.
    el = g.num_experts // case.ranks
    for d, st in enumerate(res.ranks):
        lay = st.layout
        assert lay.counts.tolist() == hist[d * el : (d + 1) * el].tolist(), f"pool {d}: counts"
        seg = lay.padded_offsets.diff()
        assert ((seg % case.block_m) == 0).all() and (seg >= lay.counts).all() and (seg - lay.counts < case.block_m).all()
        assert int(lay.is_real.sum()) == lay.num_routed_rows


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_exact_recipe_ep_matches_one_rank(ranks, weights_for):
    g, w = weights_for("tiny")
    case = EPCase("exact", "tiny", (3, 0, 5, 1)[:ranks] if ranks > 1 else (6,), 8, "exact", mask_prob=0.2)
    inputs = rank_inputs(case, g, seed=7)
    res = moe_forward_ep(inputs, w, "exact", g, block_m=8)
    y_one = moe_forward(concat(inputs), w, "exact", g)
    assert_close_diff(torch.cat(res.y), y_one, 1e-14, f"exact recipe, R={ranks}")


@pytest.mark.parametrize("recipe", ["flashinfer-mxfp4", "deepgemm-sm90-fp8"])
def test_block_m_does_not_change_results(recipe, weights_for):
    g, w = weights_for("tiny", recipe=recipe)
    inp = make_inputs(g, 21, seed=3, empty_experts=(2, 3), mask_prob=0.1)
    y1 = moe_forward(inp, w, recipe, g, block_m=1)
    for block_m in (8, 64):
        assert_bitwise_equal(moe_forward(inp, w, recipe, g, block_m=block_m), y1, f"{recipe}: BLOCK_M {block_m} vs 1")


def test_layout_padding_and_order():
    idx = [torch.tensor([[0, 2], [2, -1], [1, 0]]), torch.tensor([[2, 0]])]
    lay = build_layout(idx, 0, 4, block_m=4)
    assert lay.counts.tolist() == [3, 1, 3, 0]  # expert 3 gets nothing
    assert lay.padded_offsets.tolist() == [0, 4, 8, 12, 12]
    # Expert 0: rank 0 token 0 slot 0, rank 0 token 2 slot 1, rank 1 token 0 slot 1, then one padding row.
    assert lay.src_rank[:4].tolist() == [0, 0, 1, -1]
    assert lay.src_token[:4].tolist() == [0, 2, 0, -1]
    assert lay.src_slot[:4].tolist() == [0, 1, 1, -1]
    with pytest.raises(ValueError, match="block_m must be positive"):
        build_layout(idx, 0, 4, block_m=0)


def test_ranks_must_divide_experts(weights_for):
    g, w = weights_for("tiny")
    inputs = rank_inputs(EPCase("x", "tiny", (1, 1, 1), 1), g)
    with pytest.raises(ValueError, match="num_ranks must divide num_experts=8, got num_ranks=3"):
        moe_forward_ep(inputs, w, "exact", g)
    with pytest.raises(ValueError, match=r"expected one MoEInputs per rank \(2\), got 3"):
        moe_forward_ep(inputs, w, "exact", g, num_ranks=2)

"""Plan / BLOCK_M models: agree with FlashInfer's selector everywhere; pools; the data-parallel rule."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megamoe.geometry import PRESETS
from megamoe.layouts.plans import (
    H20_NUM_SMS,
    H200_NUM_SMS,
    agreed_token_count,
    deepgemm_plan_hint,
    deepgemm_sm90_fp8_plan,
    expert_counts,
    flashinfer_block_m_ranges,
    flashinfer_legal_block_ms,
    flashinfer_mxfp4_plan,
    flashinfer_pool_tokens,
    flashinfer_sf_pool_tokens,
    flashinfer_tokens_for_block_m,
    pad_to_token_count,
    padding_waste,
)
from megamoe.inputs import make_routing
from megamoe.testing import FLASHINFER_ORACLE

MAX_TOKENS = 8192


def geom_args(g):
    return (g.num_experts, g.num_topk, g.hidden, g.intermediate)


@pytest.mark.parametrize("ranks", [1, 8])
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_plan_agrees_with_flashinfer_for_every_token_count(preset, ranks):
    heur = pytest.importorskip("flashinfer.megamoe.heuristics", reason=FLASHINFER_ORACLE)
    g = PRESETS[preset]
    names = [f.name for f in dataclasses.fields(heur.FusedPlan)]
    assert names == [f.name for f in dataclasses.fields(flashinfer_mxfp4_plan(H200_NUM_SMS, ranks, *geom_args(g), MAX_TOKENS, 1))]
    for sms, step in ((H200_NUM_SMS, 1), (H20_NUM_SMS, 7)):
        for t in range(1, MAX_TOKENS + 1, step):
            ours = flashinfer_mxfp4_plan(sms, ranks, *geom_args(g), MAX_TOKENS, t)
            theirs = heur.select_mxfp4_fused_plan(sms, ranks, *geom_args(g), MAX_TOKENS, t)
            if [getattr(ours, n) for n in names] != [getattr(theirs, n) for n in names]:
                raise AssertionError(f"{preset} R={ranks} sms={sms} T={t}: {ours} != {theirs}")


def test_pool_formulas_agree_with_flashinfer():
    heur = pytest.importorskip("flashinfer.megamoe.heuristics", reason=FLASHINFER_ORACLE)
    for r, t, k, epr in ((1, 8192, 6, 256), (8, 8448, 6, 32), (8, 100, 2, 1), (32, 77, 8, 12)):
        pool = flashinfer_pool_tokens(r, t, k, epr)
        assert pool == heur.get_num_max_pool_tokens(r, t, k, epr)
        assert flashinfer_sf_pool_tokens(pool) == max(heur.get_num_padded_sf_pool_tokens(pool, b) for b in heur.CANDIDATE_BLOCK_M)
        assert pool % 384 == 0


@pytest.mark.parametrize("preset", ["dsv4-flash", "dsv4-pro"])
@pytest.mark.parametrize("ranks", [1, 8])
def test_legal_block_ms_and_forcing(preset, ranks):
    g = PRESETS[preset]
    assert flashinfer_legal_block_ms(H200_NUM_SMS, ranks, *geom_args(g), MAX_TOKENS) == (8, 24, 64)
    assert 32 in flashinfer_legal_block_ms(H20_NUM_SMS, ranks, *geom_args(g), MAX_TOKENS)
    for bm in (8, 24, 64):
        tokens = flashinfer_tokens_for_block_m(bm, H200_NUM_SMS, ranks, *geom_args(g), MAX_TOKENS)
        for t in (tokens.start, tokens.stop - 1):
            assert flashinfer_mxfp4_plan(H200_NUM_SMS, ranks, *geom_args(g), MAX_TOKENS, t).block_m == bm
    with pytest.raises(ValueError, match="block_m=16 is never chosen"):
        flashinfer_tokens_for_block_m(16, H200_NUM_SMS, ranks, *geom_args(g), MAX_TOKENS)
    assert flashinfer_legal_block_ms(g, num_ranks=ranks) == (8, 24, 64)
    ranges = flashinfer_block_m_ranges(H200_NUM_SMS, ranks, *geom_args(g), MAX_TOKENS)
    assert flashinfer_legal_block_ms(g, ranges[24][0].stop, num_ranks=ranks) == (64,)  # padding only grows T
    assert sum(len(r) for rs in ranges.values() for r in rs) == MAX_TOKENS


def test_legal_block_ms_default_form():
    assert flashinfer_legal_block_ms() == (8, 24, 64)
    assert flashinfer_legal_block_ms("small", None, num_ranks=8) == (8, 24, 32, 64)
    with pytest.raises(TypeError, match="expected"):
        flashinfer_legal_block_ms(132, 8)


def test_plan_argument_errors():
    g = PRESETS["dsv4-flash"]
    with pytest.raises(ValueError, match="num_ranks must be a power of two"):
        flashinfer_mxfp4_plan(132, 6, *geom_args(g), 64, 1)
    with pytest.raises(ValueError, match=r"num_tokens must be in \[1, num_max_tokens_per_rank=64\], got 65"):
        flashinfer_mxfp4_plan(132, 8, *geom_args(g), 64, 65)
    with pytest.raises(ValueError, match="hidden must be a positive multiple of 256"):
        flashinfer_mxfp4_plan(132, 8, g.num_experts, g.num_topk, 384, g.intermediate, 64, 1)


def test_ragged_step_all_ranks_pick_one_plan():
    """A ragged data-parallel step: with the agreed count / hint every rank computes the same plan;
    with its own count, ranks disagree on BLOCK_M (the 1.5-1.9x slowdown of KERNELS.md)."""
    g = PRESETS["dsv4-flash"]
    counts = [3, 40, 90, 1, 0, 12, 77, 5]
    own = {flashinfer_mxfp4_plan(132, 8, *geom_args(g), 128, max(c, 1)).block_m for c in counts}
    assert len(own) > 1
    agreed = agreed_token_count(counts)
    assert agreed == 90
    assert len({flashinfer_mxfp4_plan(132, 8, *geom_args(g), 128, agreed) for _ in counts}) == 1
    assert deepgemm_plan_hint(counts) == 29  # ceil(228 / 8)
    assert deepgemm_plan_hint(torch.tensor(counts)) == 29
    assert agreed_token_count([0, 0]) == 1 and deepgemm_plan_hint([0, 0]) == 1
    with pytest.raises(ValueError, match="one token count per rank"):
        agreed_token_count([])
    with pytest.raises(ValueError, match=">= 0"):
        deepgemm_plan_hint([3, -1])


def test_pad_to_token_count():
    gen = torch.Generator().manual_seed(61)
    x = torch.randn(5, 256, generator=gen).to(torch.bfloat16)
    idx, w = make_routing(5, 8, 2, gen=gen)
    px, pidx, pw = pad_to_token_count(x, idx, w, 9)
    assert px.shape == (9, 256) and bool((pidx[5:] == -1).all()) and torch.equal(pidx[:5], idx)
    assert torch.equal(px[:5], x) and torch.equal(pw[:5], w)
    with pytest.raises(ValueError, match="below this rank's 5 tokens"):
        pad_to_token_count(x, idx, w, 4)


def test_padding_waste_counts_empty_experts_as_free():
    pw = padding_waste([0, 1, 8, 9, 24], 8)
    assert (pw.rows, pw.blocks, pw.padded_rows, pw.wasted_rows) == (42, 0 + 1 + 1 + 2 + 3, 56, 14)
    assert pw.fraction == pytest.approx(14 / 56)
    assert padding_waste([0, 0], 64).fraction == 0.0
    gen = torch.Generator().manual_seed(62)
    idx, _ = make_routing(64, 16, 4, gen=gen, mask_prob=0.2, empty_experts=(3,))
    counts = expert_counts(idx, range(16))
    assert counts[3] == 0 and sum(counts) == int((idx >= 0).sum())
    assert padding_waste(counts, 64).padded_rows >= padding_waste(counts, 8).padded_rows
    with pytest.raises(ValueError, match="block_m must be positive"):
        padding_waste(counts, 0)


def test_deepgemm_plan_model():
    g = PRESETS["dsv4-flash"]
    small = deepgemm_sm90_fp8_plan(8, g.num_experts, g.num_topk, 16)
    assert (small.block_m, small.block_n, small.swap_ab, small.modelled) == (64, 128, True, True)
    big = deepgemm_sm90_fp8_plan(8, g.num_experts, g.num_topk, 4096)
    assert (big.block_m, big.block_n, big.swap_ab) == (128, 256, False)
    assert all(deepgemm_sm90_fp8_plan(8, g.num_experts, g.num_topk, t).block_m % 64 == 0 for t in range(0, 9000, 97))

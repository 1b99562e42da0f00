"""The GEMM accumulation modes of megamoe.reference.gemm against a scalar oracle written from the
DeepGEMM SM90 source (prescale / WGMMA / postscale), and the recipe plumbing."""

from __future__ import annotations

import math

import pytest
import torch

from megamoe.recipe import DEEPGEMM_SM90_FP8
from megamoe.reference.gemm import promoted_gemm
from megamoe.reference.tensorcore import MODELS, tc_step


def _e4m3(shape, gen, scale=1.0):
    return (torch.randn(shape, generator=gen) * scale).to(torch.float8_e4m3fn).float()


def _exp(v: float) -> int:
    """e4m3 exponent, 1 <= |significand| < 2, subnormals and zero at -6 (written apart from the library's)."""
    return max(math.frexp(v)[1] - 1, -6) if v else -6


def _oracle(a, a_sf, b, b_sf, pk, mode, model_name):
    """One output element at a time, straight from the kernel's loop structure."""
    model = MODELS[model_name]

    def step(acc, i, j, c0):
        ks = range(c0, c0 + model.chunk)
        e_ops = torch.tensor([[_exp(float(a[i, k])) + _exp(float(b[j, k])) for k in ks]]) if model.align == "operands" else None
        p = (a[i, c0 : c0 + model.chunk] * b[j, c0 : c0 + model.chunk]).double().view(1, -1)
        return tc_step(acc.view(1), p, model, e_ops)[0]

    m, k = a.shape
    n = b.shape[0]
    ga = k // a_sf.shape[1]
    out = torch.empty(m, n)
    for i in range(m):
        for j in range(n):
            acc = torch.tensor(0.0, dtype=torch.float64)
            prev = None
            for kb in range(k // pk):
                s = torch.tensor(float(a_sf[i, kb * pk // ga]), dtype=torch.float32) * b_sf[j // 128, kb * pk // 128]
                if kb and mode == "rescale":
                    acc = (acc * torch.reciprocal(s).double()).float().double()
                if kb and mode == "rescale-ratio":
                    r = (prev.double() * torch.reciprocal(s).double()).float().double()
                    acc = (acc * r).float().double()
                if mode == "promote":
                    blk = torch.tensor(0.0, dtype=torch.float64)
                    for c0 in range(kb * pk, (kb + 1) * pk, model.chunk):
                        blk = step(blk, i, j, c0)
                    acc = (s.double() * blk + acc).float().double()
                else:
                    for c0 in range(kb * pk, (kb + 1) * pk, model.chunk):
                        acc = step(acc, i, j, c0)
                    if mode == "rescale":
                        acc = (acc * s.double()).float().double()
                prev = s
            if mode == "rescale-ratio":
                acc = (acc * prev.double()).float().double()
            out[i, j] = float(acc)
    return out


@pytest.mark.parametrize("mode", ["promote", "rescale", "rescale-ratio"])
@pytest.mark.parametrize("model", ["exact-block", "sm90-fp8-tc", "sm90-fp8-tc-operands"])
@pytest.mark.parametrize("pk", [128, 64])
def test_modes_match_scalar_oracle(mode, model, pk):
    gen = torch.Generator().manual_seed(hash((mode, model, pk)) % 2**31)
    m, n, k = 3, 130, 256  # two weight row blocks, two (or four) K blocks
    a, b = _e4m3((m, k), gen), _e4m3((n, k), gen, 0.5)
    a_sf = torch.rand(m, k // pk, generator=gen) * 1e-2 + 1e-4  # per-pk activation scales (L2: per 64)
    b_sf = torch.rand((n + 127) // 128, k // 128, generator=gen) + 0.5
    got = promoted_gemm(a, a_sf, b, b_sf, pk, model, mode)
    want = _oracle(a, a_sf, b, b_sf, pk, mode, model)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (got - want).abs().max()


def test_modes_differ_where_they_should():
    """Rescaling the running sum through a 13-bit accumulator is not the same arithmetic as promotion."""
    gen = torch.Generator().manual_seed(5)
    a, b = _e4m3((16, 512), gen), _e4m3((128, 512), gen)
    a_sf, b_sf = torch.rand(16, 4, generator=gen) + 0.1, torch.rand(1, 4, generator=gen) + 0.1
    p = promoted_gemm(a, a_sf, b, b_sf, 128, "sm90-fp8-tc", "promote")
    r = promoted_gemm(a, a_sf, b, b_sf, 128, "sm90-fp8-tc", "rescale")
    frac = (p.view(torch.int32) != r.view(torch.int32)).float().mean()
    assert frac > 0.05
    rel = ((p - r).abs() / p.abs().clamp(min=1e-6)).median()
    assert rel < 1e-2  # same value to a few accumulator ulps, not a different result


@pytest.mark.parametrize("mode", ["promote", "rescale"])
def test_batched_leading_dims_equal_per_expert(mode):
    gen = torch.Generator().manual_seed(7)
    a, b = _e4m3((2, 5, 256), gen), _e4m3((2, 128, 256), gen)
    a_sf, b_sf = torch.rand(2, 5, 2, generator=gen) + 0.1, torch.rand(2, 1, 2, generator=gen) + 0.1
    both = promoted_gemm(a, a_sf, b, b_sf, 128, "sm90-fp8-tc", mode)
    for e in range(2):
        one = promoted_gemm(a[e], a_sf[e], b[e], b_sf[e], 128, "sm90-fp8-tc", mode)
        assert torch.equal(both[e], one)


def test_bad_mode_rejected():
    with pytest.raises(ValueError, match="accumulate must be one of"):
        DEEPGEMM_SM90_FP8.with_(accumulate="fma")
    a = torch.ones(1, 128)
    with pytest.raises(ValueError, match="accumulate must be one of"):
        promoted_gemm(a, torch.ones(1, 1), torch.ones(128, 128), torch.ones(1, 1), 128, "exact-block", "bogus")


def test_expert_batches_count_the_weights():
    """A batch's decoded weights (float32 + float64 copies) stay within the budget too: on
    DeepSeek-V4-Flash at 128 tokens an activation-only budget put 227 experts (28 GiB) in one batch."""
    from megamoe.geometry import get_geometry
    from megamoe.recipe import FLASHINFER_MXFP4
    from megamoe.reference.pipeline import _expert_batches

    g = get_geometry("dsv4-flash")
    gen = torch.Generator().manual_seed(3)
    counts = torch.randint(0, 9, (g.num_experts,), generator=gen).tolist()
    per_weight = 20  # float32 + float64 + the matmul's float64 operand
    for budget in (16 << 30, 2 << 30, 256 << 20):
        batches = _expert_batches(counts, g, FLASHINFER_MXFP4, budget)
        assert sorted(e for b in batches for e in b) == [e for e, c in enumerate(counts) if c]
        for b in batches:
            weight_bytes = len(b) * per_weight * 3 * g.intermediate * g.hidden
            assert len(b) == 1 or weight_bytes <= budget
        if budget == 16 << 30:
            assert max(len(b) for b in batches) > 10  # the budget is used, not one expert a batch


def test_batch_budget():
    from megamoe.reference.pipeline import _batch_budget

    assert _batch_budget("cpu") == 256 << 20


def test_operand_alignment_keeps_the_bit_a_product_alignment_drops():
    """Hand-worked: 1.5 * 1.5 = 2.25 (operand exponents 0 + 0, product exponent 1) plus two products of
    2**-13. Aligned to the product's exponent the unit is 2**(1 - 13): both small terms drop, the result is
    2.25. Aligned to ea + eb = 0 the unit is 2**-13: both stay, sum 2.25 + 2**-12, which the 13-bit output
    (unit 2**-12 at exponent 1) keeps."""
    from megamoe.reference.tensorcore import SM90_FP8_TC, SM90_FP8_TC_OPERANDS, tc_dot

    a = torch.zeros(1, 32)
    b = torch.zeros(1, 32)
    a[0, :3] = torch.tensor([1.5, 2.0**-6, 2.0**-6])
    b[0, :3] = torch.tensor([1.5, 2.0**-7, 2.0**-7])
    assert float(tc_dot(a, b, SM90_FP8_TC)[0, 0]) == 2.25
    assert float(tc_dot(a, b, SM90_FP8_TC_OPERANDS)[0, 0]) == 2.25 + 2.0**-12
    # 1.0 * 2.0 has significands multiplying to 1: both alignments agree (2 + 2**-12 needs unit 2**-12).
    a[0, 0], b[0, 0] = 1.0, 2.0
    assert float(tc_dot(a, b, SM90_FP8_TC)[0, 0]) == float(tc_dot(a, b, SM90_FP8_TC_OPERANDS)[0, 0]) == 2.0


def test_operand_exponents_of_e4m3_subnormals_are_minus_6():
    from megamoe.reference.tensorcore import operand_exponents

    x = torch.tensor([448.0, 1.0, 1.875, 2.0**-6, 2.0**-7, 2.0**-9, 0.0, -3.0])
    assert operand_exponents(x).tolist() == [8, 0, 0, -6, -6, -6, -6, 1]

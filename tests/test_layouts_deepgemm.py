"""DeepGEMM SM90 FP8 / FP4 and SM100 FP4 layouts: bitwise inverses, and equality with DeepGEMM's
transform re-derived independently from its source (the real function runs in the GPU test)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megamoe.formats import quantize_fp8_block, unpack_ue8m0_x4
from megamoe.geometry import get_geometry
from megamoe.layouts.deepgemm_sm90 import (
    from_deepgemm_sm90_fp4,
    from_deepgemm_sm90_fp8,
    to_deepgemm_sm90_fp4,
    to_deepgemm_sm90_fp8,
    to_fp8_block,
)
from megamoe.layouts.deepgemm_sm100 import from_deepgemm_sm100_fp4, to_deepgemm_sm100_fp4
from megamoe.layouts.random import random_mxfp4_bytes
from megamoe.layouts.ranges import repair_ranges
from megamoe.testing import assert_bitwise_equal
from megamoe.weights import FP8BlockWeights, random_mxfp4_weights

PRESETS = [("tiny", 8), ("small", 4), ("dsv4-flash", 2), ("dsv4-pro", 1)]


def assert_mxfp4_equal(a, b):
    for name in ("l1", "l1_scale", "l2", "l2_scale"):
        assert_bitwise_equal(getattr(a, name), getattr(b, name), name)


def interleave_by_index(t: torch.Tensor, gran: int = 8) -> torch.Tensor:
    """DeepGEMM's gate/up interleave restated by its index equation (independent of the library)."""
    n = t.shape[1]
    half = n // 2
    src = torch.empty(n, dtype=torch.long)
    for row in range(n):
        j, rem = divmod(row, 2 * gran)
        s, r = divmod(rem, gran)
        src[row] = s * half + j * gran + r
    return t[:, src]


@pytest.mark.parametrize("preset,experts", PRESETS, ids=[p for p, _ in PRESETS])
def test_fp4_roundtrip_bitwise(preset, experts):
    g = get_geometry(preset)
    w = random_mxfp4_bytes(g, seed=21, num_experts=experts, scale_bytes=(100, 133))
    (l1, l1_sf), (l2, l2_sf) = to_deepgemm_sm90_fp4(w, check=False)  # every byte moves, legal or not
    h, i = g.hidden, g.intermediate
    assert (l1.shape, l1.dtype, l1_sf.shape, l1_sf.dtype) == ((experts, 2 * i, h // 2), torch.uint8, (experts, 2 * i, h // 128), torch.int32)
    assert (l2.shape, l2_sf.shape, l2_sf.dtype) == ((experts, h, i // 2), (experts, h, i // 128), torch.int32)
    assert_mxfp4_equal(from_deepgemm_sm90_fp4((l1, l1_sf), (l2, l2_sf)), w)


def test_fp4_layout_by_index():
    w = random_mxfp4_bytes(get_geometry("small"), seed=22, num_experts=2)
    (l1, l1_sf), (l2, l2_sf) = to_deepgemm_sm90_fp4(w)
    assert_bitwise_equal(l1, interleave_by_index(w.l1), "l1 interleave")
    assert_bitwise_equal(unpack_ue8m0_x4(l1_sf), interleave_by_index(w.l1_scale), "l1_sf")
    assert_bitwise_equal(l2, w.l2, "l2 keeps checkpoint nibble order")
    # little-endian: byte 0 of word j is group 4j
    assert int(l2_sf[1, 3, 1]) & 0xFF == int(w.l2_scale[1, 3, 4])
    assert (int(l2_sf[1, 3, 1]) >> 24) & 0xFF == int(w.l2_scale[1, 3, 7])


def test_fp4_refuses_out_of_range_and_global_scales():
    g = get_geometry("tiny")
    high = random_mxfp4_bytes(g, seed=23, num_experts=2, scale_bytes=(125, 140))
    with pytest.raises(ValueError, match=r"expert 0 l1: .*above byte 133.*no per-expert global scale"):
        to_deepgemm_sm90_fp4(high)
    low = random_mxfp4_bytes(g, seed=23, num_experts=2, scale_bytes=(110, 125))
    with pytest.raises(ValueError, match=r"expert 0 l1: .*below byte 119.*no per-expert global scale"):
        to_deepgemm_sm90_fp4(low)
    rebased = repair_ranges(random_mxfp4_weights(g, seed=24), "flashinfer-mxfp4")
    with pytest.raises(ValueError, match="fold it into the scale bytes first"):
        to_deepgemm_sm90_fp4(rebased)
    folded = repair_ranges(rebased, "deepgemm-sm90-fp4")  # folds the powers of two back
    assert folded.l1_global_scale is None
    to_deepgemm_sm90_fp4(folded)


def deepgemm_sm90_transform_from_source(l1_weights, l2_weights):
    """sgl-deep-gemm 0.1.5.post1 ``transform_weights_for_mega_moe_sm90``, restated: L1 data
    interleaved by 8 rows (into a fresh tensor), L1 scales and all of L2 passed through."""
    (l1, l1_sf) = l1_weights
    return (interleave_by_index(l1).contiguous(), l1_sf), l2_weights


def test_fp8_layout_equals_deepgemm_source_and_inverts():
    w = to_fp8_block(random_mxfp4_weights(get_geometry("small").with_(num_experts=4), seed=25))
    ours = to_deepgemm_sm90_fp8(w)
    theirs = deepgemm_sm90_transform_from_source((w.l1, w.l1_scale), (w.l2, w.l2_scale))
    for a, b, what in zip((*ours[0], *ours[1]), (*theirs[0], *theirs[1]), ("l1", "l1_sf", "l2", "l2_sf")):
        assert_bitwise_equal(a, b, what)
    back = from_deepgemm_sm90_fp8(*ours)
    for name in ("l1", "l1_scale", "l2", "l2_scale"):
        assert_bitwise_equal(getattr(back, name), getattr(w, name), name)
    # the scale is *not* interleaved: block row 0 is gate rows 0..127 only
    assert ours[0][1].shape == (4, 2 * 256 // 128, 512 // 128)


def test_to_fp8_block_is_the_documented_requantization():
    mx = random_mxfp4_weights(get_geometry("tiny"), seed=26)
    fp8 = to_fp8_block(mx)
    assert isinstance(fp8, FP8BlockWeights)
    for e in (0, 5):
        w1, w2 = mx.dequantize_expert(e)
        q1, s1 = quantize_fp8_block(w1)
        assert_bitwise_equal(fp8.l1[e], q1)
        assert_bitwise_equal(fp8.l1_scale[e], s1)
        d1, d2 = fp8.dequantize_expert(e)
        assert (d1 - w1).norm() / w1.norm() < 0.05  # lossy, but close
    with pytest.raises(TypeError, match="MXFP4Weights"):
        to_fp8_block(fp8)


def test_fp8_bad_inputs():
    w = to_fp8_block(random_mxfp4_weights(get_geometry("tiny").with_(num_experts=2), seed=27))
    (l1, l1_sf), l2 = to_deepgemm_sm90_fp8(w)
    with pytest.raises(TypeError, match="l1 must have dtype"):
        from_deepgemm_sm90_fp8((l1.float(), l1_sf), l2)
    with pytest.raises(ValueError, match="l1_scale must have shape"):
        from_deepgemm_sm90_fp8((l1, l1_sf[:, :1]), l2)
    with pytest.raises(TypeError, match="FP8BlockWeights"):
        to_deepgemm_sm90_fp8((l1, l1_sf))


def test_fp4_bad_inputs():
    w = random_mxfp4_bytes(get_geometry("tiny"), seed=28, num_experts=2)
    (l1, l1_sf), (l2, l2_sf) = to_deepgemm_sm90_fp4(w)
    with pytest.raises(TypeError, match="l1_sf must have dtype torch.int32"):
        from_deepgemm_sm90_fp4((l1, l1_sf.to(torch.int64)), (l2, l2_sf))
    with pytest.raises(ValueError, match=r"l2 must have shape \(2, 256, 64\)"):
        from_deepgemm_sm90_fp4((l1, l1_sf), (l2[:, :, :-1], l2_sf))


@pytest.mark.parametrize("preset,experts", PRESETS[:3], ids=[p for p, _ in PRESETS[:3]])
def test_sm100_roundtrip_and_utccp_order(preset, experts):
    w = random_mxfp4_bytes(get_geometry(preset), seed=29, num_experts=experts, scale_bytes=(0, 252))  # 253, 254 overflow float32 (exact decode)
    (l1, l1_sf), (l2, l2_sf) = to_deepgemm_sm100_fp4(w)
    assert_mxfp4_equal(from_deepgemm_sm100_fp4((l1, l1_sf), (l2, l2_sf)), w)
    # out row 128q + 4b + a = in row 128q + 32a + b
    packed = unpack_ue8m0_x4(l2_sf)
    for q, a, b in ((0, 1, 2), (1, 3, 31), (0, 0, 5)):
        assert_bitwise_equal(packed[:, 128 * q + 4 * b + a], w.l2_scale[:, 128 * q + 32 * a + b])


def _deep_gemm_sm90():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("needs a Hopper GPU")
    return pytest.importorskip("deep_gemm")


@pytest.mark.gpu
def test_fp8_layout_equals_real_deep_gemm():
    dg = _deep_gemm_sm90()
    w = to_fp8_block(random_mxfp4_weights(get_geometry("small"), seed=30)).to("cuda")
    ours = to_deepgemm_sm90_fp8(w)
    theirs = dg.transform_weights_for_mega_moe_sm90((w.l1, w.l1_scale), (w.l2, w.l2_scale))
    for a, b, what in zip((*ours[0], *ours[1]), (*theirs[0], *theirs[1]), ("l1", "l1_sf", "l2", "l2_sf")):
        assert_bitwise_equal(a, b, what)


@pytest.mark.gpu
def test_fp4_layout_equals_real_deep_gemm():
    """Our SM90 FP4 layout byte for byte against the package's own transform (DeepGEMM PR #323 build), on
    random codes and every scale byte 0..254 (the transform takes FP32 scales; byte 0 is the subnormal
    2**-127, whose exponent field is 0)."""
    from megamoe.formats import e8m0_to_float

    dg = _deep_gemm_sm90()
    if not hasattr(dg, "transform_weights_for_mega_moe_sm90_fp4"):
        pytest.skip(f"deep_gemm {getattr(dg, '__version__', '?')} has no SM90 FP4 transform (build DeepGEMM PR #323)")
    for preset, experts in (("small", 4), ("dsv4-flash", 2)):
        w = random_mxfp4_bytes(get_geometry(preset), seed=31, num_experts=experts, scale_bytes=(0, 254)).to("cuda")
        ours = to_deepgemm_sm90_fp4(w, check=False)
        theirs = dg.transform_weights_for_mega_moe_sm90_fp4((w.l1, e8m0_to_float(w.l1_scale)),
                                                            (w.l2, e8m0_to_float(w.l2_scale)))
        for a, b, what in zip((*ours[0], *ours[1]), (*theirs[0], *theirs[1]), ("l1", "l1_sf", "l2", "l2_sf")):
            assert_bitwise_equal(a.view(torch.uint8), b.view(torch.uint8), f"{preset} {what}")


def test_fp8_block_weights_for_kernel_rejects_nonfinite_and_wrong_types():
    from megamoe.layouts.deepgemm_sm90 import fp8_block_weights_for_kernel, to_fp8_block
    from megamoe.weights import random_mxfp4_weights

    w = to_fp8_block(random_mxfp4_weights(get_geometry("tiny"), seed=4))
    assert fp8_block_weights_for_kernel(w, "be") is w
    bad = dataclasses.replace(w, l2_scale=w.l2_scale.clone())
    bad.l2_scale[1, 0, 0] = float("inf")
    with pytest.raises(ValueError, match="be: FP8 block weights l2_scale contains NaN or Inf"):
        fp8_block_weights_for_kernel(bad, "be")
    with pytest.raises(TypeError, match="be: weights must be MXFP4Weights or FP8BlockWeights, got str"):
        fp8_block_weights_for_kernel("w", "be")

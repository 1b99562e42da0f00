"""DeepGEMM SM90 weight layouts: FP8 block (sgl-deep-gemm 0.1.5.post1) and FP4 (DeepGEMM PR #323).

FP8 (``deep_gemm.fp8_mega_moe``, recipe (128, 128, 128)):
    l1     e4m3 [E, 2I, H]            gate/up rows interleaved by 8 (``interleave_gate_up``)
    l1_sf  fp32 [E, 2I/128, H/128]    NOT interleaved: block row j still covers canonical rows
                                      [128j, 128j + 128) (gate for j < I/128, up after)
    l2     e4m3 [E, H, I],  l2_sf fp32 [E, H/128, I/128]   unchanged
    This is exactly what ``deep_gemm.transform_weights_for_mega_moe_sm90`` returns (read from its
    Python source; the GPU-marked test compares bytes with the real function).

FP4 (``fp8_fp4_mega_moe`` on SM90, DeepGEMM PR #323 at 8ddf7f9 / sgl-project PR #53; in no installable
package, so this layout is read from the pull request and docs/kernel-contract.md, unverified on hardware):
    l1     uint8 [E, 2I, H/2]         K-major, K[2i] low nibble (checkpoint order), rows interleaved by 8
    l1_sf  int32 [E, 2I, H/128]       UE8M0 bytes, groups 4j..4j+3 in bytes 0..3 (little-endian) of
                                      word j, rows interleaved with their weight rows
    l2     uint8 [E, H, I/2],  l2_sf int32 [E, H, I/128]   not interleaved
"""

from __future__ import annotations

import torch

from ..formats import MXFP4_BLOCK, pack_ue8m0_x4, quantize_fp8_block, unpack_ue8m0_x4
from ..validate import check_fp8_block_values, check_mxfp4_values
from ..weights import FP8BlockWeights, MXFP4Weights
from ._common import deinterleave_gate_up, expect_tensor, interleave_gate_up, require_no_global_scales

FP8_BLOCK = 128


# ------------------------------------------------------------------------------------ FP8
def to_fp8_block(weights: MXFP4Weights) -> FP8BlockWeights:
    """MXFP4 -> FP8 e4m3 + FP32 per 128x128 block. **Lossy**: the exact MXFP4 values (global scales
    folded in) are requantized with ``formats.quantize_fp8_block`` (amax / 448 per block), so groups
    much smaller than their block's amax lose bits or flush to zero. One expert at a time."""
    if not isinstance(weights, MXFP4Weights):
        raise TypeError(f"weights must be MXFP4Weights, got {type(weights).__name__}")
    for name, n in (("hidden", weights.hidden), ("intermediate", weights.intermediate)):
        if n % FP8_BLOCK:
            raise ValueError(f"{name} must be a multiple of {FP8_BLOCK} for 128x128 FP8 blocks, got {n}")
    from ..recipe import EXACT
    from .ranges import check_ranges

    check_ranges(weights, EXACT)  # the values requantized must be the exact ones (no 0xFF, no float32 overflow)
    parts = []
    for e in range(weights.num_experts):
        w1, w2 = weights.dequantize_expert(e)
        parts.append((*quantize_fp8_block(w1), *quantize_fp8_block(w2)))
    return FP8BlockWeights(*(torch.stack([p[j] for p in parts]) for j in range(4)))


def to_deepgemm_sm90_fp8(
    w: FP8BlockWeights,
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """FP8BlockWeights -> ((l1 e4m3 [E, 2I, H] interleaved, l1_sf fp32 [E, 2I/128, H/128]), (l2, l2_sf))."""
    if not isinstance(w, FP8BlockWeights):
        raise TypeError(f"w must be FP8BlockWeights, got {type(w).__name__}")
    return (interleave_gate_up(w.l1), w.l1_scale.contiguous()), (w.l2.contiguous(), w.l2_scale.contiguous())


def from_deepgemm_sm90_fp8(
    l1_weights: tuple[torch.Tensor, torch.Tensor], l2_weights: tuple[torch.Tensor, torch.Tensor]
) -> FP8BlockWeights:
    """Inverse of ``to_deepgemm_sm90_fp8``, bitwise (shapes and dtypes checked by FP8BlockWeights)."""
    (l1, l1_sf), (l2, l2_sf) = l1_weights, l2_weights
    expect_tensor("l1", l1, dtype=torch.float8_e4m3fn)
    if l1.ndim != 3:
        raise ValueError(f"l1 must be 3-D [E, 2I, H], got shape {tuple(l1.shape)}")
    return FP8BlockWeights(deinterleave_gate_up(l1), l1_sf, l2, l2_sf)


# ------------------------------------------------------------------------------------ FP4
def _check_fp4_dims(weights: MXFP4Weights) -> None:
    for name, n in (("hidden", weights.hidden), ("intermediate", weights.intermediate)):
        if n % (4 * MXFP4_BLOCK):
            raise ValueError(f"{name} must be a multiple of 128 (four 32-groups per int32 scale word), got {n}")


def to_deepgemm_sm90_fp4(
    weights: MXFP4Weights, *, check: bool = True
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """MXFP4Weights -> ((l1 uint8 [E, 2I, H/2], l1_sf int32 [E, 2I, H/128]), (l2 uint8 [E, H, I/2], l2_sf int32 [E, H, I/128])).

    Layout read from DeepGEMM PR #323 (not installable anywhere; unverified on hardware).
    This kernel has no global scales: power-of-two ones must be folded first
    (``ranges.fold_global_scales``). ``check`` raises when a nonzero group's byte is outside 119..133
    (2**-8 .. 2**6), where its decode table is not exact (``ranges.check_ranges``: the message counts
    the weights that would change). ``check=False`` lets such bytes through (a lossy decode the caller
    chose); byte 0xFF (NaN) is refused either way.
    """
    from ..recipe import DEEPGEMM_SM90_FP4
    from .ranges import check_ranges

    if not isinstance(weights, MXFP4Weights):
        raise TypeError(f"weights must be MXFP4Weights, got {type(weights).__name__}")
    _check_fp4_dims(weights)
    require_no_global_scales(weights, "DeepGEMM SM90 FP4")
    check_mxfp4_values(weights, "to_deepgemm_sm90_fp4")
    if check:
        check_ranges(weights, DEEPGEMM_SM90_FP4)
    l1 = interleave_gate_up(weights.l1)
    l1_sf = pack_ue8m0_x4(interleave_gate_up(weights.l1_scale))
    return (l1, l1_sf), (weights.l2.contiguous(), pack_ue8m0_x4(weights.l2_scale))


def check_fp4_ue8m0_x4(l1, l1_sf, l2, l2_sf) -> None:
    """Shapes of a DeepGEMM FP4 weight set (SM90 and SM100): l1 uint8 [E, 2I, H/2], l1_sf int32
    [E, 2I, H/128], l2 uint8 [E, H, I/2], l2_sf int32 [E, H, I/128], all on l1's device."""
    expect_tensor("l1", l1, dtype=torch.uint8)
    if l1.ndim != 3:
        raise ValueError(f"l1 must be 3-D [E, 2I, H/2], got shape {tuple(l1.shape)}")
    e, two_i, half_h = l1.shape
    h, i = 2 * half_h, two_i // 2
    expect_tensor("l1_sf", l1_sf, shape=(e, two_i, h // 128), dtype=torch.int32, device=l1.device)
    expect_tensor("l2", l2, shape=(e, h, i // 2), dtype=torch.uint8, device=l1.device)
    expect_tensor("l2_sf", l2_sf, shape=(e, h, i // 128), dtype=torch.int32, device=l1.device)


def from_deepgemm_sm90_fp4(
    l1_weights: tuple[torch.Tensor, torch.Tensor], l2_weights: tuple[torch.Tensor, torch.Tensor]
) -> MXFP4Weights:
    """Inverse of ``to_deepgemm_sm90_fp4``, bitwise."""
    (l1, l1_sf), (l2, l2_sf) = l1_weights, l2_weights
    check_fp4_ue8m0_x4(l1, l1_sf, l2, l2_sf)
    return MXFP4Weights(
        deinterleave_gate_up(l1), deinterleave_gate_up(unpack_ue8m0_x4(l1_sf)), l2.contiguous(), unpack_ue8m0_x4(l2_sf)
    )


def fp8_block_weights_for_kernel(weights, who: str):
    """What a DeepGEMM FP8 backend's ``prepare`` takes: MXFP4Weights (converted, lossy, by to_fp8_block) or
    FP8BlockWeights. NaN / Inf values and block scales that are not > 0 raise before anything reaches a
    kernel (the GEMMs would spread NaN through every output row of the expert, and a scale <= 0 zeroes or
    flips a whole 128 x 128 block, silently)."""
    if isinstance(weights, MXFP4Weights):
        weights = to_fp8_block(weights)
    if not isinstance(weights, FP8BlockWeights):
        raise TypeError(f"{who}: weights must be MXFP4Weights or FP8BlockWeights, got {type(weights).__name__}")
    check_fp8_block_values(weights, who)  # again: the tensors may have been changed in place since construction
    return weights

"""DeepGEMM SM100 (Blackwell) FP4 weight layout for ``deep_gemm.fp8_fp4_mega_moe``, with its inverse.

Read from ``deep_gemm/mega/__init__.py`` of sgl-deep-gemm 0.1.5.post1 (``transform_weights_for_mega_moe``);
never run: there is no SM100 card here. Logical values (contiguous tensors):

    l1     uint8 [E, 2I, H/2]     K[2i] low nibble, rows gate/up interleaved by 8
    l1_sf  int32 [E, 2I, H/128]   UE8M0 packed 4 per int32 (as SM90 FP4), rows interleaved by 8, then
                                  within each 128-row block row 32*a + b moves to 4*b + a (UTCCP order)
    l2     uint8 [E, H, I/2],  l2_sf int32 [E, H, I/128]  with the same UTCCP row order, no interleave

Not modelled: DeepGEMM first passes the scales through ``transform_sf_into_required_layout`` (compiled,
in _C.so), which may store them MN-major; ``transform_weights_for_mega_moe`` keeps those strides
(``empty_like``). The values above are what each (expert, row, word) index holds either way.
"""

from __future__ import annotations

import torch

from ..formats import pack_ue8m0_x4, unpack_ue8m0_x4
from ..weights import MXFP4Weights
from .deepgemm_sm90 import check_fp4_ue8m0_x4
from ._common import deinterleave_gate_up, expect_tensor, interleave_gate_up, require_no_global_scales

UTCCP_ROWS = 128


def utccp_rows(sf: torch.Tensor) -> torch.Tensor:
    """int32 [E, N, W] -> same shape; out[e, 128q + 4b + a] = sf[e, 128q + 32a + b] (a < 4, b < 32)."""
    e, n, w = sf.shape
    if n % UTCCP_ROWS:
        raise ValueError(f"scale rows must be a multiple of {UTCCP_ROWS}, got {n}")
    return sf.reshape(e, n // UTCCP_ROWS, 4, 32, w).transpose(2, 3).reshape(e, n, w).contiguous()


def utccp_rows_inverse(sf: torch.Tensor) -> torch.Tensor:
    e, n, w = sf.shape
    if n % UTCCP_ROWS:
        raise ValueError(f"scale rows must be a multiple of {UTCCP_ROWS}, got {n}")
    return sf.reshape(e, n // UTCCP_ROWS, 32, 4, w).transpose(2, 3).reshape(e, n, w).contiguous()


def to_deepgemm_sm100_fp4(weights: MXFP4Weights):
    """MXFP4Weights -> ((l1, l1_sf), (l2, l2_sf)) in the SM100 layout above. SM100 decodes MXFP4 in
    hardware (recipe ``deepgemm-sm100-fp4``, the exact decode): bytes 0..252 are exact, 0xFF (NaN) and the
    float32 overflows of 253 / 254 on nonzero groups are refused (``ranges.check_ranges``)."""
    from ..recipe import DEEPGEMM_SM100_FP4
    from .ranges import check_ranges

    if not isinstance(weights, MXFP4Weights):
        raise TypeError(f"weights must be MXFP4Weights, got {type(weights).__name__}")
    for name, n in (("hidden", weights.hidden), ("intermediate", weights.intermediate)):
        if n % 128:
            raise ValueError(f"{name} must be a multiple of 128, got {n}")
    require_no_global_scales(weights, "DeepGEMM SM100 FP4")
    check_ranges(weights, DEEPGEMM_SM100_FP4)
    l1_sf = utccp_rows(pack_ue8m0_x4(interleave_gate_up(weights.l1_scale)))
    l2_sf = utccp_rows(pack_ue8m0_x4(weights.l2_scale))
    return (interleave_gate_up(weights.l1), l1_sf), (weights.l2.contiguous(), l2_sf)


def from_deepgemm_sm100_fp4(l1_weights, l2_weights) -> MXFP4Weights:
    """Inverse of ``to_deepgemm_sm100_fp4``, bitwise."""
    (l1, l1_sf), (l2, l2_sf) = l1_weights, l2_weights
    check_fp4_ue8m0_x4(l1, l1_sf, l2, l2_sf)
    s1 = deinterleave_gate_up(unpack_ue8m0_x4(utccp_rows_inverse(l1_sf)))
    return MXFP4Weights(deinterleave_gate_up(l1), s1, l2.contiguous(), unpack_ue8m0_x4(utccp_rows_inverse(l2_sf)))

"""The unfused peer: DeepGEMM contiguous grouped FP8 GEMMs with the library's own dispatch,
SwiGLU + FP8 requant and combine in PyTorch (what a framework runs without a fused kernel).

    stage    per_token_cast_to_fp8 (megamoe.layouts.staging)
    dispatch megamoe.reference.dispatch.build_layout / dispatch, segments aligned to
             deep_gemm.get_mk_alignment_for_contiguous_layout(), padding rows expert -1
    L1       deep_gemm.m_grouped_fp8_gemm_nt_contiguous -> bf16 [P, 2I]   (gate | up, not interleaved)
    SwiGLU   clamp, silu(g) * u * topk_weight in FP32, then per_token_cast_to_fp8 per 128 (continuous)
    L2       deep_gemm.m_grouped_fp8_gemm_nt_contiguous -> bf16 [P, H]
    combine  megamoe.reference.pipeline.combine (FP32 slot-ordered sum, one bf16 rounding)

Its numerics are ``DEEPGEMM_STAGED_FP8``: the L1 output is rounded to bf16 by the GEMM before the
SwiGLU, and the L2 activation scale is DeepGEMM's staging rule (amax floored at 1e-4, continuous).
``launch`` syncs the host (the glue sizes its pool from the routing): time it as a whole.
"""

from __future__ import annotations

import importlib

import torch

from ..layouts.staging import per_token_cast_to_fp8
from ..recipe import DEEPGEMM_SM90_FP8
from ..reference.dispatch import build_layout, dispatch_slot_values, undispatch
from ..reference.pipeline import combine
from ..testing import MoEInputs
from ..weights import FP8BlockWeights, MXFP4Weights
from .base import FusedBackend, Plan, kernel_availability

DEEPGEMM_STAGED_FP8 = DEEPGEMM_SM90_FP8.with_(
    name="deepgemm-staged-fp8",
    kernel="deep_gemm.m_grouped_fp8_gemm_nt_contiguous x2 + torch glue (sgl-deep-gemm 0.1.5.post1)",
    gate_up_bf16=True,
    l2_group=128,
    l2_scale="continuous",
    l2_amax_floor=1e-4,
)


class StagedDeepGEMM(FusedBackend):
    name = "deepgemm-staged-fp8"
    recipe = DEEPGEMM_STAGED_FP8
    weight_format = "fp8_block"
    persistent = False
    fused = False
    kernel = DEEPGEMM_STAGED_FP8.kernel
    allows_zero_tokens = True

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        return kernel_availability(
            lambda: importlib.import_module("deep_gemm"), "deep_gemm",
            ("m_grouped_fp8_gemm_nt_contiguous", "get_mk_alignment_for_contiguous_layout"))

    def legal_block_ms(self, num_tokens: int | None = None) -> tuple[int, ...]:
        return ()

    def _prepare(self, weights) -> None:
        import deep_gemm as dg

        from ..layouts.deepgemm_sm90 import to_fp8_block

        if isinstance(weights, MXFP4Weights):
            weights = to_fp8_block(weights)
        if not isinstance(weights, FP8BlockWeights):
            raise TypeError(f"{self.name}: weights must be MXFP4Weights or FP8BlockWeights, got {type(weights).__name__}")
        self.kernel_weights = weights
        self._dg = dg
        self.align = int(dg.get_mk_alignment_for_contiguous_layout())

    def _allocate(self) -> None:
        pass  # no symmetric buffer: one rank, plain tensors

    def plan(self, num_tokens: int) -> Plan:
        return Plan(block_m=getattr(self, "align", 0), detail={"source": "contiguous-layout M alignment"})

    def _stage(self, inputs: MoEInputs, m: int) -> None:
        t = inputs.num_tokens
        q, sf = per_token_cast_to_fp8(inputs.x) if t else (inputs.x.to(torch.float8_e4m3fn), inputs.x.new_zeros(0, self.g.hidden // 128, dtype=torch.float32))
        idx = inputs.topk_idx
        if m > t:
            pad = m - t
            q = torch.cat([q, q.new_zeros(pad, q.shape[1])])
            sf = torch.cat([sf, sf.new_zeros(pad, sf.shape[1])])
            idx = torch.cat([idx, idx.new_full((pad, idx.shape[1]), -1)])
        w = inputs.topk_weights if m == t else torch.cat([inputs.topk_weights, inputs.topk_weights.new_zeros(m - t, idx.shape[1])])
        self._staged_inputs = (q, sf, idx, w)

    def launch(self, num_tokens: int) -> torch.Tensor:
        dg, g, wts = self._dg, self.g, self.kernel_weights
        q, sf, idx, w = self._staged_inputs
        lay = build_layout([idx], 0, g.num_experts, self.align)
        p = lay.num_pool_rows
        if p == 0:
            return torch.zeros(num_tokens, g.hidden, dtype=torch.bfloat16, device=self.device)
        pool_x = _gather_rows(q, lay)
        pool_sf = _gather_rows(sf, lay)
        pool_w = dispatch_slot_values([w], lay).nan_to_num(0.0)
        m_idx = _row_experts(lay)
        h = torch.empty(p, 2 * g.intermediate, dtype=torch.bfloat16, device=self.device)
        dg.m_grouped_fp8_gemm_nt_contiguous((pool_x, pool_sf), (wts.l1, wts.l1_scale), h, m_idx)
        i = g.intermediate
        gt = h[:, :i].float().clamp(max=g.clamp)
        up = h[:, i:].float().clamp(min=-g.clamp, max=g.clamp)
        vw = gt * (1.0 / (1.0 + torch.exp(-gt))) * up * pool_w.unsqueeze(1)
        q2, sf2 = per_token_cast_to_fp8(vw)
        out = torch.empty(p, g.hidden, dtype=torch.bfloat16, device=self.device)
        dg.m_grouped_fp8_gemm_nt_contiguous((q2, sf2), (wts.l2, wts.l2_scale), out, m_idx)
        slots, filled = undispatch([out], [lay], 0, int(num_tokens), g.num_topk)
        return combine(slots, filled, self.recipe)


def _gather_rows(v: torch.Tensor, lay) -> torch.Tensor:
    """values [T, ...] -> pool [P, ...], zeros on padding rows (DeepGEMM reads them, never writes back)."""
    out = torch.zeros((lay.num_pool_rows, *v.shape[1:]), dtype=v.dtype, device=v.device) if v.dtype != torch.float8_e4m3fn else \
        torch.zeros((lay.num_pool_rows, *v.shape[1:]), dtype=torch.uint8, device=v.device).view(torch.float8_e4m3fn)
    real = lay.is_real
    out[real] = v[lay.src_token[real]]
    return out


def _row_experts(lay) -> torch.Tensor:
    """int32 [P]: the expert of each pool row, -1 on padding (DeepGEMM's contiguous grouped layout)."""
    rows = torch.arange(lay.num_pool_rows, device=lay.src_token.device)
    e = torch.searchsorted(lay.padded_offsets[1:], rows, right=True)
    return torch.where(lay.is_real, e, torch.full_like(e, -1)).to(torch.int32)

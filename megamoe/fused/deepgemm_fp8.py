"""sgl-deep-gemm 0.1.5.post1 ``fp8_mega_moe``: FP8 activations x FP8 (128x128 block) experts, SM90.

Weights: FP8BlockWeights (from MXFP4 through ``megamoe.layouts.deepgemm_sm90.to_fp8_block``, lossy,
or given directly), then ``to_deepgemm_sm90_fp8`` (= ``deep_gemm.transform_weights_for_mega_moe_sm90``:
L1 rows gate/up interleaved by 8, scales untouched).

Plans: the package chooses BLOCK_M (a multiple of 64) and its other template parameters in C++
(``heuristics/sm90_mega_moe.hpp``) from the local token count, with no Python override; the plan is
reported as chosen by the package and ``legal_block_ms`` is empty (nothing can be forced). Every
configuration is a JIT build on first use.

Intermediates: ``SM90SymmBuffer`` exposes ``l1_acts`` (the dispatched pool, e4m3 [P, H]), ``l1_acts_sf``,
``l2_acts`` (the L2 input, e4m3 [P, I]) and ``l2_acts_sf`` (fp32, one per 64 channels).
"""

from __future__ import annotations

import torch

from ..layouts.staging import per_token_cast_to_fp8
from ..recipe import DEEPGEMM_SM90_FP8
from ..testing import MoEInputs
from ..weights import FP8BlockWeights, MXFP4Weights
from .base import FusedBackend, Plan, kernel_availability


def _import():
    import deep_gemm

    return deep_gemm


class DeepGEMMFP8(FusedBackend):
    name = "deepgemm-sm90-fp8"
    recipe = DEEPGEMM_SM90_FP8
    weight_format = "fp8_block"
    kernel = "deep_gemm.fp8_mega_moe (sgl-deep-gemm 0.1.5.post1)"

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        return kernel_availability(
            _import, "deep_gemm", ("fp8_mega_moe", "get_symm_buffer_for_sm90_mega_moe", "transform_weights_for_mega_moe_sm90"))

    def legal_block_ms(self, num_tokens: int | None = None) -> tuple[int, ...]:
        return ()  # chosen in C++, not forceable in 0.1.5.post1

    def _prepare(self, weights) -> None:
        from ..layouts.deepgemm_sm90 import to_deepgemm_sm90_fp8, to_fp8_block

        if isinstance(weights, MXFP4Weights):
            weights = to_fp8_block(weights)
        if not isinstance(weights, FP8BlockWeights):
            raise TypeError(f"{self.name}: weights must be MXFP4Weights or FP8BlockWeights, got {type(weights).__name__}")
        if not all(torch.isfinite(t.float()).all() for t in weights.tensors()):
            raise ValueError(f"{self.name}: FP8 block weights contain NaN or Inf")
        self.kernel_weights = weights
        (l1, l1_sf), (l2, l2_sf) = to_deepgemm_sm90_fp8(weights)
        self.l1 = (l1.contiguous(), l1_sf.contiguous())
        self.l2 = (l2.contiguous(), l2_sf.contiguous())

    def _allocate(self) -> None:
        dg = _import()
        g = self.g
        self.buf = dg.get_symm_buffer_for_sm90_mega_moe(self.group, g.num_experts, self.capacity, g.num_topk,
                                                        g.hidden, g.intermediate)
        self.y = torch.empty(self.buf.num_max_tokens_per_rank, g.hidden, dtype=torch.bfloat16, device=self.device)

    def plan(self, num_tokens: int) -> Plan:
        return Plan(block_m=0, forced=False, detail={"source": "deep_gemm C++ heuristic (not exposed)"})

    def _build_job(self, num_tokens: int):
        # A launch builds its configuration on first use; warm it with staged padding rows.
        def warm():
            self._stage_padding(num_tokens)
            self.launch(num_tokens)
            torch.cuda.synchronize()

        return ("dg", num_tokens), warm

    def build(self, token_counts, max_workers: int = 1) -> int:
        return super().build(token_counts, max_workers=1)  # launches: one at a time

    def _stage_padding(self, m: int) -> None:
        b = self.buf
        b.x[:m].view(torch.uint8).zero_()
        b.x_sf[:m].fill_(1.0)
        b.topk_idx[:m].fill_(-1)
        b.topk_weights[:m].zero_()

    def _stage(self, inputs: MoEInputs, m: int) -> None:
        b, t = self.buf, inputs.num_tokens
        if t:
            q, sf = per_token_cast_to_fp8(inputs.x)
            b.x[:t].copy_(q)
            b.x_sf[:t].copy_(sf)
            b.topk_idx[:t].copy_(inputs.topk_idx)
            b.topk_weights[:t].copy_(inputs.topk_weights)
        if m > t:
            b.x[t:m].view(torch.uint8).zero_()
            b.x_sf[t:m].fill_(1.0)
            b.topk_idx[t:m].fill_(-1)
            b.topk_weights[t:m].zero_()

    allows_zero_tokens = True

    def launch(self, num_tokens: int) -> torch.Tensor:
        dg = _import()
        y = self.y[: int(num_tokens)]
        dg.fp8_mega_moe(y, self.l1, self.l2, self.buf, recipe=(128, 128, 128), activation="swiglu",
                        activation_clamp=float(self.g.clamp), fast_math=True)
        return y

    def poison_intermediates(self) -> None:
        b = self.buf
        for t in (b.l1_acts, b.l2_acts):
            t.view(torch.uint8).fill_(0x7F)
        for t in (b.l1_acts_sf, b.l2_acts_sf):
            if t.dtype.is_floating_point:
                t.fill_(float("nan"))
            else:
                t.view(torch.uint8).fill_(0x7F)
        self.y.fill_(float("nan"))

    def intermediates(self) -> dict:
        b = self.buf
        return {"pool_x": b.l1_acts.clone(), "l2_in": b.l2_acts.clone(), "l2_in_sf_raw": b.l2_acts_sf.clone(),
                "l2_group": 64, "block_m": None}

    def destroy(self) -> None:
        buf = getattr(self, "buf", None)
        if buf is not None:
            buf.destroy()

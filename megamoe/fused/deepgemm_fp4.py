"""DeepGEMM SM90 FP8 x FP4 ``fp8_fp4_mega_moe`` (DeepGEMM PR #323 / sgl-project PR #53).

No installable package ships it: sgl-deep-gemm 0.1.5.post1 has ``fp8_fp4_mega_moe`` for SM100 only and
no ``transform_weights_for_mega_moe_sm90_fp4``. This backend detects the SM90 entry points at run time
and reports itself unavailable, with the reason, until a ``deep_gemm`` that has them is installed.
The code path below follows the pull request's Python API and is unverified on hardware.
"""

from __future__ import annotations

import torch

from ..recipe import DEEPGEMM_SM90_FP4
from .base import FusedBackend, Plan, cuda_hopper_reason
from .deepgemm_fp8 import DeepGEMMFP8

SM90_FP4_ENTRY_POINTS = ("fp8_fp4_mega_moe", "transform_weights_for_mega_moe_sm90_fp4")


def sm90_fp4_missing(dg) -> list[str]:
    """Names of the SM90 FP8 x FP4 entry points the given deep_gemm module lacks."""
    return [a for a in SM90_FP4_ENTRY_POINTS if not hasattr(dg, a)]


class DeepGEMMFP4(FusedBackend):
    name = "deepgemm-sm90-fp4"
    recipe = DEEPGEMM_SM90_FP4
    weight_format = "mxfp4"
    kernel = "deep_gemm.fp8_fp4_mega_moe on SM90 (DeepGEMM PR #323)"
    kernel_module = "deep_gemm"

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        try:
            import deep_gemm as dg
        except Exception as exc:  # noqa: BLE001
            return False, f"package missing: deep_gemm not importable ({type(exc).__name__}: {exc})"
        missing = sm90_fp4_missing(dg)
        if missing:
            return False, (
                f"kernel missing: deep_gemm {getattr(dg, '__version__', '?')} lacks {', '.join(missing)} "
                "(SM90 FP8 x FP4 Mega MoE is DeepGEMM PR #323, in no installable package)"
            )
        why = cuda_hopper_reason()
        if why:
            return False, why
        return True, ""

    def legal_block_ms(self, num_tokens: int | None = None) -> tuple[int, ...]:
        return ()

    def _prepare(self, weights) -> None:
        import deep_gemm as dg

        from ..layouts.deepgemm_sm90 import to_deepgemm_sm90_fp4
        from ..layouts.ranges import repair_ranges

        self.kernel_weights = repair_ranges(weights, self.recipe)
        (l1, l1_sf), (l2, l2_sf) = to_deepgemm_sm90_fp4(self.kernel_weights)
        self.l1, self.l2 = (l1, l1_sf), (l2, l2_sf)
        self._dg = dg

    def _allocate(self) -> None:
        g = self.g
        self.buf = self._dg.get_symm_buffer_for_sm90_mega_moe(self.group, g.num_experts, self.capacity, g.num_topk,
                                                              g.hidden, g.intermediate)
        self.y = torch.empty(self.buf.num_max_tokens_per_rank, g.hidden, dtype=torch.bfloat16, device=self.device)

    def plan(self, num_tokens: int) -> Plan:
        return Plan(block_m=0, detail={"source": "deep_gemm C++ heuristic (not exposed)"})

    allows_zero_tokens = True

    def launch(self, num_tokens: int) -> torch.Tensor:
        y = self.y[: int(num_tokens)]
        self._dg.fp8_fp4_mega_moe(y, self.l1, self.l2, self.buf, activation_clamp=float(self.g.clamp), fast_math=True)
        return y

    intermediates = DeepGEMMFP8.intermediates
    poison_intermediates = DeepGEMMFP8.poison_intermediates

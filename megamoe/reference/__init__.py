"""Eager PyTorch reference of the Mega MoE layer, one module per stage (see pipeline.py)."""

from .dispatch import DispatchLayout, build_layout, dispatch, dispatch_slot_values, undispatch, validate_topk
from .gemm import exact_gemm, promoted_gemm
from .pipeline import MoEResult, RankStages, combine, decode_expert, decode_experts, expert_forward, experts_forward, moe_forward, moe_forward_ep, stage_activations
from .block import DeepSeekV4MoEParams, moe_block_fused, moe_block_reference, random_block_params
from .routing import expert_histogram, route
from .swiglu import requant_fp8, swiglu

__all__ = [
    "DispatchLayout", "build_layout", "dispatch", "dispatch_slot_values", "undispatch", "validate_topk",
    "exact_gemm", "promoted_gemm", "MoEResult", "RankStages", "combine", "decode_expert", "decode_experts", "expert_forward", "experts_forward",
    "moe_forward", "moe_forward_ep", "DeepSeekV4MoEParams", "moe_block_fused", "moe_block_reference",
    "random_block_params", "stage_activations", "expert_histogram", "route", "requant_fp8", "swiglu",
]

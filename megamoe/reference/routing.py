"""Routing: router logits -> (topk_idx int64 [T, K], topk_weights fp32 [T, K]).

DeepSeek-V4 style (``score_func="sqrtsoftplus"``):
    scores   = sqrt(softplus(logits))                     # [T, E], FP32
    selected = topk(scores + bias, K)                     # the noaux_tc bias steers selection only
    w        = scores[selected]; w /= w.sum() if norm_topk_prob
    w       *= routed_scaling                             # once, here; never again in staging
Plain softmax top-k (``score_func="softmax"``) is the Mixtral/Qwen rule.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..geometry import Geometry
from ..validate import check_finite, check_output, expect_tensor


def _check_logits(logits: torch.Tensor, num_experts: int) -> None:
    expect_tensor("router logits", logits, who="route")
    if logits.ndim != 2 or logits.shape[1] != num_experts:
        raise ValueError(f"router logits must be [T, {num_experts}], got {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise TypeError(f"router logits must be floating, got {logits.dtype}")
    check_finite("router logits", logits, "route", "[token, expert]")


def route(logits: torch.Tensor, g: Geometry, bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Route by the geometry's rule. logits [T, E] -> (topk_idx int64 [T, K], topk_weights fp32 [T, K])."""
    _check_logits(logits, g.num_experts)
    logits = logits.float()
    if g.score_func == "softmax":
        scores = logits.softmax(dim=-1)
    else:
        scores = F.softplus(logits).sqrt()
    if bias is not None:
        expect_tensor("bias", bias, who="route")
        if bias.shape != (g.num_experts,):
            raise ValueError(f"bias must be [{g.num_experts}], got {tuple(bias.shape)}")
        if not bias.is_floating_point() or bias.device != logits.device:
            raise TypeError(f"route: bias must be a floating tensor on {logits.device}, got {bias.dtype} on {bias.device}")
        # A NaN bias would win every top-k comparison and route every token to that expert.
        check_finite("bias", bias, "route", "[expert]")
        select_on = scores + bias.float()
    else:
        select_on = scores
    # Ties broken by the lower expert index, so the result does not depend on the device's topk.
    order = torch.argsort(select_on, dim=-1, descending=True, stable=True)
    idx = order[:, : g.num_topk]
    w = scores.gather(1, idx)
    if g.norm_topk_prob:
        w = w / w.sum(dim=-1, keepdim=True)
    w = w * g.routed_scaling
    check_output("topk_weights", w, "route", "the selected scores sum to 0 in float32 (softplus or softmax "
                 "underflowed: logits far below zero), so normalizing divides 0 by 0")
    return idx.to(torch.int64), w.to(torch.float32)


def expert_histogram(topk_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Tokens routed to each expert (masked slots, -1, ignored): int64 [E]."""
    valid = topk_idx[topk_idx >= 0]
    return torch.bincount(valid, minlength=num_experts)

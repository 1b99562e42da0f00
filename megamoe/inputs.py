"""One rank's step of the MoE layer as every layer passes it, and the generators of fresh random steps.

    MoEInputs(x, topk_idx, topk_weights)   x bf16 [T, H], topk_idx int64 [T, K] (-1 = masked), weights fp32 [T, K]
    make_routing(T, E, K, gen=...)         random distinct top-k experts and positive weights
    make_inputs(g, T, seed=...)            a fresh random step at geometry g
    pad_inputs(inputs, T_pad)              the step extended to T_pad rows routed to -1 (data-parallel padding)
    ragged_counts(mean, ranks)             per-rank token counts of a ragged data-parallel step around ``mean``
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .geometry import Geometry


@dataclass
class MoEInputs:
    """One rank's step: x bf16 [T, H], topk_idx int64 [T, K] (-1 = masked), topk_weights fp32 [T, K]."""

    x: torch.Tensor
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor

    def __post_init__(self) -> None:
        from .validate import check_step_structure

        check_step_structure(self.x, self.topk_idx, self.topk_weights)

    @property
    def num_tokens(self) -> int:
        return self.x.shape[0]

    def to(self, device) -> "MoEInputs":
        return MoEInputs(self.x.to(device), self.topk_idx.to(device), self.topk_weights.to(device))

    def clone(self) -> "MoEInputs":
        return MoEInputs(self.x.clone(), self.topk_idx.clone(), self.topk_weights.clone())

    def select(self, tokens: torch.Tensor) -> "MoEInputs":
        """The step of the tokens ``tokens`` (int64 indices, on this step's device) alone, in that order."""
        return MoEInputs(self.x[tokens], self.topk_idx[tokens], self.topk_weights[tokens])


def make_routing(
    num_tokens: int,
    num_experts: int,
    num_topk: int,
    *,
    gen: torch.Generator,
    mask_prob: float = 0.0,
    skew: float = 0.0,
    empty_experts: tuple[int, ...] = (),
    fully_masked_tokens: tuple[int, ...] = (),
    expert_range: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random distinct top-k experts per token and positive weights (CPU tensors).

    skew > 0 draws experts from a Zipf-like law p(e) ~ 1/(e+1)**skew (hot experts);
    empty_experts never receive a token; mask_prob masks slots with -1;
    fully_masked_tokens get -1 in every slot (their output row must be zero).
    expert_range restricts routing to experts [lo, hi) (e.g. one EP rank's experts).
    """
    lo, hi = expert_range or (0, num_experts)
    logits = -skew * torch.log(torch.arange(num_experts, dtype=torch.float64) + 1.0)
    allowed = torch.full((num_experts,), False)
    allowed[lo:hi] = True
    if empty_experts:
        allowed[list(empty_experts)] = False
    if int(allowed.sum()) < num_topk:
        raise ValueError(f"only {int(allowed.sum())} experts may receive tokens but num_topk={num_topk}")
    probs = torch.where(allowed, logits.exp(), torch.zeros_like(logits))
    idx = torch.multinomial(probs.expand(max(num_tokens, 1), -1), num_topk, replacement=False, generator=gen)[:num_tokens]
    w = torch.rand(num_tokens, num_topk, generator=gen, dtype=torch.float32) + 0.05
    w = w / w.sum(dim=1, keepdim=True) * 1.5
    if mask_prob:
        masked = torch.rand(num_tokens, num_topk, generator=gen) < mask_prob
        idx = idx.masked_fill(masked, -1)
    if fully_masked_tokens:
        idx[list(fully_masked_tokens)] = -1
    return idx.to(torch.int64), w


def make_inputs(
    g: Geometry,
    num_tokens: int,
    *,
    seed: int,
    device="cpu",
    x_scale: float = 1.0,
    outlier_channels: int = 0,
    **routing,
) -> MoEInputs:
    """Fresh random inputs for one step. x ~ N(0, x_scale) in bf16, with optional outlier channels
    (x100) so that per-128 scales differ across groups, as in real activations."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, g.hidden, generator=gen) * x_scale
    if outlier_channels:
        ch = torch.randperm(g.hidden, generator=gen)[:outlier_channels]
        x[:, ch] *= 100
    idx, w = make_routing(num_tokens, g.num_experts, g.num_topk, gen=gen, **routing)
    return MoEInputs(x.to(torch.bfloat16), idx, w).to(device)


def pad_inputs(inputs: MoEInputs, num_tokens: int) -> MoEInputs:
    """inputs [T, ...] -> [num_tokens, ...]: rows T.. are x 0, topk_idx -1 (every slot masked), topk_weights 0
    (``megamoe.layouts.plans.pad_to_token_count``). Masked rows are never dispatched, so the first T output
    rows do not change and the padded rows' outputs are 0. Returns ``inputs`` itself when nothing is padded."""
    from .layouts.plans import pad_to_token_count

    if num_tokens < inputs.num_tokens:
        raise ValueError(f"pad_inputs: num_tokens must be >= the rank's {inputs.num_tokens} tokens, got {num_tokens}")
    if num_tokens == inputs.num_tokens:
        return inputs
    return MoEInputs(*pad_to_token_count(inputs.x, inputs.topk_idx, inputs.topk_weights, num_tokens))


def ragged_counts(mean: int, ranks: int = 4, cap: int | None = None) -> list[int]:
    """A ragged data-parallel step of ``ranks`` ranks around ``mean`` tokens per rank: 0.25x .. 1.75x the
    mean, evenly spaced ((0.25, 0.75, 1.25, 1.75) x mean for 4 ranks), each at least 1 and at most ``cap``."""
    if mean < 1 or ranks < 1:
        raise ValueError(f"ragged_counts: mean and ranks must be >= 1, got mean={mean}, ranks={ranks}")
    fr = [0.25 + 1.5 * r / max(1, ranks - 1) for r in range(ranks)] if ranks > 1 else [1.0]
    return [max(1, round(mean * f) if cap is None else min(cap, round(mean * f))) for f in fr]

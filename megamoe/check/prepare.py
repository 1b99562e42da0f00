"""The weights ``megamoe check`` runs on, made once for every token count, and what the whole check will cost.

    estimate_seconds(g, recipes, tokens, ranks, device) -> {"weights_s", "convert_s", "forward_s", "total_s"}
        measured on one expert of the geometry first: DeepSeek-V4-Flash's 256 random experts take ~15 min to
        make on a 2-core CPU and its FP8 conversion ~5 min more, so the CLI says so before it starts
    prepare_weights(g, recipes, seed, device, progress) -> CheckWeights
        random MXFP4 experts and, per recipe, what its kernel would be handed (``testing.weights_for_recipe``),
        converted ``CHUNK`` experts at a time so that the progress bar moves (every conversion is per expert)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields

import torch

from ..geometry import Geometry
from ..inputs import make_inputs
from ..testing import weights_for_recipe
from ..weights import random_mxfp4_weights

CHUNK = 8  # experts converted at a time


@dataclass
class CheckWeights:
    raw: object  # MXFP4Weights, all experts
    by_recipe: dict  # recipe name -> the weights its kernel is handed


def concat_experts(parts: list):
    """Weights of consecutive expert ranges -> one weights object over all of them (same type)."""
    first = parts[0]
    return type(first)(**{f.name: None if getattr(first, f.name) is None else torch.cat([getattr(p, f.name) for p in parts])
                          for f in fields(first)})


def convert(raw, recipe: str, progress=None):
    """``weights_for_recipe`` over ``CHUNK`` experts at a time (``progress(n)`` after each chunk of n)."""
    parts = []
    for lo in range(0, raw.num_experts, CHUNK):
        hi = min(lo + CHUNK, raw.num_experts)
        try:
            parts.append(weights_for_recipe(raw.experts(lo, hi), recipe))
        except ValueError as exc:
            raise ValueError(f"{recipe}: experts {lo}..{hi - 1}: {exc}") from exc
        if progress is not None:
            progress(hi - lo)
    return concat_experts(parts)


def prepare_weights(g: Geometry, recipes, seed: int, device="cpu", progress=None) -> CheckWeights:
    """``progress(phase, experts_done)``: after each expert made and each chunk converted."""
    tick = (lambda phase: (lambda n=1: progress(phase, n))) if progress else (lambda phase: None)
    raw = random_mxfp4_weights(g, seed=seed, device=device, progress=(lambda e: tick("weights")()) if progress else None)
    return CheckWeights(raw, {r: convert(raw, r, tick(f"convert {r}")) for r in recipes})


def touched_experts(g: Geometry, tokens: int, ranks: int) -> int:
    return min(g.num_experts, tokens * ranks * g.num_topk)


def _one_expert_costs(g: Geometry, recipes, experts: int, device) -> tuple[float, dict, dict]:
    """(seconds to make the experts, {recipe: seconds to convert them}, {recipe: seconds of a one-token forward})
    at ``g`` with ``experts`` experts, each touched (top-k = experts)."""
    from ..reference.pipeline import moe_forward

    small = g.with_(num_experts=experts, num_topk=experts)
    t0 = time.perf_counter()
    w = random_mxfp4_weights(small, seed=0, device=device)
    gen = time.perf_counter() - t0
    conv, fwd = {}, {}
    inp = make_inputs(small, 1, seed=0, device=device)
    for r in ("exact", *recipes):
        t0 = time.perf_counter()
        wr = weights_for_recipe(w, r)
        conv[r] = time.perf_counter() - t0
        t0 = time.perf_counter()
        moe_forward(inp, wr, r, small)
        fwd[r] = time.perf_counter() - t0
    return gen, conv, fwd


def estimate_seconds(g: Geometry, recipes, tokens, ranks: int, device="cpu") -> dict:
    """Seconds the check will take here, measured on copies of ``g`` with one and two experts (after one
    untimed pass, so first-call costs stay out): making an expert and converting it for each recipe scale with
    the experts; a forward costs a fixed part plus a part per expert touched (the difference of the two). A
    model, not a promise."""
    _one_expert_costs(g, recipes, 1, device)  # warm-up: lazy initialisation, allocator, first kernels
    gen1, conv1, fwd1 = _one_expert_costs(g, recipes, 1, device)
    _, _, fwd2 = _one_expert_costs(g, recipes, 2, device)
    weights_s = g.num_experts * gen1
    convert_s = g.num_experts * sum(conv1[r] for r in recipes)
    forward_s = 0.0
    for r, n in [("exact", 1)] + [(r, 2) for r in recipes]:  # exact once; each recipe over the ranks and as one rank
        per_expert = max(fwd2[r] - fwd1[r], 0.0)
        fixed = max(fwd1[r] - per_expert, 0.0)
        forward_s += n * sum(fixed + per_expert * touched_experts(g, t, ranks) for t in tokens)
    return {"weights_s": weights_s, "convert_s": convert_s, "forward_s": forward_s,
            "total_s": weights_s + convert_s + forward_s}

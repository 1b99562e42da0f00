"""The weights ``megamoe check`` runs on, made once for every token count.

    prepare_weights(g, recipes, seed, device, progress) -> CheckWeights
        random MXFP4 experts and, per recipe, what its kernel would be handed (``testing.weights_for_recipe``),
        converted ``CHUNK`` experts at a time so that a progress bar moves: DeepSeek-V4-Flash's 256 experts take
        minutes to make and convert on a CPU (every conversion is per expert)
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ..geometry import Geometry
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


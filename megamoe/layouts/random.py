"""Random MXFP4 weights as raw bytes, cheap at any geometry (no float round trip).

Every code 0..15 appears (including -0, code 8), and scale bytes are uniform in ``scale_bytes``
(inclusive), so the layout converters are exercised on every bit pattern.
"""

from __future__ import annotations

import torch

from ..formats import MXFP4_BLOCK
from ..geometry import Geometry
from ..weights import MXFP4Weights


def random_mxfp4_bytes(
    g: Geometry, *, seed: int, num_experts: int | None = None, scale_bytes: tuple[int, int] = (122, 133), device="cpu"
) -> MXFP4Weights:
    """MXFP4Weights [E, 2I, H/2] / [E, H, I/2] of uniform random bytes; E = num_experts or g.num_experts."""
    e = g.num_experts if num_experts is None else num_experts
    h, i = g.hidden, g.intermediate
    gen = torch.Generator().manual_seed(seed)
    lo, hi = scale_bytes
    if not 0 <= lo <= hi <= 254:
        raise ValueError(f"scale_bytes must satisfy 0 <= lo <= hi <= 254, got {scale_bytes}")

    def rnd(shape, a=0, b=256):
        return torch.randint(a, b, shape, dtype=torch.int32, generator=gen).to(torch.uint8).to(device)

    return MXFP4Weights(
        rnd((e, 2 * i, h // 2)), rnd((e, 2 * i, h // MXFP4_BLOCK), lo, hi + 1),
        rnd((e, h, i // 2)), rnd((e, h, i // MXFP4_BLOCK), lo, hi + 1),
    )

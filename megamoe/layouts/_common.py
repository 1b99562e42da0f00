"""Shared pieces of the layout converters: argument checks and the gate/up row interleave.

Dimension legend (see ``megamoe.geometry``): E experts, I intermediate, H hidden, N rows of one GEMM's
weight (2I for L1, H for L2), K its reduction size (H for L1, I for L2).
"""

from __future__ import annotations

import torch

from ..validate import expect_tensor  # noqa: F401 (the converters' shared check, re-exported)

GATE_UP_GRAN = 8  # rows per gate / up run after the interleave


def expect_multiple(name: str, value: int, of: int, why: str = "") -> None:
    if value <= 0 or value % of:
        raise ValueError(f"{name} must be a positive multiple of {of}{f' ({why})' if why else ''}, got {value}")


def interleave_gate_up(t: torch.Tensor, gran: int = GATE_UP_GRAN) -> torch.Tensor:
    """[E, 2I, ...] with gate rows then up rows -> rows [g0..g7, u0..u7, g8..g15, u8..u15, ...].

    Indexing: out[e, 2*gran*j + gran*s + r] = t[e, s*I + gran*j + r]  (s = 0 gate, 1 up; r < gran).
    """
    e, n = t.shape[:2]
    if n % (2 * gran):
        raise ValueError(f"L1 rows (2I = {n}) must be a multiple of {2 * gran} to interleave gate/up by {gran}")
    rest = t.shape[2:]
    halves = t.reshape(e, 2, n // (2 * gran), gran, *rest)  # [E, s, j, r, ...]
    return halves.transpose(1, 2).reshape(e, n, *rest).contiguous()


def deinterleave_gate_up(t: torch.Tensor, gran: int = GATE_UP_GRAN) -> torch.Tensor:
    """Inverse of ``interleave_gate_up``: back to gate rows then up rows."""
    e, n = t.shape[:2]
    if n % (2 * gran):
        raise ValueError(f"L1 rows (2I = {n}) must be a multiple of {2 * gran} to de-interleave gate/up by {gran}")
    rest = t.shape[2:]
    runs = t.reshape(e, n // (2 * gran), 2, gran, *rest)  # [E, j, s, r, ...]
    return runs.transpose(1, 2).reshape(e, n, *rest).contiguous()


def require_no_global_scales(weights, layout: str) -> None:
    """Layouts without per-expert global scales must not silently drop them."""
    for name in ("l1_global_scale", "l2_global_scale"):
        gs = getattr(weights, name)
        if gs is not None and not bool((gs == 1).all()):
            bad = int((gs != 1).nonzero()[0])
            raise ValueError(
                f"{layout} has no per-expert global scale, but weights.{name}[{bad}] = {gs[bad].item()!r}; "
                "fold it into the scale bytes first (megamoe.layouts.ranges.fold_global_scales)"
            )

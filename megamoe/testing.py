"""Checkers shared by the tests, the benchmarks, the notebooks and ``megamoe check``: a failure says which
stage, where, and how far off. (The steps they check are made by ``megamoe.inputs``.)
"""

from __future__ import annotations

import torch

# Why FlashInfer's layout-oracle tests skip, and how to run them: flashinfer-python imports on a CPU only when
# installed without its CUDA dependencies, which no extra of pyproject.toml can say (README.md).
FLASHINFER_ORACLE = ("FlashInfer's layout oracle is not installed; on a CPU: pip install --no-deps "
                     "flashinfer-python==0.7.4 apache-tvm-ffi==0.1.11 nvidia-ml-py tqdm")

# ------------------------------------------------------------------------------------ checkers
def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepGEMM's similarity distance, 1 - 2<x,y> / (|x|^2 + |y|^2), in float64 (0 when both are 0)."""
    x, y = x.double(), y.double()
    denom = (x * x + y * y).sum()
    if denom == 0:
        return 0.0
    return float(1 - 2 * (x * y).sum() / denom)


def rel_l2(x: torch.Tensor, ref: torch.Tensor) -> float:
    """|x - ref| / |ref| in float64 (inf if ref is 0 and x is not)."""
    x, ref = x.double(), ref.double()
    num, den = (x - ref).norm(), ref.norm()
    if den == 0:
        return 0.0 if num == 0 else float("inf")
    return float(num / den)


def first_mismatch(x: torch.Tensor, y: torch.Tensor) -> str:
    """Describe where two same-shape tensors first differ bitwise ('' when identical)."""
    if x.shape != y.shape:
        return f"shape {tuple(x.shape)} != {tuple(y.shape)}"
    if x.dtype != y.dtype:
        return f"dtype {x.dtype} != {y.dtype}"
    # reshape(-1) first: view(uint8) needs a last dim, which 0-dim and some strided tensors lack.
    xb = x.detach().reshape(-1).contiguous().view(torch.uint8).reshape(x.numel(), -1) if x.numel() else x
    yb = y.detach().reshape(-1).contiguous().view(torch.uint8).reshape(y.numel(), -1) if y.numel() else y
    if x.numel() == 0 or torch.equal(xb, yb):
        return ""
    bad = (xb != yb).any(dim=1)
    n_bad = int(bad.sum())
    flat = int(bad.nonzero()[0])
    coord = tuple(int(c) for c in torch.unravel_index(torch.tensor(flat), x.shape))
    xv, yv = x.reshape(-1)[flat], y.reshape(-1)[flat]
    if xv.dtype.is_floating_point:
        xv, yv = xv.float(), yv.float()
    return f"{n_bad}/{x.numel()} elements differ; first at {coord}: {xv.item()!r} vs {yv.item()!r}"


def assert_bitwise_equal(x: torch.Tensor, y: torch.Tensor, what: str = "") -> None:
    msg = first_mismatch(x, y)
    if msg:
        raise AssertionError(f"bitwise mismatch{f' in {what}' if what else ''}: {msg}")


def assert_close_diff(x: torch.Tensor, ref: torch.Tensor, max_diff: float, what: str = "") -> float:
    """Assert calc_diff(x, ref) <= max_diff; NaN never passes. Returns the diff."""
    if torch.isnan(x.float()).any():
        n = int(torch.isnan(x.float()).sum())
        raise AssertionError(f"{what or 'output'}: {n} NaN values")
    d = calc_diff(x, ref)
    if not d <= max_diff:
        err = (x.double() - ref.double()).abs()
        worst = tuple(int(c) for c in torch.unravel_index(err.argmax(), err.shape))
        raise AssertionError(
            f"{what or 'output'}: calc_diff {d:.3e} > {max_diff:.1e}; rel_l2 {rel_l2(x, ref):.3e}; "
            f"worst |err| {err.max().item():.3e} at {worst} ({x.reshape(-1)[err.argmax()].item():.6g} vs "
            f"{ref.reshape(-1)[err.argmax()].item():.6g})"
        )
    return d


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill an output buffer with NaN (floats) or 0x7F bytes before a kernel writes it, so an
    unwritten element shows as NaN instead of passing as a plausible zero."""
    if t.dtype.is_floating_point:
        return t.fill_(float("nan"))
    t.view(torch.uint8).fill_(0x7F)
    return t


class Relaunches:
    """Outputs [T, H] (2-byte floats) of repeated launches, each compared bit for bit with the first output of
    the same input (``key``): how many differ (``changed``) and the most rows one of them changed."""

    def __init__(self) -> None:
        self.first, self.changed, self.max_rows = {}, 0, 0

    def add(self, y: torch.Tensor, key=0) -> torch.Tensor | None:
        """Record y; returns its rows [T] (bool) that differ from the first output of ``key`` (None for that one)."""
        first = self.first.setdefault(key, y)
        if first is y:
            return None
        bad = (y.view(torch.int16) != first.view(torch.int16)).any(dim=1)
        if bad.any():
            self.changed += 1
            self.max_rows = max(self.max_rows, int(bad.sum()))
        return bad


# ------------------------------------------------------------------------------------ weights for a recipe
def fp8_block_weights(weights):
    """MXFP4Weights -> FP8BlockWeights (DeepGEMM SM90 FP8 input): dequantize each expert exactly,
    then ``formats.quantize_fp8_block`` (per 128x128: amax * fl32(1/448), e4m3 RN).

    Uses ``megamoe.layouts.deepgemm_sm90.to_fp8_block`` when that module provides it.
    """
    from .weights import FP8BlockWeights, MXFP4Weights

    if isinstance(weights, FP8BlockWeights):
        return weights
    if not isinstance(weights, MXFP4Weights):
        raise TypeError(f"weights must be MXFP4Weights, got {type(weights).__name__}")
    try:
        from .layouts.deepgemm_sm90 import to_fp8_block  # type: ignore[attr-defined]
    except ImportError:
        to_fp8_block = None
    if to_fp8_block is not None:
        out = to_fp8_block(weights)
        if isinstance(out, FP8BlockWeights):
            return out
    from .formats import quantize_fp8_block

    parts = [[], [], [], []]
    for e in range(weights.num_experts):
        w1, w2 = weights.dequantize_expert(e)
        for lst, t in zip(parts, (*quantize_fp8_block(w1), *quantize_fp8_block(w2))):
            lst.append(t)
    return FP8BlockWeights(*(torch.stack(p) for p in parts))


def weights_for_recipe(weights, recipe):
    """The weights a recipe's kernel would be handed: FP8 block weights for ``fp8_block`` recipes;
    MXFP4 scale bytes rebased into the legal window (exact, via per-expert global scales) for
    recipes that have global scales (``megamoe.layouts.ranges.repair_ranges``); else unchanged."""
    from .recipe import get_recipe

    recipe = get_recipe(recipe)
    if recipe.weight_format == "fp8_block":
        return fp8_block_weights(weights)
    if recipe.global_scales and recipe.weight_decode != "exact":
        try:
            from .layouts.ranges import repair_ranges
        except ImportError:  # the range module not installed: hand the raw bytes over
            return weights
        return repair_ranges(weights, recipe)
    return weights

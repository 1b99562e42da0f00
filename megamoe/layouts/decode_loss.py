"""What a recipe's FP4 decoder does to MXFP4 weights, against their exact values, per expert and tensor.

A weight's decoded value depends on its (E8M0 byte, e2m1 code) pair alone, so each of the 256 x 16
pairs is judged once (decoded by the recipe's rule vs e2m1 * 2**(b - 127) in float64), and a tensor
is measured by counting how often each pair occurs in it (one ``bincount``):

    changed        weights whose decoded value differs from the exact one
    to_zero        nonzero weights that decode to zero (a whole group, below the window)
    max_abs_error  largest |decoded - exact|, times the expert's global scale (the weight's real units)
    max_rel_error  largest |decoded - exact| / |exact| over nonzero weights
    bytes          the scale bytes of the groups that hold a changed weight

The decode rule is the reference's (``formats.WEIGHT_DECODERS``). Inside every window it is the
kernel's, bit for bit. Above 133, DeepGEMM SM90 FP4's table wraps large codes into other e4m3 bytes
where the reference saturates at 448: the counts are the same (neither is exact), the errors there a
lower bound. Byte 0xFF is refused before any of this (``validate.check_mxfp4_values``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..formats import E2M1_MAGNITUDES, E8M0_BIAS, MXFP4_BLOCK, WEIGHT_DECODERS, mxfp4_decode_table, unpack_e2m1
from ..recipe import get_recipe
from ..validate import check_mxfp4_values

TENSORS = ("l1", "l2")


@dataclass(frozen=True)
class DecodeLoss:
    """One expert's tensor (l1 = gate+up [2I, H], l2 [H, I]) under one recipe's decoder."""

    expert: int
    tensor: str
    weights: int
    changed: int
    to_zero: int
    max_abs_error: float
    max_rel_error: float
    bytes: tuple[int, ...]

    @property
    def lossless(self) -> bool:
        return self.changed == 0


@functools.lru_cache(maxsize=None)
def _pair_tables(weight_decode: str):
    """float64 [4096] each, entry 16 * byte + code: changed (0/1), to_zero (0/1), |error|, |error| / |exact|."""
    decoded = mxfp4_decode_table(WEIGHT_DECODERS[weight_decode]).double()
    codes = torch.arange(16)
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float64)[codes & 7]
    signed = torch.where(codes >= 8, -mags, mags)
    exact = (signed[None, :] * torch.exp2(torch.arange(256, dtype=torch.float64) - E8M0_BIAS)[:, None]).reshape(-1)
    err = (decoded - exact).abs()
    changed = (decoded != exact).double()
    to_zero = ((decoded == 0) & (exact != 0)).double()
    rel = torch.where(exact != 0, err / exact.abs(), torch.zeros_like(err))
    return changed, to_zero, err, rel


def _pair_counts(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """packed uint8 [N, K/2], scale uint8 [N, K/32] -> int64 [4096]: how often each (byte, code) pair occurs."""
    codes = unpack_e2m1(packed).to(torch.int64)  # [N, K]
    idx = (scale.to(torch.int64) << 4).repeat_interleave(MXFP4_BLOCK, dim=-1) | codes
    return torch.bincount(idx.flatten(), minlength=256 * 16).cpu()


def tensor_loss(expert: int, tensor: str, packed: torch.Tensor, scale: torch.Tensor, weight_decode: str,
                global_scale: float = 1.0) -> DecodeLoss:
    """``DecodeLoss`` of one tensor: packed uint8 [N, K/2], E8M0 bytes uint8 [N, K/32]."""
    counts = _pair_counts(packed, scale)
    changed, to_zero, err, rel = _pair_tables(weight_decode)
    seen = counts > 0
    hit = seen & (changed > 0)
    return DecodeLoss(
        expert=expert, tensor=tensor, weights=int(counts.sum()),
        changed=int((counts * changed).sum()), to_zero=int((counts * to_zero).sum()),
        max_abs_error=float(err[hit].max()) * abs(global_scale) if bool(hit.any()) else 0.0,
        max_rel_error=float(rel[hit].max()) if bool(hit.any()) else 0.0,
        bytes=tuple(sorted({int(i) >> 4 for i in hit.nonzero().flatten()})),
    )


def decode_loss(weights, recipe, experts=None) -> list[DecodeLoss]:
    """Per expert (all, or ``experts``) and tensor (l1, l2): what ``recipe``'s decoder does to ``weights``
    (MXFP4Weights), against their exact values. Lossless tensors are included (changed == 0)."""
    recipe = get_recipe(recipe)
    if getattr(weights, "format", None) != "mxfp4":
        raise TypeError(f"decode_loss: weights must be MXFP4Weights, got {type(weights).__name__}")
    if recipe.weight_format != "mxfp4":
        raise ValueError(f"decode_loss: recipe {recipe.name!r} does not decode MXFP4 weights")
    check_mxfp4_values(weights, f"decode loss for {recipe.name}")
    out = []
    for e in (range(weights.num_experts) if experts is None else experts):
        for name in TENSORS:
            gs = getattr(weights, f"{name}_global_scale")
            out.append(tensor_loss(e, name, getattr(weights, name)[e], getattr(weights, f"{name}_scale")[e],
                                   recipe.weight_decode, 1.0 if gs is None else float(gs[e])))
    return out


def describe_loss(loss: DecodeLoss) -> str:
    """One line: '1,617 of 8,388,608 weights decode differently (1,617 to zero; largest error 2.4e-04 abs,
    100% rel), scale bytes [117, 118]'."""
    if loss.lossless:
        return f"all {loss.weights:,} weights decode exactly"
    return (f"{loss.changed:,} of {loss.weights:,} weights decode differently ({loss.to_zero:,} to zero; largest "
            f"error {loss.max_abs_error:.3g} abs, {loss.max_rel_error:.3g} rel), scale bytes {list(loss.bytes)}")

"""The decode window of a kernel without global scales (DeepGEMM SM90 FP4): refuse, measure the loss, or
move synthetic weights into it.

The kernel turns each (E8M0 byte b, e2m1 code c) into one e4m3 byte (``Recipe.weight_decode``). Inside
[``min_scale_byte``, ``max_scale_byte``] every code decodes exactly; below, small codes round (to zero at
the bottom); above, large codes wrap into negative or NaN bytes. With no per-expert global scale to absorb a
shift, out-of-window bytes have no exact repair, so:

    check_fp4_window(w, recipe)                      raises, naming expert, tensor, bytes, weights changed
    check_fp4_window(w, recipe, accept_below=True)   accepts bytes below the window and returns their loss
                                                     (measured by megamoe.layouts.decode_loss)
    shift_into_window(w, recipe)                     synthetic weights only: each tensor x 2**s into the window
    decode_probe_layer(g)                            a layer that reads a kernel's decode table off its output

Byte 0xFF is NaN in E8M0 and is refused everywhere, all-zero groups included.
"""

from __future__ import annotations

from dataclasses import asdict, replace

import torch

from ..formats import E8M0_BIAS
from ..recipe import get_recipe
from ..validate import check_mxfp4_values
from ..weights import MXFP4Weights
from .decode_loss import decode_loss, describe_loss
from .ranges import TENSORS, _shift_bytes, analyze_ranges, scale_bytes_within


def check_fp4_window(weights: MXFP4Weights, recipe, *, accept_below: bool = False, who: str = "") -> dict | None:
    """Refuse weights the recipe's decoder cannot represent exactly; returns None when all decode exactly.

    Above the window (codes wrap into negative / NaN bytes) and 0xFF bytes are always refused. Below it,
    ``accept_below=True`` accepts the weights and returns {'summary', 'weights_changed', 'weights_to_zero',
    'weights_total', 'max_abs_err', 'max_rel_err', 'tensors'} (``layouts.decode_loss``) for the caller to report."""
    recipe = get_recipe(recipe)
    prefix = f"{who}: " if who else ""
    check_mxfp4_values(weights, who)
    lo, hi = recipe.min_scale_byte, recipe.max_scale_byte
    if scale_bytes_within(weights, lo, hi):
        return None  # every byte in the window (shift_into_window's output, asked again): all decode exactly
    report = analyze_ranges(weights, recipe)
    above = [t for t in report.entries if t.above]
    if above:
        t = above[0]
        raise ValueError(
            f"{prefix}{len(above)} expert tensor(s) have nonzero scale groups above byte {hi} (2**{hi - E8M0_BIAS}), "
            f"where {recipe.name}'s decode table wraps the largest codes into negative or NaN values; first: expert "
            f"{t.expert} {t.tensor}: {t.above} groups, bytes up to {t.max_byte}. This kernel has no global scale "
            "to absorb them: requantize those experts")
    below = [t for t in report.entries if t.below]
    if not below:
        return None
    loss = [x for x in decode_loss(weights, recipe, experts=sorted({t.expert for t in below})) if not x.lossless]
    total = 2 * sum(getattr(weights, n).numel() for n in TENSORS)
    changed, to_zero = sum(x.changed for x in loss), sum(x.to_zero for x in loss)
    summary = (f"{changed} of {total} weights ({changed / total:.3%}) in {len(loss)} expert tensor(s) decode "
               f"differently (scale bytes below {lo}); {to_zero} become 0; largest error "
               f"{max((x.max_abs_error for x in loss), default=0.0):.3g}")
    if not accept_below:
        t = below[0]
        first = next((x for x in loss if (x.expert, x.tensor) == (t.expert, t.tensor)), None)
        raise ValueError(
            f"{prefix}{len(below)} expert tensor(s) have nonzero scale groups below byte {lo} "
            f"(2**{lo - E8M0_BIAS}), which {recipe.name}'s decode table rounds; first: expert {t.expert} {t.tensor}: "
            f"{t.below} groups, bytes down to {t.min_byte}: {describe_loss(first) if first else 'no weight changes'}. "
            f"In all: {summary}. The kernel has no global scale, so no exact repair exists: pass "
            "accept_lossy_scales=True to run them and record this loss")
    return {"summary": summary, "weights_changed": changed, "weights_to_zero": to_zero, "weights_total": total,
            "max_abs_err": max(x.max_abs_error for x in loss), "max_rel_err": max(x.max_rel_error for x in loss),
            "tensors": [asdict(x) for x in loss]}


def shift_into_window(weights: MXFP4Weights, recipe) -> MXFP4Weights:
    """SYNTHETIC weights only: per (expert, tensor), add the smallest shift s that lands every nonzero group's
    byte in the recipe's window. The layer's values change (that tensor is multiplied by 2**s), which is
    fine for random test weights and wrong for a checkpoint. Raises ValueError when a span is too wide."""
    recipe = get_recipe(recipe)
    if weights.l1_global_scale is not None or weights.l2_global_scale is not None:
        from .ranges import fold_global_scales

        weights = fold_global_scales(weights)
    report = analyze_ranges(weights, recipe)
    wide = [t for t in report.entries if t.shift is None]
    if wide:
        t = wide[0]
        raise ValueError(f"expert {t.expert} {t.tensor}: nonzero-group bytes {t.min_byte}..{t.max_byte} span more "
                         f"than {recipe.name}'s window {recipe.min_scale_byte}..{recipe.max_scale_byte}")
    lo, hi = recipe.min_scale_byte, recipe.max_scale_byte
    new = {}
    for name in TENSORS:
        shifts = [t.shift for t in report.entries if t.tensor == name]
        packed, scale = getattr(weights, name), getattr(weights, f"{name}_scale")
        new[f"{name}_scale"] = torch.stack([_shift_bytes(scale[e], packed[e], s, lo, hi) for e, s in enumerate(shifts)])
    return replace(weights, **new)


def decode_probe_layer(g, device="cpu"):
    """A crafted layer that reads a kernel's FP4 decode off its output: every (scale byte, code) pair once.

    Needs 8 experts x H rows >= 4096 pairs (``small``: H = 512). Token t is routed to expert t alone with
    weight 1; its x is 1.0 in channel 0, so every gate and up row (code 1.0 at K = 0, byte 127) sees the same
    value and every L2 input channel gets the same FP8 value a. Row h of expert t's L2 holds pair
    p = 512 t + h (byte p // 16, code p % 16) at K = 0 and zeros elsewhere, so
    ``y[t, h] = bf16(a * decode(byte, code))``: a product of two values of at most 4 significant bits, exact
    in bf16. Byte 0xFF is left out (refused as NaN): its rows read 0. Returns (weights, inputs, pairs [8, H]
    int64); the decode table is y / a, reshaped [256, 16] (row 255 not measured)."""
    from ..inputs import MoEInputs

    e, h, i, k = g.num_experts, g.hidden, g.intermediate, g.num_topk
    if e < 8 or 8 * h != 4096:
        raise ValueError(f"decode_probe_layer needs >= 8 experts and 8 * hidden == 4096, got E={e}, H={h}")
    l1 = torch.zeros(e, 2 * i, h // 2, dtype=torch.uint8)
    l1[:, :, 0] = 0x02  # K = 0: code 2 (1.0) in every gate and up row
    l2 = torch.zeros(e, h, i // 2, dtype=torch.uint8)
    l2_scale = torch.full((e, h, i // 32), 127, dtype=torch.uint8)
    pairs = torch.arange(8 * h).view(8, h)
    byte, code = pairs // 16, pairs % 16
    # Byte 0xFF (NaN) cannot be handed over (MXFP4Weights refuses it): its 16 rows carry byte 127, code 0.
    nan_rows = byte == 0xFF
    byte, code = byte.masked_fill(nan_rows, 127), code.masked_fill(nan_rows, 0)
    l2[:8, :, 0] = code.to(torch.uint8)  # low nibble = K 0, high nibble (K 1) = code 0
    l2_scale[:8, :, 0] = byte.to(torch.uint8)
    w = MXFP4Weights(l1, torch.full((e, 2 * i, h // 32), 127, dtype=torch.uint8), l2, l2_scale)
    x = torch.zeros(8, h)
    x[:, 0] = 1.0
    idx = torch.full((8, k), -1, dtype=torch.int64)
    idx[:, 0] = torch.arange(8)
    tw = torch.zeros(8, k)
    tw[:, 0] = 1.0
    return w.to(device), MoEInputs(x.to(torch.bfloat16), idx, tw).to(device), pairs

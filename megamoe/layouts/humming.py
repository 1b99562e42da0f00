"""Checkpoint MXFP4 <-> Humming's MXFP4 schema, and the scale window of Humming's FP8-activation path.

Humming (package ``humming-kernels``, vLLM main's default MoE GEMM on Hopper) takes each sublayer as its
``Mxfp4WeightSchema`` tensors, then transforms them for its kernel (``humming.transform``). vLLM calls the
gate/up sublayer ``w13`` and the down sublayer ``w2``:

    w13  weight uint8 [E, 2I, H/2]   rows: the I gate rows, then the I up rows (two stacks of I)
         weight_scale  E8M0 [E, 2I, H/32]
    w2   weight uint8 [E, H, I/2]    weight_scale  E8M0 [E, H, I/32]

Byte i of a row holds K 2i in its low nibble and K 2i+1 in its high one, as in a DeepSeek checkpoint, so
``to_humming_mxfp4`` is a relabelling of the library's ``MXFP4Weights`` (no byte moves) and
``from_humming_mxfp4`` its inverse. Humming's own transform (a repack for its MMA layout) runs on the GPU
inside ``humming.transform.transform_humming_tensors``; the backend calls it, it is not rewritten here.

With FP8 activations (W4A8) the transform also *rebases* the E8M0 scales (``process_fused_e8m0_scale``, the
``use_fused_e8m0_scale`` path, which is what vLLM runs: it prepares the layer without the tensors, so the
per-row variant ``fit_fused_e8m0_scale_range`` is never taken). Per expert and sublayer, over every scale
byte of the tensor:

    hi = max(byte);  lo = max(min(byte), hi - 11)                      the window: 12 bytes, 11 binades
    byte' = max(byte, lo) - lo + 1   (1..12)                           e2m1 x 2**(byte' + c) is an exact e4m3
    weight_scale_2 = 2**(lo - 127) / 2   (FP32, per expert)            applied to the GEMM's output
    a group with byte < lo: each code becomes round_half_away(e2m1 x 2**(byte - lo)) on the e2m1 grid, sign kept
                            (``humming/include/humming/kernel/process_mxfp4.cuh``); code 8 (-0) becomes +0 in
                            every group first

So a weight decodes exactly iff its group's byte lies in [hi - 11, hi] of its (expert, sublayer), or its
codes are all zero. ``humming_window`` reports the groups outside; ``check_humming_window`` refuses them
(or, with ``accept_lossy=True``, accepts them and returns what the rewrite loses), and
``rebase_fused_e8m0`` computes the rewritten codes and bytes exactly, on any device, so the reference can
run on the values the kernel computes with (``humming_kernel_weights``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..formats import E2M1_MAGNITUDES, E8M0_BIAS, MXFP4_BLOCK, nonzero_groups
from ..validate import check_mxfp4_values
from ..weights import MXFP4Weights

# Humming's fused-E8M0 path with FP8 activations keeps the bytes [max - 11, max] of each (expert, sublayer):
# e2m1's exponents 0..3 plus a rebased byte 1..12 fill e4m3's 15 normal binades exactly.
W4A8_SCALE_SPAN = 11
SUBLAYERS = {"w13": ("l1", "l1_scale"), "w2": ("l2", "l2_scale")}


@dataclass(frozen=True)
class HummingMXFP4:
    """One sublayer in Humming's ``Mxfp4WeightSchema``: weight uint8 [E, N, K/2], weight_scale E8M0 [E, N, K/32]."""

    weight: torch.Tensor
    weight_scale: torch.Tensor

    def tensors(self) -> dict[str, torch.Tensor]:
        """The dict ``Mxfp4WeightSchema.convert_humming`` takes (uint8 views; the schema reinterprets them)."""
        return {"weight": self.weight, "weight_scale": self.weight_scale}


def to_humming_mxfp4(weights: MXFP4Weights) -> dict[str, HummingMXFP4]:
    """MXFP4Weights (no global scales) -> {"w13": gate | up, "w2": down} in Humming's MXFP4 schema. The
    tensors are the checkpoint's own bytes (views): gate rows then up rows is Humming's stacking too."""
    if weights.l1_global_scale is not None or weights.l2_global_scale is not None:
        raise ValueError("to_humming_mxfp4: weights carry per-expert global scales, which Humming's MXFP4 schema has "
                         "no place for; fold them first (megamoe.layouts.ranges.fold_global_scales)")
    return {name: HummingMXFP4(getattr(weights, codes), getattr(weights, scale))
            for name, (codes, scale) in SUBLAYERS.items()}


def from_humming_mxfp4(sublayers: dict[str, HummingMXFP4]) -> MXFP4Weights:
    """The inverse of ``to_humming_mxfp4`` (shapes and dtypes checked by MXFP4Weights)."""
    w13, w2 = sublayers["w13"], sublayers["w2"]
    return MXFP4Weights(w13.weight.view(torch.uint8), w13.weight_scale.view(torch.uint8),
                        w2.weight.view(torch.uint8), w2.weight_scale.view(torch.uint8))


# ------------------------------------------------------------------------------------------ the rewrite
def _shrunk_code_table() -> torch.Tensor:
    """uint8 [32, 16]: entry [d, c] is code c after Humming's rewrite by 2**-d (d >= 31 acts as 31: all zero).

    -0 (code 8) becomes +0 first, at every d. Then, for d > 0, the magnitude m = e2m1(c) * 2**-d is rounded to
    the e2m1 grid half away from zero (Humming adds half an ulp of the one-mantissa-bit grid and truncates) and
    the sign bit is kept, also when the magnitude rounds to 0 (a negative code can become -0, code 8)."""
    grid = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float64)
    # Rounding boundaries between grid points, ties upwards: m >= midpoint takes the upper point.
    mids = (grid[1:] + grid[:-1]) / 2
    table = torch.zeros(32, 16, dtype=torch.uint8)
    for d in range(32):
        for c in range(16):
            c = 0 if c == 8 else c
            m = float(grid[c & 7]) * 2.0**-d
            idx = int((m >= mids).sum())
            table[d, c] = (idx | (c & 8)) if d else c
        table[d, 8] = 0
    return table


_SHRUNK = _shrunk_code_table()


@dataclass(frozen=True)
class Rebased:
    """Humming's W4A8 form of one sublayer, exactly: codes uint8 [E, N, K/2] (rewritten where a group was below
    its window), byte' uint8 [E, N, K/32] (1..12), weight_scale_2 fp32 [E] = 2**(lo - 127) / 2, lo uint8 [E]."""

    codes: torch.Tensor
    scale: torch.Tensor
    weight_scale_2: torch.Tensor
    lo: torch.Tensor


def window_low(scale: torch.Tensor, span: int = W4A8_SCALE_SPAN) -> torch.Tensor:
    """scale uint8 [E, N, K/32] -> int16 [E]: each tensor's window's lowest exact byte, max(min, max - span)."""
    s = scale.view(torch.uint8).reshape(scale.shape[0], -1).to(torch.int16)
    return torch.maximum(s.amin(dim=1), s.amax(dim=1) - span)


def rebase_fused_e8m0(codes: torch.Tensor, scale: torch.Tensor, span: int = W4A8_SCALE_SPAN) -> Rebased:
    """Humming's ``process_fused_e8m0_scale`` for FP8 activations, in PyTorch (module docstring):
    codes uint8 [E, N, K/2], scale uint8 [E, N, K/32] -> ``Rebased``. Every byte of the tensor counts for
    the window's low end (Humming's rule), also the bytes of all-zero groups."""
    e, n, half_k = codes.shape
    if scale.shape != (e, n, half_k * 2 // MXFP4_BLOCK):
        raise ValueError(f"scale must be [{e}, {n}, {half_k * 2 // MXFP4_BLOCK}] for codes {tuple(codes.shape)}, "
                         f"got {tuple(scale.shape)}")
    s = scale.view(torch.uint8).view(e, -1).to(torch.int16)
    lo = window_low(scale, span)  # [E]
    delta = (lo[:, None] - s).clamp(min=0).clamp(max=31).view(e, n, -1)  # [E, N, K/32]
    new_scale = (torch.maximum(s, lo[:, None]) - lo[:, None] + 1).to(torch.uint8).view(e, n, -1)
    # Each nibble through the table of its group's delta (delta 0 maps -0 to 0 and keeps the rest), one expert at
    # a time: the int64 indices of a whole DeepSeek-V4-Flash sublayer would take 16 GiB.
    table = _SHRUNK.to(codes.device).flatten().long()  # [32 * 16], entry 16 * delta + code
    new_codes = torch.empty_like(codes.view(torch.uint8))
    for x in range(e):
        c = codes[x].view(torch.uint8).view(n, -1, MXFP4_BLOCK // 2).long()  # [N, K/32, 16 bytes]
        row = (delta[x].long() * 16).unsqueeze(-1)
        new_codes[x] = (table[row + (c & 0xF)] | (table[row + (c >> 4)] << 4)).to(torch.uint8).view(n, half_k)
    ws2 = torch.exp2(lo.double() - E8M0_BIAS - 1).float()
    return Rebased(new_codes, new_scale, ws2, lo.to(torch.uint8))


def rebased_values(r: Rebased) -> tuple[torch.Tensor, torch.Tensor]:
    """The (codes, E8M0 bytes) whose exact MXFP4 value is what Humming's kernel computes with: the rewritten
    codes and byte = byte' - 1 + lo (so e2m1 x 2**(byte - 127) = e2m1 x 2**byte' x weight_scale_2)."""
    bytes_ = (r.scale.to(torch.int16) - 1 + r.lo.view(-1, 1, 1).to(torch.int16)).to(torch.uint8)
    return r.codes, bytes_


# ------------------------------------------------------------------------------------------ the window
@dataclass(frozen=True)
class WindowEntry:
    """One (expert, tensor) with nonzero groups outside its W4A8 window [lo, hi]."""

    expert: int
    tensor: str  # "l1" (gate/up, Humming's w13) or "l2" (down, w2)
    hi: int
    lo: int
    groups_below: int  # nonzero groups whose byte < lo
    min_byte: int  # smallest byte of those groups
    weights_changed: int  # weights whose value the rewrite changes
    weights_to_zero: int  # nonzero weights the rewrite makes 0
    max_abs_error: float  # largest |rewritten - exact| in the weight's units


def humming_window(weights: MXFP4Weights, span: int = W4A8_SCALE_SPAN) -> list[WindowEntry]:
    """Every (expert, tensor) whose nonzero groups do not all lie in [max - span, max] of that tensor's bytes,
    with what Humming's rewrite does to them (compared against the exact MXFP4 values)."""
    from ..formats import dequantize_mxfp4

    out, kernel = [], None
    for codes_name, scale_name in SUBLAYERS.values():
        codes, scale = getattr(weights, codes_name), getattr(weights, scale_name)
        lo = window_low(scale, span).view(-1, 1, 1)
        below = nonzero_groups(codes) & (scale.to(torch.int16) < lo)  # [E, N, K/32]
        experts = torch.nonzero(below.flatten(1).any(1)).flatten()
        if not experts.numel():
            continue
        if kernel is None:  # the rewrite, only where something is below
            kernel = humming_kernel_weights(weights, span)
        kc, ks = getattr(kernel, codes_name), getattr(kernel, scale_name)
        for e in experts.tolist():  # one expert at a time: a whole sublayer in float64 is tens of GiB
            exact = dequantize_mxfp4(codes[e], scale[e]).double()
            got = dequantize_mxfp4(kc[e], ks[e]).double()
            changed = got != exact
            out.append(WindowEntry(e, codes_name, int(scale[e].max()), int(lo[e]), int(below[e].sum()),
                                   int(scale[e][below[e]].min()), int(changed.sum()),
                                   int((changed & (got == 0) & (exact != 0)).sum()), float((got - exact).abs().max())))
    return sorted(out, key=lambda x: (x.expert, x.tensor))


def check_humming_window(weights: MXFP4Weights, *, accept_lossy: bool = False, who: str = "",
                         span: int = W4A8_SCALE_SPAN) -> dict | None:
    """Refuse weights Humming's W4A8 path would change (None when every weight decodes exactly). With
    ``accept_lossy=True`` accept them and return {'summary', 'weights_changed', 'weights_to_zero',
    'weights_total', 'max_abs_err', 'tensors'}. There is no exact repair: the window is relative to each
    tensor's largest byte, and moving the whole tensor by a power of two moves the window with it."""
    prefix = f"{who}: " if who else ""
    check_mxfp4_values(weights, who)
    entries = humming_window(weights, span)
    if not entries:
        return None
    total = 2 * sum(getattr(weights, codes).numel() for codes, _ in SUBLAYERS.values())
    changed = sum(x.weights_changed for x in entries)
    to_zero = sum(x.weights_to_zero for x in entries)
    summary = (f"{changed} of {total} weights ({changed / total:.3%}) in {len(entries)} expert tensor(s) change under "
               f"Humming's W4A8 scale rebase (nonzero groups more than {span} binades below their tensor's largest "
               f"scale); {to_zero} become 0; largest error {max(x.max_abs_error for x in entries):.3g}")
    if not accept_lossy:
        t = entries[0]
        raise ValueError(
            f"{prefix}{len(entries)} expert tensor(s) have nonzero scale groups below their W4A8 window; first: "
            f"expert {t.expert} {t.tensor}: bytes {t.lo}..{t.hi} are exact, {t.groups_below} groups go down to byte "
            f"{t.min_byte} and Humming rounds their codes ({t.weights_changed} weights change, {t.weights_to_zero} "
            f"become 0). In all: {summary}. No exact repair exists: pass accept_lossy_scales=True to run them and "
            "record this loss")
    return {"summary": summary, "weights_changed": changed, "weights_to_zero": to_zero, "weights_total": total,
            "max_abs_err": max(x.max_abs_error for x in entries), "tensors": [x.__dict__ for x in entries]}


def humming_kernel_weights(weights: MXFP4Weights, span: int = W4A8_SCALE_SPAN) -> MXFP4Weights:
    """The MXFP4 weights whose exact values Humming's W4A8 kernel computes with: unchanged inside every window,
    the rewritten codes (and bytes raised to the window) below it. Identical tensors when nothing is below."""
    new = {}
    for codes_name, scale_name in SUBLAYERS.values():
        codes, scale = getattr(weights, codes_name), getattr(weights, scale_name)
        r = rebase_fused_e8m0(codes, scale, span)
        new_codes, new_bytes = rebased_values(r)
        # All-zero groups keep their bytes (any byte decodes 0 there); -0 codes stay as the checkpoint wrote them.
        keep = ~nonzero_groups(codes) | (scale >= r.lo.view(-1, 1, 1))
        new[scale_name] = torch.where(keep, scale, new_bytes)
        keep_codes = keep.repeat_interleave(MXFP4_BLOCK // 2, dim=-1)
        new[codes_name] = torch.where(keep_codes, codes, new_codes)
    return replace(weights, **new)


__all__ = ["W4A8_SCALE_SPAN", "HummingMXFP4", "Rebased", "WindowEntry", "to_humming_mxfp4", "from_humming_mxfp4",
           "rebase_fused_e8m0", "rebased_values", "humming_window", "check_humming_window", "humming_kernel_weights"]

"""Scale-range analysis and exact repair: no out-of-range weight scale reaches a kernel silently.

The SM90 FP4 decoders turn e2m1 * 2**(b - 127) into one e4m3 byte, which is exact only for a window
of scale bytes b (``Recipe.min_scale_byte`` .. ``Recipe.max_scale_byte``, derived from the recipe's
decode rule: FlashInfer 122..133, DeepGEMM SM90 FP4 119..133, the exact float32 decode 0..252). No
kernel checks. A *scale group* (32 K values sharing one byte) counts only when one of its codes is
nonzero: an all-zero group decodes to 0 whatever its scale. Byte 0xFF is NaN, not a scale: every
function here refuses it, on any group, and never repairs it.

``decode_loss`` measures, per expert and tensor, what a recipe's decoder does to the weights outside its
window (weights changed, how many to zero, largest absolute and relative error); the refusals quote it.

Repair (``repair_ranges``) is exact: per expert and tensor it adds one integer shift s to every
scale byte and multiplies the expert's global scale by 2**-s, so decode(codes, b + s) * gs * 2**-s
is the same float as before, bit for bit. L1's gate and up share one global scale, so one shift.
A shift exists iff the expert's nonzero-group bytes span at most the window; else ValueError.
Recipes without global scales can only fold existing power-of-two global scales into the bytes.

The per-expert analysis runs once per (weights, recipe) along a backend's path: ``synthetic_weights``, its
``prepare``, and the converter inside it each ask about the same weights, and once they are in the window the
later asks are answered by one min / max over the scale bytes (``scale_bytes_within``: if every byte is in the
window, no nonzero group can be out). That test reads the bytes on every call, as the cheap checks do
(``megamoe.validate``), so no write made since can hide; what it cannot clear goes to the full analysis, whose
refusals are unchanged. ``repair_ranges`` hands back its input when nothing would move, so the next ask finds
weights already in the window.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch

from ..formats import E8M0_BIAS, MXFP4_BLOCK, nonzero_groups
from ..recipe import Recipe, get_recipe
from ..validate import check_mxfp4_values
from ..weights import MXFP4Weights
from .decode_loss import DecodeLoss, decode_loss, describe_loss, tensor_loss  # noqa: F401 (re-exported)

TENSORS = ("l1", "l2")


@dataclass(frozen=True)
class TensorRange:
    """Scale bytes of one expert's tensor (l1 = gate+up [2I, H/32] groups, l2 [H, I/32]).

    Counts cover groups with nonzero codes only; min_byte / max_byte are None when there are none.
    ``shift`` is the exact rebase (bytes += shift, global scale *= 2**-shift) that lands every
    counted group in the window, 0 when already legal, None when no shift can (span too wide).
    """

    expert: int
    tensor: str
    groups: int  # all scale groups
    nonzero_groups: int
    below: int  # nonzero groups with byte < min_scale_byte
    above: int  # nonzero groups with byte > max_scale_byte
    min_byte: int | None
    max_byte: int | None
    shift: int | None

    @property
    def out_of_range(self) -> int:
        return self.below + self.above

    @property
    def ok(self) -> bool:
        return self.out_of_range == 0


@dataclass(frozen=True)
class RangeReport:
    """Per (expert, tensor) ``TensorRange`` for one recipe's legal window [min_scale_byte, max_scale_byte]."""

    recipe: str
    min_scale_byte: int | None
    max_scale_byte: int | None
    global_scales: bool
    entries: tuple[TensorRange, ...]

    @property
    def ok(self) -> bool:
        return all(t.ok for t in self.entries)

    @property
    def out_of_range(self) -> int:
        return sum(t.out_of_range for t in self.entries)

    def bad(self) -> list[TensorRange]:
        return [t for t in self.entries if not t.ok]

    def to_dict(self) -> dict:
        return {
            "recipe": self.recipe,
            "min_scale_byte": self.min_scale_byte,
            "max_scale_byte": self.max_scale_byte,
            "global_scales": self.global_scales,
            "ok": self.ok,
            "out_of_range": self.out_of_range,
            "entries": [asdict(t) for t in self.entries],
        }

    def __str__(self) -> str:
        bad = self.bad()
        head = (f"{self.recipe}: window {self.min_scale_byte}..{self.max_scale_byte}, "
                f"{len(self.entries)} tensors, {len(bad)} with out-of-range nonzero groups ({self.out_of_range} groups)")
        lines = [head] + [
            f"  expert {t.expert} {t.tensor}: {t.below} below, {t.above} above, bytes {t.min_byte}..{t.max_byte}, "
            f"shift {t.shift if t.shift is not None else 'none possible'}"
            for t in bad[:20]
        ]
        if len(bad) > 20:
            lines.append(f"  ... {len(bad) - 20} more")
        return "\n".join(lines)

    def __rich__(self):
        from rich.table import Table

        table = Table(title=f"scale ranges for {self.recipe} (legal bytes {self.min_scale_byte}..{self.max_scale_byte})")
        for col in ("expert", "tensor", "nonzero groups", "below", "above", "min byte", "max byte", "shift"):
            table.add_column(col, justify="right")
        for t in self.entries:
            style = None if t.ok else ("red" if t.shift is None else "yellow")
            table.add_row(str(t.expert), t.tensor, str(t.nonzero_groups), str(t.below), str(t.above),
                          str(t.min_byte), str(t.max_byte), str(t.shift), style=style)
        return table


def _window(recipe: Recipe) -> tuple[int, int]:
    lo = recipe.min_scale_byte if recipe.min_scale_byte is not None else 0
    hi = recipe.max_scale_byte if recipe.max_scale_byte is not None else 254
    return lo, hi


def _shift_for(mn: int | None, mx: int | None, lo: int, hi: int) -> int | None:
    """Smallest |s| with lo <= mn + s and mx + s <= hi; None when mx - mn > hi - lo."""
    if mn is None:
        return 0
    if mx - mn > hi - lo:
        return None
    if mn < lo:
        return lo - mn
    if mx > hi:
        return hi - mx
    return 0


def _tensor_range(e: int, name: str, packed: torch.Tensor, scale: torch.Tensor, lo: int, hi: int) -> TensorRange:
    mask = nonzero_groups(packed)
    b = scale.to(torch.int16)
    n = int(mask.sum())
    mn = int(torch.where(mask, b, 256).min()) if n else None
    mx = int(torch.where(mask, b, -1).max()) if n else None
    return TensorRange(
        expert=e, tensor=name, groups=scale.numel(), nonzero_groups=n,
        below=int((mask & (b < lo)).sum()), above=int((mask & (b > hi)).sum()), min_byte=mn, max_byte=mx,
        shift=_shift_for(mn, mx, lo, hi),
    )


def _readable(weights, recipe: Recipe) -> None:
    """What every range question asks first: MXFP4Weights, no byte 0xFF (NaN: no window holds it), global scales
    finite and positive."""
    if not isinstance(weights, MXFP4Weights):
        raise TypeError(f"weights must be MXFP4Weights, got {type(weights).__name__}")
    check_mxfp4_values(weights, f"scale ranges for {recipe.name}")


def analyze_ranges(weights: MXFP4Weights, recipe) -> RangeReport:
    """Count, per expert and tensor, the nonzero scale groups outside ``recipe``'s legal bytes."""
    recipe = get_recipe(recipe)
    _readable(weights, recipe)
    return _analyze(weights, recipe)


def _analyze(weights: MXFP4Weights, recipe: Recipe) -> RangeReport:
    """``analyze_ranges`` on weights ``_readable`` has passed: every expert's two tensors, one by one."""
    lo, hi = _window(recipe)
    entries = []
    for e in range(weights.num_experts):
        entries.append(_tensor_range(e, "l1", weights.l1[e], weights.l1_scale[e], lo, hi))
        entries.append(_tensor_range(e, "l2", weights.l2[e], weights.l2_scale[e], lo, hi))
    return RangeReport(recipe.name, recipe.min_scale_byte, recipe.max_scale_byte, recipe.global_scales, tuple(entries))


def _offending_bytes(weights: MXFP4Weights, t: TensorRange, lo: int, hi: int) -> list[int]:
    """The distinct bytes of tensor t's nonzero groups that lie outside [lo, hi]."""
    packed, scale = getattr(weights, t.tensor)[t.expert], getattr(weights, f"{t.tensor}_scale")[t.expert]
    b = scale[nonzero_groups(packed)].to(torch.int16)
    return sorted(int(v) for v in b[(b < lo) | (b > hi)].unique())


def _refusal(weights: MXFP4Weights, t: TensorRange, recipe: Recipe, why: str) -> str:
    """expert, tensor, the offending bytes and how many weights the recipe's decoder would change."""
    lo, hi = _window(recipe)
    gs = getattr(weights, f"{t.tensor}_global_scale")
    loss = tensor_loss(t.expert, t.tensor, getattr(weights, t.tensor)[t.expert],
                       getattr(weights, f"{t.tensor}_scale")[t.expert], recipe.weight_decode,
                       1.0 if gs is None else float(gs[t.expert]))
    return (
        f"expert {t.expert} {t.tensor}: {t.below} scale groups below byte {lo} and {t.above} above byte {hi} "
        f"(offending bytes {_offending_bytes(weights, t, lo, hi)}; nonzero-group bytes {t.min_byte}..{t.max_byte} "
        f"= 2**{t.min_byte - E8M0_BIAS}..2**{t.max_byte - E8M0_BIAS}); {recipe.name} decodes only bytes "
        f"{lo}..{hi} exactly ({describe_loss(loss)}); {why}"
    )


def _explain(weights: MXFP4Weights, t: TensorRange, recipe: Recipe) -> str:
    lo, hi = _window(recipe)
    span, width = t.max_byte - t.min_byte + 1, hi - lo + 1
    if recipe.global_scales:
        return _refusal(weights, t, recipe, f"the span is {span} binades but the window is {width}: {span - width} "
                        "binade(s) too wide for any exact power-of-two rebase (requantize the expert instead)")
    over = max(t.max_byte - hi, 0)
    under = max(lo - t.min_byte, 0)
    return _refusal(weights, t, recipe, f"{over + under} binade(s) out ({over} over, {under} under) and this "
                    "kernel has no per-expert global scale to absorb them, so no exact repair exists")


def scale_bytes_within(weights: MXFP4Weights, lo: int, hi: int) -> bool:
    """Whether every scale byte, of all-zero groups too, lies in lo..hi: then no nonzero group is out of the window
    and the per-expert analysis has nothing to find. One min / max over the scale bytes (1/16 of the weights)."""
    for scale in (weights.l1_scale, weights.l2_scale):
        if scale.numel():
            b = torch.aminmax(scale)
            if int(b.min) < lo or int(b.max) > hi:
                return False
    return True


def check_ranges(weights: MXFP4Weights, recipe) -> None:
    """Raise ValueError if any nonzero group's byte is out of ``recipe``'s window (or any byte is 0xFF),
    naming the expert, the tensor (l1 / l2), the offending bytes and how many weights would decode
    differently (``decode_loss``), and whether an exact rebase exists."""
    recipe = get_recipe(recipe)
    if recipe.max_scale_span is not None:  # a window relative to each tensor's largest byte (Humming W4A8)
        from .humming import check_humming_window

        check_humming_window(weights, who=recipe.name, span=recipe.max_scale_span)
    _readable(weights, recipe)
    if scale_bytes_within(weights, *_window(recipe)):
        return  # in the window already (a repaired or shifted copy, asked again): nothing the analysis could refuse
    report = _analyze(weights, recipe)
    bad = report.bad()
    if not bad:
        return
    hopeless = [t for t in bad if t.shift is None or not recipe.global_scales]
    if hopeless:  # the tensors no rebase can fix come first: they are the real problem
        raise ValueError(f"{len(bad)} expert tensor(s) out of range for {recipe.name}; first without an exact "
                         f"repair: {_explain(weights, hopeless[0], recipe)}")
    first = bad[0]
    raise ValueError(
        f"{len(bad)} expert tensor(s) out of range for {recipe.name}; first: "
        f"{_refusal(weights, first, recipe, f'an exact rebase by {first.shift} binade(s) exists')}; "
        "call megamoe.layouts.ranges.repair_ranges (or prepare_flashinfer_sm90) first"
    )


def _shift_bytes(scale: torch.Tensor, packed: torch.Tensor, s: int, lo: int, hi: int) -> torch.Tensor:
    """bytes + s on nonzero groups; all-zero groups (value 0 at any scale) are clamped into the window."""
    b = scale.to(torch.int32) + s
    b = torch.where(nonzero_groups(packed), b, b.clamp(lo, hi))
    if (b < 0).any() or (b > 254).any():  # cannot happen for a legal window, kept as a guard
        raise ValueError(f"rebase by {s} leaves the E8M0 range")
    return b.to(torch.uint8)


def fold_global_scales(weights: MXFP4Weights) -> MXFP4Weights:
    """Move power-of-two global scales into the scale bytes (exact); result has none.

    Raises ValueError when a global scale is not a power of two or the folded byte leaves 0..254.
    """
    check_mxfp4_values(weights, "fold_global_scales")
    out = {}
    for name in TENSORS:
        gs = getattr(weights, f"{name}_global_scale")
        packed, scale = getattr(weights, name), getattr(weights, f"{name}_scale")
        if gs is None:
            out[f"{name}_scale"] = scale
            continue
        m, ex = torch.frexp(gs)
        if not bool((m == 0.5).all()):
            bad = int((m != 0.5).nonzero()[0])
            raise ValueError(f"{name}_global_scale[{bad}] = {gs[bad].item()!r} is not a power of two; cannot fold it exactly")
        k = (ex - 1).to(torch.int32)  # gs = 2**k
        b = scale.to(torch.int32) + k[:, None, None]
        bad = ((b < 0) | (b > 254)) & nonzero_groups(packed)
        if bool(bad.any()):
            e = int(bad.flatten(1).any(1).nonzero()[0])
            raise ValueError(f"folding {name}_global_scale[{e}] = 2**{int(k[e])} pushes expert {e}'s scale bytes outside 0..254")
        out[f"{name}_scale"] = b.clamp(0, 254).to(torch.uint8)
    return replace(weights, l1_scale=out["l1_scale"], l2_scale=out["l2_scale"], l1_global_scale=None, l2_global_scale=None)


def repair_ranges(weights: MXFP4Weights, recipe) -> MXFP4Weights:
    """Exact rebase into ``recipe``'s window, or ValueError naming expert, tensor, bytes and binades.

    Global-scale recipes (FlashInfer): per expert, L1 (gate and up together) and L2 each get the
    smallest shift s landing every nonzero group in the window; bytes += s, global scale *= 2**-s
    (created as ones when absent). Other recipes: existing power-of-two global scales are folded
    into the bytes, then the window is checked. Already-legal weights come back unchanged in value.
    """
    recipe = get_recipe(recipe)
    if not isinstance(weights, MXFP4Weights):
        raise TypeError(f"weights must be MXFP4Weights, got {type(weights).__name__}")
    if not recipe.global_scales:
        if weights.l1_global_scale is not None or weights.l2_global_scale is not None:
            weights = fold_global_scales(weights)
        check_ranges(weights, recipe)
        return weights
    lo, hi = _window(recipe)
    _readable(weights, recipe)
    if _already_repaired(weights, lo, hi):
        return weights  # what the rebuild below would give, bit for bit, without scanning every expert again
    report = _analyze(weights, recipe)
    refused = [t for t in report.entries if t.shift is None]
    if refused:
        raise ValueError(f"cannot rebase {len(refused)} expert tensor(s) for {recipe.name}; first: "
                         f"{_explain(weights, refused[0], recipe)}")
    ones = torch.ones(weights.num_experts, dtype=torch.float32, device=weights.device)
    new = {}
    for name in TENSORS:
        shifts = [t.shift for t in report.entries if t.tensor == name]
        packed, scale = getattr(weights, name), getattr(weights, f"{name}_scale")
        new[f"{name}_scale"] = torch.stack([_shift_bytes(scale[e], packed[e], s, lo, hi) for e, s in enumerate(shifts)])
        gs = getattr(weights, f"{name}_global_scale")
        new[f"{name}_global_scale"] = _rebased_global_scale(name, ones if gs is None else gs, shifts)
    return replace(weights, **new)


def _already_repaired(weights: MXFP4Weights, lo: int, hi: int) -> bool:
    """Whether ``repair_ranges`` would rebuild these weights unchanged: every byte in the window (no shift; the
    all-zero groups it clamps already in), global scales present (it would add ones) and normal floats (it refuses
    a subnormal or zero one, shift or not: ``_rebased_global_scale``)."""
    for gs in (weights.l1_global_scale, weights.l2_global_scale):
        if gs is None or not bool((gs.abs() >= torch.finfo(torch.float32).tiny).all()):
            return False
    return scale_bytes_within(weights, lo, hi)


def _rebased_global_scale(name: str, gs: torch.Tensor, shifts: list[int]) -> torch.Tensor:
    """gs * 2**-s per expert, refused unless exact in float32: a power of two times a float32 is exact
    unless the product leaves the normal range (a subnormal loses bits, a huge one overflows)."""
    want = gs.double() * torch.tensor([2.0 ** -s for s in shifts], dtype=torch.float64, device=gs.device)
    got = want.float()
    bad = (got.double() != want) | ~torch.isfinite(got) | (got == 0) | (got.abs() < torch.finfo(torch.float32).tiny)
    if bool(bad.any()):
        e = int(bad.nonzero()[0])
        raise ValueError(
            f"{name}_global_scale[{e}] = {gs[e].item()!r} times 2**{-shifts[e]} (the rebase of expert {e} {name}) is "
            f"{want[e].item()!r}, which float32 holds only as {got[e].item()!r} (a subnormal, zero or overflow): "
            "the repair would change the expert's values, so it is refused")
    return got

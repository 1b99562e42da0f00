"""Adversarial cases: E8M0 scale bytes, decode windows, exact repair, decode loss (``SCALE``)."""

from __future__ import annotations

import dataclasses
import functools
import re

import torch

from adversarial_support import (
    NAN_BYTE, NONFINITE, Case, Correct, Exact, Refused, decoded_differently, fwd, inputs, legal_bytes, mutated,
    ranges, same_values, zero_group,
)
from megamoe.validate import NonFiniteOutputError


# ------------------------------------------------------------------------------------ scale bytes
@functools.lru_cache(maxsize=1)
def _real_like(wf=None):
    """Gaussian weights quantized to MXFP4, one expert with H = 1024, rows spread over 2**+-3 (as real
    checkpoints' per-row scales spread): their scale bytes reach below 119."""
    from megamoe.geometry import Geometry
    from megamoe.weights import quantize_experts_mxfp4, random_dense_expert

    g = Geometry("wide", num_experts=1, num_topk=1, hidden=1024, intermediate=128)
    w1, w2 = random_dense_expert(g, gen=torch.Generator().manual_seed(11), row_spread=3.0)
    return quantize_experts_mxfp4(w1[None], w2[None])


def _counts_in_message(get_weights, decode="e4m3_rn"):
    """The refusal's 'N of M weights decode differently (Z to zero' against an independent count."""
    def check(msg, wf):
        w = get_weights(wf)
        e, t = re.search(r"expert (\d+) (l[12]):", msg).groups()
        n, m, z = (int(v.replace(",", "")) for v in re.search(
            r"([\d,]+) of ([\d,]+) weights decode differently \(([\d,]+) to zero", msg).groups())
        packed, scale = getattr(w, t)[int(e)], getattr(w, f"{t}_scale")[int(e)]
        assert (n, z) == decoded_differently(packed, scale, decode) and n > 0
        assert m == packed.numel() * 2
    return check


def _byte_at(value, lo=124, hi=130, where=(0, 0, 0)):
    """Legal bytes with one nonzero group's byte set to ``value`` (its codes made nonzero)."""
    w = legal_bytes(lo=lo, hi=hi)
    l1, s = w.l1.clone(), w.l1_scale.clone()
    e, row, g = where
    l1[e, row, 16 * g: 16 * g + 16] |= 0x11
    s[where] = value
    return dataclasses.replace(w, l1=l1, l1_scale=s)


def _bytes_0_and_1(wf=None):
    """Expert 0 L1 row 0: group 0 at byte 0, group 1 at byte 1, both with nonzero codes."""
    w = _byte_at(0, where=(0, 0, 0))
    l1, s = w.l1.clone(), w.l1_scale.clone()
    l1[0, 0, 16:32] |= 0x11
    s[0, 0, 1] = 1
    return dataclasses.replace(w, l1=l1, l1_scale=s)


def _gs(value, byte_shift):
    """Legal bytes moved by ``byte_shift`` (the repair must move them back) under l1 global scale ``value``."""
    w = legal_bytes(lo=125, hi=127)
    return dataclasses.replace(w, l1_scale=(w.l1_scale.int() + byte_shift).to(torch.uint8),
                               l1_global_scale=torch.full((2,), value), l2_global_scale=torch.ones(2))


def _loss_is_independent(w, decode, expect_changed):
    """decode_loss per expert and tensor == the independent count; something lost iff ``expect_changed``."""
    def check(losses):
        for loss in losses:
            packed, scale = getattr(w, loss.tensor)[loss.expert], getattr(w, f"{loss.tensor}_scale")[loss.expert]
            assert (loss.changed, loss.to_zero) == decoded_differently(packed, scale, decode)
        assert (sum(x.changed for x in losses) > 0) == expect_changed
    return check


def _in_window_and(check, recipe):
    def both(w):
        assert ranges("analyze_ranges", w, recipe).ok
        check(w)
    return both


def _layout(name, **kw):
    def run(w):
        from megamoe import layouts

        return getattr(layouts, name)(w, **kw)
    return run


def _zero_group_ff(num_experts=2):
    """Expert 0 L1 row 3, group 1: all codes zero, scale byte 0xFF (written after construction)."""
    return mutated(zero_group(legal_bytes(num_experts=num_experts), 0, 3, 1), "l1_scale", (0, 3, 1), 255)


EXPERT_253 = mutated(legal_bytes(num_experts=8), "l1_scale", 0, 253)  # expert 0 L1: 4 * 2**126 overflows float32
ROUTED_TO_0 = dataclasses.replace(inputs(), topk_idx=torch.tensor([[0, 1]] * 6))
SCALE = [
    Case("scale", "0xFF repaired as 2**128",
         lambda wf: ranges("repair_ranges", mutated(legal_bytes(), "l1_scale", 1, 255), "flashinfer-mxfp4"),
         Refused(ValueError, rf"scale ranges for flashinfer-mxfp4: weights.l1_scale holds 2048 {NAN_BYTE} "
                             r"\(first at \[1, 0, 0\]\)"), "1"),
    Case("scale", "0xFF on an all-zero group, range check",
         lambda wf: ranges("check_ranges", _zero_group_ff(), "deepgemm-sm90-fp4"),
         Refused(ValueError, rf"holds 1 {NAN_BYTE} \(first at \[0, 3, 1\]\); 0xFF is refused even on all-zero groups"),
         "1"),
    Case("scale", "0xFF on an all-zero group, reference", lambda wf: fwd(_zero_group_ff(8), "deepgemm-sm90-fp4"),
         Refused(ValueError, rf"reference: weights.l1_scale holds 1 {NAN_BYTE}"), "1"),
    Case("scale", "0xFF on an all-zero group, SM90 FP4 layout",
         lambda wf: _layout("to_deepgemm_sm90_fp4", check=False)(_zero_group_ff()),
         Refused(ValueError, rf"to_deepgemm_sm90_fp4: weights.l1_scale holds 1 {NAN_BYTE}"), "1"),
    Case("scale", "0xFF, FlashInfer layout unchecked",
         lambda wf: _layout("to_flashinfer_sm90", check=False)(_zero_group_ff()),
         Refused(ValueError, rf"to_flashinfer_sm90: weights.l1_scale holds 1 {NAN_BYTE}"), "1"),
    Case("scale", "0xFF on a nonzero group, SM100 layout",
         lambda wf: _layout("to_deepgemm_sm100_fp4")(mutated(legal_bytes(), "l2_scale", (1, 7, 2), 255)),
         Refused(ValueError, rf"deepgemm-sm100-fp4: weights.l2_scale holds 1 {NAN_BYTE} \(first at \[1, 7, 2\]\)"), "1"),
    Case("scale", "0xFF at construction",
         lambda wf: dataclasses.replace(legal_bytes(), l2_scale=torch.full_like(legal_bytes().l2_scale, 255)),
         Refused(ValueError, rf"MXFP4Weights: weights.l2_scale holds 2048 {NAN_BYTE}"), "1"),
    Case("scale", "0xFF folded", lambda wf: _layout("fold_global_scales")(mutated(_gs(1.0, 0), "l2_scale", 0, 255)),
         Refused(ValueError, rf"fold_global_scales: weights.l2_scale holds 1024 {NAN_BYTE}"), "1"),
    Case("scale", "0xFF measured", lambda wf: ranges("decode_loss", mutated(legal_bytes(), "l1_scale", 0, 255), "exact"),
         Refused(ValueError, rf"decode loss for exact: weights.l1_scale holds 2048 {NAN_BYTE}"), "1"),
    Case("scale", "DeepGEMM FP4 below 119", lambda wf: ranges("check_ranges", _real_like(wf), "deepgemm-sm90-fp4"),
         Refused(ValueError, r"expert 0 l1: \d+ scale groups below byte 119 and 0 above byte 133 \(offending bytes "
                             r"\[(\d+, )*118\];.*decodes only bytes 119..133 exactly \([\d,]+ of [\d,]+ weights decode "
                             r"differently .*no exact repair exists", _counts_in_message(_real_like)), "2"),
    Case("scale", "DeepGEMM FP4 below 119, repair", lambda wf: ranges("repair_ranges", _real_like(wf), "deepgemm-sm90-fp4"),
         Refused(ValueError, r"expert 0 l1: .*offending bytes .*weights decode differently",
                 _counts_in_message(_real_like)), "2"),
    Case("scale", "DeepGEMM FP4 bytes 0 and 1", lambda wf: ranges("check_ranges", _bytes_0_and_1(), "deepgemm-sm90-fp4"),
         Refused(ValueError, r"offending bytes \[0, 1\];", _counts_in_message(_bytes_0_and_1)), "2"),
    Case("scale", "DeepGEMM FP4 bytes 0 and 1 measured", lambda wf: ranges("decode_loss", _bytes_0_and_1(), "deepgemm-sm90-fp4"),
         Correct(_loss_is_independent(_bytes_0_and_1(), "e4m3_rn", expect_changed=True)), "2"),
    Case("scale", "DeepGEMM FP4 byte 118", lambda wf: ranges("check_ranges", _byte_at(118), "deepgemm-sm90-fp4"),
         Refused(ValueError, r"1 scale groups below byte 119 .*offending bytes \[118\]"), "2"),
    Case("scale", "DeepGEMM FP4 byte 119 is exact", lambda wf: ranges("decode_loss", _byte_at(119), "deepgemm-sm90-fp4"),
         Correct(_loss_is_independent(_byte_at(119), "e4m3_rn", expect_changed=False)), "2"),
    Case("scale", "DeepGEMM FP4 byte 134", lambda wf: ranges("check_ranges", _byte_at(134), "deepgemm-sm90-fp4"),
         Refused(ValueError, r"0 scale groups below byte 119 and 1 above byte 133 .*offending bytes \[134\]"), "2"),
    Case("scale", "FlashInfer byte 121 rebased",
         lambda wf: ranges("repair_ranges", _byte_at(121, 122, 128), "flashinfer-mxfp4"),
         Exact(_in_window_and(same_values(_byte_at(121, 122, 128)), "flashinfer-mxfp4"))),
    Case("scale", "FlashInfer byte 134 rebased",
         lambda wf: ranges("repair_ranges", _byte_at(134, 124, 130), "flashinfer-mxfp4"),
         Exact(_in_window_and(same_values(_byte_at(134, 124, 130)), "flashinfer-mxfp4"))),
    Case("scale", "FlashInfer raw bytes measured",
         lambda wf: (ranges("decode_loss", _real_like(wf), "flashinfer-mxfp4"), _real_like(wf)),
         Correct(lambda r: _loss_is_independent(r[1], "e4m3_flush_saturate", expect_changed=True)(r[0]))),
    Case("scale", "exact decode, byte 253", lambda wf: ranges("check_ranges", EXPERT_253, "exact"),
         Refused(ValueError, r"expert 0 l1: 0 scale groups below byte 0 and \d+ above byte 252 .*offending bytes \[253\]")),
    Case("scale", "exact decode of byte 253 overflows", lambda wf: fwd(EXPERT_253, "exact", ROUTED_TO_0),
         Refused(NonFiniteOutputError, rf"reference \(exact\): y of rank 0 {NONFINITE}")),
    Case("scale", "subnormal global scale, inexact",
         lambda wf: ranges("repair_ranges", _gs(3 * 2.0**-148, -5), "flashinfer-mxfp4"),
         Refused(ValueError, r"l1_global_scale\[0\] = .* times 2\*\*-2 \(the rebase of expert 0 l1\) is .*float32 "
                             r"holds only as .*the repair would change the expert's values"), "also-subnormal"),
    Case("scale", "subnormal global scale, subnormal result",
         lambda wf: ranges("repair_ranges", _gs(3 * 2.0**-140, -4), "flashinfer-mxfp4"),
         Refused(ValueError, r"l1_global_scale\[0\] .*\(a subnormal, zero or overflow\)"), "also-subnormal"),
    Case("scale", "subnormal global scale, exact",
         lambda wf: ranges("repair_ranges", _gs(2.0**-140, 21), "flashinfer-mxfp4"),
         Exact(_in_window_and(same_values(_gs(2.0**-140, 21)), "flashinfer-mxfp4")), "also-subnormal"),
]

"""Scale-range analysis and exact repair: rebase or refuse, never pass an illegal scale silently."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megamoe.geometry import get_geometry
from megamoe.layouts.flashinfer_sm90 import from_flashinfer_sm90, prepare_flashinfer_sm90, to_flashinfer_sm90
from megamoe.layouts.random import random_mxfp4_bytes
from megamoe.layouts.ranges import analyze_ranges, check_ranges, fold_global_scales, nonzero_groups, repair_ranges
from megamoe.testing import assert_bitwise_equal
from megamoe.weights import random_mxfp4_weights

G = get_geometry("tiny")


def assert_same_values(a, b):
    for e in range(a.num_experts):
        for got, want, what in zip(a.dequantize_expert(e), b.dequantize_expert(e), ("w1", "w2")):
            assert_bitwise_equal(got, want, f"expert {e} {what}")


@pytest.fixture(scope="module")
def realistic():
    return random_mxfp4_weights(G, seed=51)


def test_realistic_scales_are_below_flashinfer_window(realistic):
    report = analyze_ranges(realistic, "flashinfer-mxfp4")
    assert not report.ok
    assert all(t.below > 0 and t.above == 0 and t.max_byte < 122 + 11 for t in report.entries)
    d = report.to_dict()
    assert d["recipe"] == "flashinfer-mxfp4" and len(d["entries"]) == 2 * G.num_experts
    assert "below" in str(report)
    with pytest.raises(ValueError, match=r"expert 0 l1: \d+ scale groups below byte 122.*repair_ranges"):
        check_ranges(realistic, "flashinfer-mxfp4")


def test_repair_is_exact_and_lands_in_window(realistic):
    fixed = repair_ranges(realistic, "flashinfer-mxfp4")
    assert analyze_ranges(fixed, "flashinfer-mxfp4").ok
    check_ranges(fixed, "flashinfer-mxfp4")
    assert_bitwise_equal(fixed.l1, realistic.l1, "codes untouched")
    assert_bitwise_equal(fixed.l2, realistic.l2, "codes untouched")
    assert_same_values(fixed, realistic)
    for gs in (fixed.l1_global_scale, fixed.l2_global_scale):
        m, _ = torch.frexp(gs)
        assert bool((m == 0.5).all()), "global scales must be powers of two"
    # gate and up share one shift: one global scale per expert
    shift = (fixed.l1_scale.int() - realistic.l1_scale.int())[nonzero_groups(fixed.l1)]
    assert shift.numel() > 0
    # repairing again is a no-op
    again = repair_ranges(fixed, "flashinfer-mxfp4")
    assert_bitwise_equal(again.l1_scale, fixed.l1_scale)
    assert_bitwise_equal(again.l1_global_scale, fixed.l1_global_scale)


def deliberate(seed: int):
    """Legal random bytes, then: expert 1's L2 pushed 5 binades above the window, expert 2's L1
    spread wider than the window, and an all-zero group with an absurd scale in expert 0."""
    w = random_mxfp4_bytes(G, seed=seed, num_experts=4, scale_bytes=(124, 130))
    w.l2_scale[1] += 8  # bytes 132..138: 5 over 133, span 7 <= 12 -> rebase by -5
    w.l1_scale[2, 0, 0] = 100  # with bytes up to 130: span 31 > 12 -> refuse
    w.l1[2, 0, :16] |= 0x11  # make sure that group has nonzero codes
    w.l1[0, 5, 16:32] &= 0x88  # group 1 of row 5: only signs, i.e. all zeros
    w.l1_scale[0, 5, 1] = 3
    return w


def test_deliberate_out_of_range_rebases_or_refuses():
    w = deliberate(52)
    report = analyze_ranges(w, "flashinfer-mxfp4")
    by = {(t.expert, t.tensor): t for t in report.entries}
    assert by[(0, "l1")].ok, "an all-zero group's scale is never used and must not count"
    assert by[(1, "l2")].above > 0 and by[(1, "l2")].shift == -5
    assert by[(2, "l1")].below == 1 and by[(2, "l1")].shift is None
    with pytest.raises(ValueError, match=r"expert 2 l1: 1 scale groups below byte 122 .*bytes 100\.\.130.*"
                                         r"span is 31 binades but the window is 12: 19 binade\(s\) too wide"):
        repair_ranges(w, "flashinfer-mxfp4")
    with pytest.raises(ValueError, match="expert 2 l1"):
        to_flashinfer_sm90(w)
    with pytest.raises(ValueError, match="expert 2 l1"):
        prepare_flashinfer_sm90(w)
    # without the impossible expert: rebased, exact, and through the kernel layout and back
    ok = w.experts(0, 2)
    fixed = repair_ranges(ok, "flashinfer-mxfp4")
    assert float(fixed.l2_global_scale[1]) == 2.0**5
    assert int(fixed.l1_scale[0, 5, 1]) == 122, "an all-zero group is clamped into the window"
    assert_same_values(fixed, ok)
    p = prepare_flashinfer_sm90(ok)
    back = from_flashinfer_sm90(p.l1, p.l2, hidden=G.hidden, intermediate=G.intermediate,
                                l1_global_scale=p.l1_global_scales, l2_global_scale=p.l2_global_scales)
    assert_same_values(back, ok)


def test_deepgemm_fp4_refuses_with_binades():
    w = deliberate(53).experts(1, 2)  # L2 bytes up to 138
    report = analyze_ranges(w, "deepgemm-sm90-fp4")
    assert report.entries[1].above > 0 and report.entries[0].ok
    with pytest.raises(ValueError, match=r"expert 0 l2: 0 scale groups below byte 119 and \d+ above byte 133 .*"
                                         r"5 binade\(s\) out .*no per-expert global scale"):
        repair_ranges(w, "deepgemm-sm90-fp4")


def test_fold_global_scales_is_exact(realistic):
    fixed = repair_ranges(realistic, "flashinfer-mxfp4")
    folded = fold_global_scales(fixed)
    assert folded.l1_global_scale is None and folded.l2_global_scale is None
    assert_same_values(folded, realistic)
    from dataclasses import replace

    with pytest.raises(ValueError, match=r"l1_global_scale\[0\] = 3.0 is not a power of two"):
        fold_global_scales(replace(fixed, l1_global_scale=torch.full((G.num_experts,), 3.0)))


def test_exact_decode_recipes_pass_every_float32_byte():
    """The exact (float32) decode holds bytes 0..252; 253 and 254 overflow float32 for the larger codes."""
    w = random_mxfp4_bytes(G, seed=54, num_experts=2, scale_bytes=(0, 252))
    assert analyze_ranges(w, "deepgemm-sm100-fp4").ok
    assert repair_ranges(w, "exact") is w


def test_rich_report_renders(realistic):
    from rich.console import Console

    console = Console(record=True, width=140)
    console.print(analyze_ranges(realistic.experts(0, 2), "flashinfer-mxfp4"))
    assert "flashinfer-mxfp4" in console.export_text()


def test_bad_arguments():
    with pytest.raises(TypeError, match="MXFP4Weights"):
        analyze_ranges("weights", "flashinfer-mxfp4")
    with pytest.raises(ValueError, match="unknown recipe"):
        analyze_ranges(random_mxfp4_bytes(G, seed=55, num_experts=1), "nope")


# ------------------------------------------------------------------------------------ one analysis per (weights, recipe)
def _count_analyses(monkeypatch) -> list:
    """Every expert tensor the per-expert range analysis scans, recorded (two per expert per analysis)."""
    import megamoe.layouts.ranges as ranges

    scanned, real = [], ranges._tensor_range
    monkeypatch.setattr(ranges, "_tensor_range", lambda e, name, *a: scanned.append((e, name)) or real(e, name, *a))
    return scanned


def _on_cpu(cls):
    """A backend class whose prepare runs here: the CPU is its device, and it says it is available."""
    return type(f"CPU{cls.__name__}", (cls,), {"device": property(lambda self: torch.device("cpu")),
                                              "availability": classmethod(lambda c: (True, ""))})


@pytest.mark.parametrize("name", ["flashinfer-mxfp4", "deepgemm-sm90-fp4"])
def test_the_matrix_path_analyses_its_weights_once_per_recipe(monkeypatch, name):
    """What the differential matrix does with a backend: synthetic_weights, then prepare (FlashInfer: its repair, the
    converter's repair and check; DeepGEMM FP4: its window check). One per-expert analysis, of the raw weights;
    every later ask finds the weights in the window by their scale bytes. It was four for FlashInfer."""
    from megamoe.fused.external import OneRank
    from megamoe.fused.registry import BACKENDS

    cls = _on_cpu(BACKENDS[name])
    w = random_mxfp4_weights(G, seed=52)
    scanned = _count_analyses(monkeypatch)
    synthetic = cls.synthetic_weights(w)
    be = cls(G, capacity=8, group=OneRank())
    be.prepare(synthetic)
    assert_same_values(be.kernel_weights, synthetic)
    if name == "flashinfer-mxfp4":
        assert repair_ranges(synthetic, name) is synthetic  # nothing to move: handed back, not rebuilt
    assert len(scanned) == 2 * G.num_experts, scanned
    if name == "flashinfer-mxfp4":
        want = prepare_flashinfer_sm90(w)  # the converter on the raw weights, as prepare called it before
        for got, ref, what in ((be.l1, want.l1, "l1"), (be.l2, want.l2, "l2"), (be.gs1, want.l1_global_scales, "gs1"),
                               (be.gs2, want.l2_global_scales, "gs2")):
            assert_bitwise_equal(got, ref, what)


def test_the_scale_byte_answer_only_clears_what_the_analysis_would(monkeypatch, realistic):
    """All bytes in the window: answered without the analysis. One all-zero group's byte outside it: the analysis
    runs and passes (an all-zero group decodes to 0 at any scale); the same byte in a nonzero group: refused."""
    w = repair_ranges(realistic, "flashinfer-mxfp4")
    scanned = _count_analyses(monkeypatch)
    check_ranges(w, "flashinfer-mxfp4")
    assert repair_ranges(w, "flashinfer-mxfp4") is w and not scanned
    l2 = w.l2.clone()
    l2[1, 2, 0:16] = 0  # group 0 of expert 1's row 2: all-zero codes
    quiet_scale, loud_scale = w.l2_scale.clone(), w.l2_scale.clone()
    quiet_scale[1, 2, 0] = 140
    check_ranges(dataclasses.replace(w, l2=l2, l2_scale=quiet_scale), "flashinfer-mxfp4")
    assert len(scanned) == 2 * G.num_experts
    assert nonzero_groups(w.l2)[1, 2, 0]
    loud_scale[1, 2, 0] = 140  # the same byte where the codes are not all zero
    with pytest.raises(ValueError, match=r"out of range for flashinfer-mxfp4.*expert 1 l2: 0 scale groups below byte "
                                         r"122 and 1 above byte 133 \(offending bytes \[140\]"):
        check_ranges(dataclasses.replace(w, l2_scale=loud_scale), "flashinfer-mxfp4")

"""FlashInfer SM90 MXFP4 layout: bitwise round trips, bytes equal FlashInfer's own transform."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from megamoe.formats import pack_e2m1
from megamoe.geometry import get_geometry
from megamoe.layouts.flashinfer_sm90 import (
    TILE_BYTES,
    FlashInferSM90Layout,
    from_flashinfer_sm90,
    from_marlin_order,
    prepare_flashinfer_sm90,
    to_flashinfer_sm90,
    to_marlin_order,
)
from megamoe.layouts.random import random_mxfp4_bytes
from megamoe.testing import FLASHINFER_ORACLE, assert_bitwise_equal
from megamoe.weights import random_mxfp4_weights


@dataclass(frozen=True)
class Case:
    preset: str
    experts: int  # dsv4 presets sliced to a few experts, full H and I
    seed: int

    @property
    def id(self) -> str:
        return f"{self.preset}-E{self.experts}"


CASES = [Case("tiny", 8, 1), Case("small", 4, 2), Case("dsv4-flash", 2, 3), Case("dsv4-pro", 1, 4)]
_cache: dict = {}


def weights_for(case: Case):
    if case not in _cache:
        _cache[case] = random_mxfp4_bytes(get_geometry(case.preset), seed=case.seed, num_experts=case.experts)
    return _cache[case]


def converted(case: Case):
    key = ("fi", case)
    if key not in _cache:
        _cache[key] = to_flashinfer_sm90(weights_for(case))
    return _cache[key]


def assert_weights_equal(a, b, what=""):
    for name in ("l1", "l1_scale", "l2", "l2_scale"):
        assert_bitwise_equal(getattr(a, name), getattr(b, name), f"{what}{name}")


def test_marlin_order_example():
    # One word: K[0..7] = codes 1..8. Marlin byte b = K[b] << 4 | K[b+4].
    codes = torch.arange(1, 9, dtype=torch.uint8)
    marlin = to_marlin_order(pack_e2m1(codes)[None])[0]
    assert marlin.tolist() == [(1 << 4) | 5, (2 << 4) | 6, (3 << 4) | 7, (4 << 4) | 8]
    assert_bitwise_equal(from_marlin_order(marlin[None])[0], pack_e2m1(codes))


def test_marlin_order_roundtrip_random():
    p = torch.randint(0, 256, (3, 64, 128), dtype=torch.int32, generator=torch.Generator().manual_seed(5)).to(torch.uint8)
    assert_bitwise_equal(from_marlin_order(to_marlin_order(p)), p)
    assert not torch.equal(to_marlin_order(p), p)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_roundtrip_bitwise(case):
    w = weights_for(case)
    l1, l2 = converted(case)  # random bytes 122..133: inside the legal window
    g = get_geometry(case.preset)
    assert l1.shape == (case.experts, 2 * g.intermediate // 128 * (g.hidden // 128), TILE_BYTES) and l1.dtype == torch.uint8
    assert l2.shape == (case.experts, g.hidden // 128 * (g.intermediate // 128), TILE_BYTES)
    back = from_flashinfer_sm90(l1, l2, hidden=g.hidden, intermediate=g.intermediate)
    assert_weights_equal(back, w)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_bytes_equal_flashinfer_transform(case):
    fm = pytest.importorskip("flashinfer.megamoe", reason=FLASHINFER_ORACLE)
    w = weights_for(case)
    ours = converted(case)
    theirs = fm.transform_mxfp4_weights_for_mega_moe((to_marlin_order(w.l1), w.l1_scale), (to_marlin_order(w.l2), w.l2_scale))
    assert_bitwise_equal(ours[0], theirs[0], "l1 tiles")
    assert_bitwise_equal(ours[1], theirs[1], "l2 tiles")


def test_realistic_weights_match_flashinfer_after_repair():
    fm = pytest.importorskip("flashinfer.megamoe", reason=FLASHINFER_ORACLE)
    w = random_mxfp4_weights(get_geometry("tiny"), seed=11)
    p = prepare_flashinfer_sm90(w)
    from megamoe.layouts.ranges import repair_ranges

    r = repair_ranges(w, "flashinfer-mxfp4")
    theirs = fm.transform_mxfp4_weights_for_mega_moe((to_marlin_order(r.l1), r.l1_scale), (to_marlin_order(r.l2), r.l2_scale))
    assert_bitwise_equal(p.l1, theirs[0])
    assert_bitwise_equal(p.l2, theirs[1])
    back = from_flashinfer_sm90(p.l1, p.l2, hidden=w.hidden, intermediate=w.intermediate,
                                l1_global_scale=p.l1_global_scales, l2_global_scale=p.l2_global_scales)
    for e in range(w.num_experts):
        for got, want in zip(back.dequantize_expert(e), w.dequantize_expert(e)):
            assert_bitwise_equal(got, want, f"expert {e} values")


def test_broken_variants_are_caught():
    """A gate/up swap or a missing Marlin reorder must not pass the oracle comparison."""
    fm = pytest.importorskip("flashinfer.megamoe", reason=FLASHINFER_ORACLE)
    w = weights_for(CASES[0])
    ours = to_flashinfer_sm90(w)
    i = w.intermediate
    swapped = torch.cat([w.l1[:, i:], w.l1[:, :i]], dim=1)
    bad = fm.transform_mxfp4_weights_for_mega_moe((to_marlin_order(swapped), w.l1_scale), (to_marlin_order(w.l2), w.l2_scale))
    assert not torch.equal(bad[0], ours[0])
    no_marlin = fm.transform_mxfp4_weights_for_mega_moe((w.l1, w.l1_scale), (w.l2, w.l2_scale))
    assert not torch.equal(no_marlin[1], ours[1])


def test_fast_braid_equals_nibble_statement():
    from megamoe.layouts.flashinfer_sm90 import _braid_from_checkpoint, _braid_signs, _unbraid_to_checkpoint

    p = random_mxfp4_bytes(get_geometry("tiny"), seed=12, num_experts=2).l1
    fast = _braid_from_checkpoint(p)
    assert_bitwise_equal(fast, _braid_signs(to_marlin_order(p)))
    assert_bitwise_equal(_unbraid_to_checkpoint(fast), p)


def test_tile_indexing_equation():
    """Spot-check FlashInferSM90Layout's stated equation on one expert's L2 bytes."""
    g = get_geometry("small")
    w = random_mxfp4_bytes(g, seed=7, num_experts=1)
    _, l2 = to_flashinfer_sm90(w)
    from megamoe.layouts.flashinfer_sm90 import _braid_from_checkpoint

    braided = _braid_from_checkpoint(w.l2)
    lay = FlashInferSM90Layout(g.hidden, g.intermediate)
    assert l2.shape[1:] == lay.shape
    gen = torch.Generator().manual_seed(8)
    for _ in range(50):
        n = int(torch.randint(0, g.hidden, (), generator=gen))
        grp = int(torch.randint(0, g.intermediate // 32, (), generator=gen))
        tile = (n // 128) * (g.intermediate // 128) + grp // 4
        assert int(l2[0, tile, 8192 + (n % 128) * 4 + grp % 4]) == int(w.l2_scale[0, n, grp])
        byte = int(torch.randint(0, g.intermediate // 2, (), generator=gen))  # k-pair index in the row
        kp = byte % 64
        tile = (n // 128) * (g.intermediate // 128) + byte // 64
        assert int(l2[0, tile, ((kp // 16) * 128 + n % 128) * 16 + kp % 16]) == int(braided[0, n, byte])


def test_bad_inputs_name_the_argument():
    g = get_geometry("tiny")
    w = random_mxfp4_bytes(g, seed=9, num_experts=2)
    l1, l2 = to_flashinfer_sm90(w)
    with pytest.raises(ValueError, match="l2 must have shape"):
        from_flashinfer_sm90(l1, l2[:, :-1], hidden=g.hidden, intermediate=g.intermediate)
    with pytest.raises(TypeError, match="l1 must have dtype"):
        from_flashinfer_sm90(l1.view(torch.int8), l2, hidden=g.hidden, intermediate=g.intermediate)
    with pytest.raises(ValueError, match="l1 must have shape"):
        from_flashinfer_sm90(l1, l2, hidden=2 * g.hidden, intermediate=g.intermediate)
    with pytest.raises(ValueError, match="hidden must be a positive multiple of 128"):
        from_flashinfer_sm90(l1, l2, hidden=100, intermediate=g.intermediate)
    with pytest.raises(TypeError, match="MXFP4Weights"):
        to_flashinfer_sm90((w.l1, w.l1_scale))
    low = random_mxfp4_bytes(g, seed=10, num_experts=2, scale_bytes=(110, 121))
    with pytest.raises(ValueError, match=r"expert 0 l1: .* below byte 122"):
        to_flashinfer_sm90(low)

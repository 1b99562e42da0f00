"""Bad inputs fail early with a message that names the argument (never deep inside a GEMM)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pytest
import torch

from megamoe.geometry import Geometry, get_geometry
from megamoe.inputs import MoEInputs, make_inputs, make_routing
from megamoe.recipe import Recipe, get_recipe
from megamoe.reference import moe_forward, moe_forward_ep
from megamoe.testing import weights_for_recipe
from megamoe.weights import MXFP4Weights


def _good(g):
    return make_inputs(g, 6, seed=0)


def _with(inp: MoEInputs, **kw) -> MoEInputs:
    d = dict(x=inp.x, topk_idx=inp.topk_idx, topk_weights=inp.topk_weights)
    d.update(kw)
    return MoEInputs(**d)


def _dup(inp):
    idx = inp.topk_idx.clone()
    idx[3, 1] = idx[3, 0]
    return _with(inp, topk_idx=idx)


def _set(inp, name, pos, value):
    t = getattr(inp, name).clone()
    t[pos] = value
    return _with(inp, **{name: t})


@dataclass
class BadCase:
    name: str
    mutate: Callable[[MoEInputs], MoEInputs]
    error: type
    match: str

    def __str__(self) -> str:
        return self.name


CASES = [
    BadCase("x-float32", lambda i: _with(i, x=i.x.float()), TypeError, "x must be bfloat16, got torch.float32"),
    BadCase("x-wrong-hidden", lambda i: _with(i, x=torch.randn(6, 384).bfloat16()), ValueError, r"x must be \[T, 256\], got \(6, 384\)"),
    BadCase("x-1d", lambda i: _with(i, x=i.x[0]), ValueError, r"MoEInputs: x must be 2-D, got shape \(256,\)"),
    BadCase("x-on-meta", lambda i: i.to("meta"), ValueError, "x is on meta but the weights are on cpu"),
    BadCase("x-nan", lambda i: _set(i, "x", (2, 7), float("nan")), ValueError, "x contains NaN or Inf"),
    BadCase("x-inf", lambda i: _set(i, "x", (0, 0), float("inf")), ValueError, "x contains NaN or Inf"),
    BadCase("topk-idx-int32", lambda i: _with(i, topk_idx=i.topk_idx.int()), TypeError, "topk_idx must be int64, got torch.int32"),
    BadCase("topk-idx-too-many-slots", lambda i: _with(i, topk_idx=torch.cat([i.topk_idx, i.topk_idx[:, :1]], 1),
                                                        topk_weights=torch.cat([i.topk_weights] * 2, 1)[:, :3]),
            ValueError, r"topk_idx must be \[6, 2\], got \(6, 3\)"),
    BadCase("topk-idx-fewer-tokens", lambda i: _with(i, topk_idx=i.topk_idx[:5]), ValueError,
            r"MoEInputs: x, topk_idx and topk_weights must be \[T, H\], \[T, K\], \[T, K\], got \(6, 256\), \(5, 2\), \(6, 2\)"),
    BadCase("topk-idx-out-of-range-high", lambda i: _set(i, "topk_idx", (1, 0), 8), ValueError,
            r"topk_idx must be in \[-1, 7\] \(-1 = masked\), got values in \[\d+, 8\]"),
    BadCase("topk-idx-out-of-range-low", lambda i: _set(i, "topk_idx", (1, 0), -2), ValueError, r"topk_idx must be in \[-1, 7\]"),
    BadCase("topk-idx-duplicated", _dup, ValueError, r"topk_idx: token 3 routes to the same expert twice"),
    BadCase("topk-idx-on-meta", lambda i: _with(i, topk_idx=i.topk_idx.to("meta")), ValueError, "topk_idx is on meta but x is on cpu"),
    BadCase("topk-weights-shape", lambda i: _with(i, topk_weights=i.topk_weights[:, :1]), ValueError,
            r"MoEInputs: x, topk_idx and topk_weights .* got \(6, 256\), \(6, 2\), \(6, 1\)"),
    BadCase("topk-weights-bf16", lambda i: _with(i, topk_weights=i.topk_weights.bfloat16()), TypeError, "topk_weights must be float32"),
    BadCase("topk-weights-nan", lambda i: _set(i, "topk_weights", (4, 1), float("nan")), ValueError, r"topk_weights contains NaN or Inf \(first at \[token, slot\] = \[4, 1\]"),
    BadCase("topk-weights-on-meta", lambda i: _with(i, topk_weights=i.topk_weights.to("meta")), ValueError,
            "topk_weights is on meta but x is on cpu"),
]


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("recipe", ["exact", "deepgemm-sm90-fp4"])
def test_bad_input_rejected(case, recipe, weights_for):
    g, w = weights_for("tiny")
    with pytest.raises(case.error, match=case.match):  # structural errors come from MoEInputs itself
        moe_forward(case.mutate(_good(g)), w, recipe, g)


def test_bad_input_names_the_rank(weights_for):
    g, w = weights_for("tiny")
    good, bad = _good(g), _dup(_good(g))
    with pytest.raises(ValueError, match="rank 1: topk_idx: token 3"):
        moe_forward_ep([good, bad], w, "exact", g)


def test_duplicate_masked_slots_are_fine(weights_for):
    g, w = weights_for("tiny")
    inp = _good(g)
    idx = inp.topk_idx.clone()
    idx[2] = -1  # two -1 in one token: masked, not duplicated
    y = moe_forward(_with(inp, topk_idx=idx), w, "exact", g)
    assert (y[2] == 0).all()


def test_weights_and_geometry_must_agree(weights_for):
    g, w = weights_for("tiny")
    with pytest.raises(ValueError, match=r"weights are \(E, H, I\) = \(8, 256, 128\) but geometry 'small' expects"):
        moe_forward(make_inputs(get_geometry("small"), 2, seed=0), w, "exact", get_geometry("small"))


def test_recipe_and_weight_format_must_agree(weights_for):
    g, w = weights_for("tiny")
    inp = _good(g)
    with pytest.raises(ValueError, match="reads FP8 block weights; convert"):
        moe_forward(inp, w, "deepgemm-sm90-fp8", g)
    _, w8 = weights_for("tiny", recipe="deepgemm-sm90-fp8")
    with pytest.raises(ValueError, match="reads MXFP4 weights, got FP8 block weights"):
        moe_forward(inp, w8, "flashinfer-mxfp4", g)
    _, wgs = weights_for("tiny", recipe="flashinfer-mxfp4")
    if wgs.l1_global_scale is not None:
        with pytest.raises(ValueError, match="has no per-expert global scales but the weights carry them"):
            moe_forward(inp, wgs, "deepgemm-sm90-fp4", g)
    with pytest.raises(ValueError, match="unknown recipe 'nope'"):
        moe_forward(inp, w, "nope", g)
    with pytest.raises(TypeError, match="weights must be MXFP4Weights or FP8BlockWeights"):
        moe_forward(inp, {"l1": w.l1}, "flashinfer-mxfp4", g.with_())


@pytest.mark.parametrize(
    "field,value,error,match",
    [
        ("l1", lambda w: w.l1.view(torch.int8), TypeError, "l1 must have dtype torch.uint8"),
        ("l1_scale", lambda w: w.l1_scale[:, :, :-1], ValueError, r"l1_scale must have shape \(8, 256, 8\)"),
        ("l2", lambda w: w.l2[:, :, :-1], ValueError, r"l2 must have shape \(8, 256, 64\)"),
        ("l1_global_scale", lambda w: torch.ones(7), ValueError, r"l1_global_scale must have shape \(8,\)"),
        ("l2_global_scale", lambda w: -torch.ones(8), ValueError, "l2_global_scale must be finite and positive"),
        ("l2_scale", lambda w: w.l2_scale.to("meta"), ValueError, "all weight tensors must be on one device"),
    ],
    ids=lambda v: v if isinstance(v, str) and not v[0].isupper() and " " not in v else None,
)
def test_mxfp4_weights_validate(field, value, error, match, weights_for):
    _, w = weights_for("tiny")
    kw = {f: getattr(w, f) for f in ("l1", "l1_scale", "l2", "l2_scale", "l1_global_scale", "l2_global_scale")}
    kw[field] = value(w)
    with pytest.raises(error, match=match):
        MXFP4Weights(**kw)


def test_geometry_and_recipe_validate():
    with pytest.raises(ValueError, match="hidden must be a positive multiple of 128, got 100"):
        Geometry("bad", num_experts=8, num_topk=2, hidden=100, intermediate=128)
    with pytest.raises(ValueError, match=r"num_topk must be in \[1, 4\], got 5"):
        Geometry("bad", num_experts=4, num_topk=5, hidden=128, intermediate=128)
    with pytest.raises(ValueError, match="unknown geometry preset 'dsv5'"):
        get_geometry("dsv5")
    with pytest.raises(ValueError, match="weight_decode must be one of"):
        Recipe(name="x", kernel="x", weight_decode="magic")
    with pytest.raises(ValueError, match="l2_group must divide or be a multiple of 128, got 48"):
        get_recipe("flashinfer-mxfp4").with_(l2_group=48)


def test_make_routing_rejects_too_many_empty_experts():
    with pytest.raises(ValueError, match="only 1 experts may receive tokens but num_topk=2"):
        make_routing(4, 8, 2, gen=torch.Generator().manual_seed(0), empty_experts=tuple(range(7)))


def test_weights_for_recipe_unknown():
    with pytest.raises(ValueError, match="unknown recipe"):
        weights_for_recipe(None, "nope")

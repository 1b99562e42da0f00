"""The eager reference pipeline against dense per-token oracles (``reference_oracles.py``, beside this file;
routing: ``test_routing.py``).

Two oracles, both a plain loop over tokens and slots (no dispatch, no pool, no batching):
    dense_exact_oracle   float64 throughout, weights via formats.dequantize_mxfp4
    kernel_oracle        replays one recipe's quantization points on one (token, slot) at a time:
                         FP8 staging, weight decode rule, per-K-block promotion, SwiGLU, routing
                         weight, requant, bf16 per slot, FP32 slot-ordered combine
The reference must match the first to calc_diff < 1e-10 and the second bit for bit.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field

import pytest
import torch

from megamoe import formats
from megamoe.geometry import get_geometry
from megamoe.inputs import make_inputs
from megamoe.recipe import get_recipe
from megamoe.reference import moe_forward
from megamoe.testing import assert_bitwise_equal, assert_close_diff, calc_diff, fp8_block_weights
from megamoe.weights import random_mxfp4_weights

from reference_oracles import dense_exact_oracle, kernel_oracle, random_byte_weights, rebase_scales

_ORACLE: dict = {}  # (kind, case, recipe) -> the oracle's output, computed once per session


def exact_ref(case, recipe_for_weights: str = "exact") -> torch.Tensor:
    """dense_exact_oracle of a case on the weights ``recipe_for_weights`` reads, memoised."""
    key = ("exact", case.name, get_recipe(recipe_for_weights).weight_format)
    if key not in _ORACLE:
        g, w = case_weights(case, recipe_for_weights)
        inp = case_inputs(case)
        _ORACLE[key] = dense_exact_oracle(inp.x, inp.topk_idx, inp.topk_weights, w, g)
    return _ORACLE[key]


def kernel_ref(case, recipe: str):
    """kernel_oracle of a case for a recipe, memoised: (y, stages)."""
    key = ("kernel", case.name, recipe)
    if key not in _ORACLE:
        g, w = case_weights(case, recipe)
        inp = case_inputs(case)
        _ORACLE[key] = kernel_oracle(inp.x, inp.topk_idx, inp.topk_weights, w, g, recipe)
    return _ORACLE[key]


# ------------------------------------------------------------------------------------ cases
@dataclass
class RefCase:
    name: str
    preset: str
    tokens: int
    seed: int = 0
    num_experts: int | None = None  # override (dsv4-flash shapes with 2 experts)
    routing: dict = field(default_factory=dict)
    x_scale: float = 1.0
    outlier_channels: int = 0

    def __str__(self) -> str:
        return self.name

    def geometry(self):
        g = get_geometry(self.preset)
        if self.num_experts is not None:
            g = g.with_(num_experts=self.num_experts, num_topk=min(g.num_topk, self.num_experts))
        return g


CASES = [
    RefCase("tiny-T1", "tiny", 1, seed=1),
    RefCase("tiny-T13-masked", "tiny", 13, seed=2, routing=dict(mask_prob=0.3, fully_masked_tokens=(4,))),
    RefCase("small-T24-skew-empty", "small", 24, seed=3, routing=dict(skew=1.2, empty_experts=(0, 5, 9)), outlier_channels=3),
    RefCase("small-T9-bigx", "small", 9, seed=4, x_scale=30.0),
]
DSV4 = RefCase("dsv4flash-E2-T3", "dsv4-flash", 3, seed=5, num_experts=2)

_WEIGHTS: dict = {}


def case_weights(case: RefCase, recipe_name: str = "exact"):
    g = case.geometry()
    key = (case.preset, case.num_experts)
    if key not in _WEIGHTS:
        # Full-size experts (dsv4-flash shapes) from random bytes: quantizing 50M Gaussians is slow.
        _WEIGHTS[key] = random_byte_weights(g, seed=100 + case.seed) if case.num_experts else random_mxfp4_weights(g, seed=0)
    w = _WEIGHTS[key]
    r = get_recipe(recipe_name)
    if r.weight_format == "fp8_block":
        kk = key + ("fp8",)
        if kk not in _WEIGHTS:
            _WEIGHTS[kk] = fp8_block_weights(w)
        return g, _WEIGHTS[kk]
    if r.global_scales:
        kk = key + ("rebased",)
        if kk not in _WEIGHTS:
            _WEIGHTS[kk] = rebase_scales(w)
        return g, _WEIGHTS[kk]
    return g, w


def case_inputs(case: RefCase):
    g = case.geometry()
    return make_inputs(g, case.tokens, seed=case.seed, x_scale=case.x_scale, outlier_channels=case.outlier_channels, **case.routing)


# ------------------------------------------------------------------------------------ exact
@pytest.mark.parametrize("case", CASES + [DSV4], ids=str)
def test_exact_recipe_vs_dense_oracle(case):
    g, w = case_weights(case)
    inp = case_inputs(case)
    y = moe_forward(inp, w, "exact", g)
    assert y.dtype == torch.float64 and y.shape == (case.tokens, g.hidden)
    assert_close_diff(y, exact_ref(case), 1e-10, f"{case}: exact recipe vs dense oracle")
    masked = (inp.topk_idx < 0).all(dim=1)
    assert (y[masked] == 0).all(), "a token with every slot masked must give a zero row"


def test_exact_recipe_fp8_block_weights():
    case = CASES[1]
    g, w = case_weights(case, "deepgemm-sm90-fp8")
    inp = case_inputs(case)
    assert_close_diff(moe_forward(inp, w, "exact", g), exact_ref(case, "deepgemm-sm90-fp8"), 1e-10,
                      "exact recipe on FP8 block weights")


# ------------------------------------------------------------------------------------ kernel recipes
KERNEL_RECIPES = ["flashinfer-mxfp4", "deepgemm-sm90-fp4", "deepgemm-sm90-fp8", "deepgemm-sm100-fp4"]


def _kernel_cases():
    for r in KERNEL_RECIPES:
        for c in CASES[1:3]:
            if r == "deepgemm-sm100-fp4" and c.preset == "small":
                continue  # promote_k 32 is the slow path; tiny covers it
            yield pytest.param(c, r, id=f"{r}-{c}")
    yield pytest.param(DSV4, "flashinfer-mxfp4", id=f"flashinfer-mxfp4-{DSV4}")


@pytest.mark.parametrize("case,recipe", list(_kernel_cases()))
def test_kernel_recipe_bit_identical_to_oracle(case, recipe):
    g, w = case_weights(case, recipe)
    inp = case_inputs(case)
    res = moe_forward(inp, w, recipe, g, keep_stages=True)
    y = res.y[0]
    y_ref, st = kernel_ref(case, recipe)
    # Stage by stage first, so that a failure names the stage, token and slot.
    rs = res.ranks[0]
    lay = rs.layout
    for r in range(lay.num_pool_rows):
        t, k = int(lay.src_token[r]), int(lay.src_slot[r])
        if t < 0:
            continue
        o = st[(t, k)]
        where = f"{recipe} {case} token {t} slot {k}"
        assert_bitwise_equal(rs.pool_x[r], o["x_q"], f"{where}: staged x")
        assert_bitwise_equal(rs.l1_out[r], o["l1_out"], f"{where}: L1 output")
        assert_bitwise_equal(rs.l2_in[r].float(), o["l2_in"], f"{where}: L2 input (requant)")
        assert_bitwise_equal(rs.l2_in_sf[r], o["l2_in_sf"], f"{where}: L2 input scales")
        assert_bitwise_equal(rs.l2_out[r], o["l2_out"], f"{where}: L2 output (bf16 per slot)")
    assert_bitwise_equal(y, y_ref, f"{recipe} {case}: combined output")
    # And the recipe is a faithful quantization of the exact layer.
    y_exact = exact_ref(case)
    assert calc_diff(y, y_exact) < 2e-2, f"{recipe} {case}: calc_diff vs exact {calc_diff(y, y_exact):.3e}"


def test_rebased_weights_are_exact():
    case = CASES[2]
    g, w = case_weights(case)
    _, wr = case_weights(case, "flashinfer-mxfp4")
    assert wr.l1_global_scale is not None and int(wr.l1_scale.min()) >= 122
    for e in (0, 7):
        for a, b in zip(w.dequantize_expert(e), wr.dequantize_expert(e)):
            assert_bitwise_equal(a, b, f"expert {e} after rebase")


# ------------------------------------------------------------------------------------ broken variants
import megamoe.reference.pipeline as pipeline_mod  # noqa: E402
import megamoe.weights as weights_mod  # noqa: E402
from megamoe.reference.swiglu import swiglu as _swiglu  # noqa: E402


def check_against_oracle(case: RefCase, recipe: str) -> None:
    """The checker the variants must fail: exact -> calc_diff <= 1e-10 vs the dense oracle;
    kernel recipes -> bitwise vs the kernel oracle. Raises AssertionError with where and how far."""
    g, w = case_weights(case, recipe)
    inp = case_inputs(case)
    y = moe_forward(inp, w, recipe, g)
    if recipe == "exact":
        assert_close_diff(y, exact_ref(case), 1e-10, f"{recipe} {case}")
    else:
        assert_bitwise_equal(y, kernel_ref(case, recipe)[0], f"{recipe} {case}")


def _gate_up_swapped(mp):
    def swapped(h, clamp, gate_up_bf16=False, silu_exp="fp32"):
        i = h.shape[1] // 2
        return _swiglu(torch.cat([h[:, i:], h[:, :i]], dim=1), clamp, gate_up_bf16, silu_exp)
    mp.setattr(pipeline_mod, "swiglu", swapped)


def _weight_twice(mp):
    orig = pipeline_mod.experts_forward
    mp.setattr(pipeline_mod, "experts_forward", lambda xa, x_sf, weight, *a: orig(xa, x_sf, weight * weight, *a))


def _dropped_slot(mp):
    orig = pipeline_mod.undispatch

    def drop(*a, **k):
        slots, filled = orig(*a, **k)
        filled = filled.clone()
        filled[filled.any(dim=1).nonzero()[0], filled[filled.any(dim=1).nonzero()[0]].nonzero()[0, 1]] = False
        return slots, filled  # the first live slot of the first live token is lost
    mp.setattr(pipeline_mod, "undispatch", drop)


def _scale_off_by_one(mp):
    # Both decoders: the exact one (weights.dequantize_expert) and the FP4 decoders' table lookup.
    for mod, name in ((weights_mod, "dequantize_mxfp4"), (pipeline_mod, "dequantize_mxfp4_lookup")):
        def off(packed, scale_bytes, *a, orig=getattr(mod, name)):
            sb = scale_bytes.clone()
            sb.view(-1)[0] += 1  # one E8M0 byte of each tensor, one binade up
            return orig(packed, sb, *a)
        mp.setattr(mod, name, off)


def _staging_true_division(mp):
    def div(x, gran=128):
        t, h = x.shape
        xv = x.view(t, h // gran, gran).float()
        sf = xv.abs().amax(dim=2).clamp(min=1e-4) / 448.0
        return formats.e4m3_satfinite(xv * (1.0 / sf).unsqueeze(2)).view(t, h), sf
    mp.setattr(pipeline_mod, "per_token_cast_to_fp8", div)


BROKEN = {
    "gate-up-swapped": _gate_up_swapped,
    "routing-weight-twice": _weight_twice,
    "dropped-slot": _dropped_slot,
    "scale-off-by-one-binade": _scale_off_by_one,
    "staging-true-division": _staging_true_division,
}


BROKEN_PARAMS = [pytest.param(v, r, id=f"{v}-{r}") for v in BROKEN for r in ("exact", "flashinfer-mxfp4", "deepgemm-sm90-fp4")
                 if not (v == "staging-true-division" and r == "exact")]  # exact does not stage x


@pytest.mark.parametrize("variant,recipe", BROKEN_PARAMS)
def test_broken_variant_is_rejected(variant, recipe, monkeypatch):
    case = CASES[1]
    check_against_oracle(case, recipe)  # the control: the unbroken pipeline passes
    with monkeypatch.context() as mp:
        BROKEN[variant](mp)
        with pytest.raises(AssertionError, match="calc_diff|bitwise mismatch"):
            check_against_oracle(case, recipe)


def test_kernel_recipe_with_float_slot_outputs_matches_per_expert_path():
    """Batched experts must write float (not bf16) slot outputs too, bit-identical to one expert at a time."""
    import torch

    from megamoe import PRESETS, make_inputs
    from megamoe.recipe import DEEPGEMM_SM90_FP4
    from megamoe.reference import expert_forward, moe_forward
    from megamoe.weights import random_mxfp4_weights

    g = PRESETS["tiny"]
    w = random_mxfp4_weights(g, seed=3)
    recipe = DEEPGEMM_SM90_FP4.with_(slot_output_bf16=False, combine_bf16=False, accum=torch.float64)
    inp = make_inputs(g, 13, seed=4)
    res = moe_forward(inp, w, recipe, g, keep_stages=True)
    st = res.ranks[0]
    assert st.l2_out.dtype == torch.float64
    for e in range(g.num_experts):
        rows = st.layout.rows_of(e)
        if rows.stop == rows.start:
            continue
        one = expert_forward(st.pool_x[rows], st.pool_x_sf[rows], st.pool_weight[rows], w, e, g, recipe)
        assert torch.equal(st.l2_out[rows], one[3].to(torch.float64)), f"expert {e}"


def test_fast_math_exp_is_expf_with_its_rounded_argument():
    """silu_exp="fast-math" against struct-level FP32 arithmetic written out here: t = fl32(-g * fl32(log2 e)),
    e = fl32(2**t) (math.pow in double, rounded once), v = fl32(g * fl32(1 / fl32(1 + e))) * u, element by element."""
    torch.manual_seed(31)
    g = torch.randn(512) * 6
    u = torch.randn(512)
    f32 = lambda x: struct.unpack("f", struct.pack("f", x))[0]  # noqa: E731
    l2e = f32(math.log2(math.e))
    want = []
    for gi, ui in zip(g.tolist(), u.tolist()):
        gi = min(gi, 7.0)
        ui = max(min(ui, 7.0), -7.0)
        e = f32(math.pow(2.0, f32(-gi * l2e)))
        want.append(f32(f32(gi * f32(1.0 / f32(1.0 + e))) * ui))
    got = _swiglu(torch.cat([g, u])[None], 7.0, silu_exp="fast-math")[0]
    assert_bitwise_equal(got, torch.tensor(want, dtype=torch.float32))
    plain = _swiglu(torch.cat([g, u])[None], 7.0, silu_exp="fp32")[0]
    assert not torch.equal(got, plain)  # the rounded argument is visible (a few ulps on many elements)
    assert ((got - plain).abs() <= 32 * torch.finfo(torch.float32).eps * plain.abs() + 1e-30).all()

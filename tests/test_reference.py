"""The eager reference pipeline against dense per-token oracles written here, and routing.

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
from megamoe.reference import moe_forward, route
from megamoe.reference.routing import expert_histogram
from megamoe.testing import assert_bitwise_equal, assert_close_diff, calc_diff, fp8_block_weights
from megamoe.weights import FP8BlockWeights, MXFP4Weights, random_mxfp4_weights

INV448 = torch.tensor(struct.unpack("<f", struct.pack("<f", 1 / 448))[0], dtype=torch.float32)
F32 = torch.float32


# ------------------------------------------------------------------------------------ oracles
_DEQ: dict = {}


def mxfp4_values(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """formats.dequantize_mxfp4, memoised per tensor (the dsv4-flash experts are 8M values each)."""
    key = (packed.data_ptr(), packed.shape, scale.data_ptr())
    if key not in _DEQ:
        _DEQ[key] = formats.dequantize_mxfp4(packed, scale)
    return _DEQ[key]


def dense_expert_weights_f64(weights, e: int):
    """Expert e as float64 (w1 [2I, H], w2 [H, I]), straight from the stored format."""
    if isinstance(weights, FP8BlockWeights):
        def deq(q, s):
            return q.double() * s.double().repeat_interleave(128, 0).repeat_interleave(128, 1)
        return deq(weights.l1[e], weights.l1_scale[e]), deq(weights.l2[e], weights.l2_scale[e])
    w1 = mxfp4_values(weights.l1[e], weights.l1_scale[e]).double()
    w2 = mxfp4_values(weights.l2[e], weights.l2_scale[e]).double()
    if weights.l1_global_scale is not None:
        w1 = w1 * float(weights.l1_global_scale[e])
    if weights.l2_global_scale is not None:
        w2 = w2 * float(weights.l2_global_scale[e])
    return w1, w2


def dense_exact_oracle(x, topk_idx, topk_weights, weights, g) -> torch.Tensor:
    """y[t] = sum_k w[t,k] * W2[e] @ (silu(min(W1g x, c)) * clamp(W1u x, -c, c)), float64."""
    t_, h = x.shape
    i = g.intermediate
    cache = {}
    y = torch.zeros(t_, h, dtype=torch.float64)
    for t in range(t_):
        for k in range(topk_idx.shape[1]):
            e = int(topk_idx[t, k])
            if e < 0:
                continue
            if e not in cache:
                cache[e] = dense_expert_weights_f64(weights, e)
            w1, w2 = cache[e]
            hh = w1 @ x[t].double()
            gate = hh[:i].clamp(max=g.clamp)
            up = hh[i:].clamp(-g.clamp, g.clamp)
            v = gate * torch.sigmoid(gate) * up
            y[t] += float(topk_weights[t, k]) * (w2 @ v)
    return y


def _e4m3(v: torch.Tensor) -> torch.Tensor:
    return v.float().clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()


def _pow2_ceil(y: float) -> float:
    m, ex = math.frexp(y)
    return math.ldexp(1.0, ex - 1 if m == 0.5 else ex)


def _stage_row(xr: torch.Tensor, recipe):
    """One token: x [H] -> (e4m3 values [H], scales [H/gran]) per the recipe."""
    gran = recipe.x_gran
    xs, sfs = [], []
    for g0 in range(0, xr.numel(), gran):
        grp = xr[g0 : g0 + gran].float()
        amax = torch.maximum(grp.abs().max(), torch.tensor(1e-4, dtype=F32))
        sf = amax * INV448  # fp32 multiply, not a division
        if recipe.x_scale == "ue8m0":
            sf = torch.tensor(_pow2_ceil(float(sf)), dtype=F32)
        xs.append(_e4m3(grp * (torch.tensor(1.0, dtype=F32) / sf)))
        sfs.append(sf)
    return torch.cat(xs), torch.stack(sfs)


def _decode_weight(w: torch.Tensor, rule: str) -> torch.Tensor:
    """Exact MXFP4 values (fp32) -> what the MMA reads (e2m1 * 2**s has 2 significant bits, so it is
    exact in e4m3's normal range; only the ends need a rule)."""
    if rule == "e4m3_flush_saturate":
        return torch.where(w.abs() < 2.0**-6, torch.zeros_like(w), w).clamp(-448, 448)
    if rule == "e4m3_rn":
        sub = torch.round(w.double() * 512) / 512  # e4m3 subnormals are k * 2**-9, RNE via round-half-even
        return torch.where(w.abs() < 2.0**-6, sub.float(), w).clamp(-448, 448)
    return w


def _promoted_row(a, a_sf, a_gran, b, b_sf, pk) -> torch.Tensor:
    """One row: acc[n] = fma(fl32(a_sf[kb] * b_sf[n/128, kb]), fl32(exact block dot), acc[n]), kb ascending."""
    n, k = b.shape
    acc = torch.zeros(n, dtype=F32)
    for kb in range(k // pk):
        sl = slice(kb * pk, (kb + 1) * pk)
        partial = (b[:, sl].double() @ a[sl].double()).float()  # exact in float64, one rounding
        s = a_sf[(kb * pk) // a_gran].reshape(1)
        if b_sf is not None:
            s = s * b_sf[torch.arange(n) // 128, (kb * pk) // 128]  # fp32 product
        acc = (s.double() * partial.double() + acc.double()).float()
    return acc


def _requant_row(vw: torch.Tensor, recipe):
    gsz = recipe.l2_group
    qs, sfs = [], []
    for g0 in range(0, vw.numel(), gsz):
        grp = vw[g0 : g0 + gsz]
        amax = grp.abs().max()
        if recipe.l2_scale == "pow2_ceil":
            y = float(amax * INV448)
            if y == 0:
                qs.append(torch.zeros_like(grp))
                sfs.append(torch.tensor(0.0))
                continue
            sf = torch.tensor(_pow2_ceil(y), dtype=F32)
        else:
            sf = torch.maximum(amax, torch.tensor(recipe.l2_amax_floor, dtype=F32)) * INV448
        qs.append(_e4m3(grp * (torch.tensor(1.0, dtype=F32) / sf)))
        sfs.append(sf)
    return torch.cat(qs), torch.stack(sfs)


def kernel_oracle(x, topk_idx, topk_weights, weights, g, recipe) -> tuple[torch.Tensor, dict]:
    """Replays ``recipe`` one (token, slot) at a time. Returns (y bf16 [T, H], per-slot stages)."""
    recipe = get_recipe(recipe)
    t_, h = x.shape
    i = g.intermediate
    decoded = {}
    y = torch.zeros(t_, h, dtype=torch.bfloat16)
    stages = {}
    for t in range(t_):
        xq, xsf = _stage_row(x[t], recipe)
        acc = torch.zeros(h, dtype=F32)
        for k in range(topk_idx.shape[1]):
            e = int(topk_idx[t, k])
            if e < 0:
                continue
            if e not in decoded:
                if isinstance(weights, FP8BlockWeights):
                    decoded[e] = (weights.l1[e].float(), weights.l1_scale[e], weights.l2[e].float(), weights.l2_scale[e])
                else:
                    w1 = mxfp4_values(weights.l1[e], weights.l1_scale[e])
                    w2 = mxfp4_values(weights.l2[e], weights.l2_scale[e])
                    decoded[e] = (_decode_weight(w1, recipe.weight_decode).double(), None,
                                  _decode_weight(w2, recipe.weight_decode).double(), None)  # exact in float64
            w1, w1_sf, w2, w2_sf = decoded[e]
            hh = _promoted_row(xq, xsf, recipe.x_gran, w1, w1_sf, min(recipe.promote_k, recipe.x_gran))
            if weights.format == "mxfp4" and weights.l1_global_scale is not None:
                hh = hh * weights.l1_global_scale[e]
            gate, up = hh[:i], hh[i:]
            if recipe.gate_up_bf16:
                gate, up = gate.bfloat16().float(), up.bfloat16().float()
            gate = gate.clamp(max=g.clamp)
            up = up.clamp(-g.clamp, g.clamp)
            v = gate * (1.0 / (1.0 + torch.exp(-gate))) * up
            vw = v * topk_weights[t, k]
            q, qsf = _requant_row(vw, recipe)
            out = _promoted_row(q, qsf, recipe.l2_group, w2, w2_sf, min(128, recipe.l2_group, recipe.promote_k))
            if weights.format == "mxfp4" and weights.l2_global_scale is not None:
                out = out * weights.l2_global_scale[e]
            out = out.bfloat16()
            acc = acc + out.float()  # slots ascending, masked ones skipped
            stages[(t, k)] = {"x_q": xq, "x_sf": xsf, "l1_out": hh, "l2_in": q, "l2_in_sf": qsf, "l2_out": out}
        y[t] = acc.bfloat16()
    return y, stages


def rebase_scales(weights: MXFP4Weights, lo: int = 122, hi: int = 133) -> MXFP4Weights:
    """Independent exact rebase: per expert and layer, bytes += s, global scale 2**-s (nonzero groups in [lo, hi])."""
    out = {}
    for name in ("l1", "l2"):
        packed, sb = getattr(weights, name), getattr(weights, f"{name}_scale").to(torch.int32)
        nz = (formats.unpack_e2m1(packed) & 7).view(*packed.shape[:-1], -1, 16 * 2).amax(-1) > 0
        shifts = []
        for e in range(weights.num_experts):
            b = sb[e][nz[e]]
            s = lo - int(b.min())
            assert int(b.max()) + s <= hi, "test weights too spread to rebase"
            shifts.append(s)
        s_t = torch.tensor(shifts, dtype=torch.int32)[:, None, None]
        out[f"{name}_scale"] = torch.where(nz, sb + s_t, torch.full_like(sb, 127)).to(torch.uint8)
        out[f"{name}_global_scale"] = torch.tensor([2.0**-s for s in shifts], dtype=F32)
    return MXFP4Weights(weights.l1, out["l1_scale"], weights.l2, out["l2_scale"], out["l1_global_scale"], out["l2_global_scale"])


def random_byte_weights(g, seed: int) -> MXFP4Weights:
    """Uniform random code bytes, scale bytes 122..124 (2**-5 .. 2**-3): legal for every FP4 recipe."""
    gen = torch.Generator().manual_seed(seed)
    e, h, i = g.num_experts, g.hidden, g.intermediate

    def rb(lo, hi, *shape):
        return torch.randint(lo, hi, shape, generator=gen, dtype=torch.int32).to(torch.uint8)

    return MXFP4Weights(rb(0, 256, e, 2 * i, h // 2), rb(122, 125, e, 2 * i, h // 32), rb(0, 256, e, h, i // 2), rb(122, 125, e, h, i // 32))


_ORACLE: dict = {}


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


# ------------------------------------------------------------------------------------ routing
def route_oracle(logits: torch.Tensor, g, bias=None):
    """Per token in Python float64: scores, selection on scores + bias (lower index wins ties), weights."""
    idx, wts = [], []
    for row in logits.double().tolist():
        if g.score_func == "softmax":
            m = max(row)
            ex = [math.exp(v - m) for v in row]
            scores = [v / sum(ex) for v in ex]
        else:
            scores = [math.sqrt(math.log1p(math.exp(v))) for v in row]
        key = [s + (0.0 if bias is None else float(bias[e])) for e, s in enumerate(scores)]
        order = sorted(range(len(row)), key=lambda e: (-key[e], e))
        sel = order[: g.num_topk]
        margin = key[order[g.num_topk - 1]] - key[order[g.num_topk]] if len(row) > g.num_topk else 1.0
        ws = [scores[e] for e in sel]
        if g.norm_topk_prob:
            ws = [v / sum(ws) for v in ws]
        idx.append(sel)
        wts.append([v * g.routed_scaling for v in ws])
        assert margin > 1e-5, "test logits have a near-tie at the top-k boundary; pick another seed"
    return torch.tensor(idx), torch.tensor(wts, dtype=torch.float64)


@dataclass
class RouteCase:
    name: str
    preset: str
    score_func: str
    bias: bool
    tokens: int = 40
    norm: bool = True

    def __str__(self) -> str:
        return self.name


ROUTE_CASES = [
    RouteCase("dsv4flash-sqrtsoftplus-bias", "dsv4-flash", "sqrtsoftplus", True),
    RouteCase("dsv4flash-sqrtsoftplus-nobias", "dsv4-flash", "sqrtsoftplus", False),
    RouteCase("small-softmax", "small", "softmax", False),
    RouteCase("small-softmax-nonorm", "small", "softmax", False, norm=False),
    RouteCase("dsv4pro-sqrtsoftplus-bias", "dsv4-pro", "sqrtsoftplus", True, tokens=7),
]


@pytest.mark.parametrize("case", ROUTE_CASES, ids=str)
def test_route_vs_oracle(case):
    g = get_geometry(case.preset).with_(score_func=case.score_func, norm_topk_prob=case.norm)
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(case.tokens, g.num_experts, generator=gen) * 2
    bias = (torch.randn(g.num_experts, generator=gen) * 0.3) if case.bias else None
    idx, w = route(logits, g, bias)
    idx_o, w_o = route_oracle(logits, g, bias)
    assert idx.dtype == torch.int64 and w.dtype == torch.float32 and idx.shape == (case.tokens, g.num_topk)
    assert_bitwise_equal(idx, idx_o.to(torch.int64), f"{case}: selected experts")
    assert torch.allclose(w.double(), w_o, rtol=2e-6, atol=0), f"{case}: weights max err {(w.double() - w_o).abs().max():.2e}"
    if g.norm_topk_prob:
        assert torch.allclose(w.sum(1).double(), torch.full((case.tokens,), g.routed_scaling, dtype=torch.float64), rtol=1e-6)


def test_bias_steers_selection_not_weights():
    g = get_geometry("small")
    logits = torch.randn(5, g.num_experts, generator=torch.Generator().manual_seed(2))
    bias = torch.zeros(g.num_experts)
    bias[[3, 7, 11, 15]] = 100.0  # forces these four experts
    idx, w = route(logits, g, bias)
    assert (idx.sort(1).values == torch.tensor([3, 7, 11, 15])).all()
    s = torch.nn.functional.softplus(logits).sqrt().gather(1, idx)
    assert torch.allclose(w, s / s.sum(1, keepdim=True) * g.routed_scaling), "bias leaked into the weights"


def test_route_ties_go_to_lower_index():
    g = get_geometry("tiny")  # K = 2
    idx, _ = route(torch.zeros(3, g.num_experts), g)
    assert idx.tolist() == [[0, 1]] * 3


def test_route_rejects_bad_logits():
    g = get_geometry("tiny")
    with pytest.raises(ValueError, match=r"router logits must be \[T, 8\]"):
        route(torch.randn(3, 7), g)
    with pytest.raises(ValueError, match="NaN or Inf"):
        route(torch.tensor([[float("nan")] * 8]), g)
    with pytest.raises(ValueError, match=r"bias must be \[8\]"):
        route(torch.randn(3, 8), g, torch.zeros(4))


def test_expert_histogram_ignores_masked():
    idx = torch.tensor([[0, 3], [-1, 3], [-1, -1]])
    assert expert_histogram(idx, 5).tolist() == [1, 0, 0, 2, 0]


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

"""The DeepSeek-V4 MoE block: routing once-scaled, shared expert added, the fused path through a backend.

The fused path is checked on the CPU with a fake backend that stages into a buffer (megamoe.staging)
and runs the reference; the real backends are checked on the H200 (``gpu`` test, lab/staging/staging_block.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megamoe.geometry import PRESETS
from megamoe.recipe import get_recipe
from megamoe.reference import moe_forward
from megamoe.reference.block import (
    DeepSeekV4MoEParams,
    RoutedBackendAdapter,
    moe_block_fused,
    moe_block_reference,
    random_block_params,
    route_block,
    shared_expert,
)
from megamoe.inputs import MoEInputs, make_inputs
from megamoe.staging import stage_into
from megamoe.staging.checks import allocate_buffers
from megamoe.testing import assert_bitwise_equal, calc_diff

G = PRESETS["tiny"]


@pytest.fixture(scope="module")
def params():
    return random_block_params(G, seed=3)


@pytest.fixture(scope="module")
def x():
    return make_inputs(G, 37, seed=11, outlier_channels=2).x


def test_router_fp32_weights_scaled_once(params, x):
    logits, idx, w = route_block(x, params, G)
    assert logits.dtype == torch.float32 and idx.dtype == torch.int64 and w.dtype == torch.float32
    assert_bitwise_equal(logits, x.float() @ params.gate_weight.T, "router logits (FP32 gate linear)")
    torch.testing.assert_close(w.sum(dim=1), torch.full((37,), G.routed_scaling), rtol=1e-6, atol=1e-6)
    # The weights are the unbiased scores of the picked experts, normalised, times the scaling: once.
    scores = F.softplus(logits).sqrt()
    want = scores.gather(1, idx)
    want = want / want.sum(dim=1, keepdim=True) * G.routed_scaling
    assert_bitwise_equal(w, want, "topk weights")


def test_bias_steers_selection_only(params, x):
    _, idx, _ = route_block(x, params, G)
    no_bias = DeepSeekV4MoEParams(params.gate_weight, torch.zeros_like(params.e_score_correction_bias),
                                  params.experts, params.shared_w1, params.shared_w3, params.shared_w2)
    _, idx0, _ = route_block(x, no_bias, G)
    assert not torch.equal(idx, idx0), "the random bias changed no selection: the test would not see it"


@pytest.mark.parametrize("recipe", ["flashinfer-mxfp4", "deepgemm-sm90-fp4"])
def test_block_vs_exact(params, x, recipe):
    exact = moe_block_reference(x, params, G, "exact", return_parts=True)
    got = moe_block_reference(x, params, G, recipe, return_parts=True)
    assert got.y.dtype == torch.bfloat16 and exact.y.dtype == torch.float64
    assert got.y.shape == x.shape
    assert calc_diff(got.shared, exact.shared) < 1e-10  # FP32 vs float64 of the same SwiGLU
    d = calc_diff(got.y, exact.y)
    assert d < 1e-2, d
    # Broken variants kept: each must land well outside what the recipe's own error gives.
    twice = exact.routed * G.routed_scaling + exact.shared
    no_shared = exact.routed
    biased = MoEInputs(x, exact.topk_idx, _biased_weights(exact.logits, exact.topk_idx, params.e_score_correction_bias))
    biased_w = moe_forward(biased, params.experts, "exact", G) + exact.shared
    for name, bad in (("routed scaling applied twice", twice), ("shared expert dropped", no_shared)):
        assert calc_diff(bad, exact.y) > 5 * max(d, 1e-4), f"broken variant not caught: {name}"
    # The bias (0.1 here) moves the weights by less than the FP8 error: caught at the exact tier only
    # (and bit for bit on the weights in test_router_fp32_weights_scaled_once).
    assert calc_diff(biased_w, exact.y) > 1e-6
    assert calc_diff(moe_block_reference(x, params, G, "exact"), exact.y) == 0.0


def _biased_weights(logits, idx, bias):
    s = (F.softplus(logits).sqrt() + bias).gather(1, idx)
    return (s / s.sum(dim=1, keepdim=True) * G.routed_scaling).float()


def test_shared_expert_clamped(params, x):
    """The shared SwiGLU uses the routed experts' clamp: huge inputs stay bounded by it."""
    big = (x.float() * 1e3).to(torch.bfloat16)
    s = shared_expert(big, params, G)
    bound = (G.clamp * G.clamp) * params.shared_w2.float().abs().sum(dim=1).max()  # |silu(g) u| <= c * c
    assert torch.isfinite(s).all() and s.abs().max() <= bound


# ------------------------------------------------------------------------------ fused path
class FakeBackend:
    """A stand-in for a megamoe.fused backend: stages into a buffer through megamoe.staging (torch
    path), checks what it staged, then runs the reference routed MoE."""

    def __init__(self, g, recipe="flashinfer-mxfp4", capacity=64):
        self.g, self.recipe, self.name = g, get_recipe(recipe), "fake"
        self.buf = allocate_buffers(capacity, g)
        self.prepared = 0
        self.staged_counts = []

    def prepare_weights(self, weights):
        self.prepared += 1
        self.weights = weights

    def run(self, inputs, num_tokens=None):
        t = inputs.num_tokens
        m = stage_into(inputs.x, inputs.topk_idx, inputs.topk_weights, *self.buf.views(), num_tokens,
                       num_experts=self.g.num_experts, backend="torch")
        self.staged_counts.append(m)
        assert_bitwise_equal(self.buf.topk_weights[:t], inputs.topk_weights, "staged weights (no second scaling)")
        assert (self.buf.topk_idx[t:m] == -1).all()
        return moe_forward(inputs, self.weights, self.recipe, self.g)


def test_fused_block_with_fake_backend_matches_reference(params, x):
    be = FakeBackend(G)
    ref = moe_block_reference(x, params, G, be.recipe)
    got = moe_block_fused(x, params, G, be, num_tokens=40)
    assert_bitwise_equal(got, ref, "fused block (fake backend) vs reference block")
    again = moe_block_fused(x[:5], params, G, be)
    assert_bitwise_equal(again, moe_block_reference(x[:5], params, G, be.recipe), "second call")
    assert be.prepared == 1, "weights prepared more than once"
    assert be.staged_counts == [40, 5]


def test_fused_block_routed_part_is_the_backends(params, x):
    """A backend that returns zeros leaves exactly the shared expert: the adapter adds, not replaces."""

    class Zeros(FakeBackend):
        def run(self, inputs, num_tokens=None):
            return torch.zeros(inputs.num_tokens, self.g.hidden, dtype=torch.bfloat16)

    parts = moe_block_fused(x, params, G, Zeros(G), return_parts=True)
    assert_bitwise_equal(parts.y, parts.shared.to(torch.bfloat16), "y with a zero routed part")


def test_adapter_rejects_bad_backends(params, x):
    with pytest.raises(TypeError, match=r"has no prepare_weights\(\)"):
        RoutedBackendAdapter(object())

    class WrongShape(FakeBackend):
        def run(self, inputs, num_tokens=None):
            return torch.zeros(inputs.num_tokens, 3, dtype=torch.bfloat16)

    with pytest.raises(ValueError, match="expected torch.bfloat16"):
        moe_block_fused(x, params, G, WrongShape(G))


def test_params_and_x_validation(params, x):
    bad = DeepSeekV4MoEParams(params.gate_weight.double(), params.e_score_correction_bias, params.experts,
                              params.shared_w1, params.shared_w3, params.shared_w2)
    with pytest.raises(ValueError, match=r"gate_weight must be torch.float32 \(8, 256\)"):
        moe_block_reference(x, bad, G)
    with pytest.raises(TypeError, match="x must be bfloat16"):
        moe_block_reference(x.float(), params, G)
    with pytest.raises(ValueError, match=r"x must be \[T, 256\]"):
        moe_block_reference(x[:, :128], params, G)


# ------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["flashinfer-mxfp4", "deepgemm-sm90-fp4"])
def test_fused_block_real_backend_gpu(name):
    from megamoe.fused.registry import get_backend_class, make_backend

    ok, why = get_backend_class(name).availability()
    if not ok:
        pytest.skip(why)
    g = PRESETS["small"]
    be = make_backend(name, g, capacity=256)
    p = random_block_params(g, seed=0, device="cuda")
    p.experts = be.synthetic_weights(p.experts)  # where the kernel reads them exactly
    xg = make_inputs(g, 129, seed=1, device="cuda").x
    got = moe_block_fused(xg, p, g, be)
    ref = moe_block_reference(xg, p, g, be.recipe)
    assert calc_diff(got, ref) < 1e-3

"""The reference's routing (megamoe.reference.route) against a per-token float64 oracle written here: selection
on scores + bias with ties to the lower index, weights from the scores alone, normalisation and scaling; and
its refusals of bad logits and biases."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from megamoe.geometry import get_geometry
from megamoe.reference import route
from megamoe.reference.routing import expert_histogram
from megamoe.testing import assert_bitwise_equal


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

"""The eager reference and its stages, timed on whatever device is here (a CPU included)."""

from __future__ import annotations

import pytest
import torch

from megamoe.bench.suite import bench_tokens
from megamoe.bench.timing import time_fn
from megamoe.inputs import make_inputs
from megamoe.layouts.staging import per_token_cast_to_fp8
from megamoe.reference import moe_forward
from megamoe.reference.swiglu import requant_fp8, swiglu

TOKENS = bench_tokens()


@pytest.mark.parametrize("num_tokens", TOKENS, ids=lambda t: f"T{t}")
@pytest.mark.parametrize("recipe", ["flashinfer-mxfp4", "deepgemm-sm90-fp4"])
def test_bench_reference_forward(record, geometry_and_weights, device, recipe, num_tokens):
    g, w = geometry_and_weights
    if recipe == "flashinfer-mxfp4":
        from megamoe.layouts.ranges import repair_ranges

        w = repair_ranges(w, recipe)
    sets = [make_inputs(g, num_tokens, seed=100 + k, device=device) for k in range(2)]
    y = moe_forward(sets[0].clone(), w, recipe, g)  # correctness before timing: finite, full shape
    assert y.shape == (num_tokens, g.hidden) and torch.isfinite(y.float()).all()
    tm = time_fn(lambda inp: moe_forward(inp, w, recipe, g), args=sets, warmup=1, repeats=3, device=device)
    record(tm, g=g, topk_idx=sets[0].topk_idx, preset=g.name, tokens=num_tokens, recipe=recipe)


@pytest.mark.parametrize("num_tokens", TOKENS, ids=lambda t: f"T{t}")
def test_bench_staging_cast(record, geometry_and_weights, device, num_tokens):
    g, _ = geometry_and_weights
    xs = [make_inputs(g, num_tokens, seed=7 + k, device=device).x for k in range(4)]
    q, sf = per_token_cast_to_fp8(xs[0])
    assert q.dtype == torch.float8_e4m3fn and sf.shape == (num_tokens, g.hidden // 128)
    tm = time_fn(per_token_cast_to_fp8, args=xs, warmup=2, repeats=10, device=device)
    nbytes = num_tokens * g.hidden * (2 + 1) + num_tokens * g.hidden // 128 * 4
    record(tm, gbps=nbytes / (tm.median_us * 1e-6) / 1e9, tokens=num_tokens)


@pytest.mark.parametrize("num_rows", [64, 1024], ids=lambda r: f"P{r}")
def test_bench_swiglu_requant(record, geometry_and_weights, device, num_rows):
    g, _ = geometry_and_weights
    gen = torch.Generator().manual_seed(num_rows)
    hs = [(torch.randn(num_rows, 2 * g.intermediate, generator=gen) * 4).to(device) for _ in range(4)]

    def fn(h):
        return requant_fp8(swiglu(h, g.clamp), 128, "pow2_ceil")

    q, sf = fn(hs[0])
    assert q.shape == (num_rows, g.intermediate) and torch.isfinite(sf).all()
    tm = time_fn(fn, args=hs, warmup=2, repeats=10, device=device)
    record(tm, rows=num_rows)

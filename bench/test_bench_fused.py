"""Every fused backend (and the unfused DeepGEMM peer) on the H200: correctness first, then the launch alone
timed as ``megamoe bench`` times it (CUDA-graph replays for a backend that promises graph_capturable, else CUDA
events over a device pass; the L2 flushed between calls); rates and roofline fractions in extra_info."""

from __future__ import annotations

import pytest
import torch

from megamoe.bench.backends import FusedBench, fused_registry
from megamoe.bench.suite import bench_tokens, device_pass_kwargs, time_fused_case
from megamoe.bench.timing import overhead_check, time_fn
from megamoe.fused.build import build_plans
from megamoe.inputs import make_inputs
from megamoe.testing import calc_diff

pytestmark = pytest.mark.gpu
TOKENS = bench_tokens()
NAMES = sorted(fused_registry())
_BACKENDS: dict = {}


def _backend(name, g, w):
    cls = fused_registry()[name]
    ok, why = cls.availability()
    if not ok:
        pytest.skip(f"{name}: {why}")
    if name not in _BACKENDS:
        b = FusedBench(cls, g, max(TOKENS))
        b.prepare(w)
        jobs = b.build_jobs(TOKENS)  # every plan first
        errors = build_plans(jobs, {k: b.build_lane for k in jobs})
        assert not errors, f"{name}: builds failed: {errors[0][1]!r}"
        _BACKENDS[name] = b
    return _BACKENDS[name]


@pytest.mark.parametrize("num_tokens", TOKENS, ids=lambda t: f"T{t}")
@pytest.mark.parametrize("name", NAMES)
def test_bench_fused_launch(record, geometry_and_weights, device, name, num_tokens):
    g, w = geometry_and_weights
    b = _backend(name, g, w)
    inp = make_inputs(g, num_tokens, seed=num_tokens, device=device)
    y = b.run(inp.clone())
    diff = calc_diff(y.float(), b.reference(inp.clone(), w).float())
    assert not torch.isnan(y.float()).any() and diff < 1e-3, f"{name} T={num_tokens}: calc_diff {diff}"
    fn, args = b.timer([inp])
    tm = time_fused_case(b, fn, args, device)
    record(tm, g=g, topk_idx=inp.topk_idx, weight_format=b.weight_format, backend=name, tokens=num_tokens,
           block_m=b.plan(num_tokens).get("block_m"), calc_diff=diff)


@pytest.mark.parametrize("name", NAMES)
def test_bench_harness_overhead(record, geometry_and_weights, device, name):
    """The harness's per-call instrument within 2% of a bare loop over the same calls (ABBA rounds, so the
    card's power-cap drift at 8192 tokens falls on both sides: megamoe.bench.timing.overhead_check)."""
    g, w = geometry_and_weights
    b = _backend(name, g, w)
    t = max(TOKENS)
    fn, _ = b.timer([make_inputs(g, t, seed=1, device=device)])
    oc = overhead_check(fn, iters=10, rounds=8, device=device, settle_s=1.0)
    tm = time_fn(fn, warmup=5, repeats=20, flush_l2=False, device=device, **device_pass_kwargs(device, 20))
    record(tm, backend=name, tokens=t, bare_loop_us=oc["bare_loop_us"], ratio=oc["ratio"])
    assert abs(oc["ratio"] - 1) <= 0.02, f"harness / bare loop = {oc['ratio']:.4f} over the same calls"

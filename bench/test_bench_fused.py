"""Every fused backend (and the unfused DeepGEMM peer) on the H200: correctness first, then the launch
alone timed as ``megamoe bench`` times it (CUDA-graph replays for a backend that promises
graph_capturable, else CUDA events over a device pass; L2 flushed between calls), rates and roofline
fractions in extra_info."""

from __future__ import annotations

import pytest
import torch

from megamoe.bench.backends import FusedAdapter, backend_available, block_m_of, fused_registry
from megamoe.bench.suite import bench_tokens, device_pass_kwargs, time_fused_case
from megamoe.bench.timing import overhead_check, time_fn
from megamoe.inputs import make_inputs
from megamoe.testing import calc_diff

pytestmark = pytest.mark.gpu
TOKENS = bench_tokens()
NAMES = sorted(fused_registry()) or ["(no megamoe.fused registry)"]
_ADAPTERS: dict = {}


def _adapter(name, g, w):
    reg = fused_registry()
    if name not in reg:
        pytest.skip(f"{name}: not in megamoe.fused.registry.BACKENDS")
    ok, why = backend_available(reg[name])
    if not ok:
        pytest.skip(f"{name}: {why}")
    if name not in _ADAPTERS:
        a = FusedAdapter(name, reg[name], g, max(TOKENS))
        a.prepare(w)
        a.build(TOKENS)  # every JIT plan first
        _ADAPTERS[name] = a
    return _ADAPTERS[name]


@pytest.mark.parametrize("num_tokens", TOKENS, ids=lambda t: f"T{t}")
@pytest.mark.parametrize("name", NAMES)
def test_bench_fused_launch(benchmark, record, geometry_and_weights, device, name, num_tokens):
    g, w = geometry_and_weights
    a = _adapter(name, g, w)
    inp = make_inputs(g, num_tokens, seed=num_tokens, device=device)
    y = a.run(inp.clone())
    ref = a.reference(inp.clone(), w)
    diff = None if ref is None else calc_diff(y.float(), ref.float())
    assert not torch.isnan(y.float()).any() and (diff is None or diff < 1e-3), f"{name} T={num_tokens}: calc_diff {diff}"
    fn, args = a.timer([inp])
    tm = time_fused_case(a, fn, args, device)
    record(fn, tm, g=g, topk_idx=inp.topk_idx, weight_format=a.weight_format, rounds=5, backend=name,
           tokens=num_tokens, block_m=block_m_of(a.plan(num_tokens)), calc_diff=diff)


@pytest.mark.parametrize("name", NAMES)
def test_bench_harness_overhead(benchmark, record, geometry_and_weights, device, name):
    """The harness's per-call instrument within 2% of a bare loop over the same calls (ABBA rounds, so the
    card's power-cap drift at 8192 tokens falls on both sides: megamoe.bench.timing.overhead_check)."""
    g, w = geometry_and_weights
    a = _adapter(name, g, w)
    t = max(TOKENS)
    fn, _ = a.timer([make_inputs(g, t, seed=1, device=device)])
    oc = overhead_check(fn, iters=10, rounds=8, device=device, settle_s=1.0)
    tm = time_fn(fn, warmup=5, repeats=20, flush_l2=False, device=device, **device_pass_kwargs(device, 20))
    info = record(fn, tm, backend=name, tokens=t, bare_loop_us=oc["bare_loop_us"], ratio=oc["ratio"])
    assert abs(info["ratio"] - 1) <= 0.02, f"harness / bare loop = {oc['ratio']:.4f} over the same calls"

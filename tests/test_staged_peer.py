"""The unfused peer (megamoe.fused.staged_deepgemm): its sync-free device layout against
reference.dispatch.build_layout, its glue against the old host-synced glue (kept below as the oracle)
and against the reference pipeline, both bit for bit with a CPU stand-in for DeepGEMM's grouped GEMM (the
oracle, the stand-in and the routing cases: ``staged_peer_support.py``, beside this file),
and a structural check that launch() has no data-dependent shapes, ops or allocations.

On a CPU a host sync cannot be seen; the ``gpu`` test at the end is the real check: the launch under
``torch.cuda.set_sync_debug_mode("error")``, captured in a CUDA graph and replayed on new inputs.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from megamoe.fused.staged_deepgemm import (
    DEEPGEMM_STAGED_FP8,
    StagedBuffers,
    StagedDeepGEMM,
    device_layout,
    pool_rows_bound,
    stage_into,
    staged_forward,
)
from megamoe.geometry import get_geometry
from megamoe.inputs import make_inputs
from megamoe.layouts.staging import per_token_cast_to_fp8, per_token_cast_to_fp8_into
from megamoe.reference import moe_forward
from megamoe.testing import first_mismatch

from staged_peer_support import (
    ALIGN, fp8_weights, inputs_for, layout_mismatch, old_staged_launch, routing_cases, standin_gemm,
)


# ------------------------------------------------------------------------------------ tests
def test_pool_rows_bound_is_tight_and_never_exceeded(gen):
    for e, k, a in ((8, 2, 128), (16, 4, 128), (256, 6, 128), (16, 4, 4), (3, 3, 2)):
        for t in (0, 1, 2, 5, 21, 64, 300, 8192):
            bound = pool_rows_bound(t, k, e, a)
            n = t * k
            assert bound % a == 0
            assert bound <= -(-(n + e * (a - 1)) // a) * a  # never above the brief's round_up formula
            if n:
                # Reached: one slot on each of min(E, N) - 1 experts, the rest on one.
                used = min(e, n)
                counts = [1] * (used - 1) + [n - (used - 1)]
                assert sum(-(-c // a) * a for c in counts) == bound
            for _ in range(20):  # never exceeded by random counts summing to at most N
                cuts = torch.randint(0, n + 1, (e - 1,), generator=gen).sort().values.tolist()
                counts = [b - a_ for a_, b in zip([0] + cuts, cuts + [n])]
                assert sum(-(-c // a) * a for c in counts) <= bound


@pytest.mark.parametrize("preset", ["tiny", "small"])
@pytest.mark.parametrize("align", [128, 8])
def test_device_layout_equals_build_layout(preset, align):
    g = get_geometry(preset)
    buf = StagedBuffers.allocate(g, 256, align, "cpu")  # one buffer for every case: stale state must not leak
    for seed, c in enumerate(routing_cases(g) + routing_cases(g)[::-1]):
        inp, m = inputs_for(g, c, seed)
        stage_into(buf, inp, m)
        p = device_layout(buf, m)
        assert not layout_mismatch(buf, inp.topk_idx, m, p), (c, layout_mismatch(buf, inp.topk_idx, m, p))


def test_layout_check_catches_an_off_by_one_rank():
    """The comparison above can fail: a rank-within-expert off by one (every row one down) is found,
    and so are swapped rows inside one expert; the GEMM stand-in refuses a block led by -1."""
    g = get_geometry("small")
    inp, m = inputs_for(g, dict(t=50, m=50, mask_prob=0.1), 1)
    buf = StagedBuffers.allocate(g, 64, ALIGN, "cpu")
    stage_into(buf, inp, m)
    buf.pos.add_(1)
    p = device_layout(buf, m)
    assert layout_mismatch(buf, inp.topk_idx, m, p)
    with pytest.raises(AssertionError, match="illegal contiguous layout"):
        standin_gemm((buf.pool_x[:p].view(torch.float8_e4m3fn), buf.pool_sf[:p]), (torch.zeros(g.num_experts, 8, g.hidden, dtype=torch.float8_e4m3fn), torch.ones(g.num_experts, 1, g.hidden // 128)),
                     torch.empty(p, 8, dtype=torch.bfloat16), buf.m_indices[:p])
    buf.pos.sub_(1)
    p = device_layout(buf, m)
    assert not layout_mismatch(buf, inp.topk_idx, m, p)
    e = int(buf.m_indices[0])
    assert int(buf.m_indices[1]) == e  # expert e has two rows here (seeded)
    buf.row_token[[0, 1]] = buf.row_token[[1, 0]]
    assert layout_mismatch(buf, inp.topk_idx, m, p)


def test_cast_to_fp8_into_is_per_token_cast_to_fp8(gen):
    m, c = 40, 512
    v = torch.randn(m, c, generator=gen) * torch.exp2(torch.randint(-30, 30, (m, 1), generator=gen).float())
    v[3] = 0.0  # below the amax floor
    v[4, :128] = 1e-7
    v[5, 7] = 1e30  # saturates the rest of its group to 0 / its own code to 448
    v[6] = -v[6].abs()
    q, sf, inv, ws = (torch.empty(m, c, dtype=torch.float8_e4m3fn), torch.empty(m, c // 128), torch.empty(m, c // 128), torch.empty(m, c))
    before = v.clone()
    per_token_cast_to_fp8_into(v, q, sf, inv, ws, torch.tensor(1.0 / 448, dtype=torch.float32))
    q_ref, sf_ref = per_token_cast_to_fp8(v)
    assert torch.equal(v, before)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(sf, sf_ref)
    # per_token_cast_to_fp8 now runs this same body: also against the rule spelled out independently
    amax = v.view(m, c // 128, 128).abs().amax(2).clamp(min=1e-4)
    sf_rule = amax * torch.tensor(1.0 / 448, dtype=torch.float32)
    q_rule = (v.view(m, c // 128, 128) * torch.reciprocal(sf_rule).unsqueeze(2)).clamp(-448, 448)
    assert torch.equal(sf, sf_rule)
    assert torch.equal(q.view(torch.uint8), q_rule.to(torch.float8_e4m3fn).view(m, c).view(torch.uint8))


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_staged_forward_equals_old_glue_and_reference_bitwise(preset):
    """The same y bit for bit as the old host-synced glue (same GEMM stand-in), and, with the exact
    stand-in, as reference.moe_forward with DEEPGEMM_STAGED_FP8: the glue is the recipe exactly."""
    g, w = fp8_weights(preset)
    buf = StagedBuffers.allocate(g, 256, ALIGN, "cpu")
    for seed, c in enumerate(routing_cases(g)):
        inp, m = inputs_for(g, c, 100 + seed)
        stage_into(buf, inp, m)
        y = staged_forward(buf, m, w, standin_gemm).clone()  # NaN in every row the GEMM does not compute
        assert y.shape == (m, g.hidden) and y.dtype == torch.bfloat16
        old = old_staged_launch(inp, m, g, w, functools.partial(standin_gemm, unused=0.0))
        assert not first_mismatch(y, old), (c, first_mismatch(y, old))
        if c["t"]:
            ref = moe_forward(inp, w, DEEPGEMM_STAGED_FP8, g)
            assert not first_mismatch(y[: c["t"]], ref), (c, first_mismatch(y[: c["t"]], ref))
            assert torch.isfinite(y).all() and (y[: c["t"]] != 0).any()
        assert (y[c["t"]:] == 0).all()


def test_staged_forward_ignores_stale_gemm_rows():
    """Unused pool rows left untouched by the GEMM (stale from a bigger earlier launch) change nothing,
    and masked slots are skipped by the combine, not added as the zero row's value."""
    g, w = fp8_weights("small")
    buf = StagedBuffers.allocate(g, 256, ALIGN, "cpu")
    untouched = functools.partial(standin_gemm, unused=None)
    big, m_big = inputs_for(g, dict(t=250, m=256, skew=1.0), 7)
    stage_into(buf, big, m_big)
    staged_forward(buf, m_big, w, untouched)
    small_in, m = inputs_for(g, dict(t=30, m=31, mask_prob=0.3), 8)
    stage_into(buf, small_in, m)
    buf.l2_out[buf.max_pool_rows] = float("nan")  # what a masked slot gathers
    y = staged_forward(buf, m, w, untouched).clone()
    assert torch.isfinite(y).all()
    assert not first_mismatch(y, old_staged_launch(small_in, m, g, w, functools.partial(standin_gemm, unused=0.0)))


class CPUPeer(StagedDeepGEMM):
    """The backend class itself on a CPU: no deep_gemm, the stand-in GEMM."""

    device = torch.device("cpu")

    @classmethod
    def availability(cls):
        return True, ""


def cpu_peer(preset: str, capacity: int) -> CPUPeer:
    g, w = fp8_weights(preset)
    be = CPUPeer(g, capacity=capacity)
    be.kernel_weights, be._gemm, be.align = w, standin_gemm, ALIGN
    be._allocate()
    be._prepared = be._allocated = True
    return be


def test_backend_launch_on_cpu_reuses_its_buffers():
    be = cpu_peer("small", 128)
    assert StagedDeepGEMM.graph_capturable is True
    g, w = fp8_weights("small")
    layout = {k: (t.data_ptr(), tuple(t.shape), t.dtype) for k, t in be.buffers.tensors().items()}
    for seed, c in enumerate([dict(t=100, m=128, skew=2.0), dict(t=100, m=128, mask_prob=0.5), dict(t=3, m=3), dict(t=0, m=0)]):
        inp, m = inputs_for(g, c, 40 + seed)
        assert be.stage(inp, m) == m
        y = be.launch(m)
        assert y.shape == (m, g.hidden) and (not m or y.data_ptr() == be.buffers.y.data_ptr())
        assert not first_mismatch(y, old_staged_launch(inp, m, g, w, functools.partial(standin_gemm, unused=0.0)))
        assert {k: (t.data_ptr(), tuple(t.shape), t.dtype) for k, t in be.buffers.tensors().items()} == layout
        if m:
            assert torch.equal(be.run(inp, m), y[: inp.num_tokens])
    inp, _ = inputs_for(g, dict(t=5, m=5), 1)
    be.stage(inp, 8)
    with pytest.raises(ValueError, match="last stage"):
        be.launch(5)


# Ops that sync the host on CUDA, or whose output shape depends on the data.
FORBIDDEN = ("_local_scalar_dense", "nonzero", "bincount", "masked_select", "unique", "item", "equal", "is_nonzero", "any", "all")


class OpLog(TorchDispatchMode):
    """Every aten op of a region: (name, output shapes), and the outputs whose storage is not one of
    ``storages`` (a tensor the region allocated)."""

    def __init__(self, storages: set[int]):
        super().__init__()
        self.storages, self.ops, self.allocated = storages, [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        name = func.overloadpacket.__name__
        self.ops.append((name, tuple(tuple(t.shape) for t in flat)))
        for t in flat:
            if t.untyped_storage().data_ptr() not in self.storages:
                self.allocated.append((name, tuple(t.shape)))
        return out


def test_launch_has_no_data_dependent_shape_op_or_allocation():
    """Pragmatic stand-in for the H200 check: for one token count, different routings (skewed, masked,
    empty) run the same op sequence with the same shapes, none of the ops syncs or sizes by data, and
    every tensor an op returns lives in the preallocated buffers (the GEMM is a data-free fill here)."""
    be = cpu_peer("small", 64)
    g, _ = fp8_weights("small")
    be._gemm = lambda a, b, out, m_idx: out.fill_(0.25)
    storages = {t.untyped_storage().data_ptr() for t in be.buffers.tensors().values()}
    storages |= {t.untyped_storage().data_ptr() for t in (be.kernel_weights.l1, be.kernel_weights.l1_scale, be.kernel_weights.l2, be.kernel_weights.l2_scale)}
    logs = []
    for seed, c in enumerate([dict(t=48, m=64), dict(t=48, m=64, skew=4.0), dict(t=48, m=64, mask_prob=0.7, empty_experts=(2, 3)),
                              dict(t=0, m=64), dict(t=64, m=64, fully_masked_tokens=tuple(range(0, 64, 2)))]):
        inp, m = inputs_for(g, c, 70 + seed)
        be.stage(inp, m)
        with OpLog(storages) as log:
            be.launch(m)
        assert not log.allocated, log.allocated
        assert not [op for op, _ in log.ops if op in FORBIDDEN]
        logs.append(log.ops)
    assert all(ops == logs[0] for ops in logs[1:])
    # The log sees allocations: the old glue, run the same way, allocates per call.
    with OpLog(storages) as log:
        old_staged_launch(inp, m, g, be.kernel_weights, be._gemm)
    assert log.allocated and any(op == "nonzero" for op, _ in log.ops)


# ------------------------------------------------------------------------------------ on the H200
@pytest.mark.gpu
def test_gpu_launch_sync_free_graph_replay_and_old_glue_bitwise():
    dg = pytest.importorskip("deep_gemm")
    g, w = fp8_weights("small")
    be = StagedDeepGEMM(g, capacity=512)
    be.prepare(w)
    be.allocate()
    ts = (1, 7, 200, 512)
    be.build(ts)
    for t in ts:
        for seed, extra in enumerate((dict(), dict(mask_prob=0.3, skew=2.0))):
            inp = make_inputs(g, t, seed=10 * t + seed, **extra).to("cuda")
            be.stage(inp, t)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                y = be.launch(t).clone()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            old = old_staged_launch_cuda(inp, t, g, be.kernel_weights, dg.m_grouped_fp8_gemm_nt_contiguous, be.align)
            assert not first_mismatch(y, old), (t, extra, first_mismatch(y, old))
        # Capture one launch, then stage new inputs into the same buffers and replay.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            be.launch(t)
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, stream=stream):
                y_graph = be.launch(t)
        torch.cuda.current_stream().wait_stream(stream)
        inp = make_inputs(g, t, seed=999 + t, mask_prob=0.2).to("cuda")
        be.stage(inp, t)
        graph.replay()
        torch.cuda.synchronize()
        replayed = y_graph.clone()
        eager = be.launch(t).clone()
        assert not first_mismatch(replayed, eager), (t, first_mismatch(replayed, eager))
        assert torch.isfinite(eager).all()
        del graph


def old_staged_launch_cuda(inputs, m, g, weights, gemm, align):
    """old_staged_launch on the inputs' device (the oracle with the real GEMM)."""
    dev = inputs.x.device
    with torch.device(dev):
        return old_staged_launch(inputs, m, g, weights, gemm, align)

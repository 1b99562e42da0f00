"""megamoe.fused: availability reasons, argument checks, the matrix case list, the stage comparison and
the tensor-core model on CPU; the kernels themselves under ``@pytest.mark.gpu``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megamoe.formats import e4m3_satfinite
from megamoe.fused.base import cuda_hopper_reason
from megamoe.fused.compare import compare_l2_inputs, match_pool_tokens
from megamoe.check.matrix import Case, default_cases
from megamoe.fused.registry import BACKENDS, available_backends, get_backend_class
from megamoe.geometry import get_geometry
from megamoe.inputs import make_inputs
from megamoe.layouts.staging import per_token_cast_to_fp8
from megamoe.recipe import FLASHINFER_MXFP4
from megamoe.reference import moe_forward
from megamoe.reference.tensorcore import EXACT_BLOCK, TensorCoreModel, tc_dot
from megamoe.testing import FLASHINFER_ORACLE


def test_every_backend_reports_availability_with_a_reason():
    rows = available_backends()
    assert [r[0] for r in rows] == list(BACKENDS)
    for name, ok, why in rows:
        assert isinstance(ok, bool)
        assert ok or why, f"{name} unavailable without a reason"
        assert not ok or why == ""


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU reason")
def test_no_gpu_reason_is_named():
    assert "no GPU" in cuda_hopper_reason()
    for name, ok, why in available_backends():
        assert not ok
        assert any(s in why for s in ("no GPU", "package missing", "kernel missing")), why


def test_fp4_backend_names_missing_entry_points():
    from megamoe.fused.deepgemm_fp4 import sm90_fp4_missing

    class Fake:  # the shape of sgl-deep-gemm 0.1.5.post1: an SM100-only fp8_fp4_mega_moe
        fp8_fp4_mega_moe = object()
        get_symm_buffer_for_sm90_mega_moe = object()

    assert sm90_fp4_missing(Fake) == ["transform_weights_for_mega_moe_sm90_fp4"]


def test_unknown_backend_and_bad_capacity():
    with pytest.raises(ValueError, match="unknown backend"):
        get_backend_class("nope")
    with pytest.raises(ValueError, match="capacity"):
        BACKENDS["flashinfer-mxfp4"]("small", capacity=0)


def test_force_block_m_is_checked():
    assert BACKENDS["flashinfer-mxfp4"]("small", capacity=64, force_block_m=24).force_block_m == 24
    with pytest.raises(ValueError, match=r"force_block_m must be one of \(8, 24, 64\) \(or None\), got 48"):
        BACKENDS["flashinfer-mxfp4"]("small", capacity=64, force_block_m=48)
    with pytest.raises(ValueError, match=r"force_block_m must be None, its tile is fixed \(sgl-deep-gemm .* got 64"):
        BACKENDS["deepgemm-sm90-fp8"]("small", capacity=64, force_block_m=64)


def test_check_inputs_rejects_before_any_kernel():
    be = BACKENDS["flashinfer-mxfp4"]("small", capacity=8)
    be.__class__ = type("CPUFlashInfer", (be.__class__,), {"device": property(lambda self: torch.device("cpu"))})
    g = be.g
    good = make_inputs(g, 4, seed=0)
    assert be.check_inputs(good) == 4
    assert be.check_inputs(good, 8) == 8
    with pytest.raises(ValueError, match="exceeds the buffer capacity 8"):
        be.check_inputs(make_inputs(g, 9, seed=0))
    with pytest.raises(ValueError, match="below the staged token count"):
        be.check_inputs(good, 3)
    with pytest.raises(TypeError, match="bfloat16"):
        be.check_inputs(dataclasses.replace(good, x=good.x.float()))
    with pytest.raises(ValueError, match=r"x must be \[T, 512\]"):
        be.check_inputs(dataclasses.replace(good, x=good.x[:, :256]))
    bad = good.clone()
    bad.x[1, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        be.check_inputs(bad)
    with pytest.raises(ValueError, match="at least one token"):
        be.check_inputs(make_inputs(g, 0, seed=0))
    bad = good.clone()
    bad.topk_idx[0, 0] = g.num_experts
    with pytest.raises(ValueError, match="topk_idx must be in"):
        be.check_inputs(bad)


def test_matrix_cases_cover_the_issue():
    cases = default_cases("flashinfer-mxfp4", (8, 24, 64))
    ids = [c.id for c in cases]
    assert len(ids) == len(set(ids))
    big = {c.num_tokens for c in cases if c.geometry == "dsv4-flash" and c.block_m is None and c.routing == "uniform" and not c.ragged}
    assert {1, 2, 7, 64, 128, 300, 512, 2048, 8192} <= big
    assert {c.block_m for c in cases} == {None, 8, 24, 64}
    assert {c.routing for c in cases} >= {"masked", "allmasked", "empty-expert", "skewed"}
    assert any(c.ragged for c in cases) and any(c.weights == "checkpoint" for c in cases)
    assert {c.broken for c in cases} >= {"gate-up-not-interleaved", "scale-off-by-one"}
    assert Case("dsv4-flash", 37, ragged=(37, 128)).launch_tokens == 128
    assert any(c.num_tokens == 0 for c in default_cases("deepgemm-sm90-fp8", (), allows_zero=True))


def _fake_kernel(g, inp, res, shuffle_seed=0):
    """What a kernel buffer would hold: the reference pool in a shuffled row order plus stale rows."""
    st = res.ranks[0]
    lay = st.layout
    x_q, _ = per_token_cast_to_fp8(inp.x)
    p = lay.num_pool_rows
    order = torch.cat([torch.randperm(p, generator=torch.Generator().manual_seed(shuffle_seed)), torch.arange(p, p + 5)])
    pool = torch.full((p + 5, g.hidden), 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)
    real = lay.src_token >= 0
    pool[:p][real] = x_q[lay.src_token[real]]
    l2 = torch.cat([st.l2_in, torch.zeros(5, g.intermediate).to(torch.float8_e4m3fn)])
    sf = torch.cat([st.l2_in_sf, torch.zeros(5, st.l2_in_sf.shape[1])])
    return {"pool_x": pool[order], "l2_in": l2[order], "l2_in_sf_kmajor": sf[order].T.contiguous(), "block_m": 8}


def test_stage_compare_matches_rows_by_content_and_catches_a_flip(small):
    g, w = small
    from megamoe.layouts.ranges import repair_ranges

    w = repair_ranges(w, FLASHINFER_MXFP4)
    inp = make_inputs(g, 12, seed=3, mask_prob=0.25)
    res = moe_forward(inp, w, FLASHINFER_MXFP4, g, block_m=8, keep_stages=True)
    k = _fake_kernel(g, inp, res)
    out = compare_l2_inputs(k, res.ranks[0], inp, g.num_topk)
    assert out["rows_matched"] == out["rows_expected"] == res.ranks[0].layout.num_routed_rows
    assert out["code_match"] == 1.0 and out["sf_match"] == 1.0 and out["sf_layout"] == "k-major"
    # A broken kernel: every code of one row off by one step -> the match rate drops below 1.
    k["l2_in"].view(torch.uint8)[int(torch.nonzero(match_pool_tokens(k["pool_x"], per_token_cast_to_fp8(inp.x)[0]) >= 0)[0])] ^= 1
    assert compare_l2_inputs(k, res.ranks[0], inp, g.num_topk)["code_match"] < 1.0


def test_tensorcore_exact_model_equals_fp64_sum_and_truncation_differs():
    gen = torch.Generator().manual_seed(0)
    a = e4m3_satfinite(torch.randn(32, 64, generator=gen) * 4).float()
    b = e4m3_satfinite(torch.randn(8, 64, generator=gen)).float()
    exact = (a.double() @ b.double().T).float()
    assert torch.equal(tc_dot(a, b, EXACT_BLOCK), exact)
    assert torch.equal(tc_dot(a, b, TensorCoreModel("no-loss", chunk=32, frac_bits=60, out_round="rn")), exact)
    trunc = tc_dot(a, b, TensorCoreModel("t", chunk=32, frac_bits=13, out_bits=13, out_round="rz"))
    assert not torch.equal(trunc, exact)
    assert ((trunc.view(torch.int32) & 0x3FF) == 0).all()  # 13 mantissa bits kept
    # Alignment loss is relative to the largest term, not to the (possibly cancelled) sum.
    assert ((trunc - exact).abs() <= (a.abs() @ b.abs().T) * 2.0**-10).all()


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["flashinfer-mxfp4", "deepgemm-sm90-fp8", "deepgemm-sm90-fp4", "megamoe-decode",
                                  "megamoe-decode-tc"])
def test_fused_backend_matches_its_reference_small(name):
    from megamoe.check.matrix import run_matrix

    ok, why = BACKENDS[name].availability()
    if not ok:  # e.g. the FP4 kernel needs the DeepGEMM PR #323 build, the FP8 ones sgl-deep-gemm
        pytest.skip(why)
    rows = run_matrix(name, [Case("small", 64, seed=1), Case("small", 7, seed=2)], None, time_iters=0)
    for r in rows:
        assert r["status"] == "pass", r
        if name == "deepgemm-sm90-fp4":  # the plan is read back, not reported as BLOCK_M 0
            assert not r["plan"].startswith("BLOCK_M 0"), r["plan"]


@pytest.mark.gpu
def test_deepgemm_fp4_broken_layouts_are_detected_and_window_enforced():
    from megamoe.check.matrix import run_matrix

    ok, why = BACKENDS["deepgemm-sm90-fp4"].availability()
    if not ok:
        pytest.skip(why)
    rows = run_matrix("deepgemm-sm90-fp4", [Case("small", 64, broken="gate-up-not-interleaved"),
                                            Case("small", 64, broken="scale-off-by-one")], None, time_iters=0)
    assert [r["status"] for r in rows] == ["detected", "detected"], rows
    from megamoe.geometry import Geometry
    from megamoe.layouts.random import random_mxfp4_bytes

    g = Geometry("low", num_experts=8, num_topk=2, hidden=512, intermediate=256)
    be = BACKENDS["deepgemm-sm90-fp4"](g, capacity=8)
    with pytest.raises(ValueError, match="below byte 119"):
        be.prepare(random_mxfp4_bytes(g, seed=2, scale_bytes=(110, 125)))


@pytest.mark.gpu
def test_flashinfer_broken_layouts_are_detected():
    pytest.importorskip("flashinfer.megamoe", reason=FLASHINFER_ORACLE)
    from megamoe.check.matrix import run_matrix

    rows = run_matrix("flashinfer-mxfp4", [Case("small", 64, broken="gate-up-not-interleaved"),
                                           Case("small", 64, broken="scale-off-by-one")], None, time_iters=0)
    assert [r["status"] for r in rows] == ["detected", "detected"], rows


@pytest.mark.parametrize("broken", ["gate-up-not-interleaved", "scale-off-by-one"])
def test_deepgemm_broken_layouts_change_what_the_kernel_reads(broken):
    """The matrix's broken DeepGEMM variants, read back through the layout's inverse, are weights whose
    layer output is far from the real one (so a kernel reading them must fail the bound), and restore()
    puts the real tensors back."""
    from types import SimpleNamespace

    from megamoe.check.matrix import Case, _break
    from megamoe.geometry import get_geometry
    from megamoe.layouts.deepgemm_sm90 import from_deepgemm_sm90_fp8, to_deepgemm_sm90_fp8, to_fp8_block
    from megamoe.recipe import DEEPGEMM_SM90_FP8
    from megamoe.reference import moe_forward
    from megamoe.inputs import make_inputs
    from megamoe.testing import calc_diff
    from megamoe.weights import random_mxfp4_weights

    g = get_geometry("tiny")
    kw = to_fp8_block(random_mxfp4_weights(g, seed=21))
    l1, l2 = to_deepgemm_sm90_fp8(kw)
    be = SimpleNamespace(weight_format="fp8_block", kernel_weights=kw, l1=l1, l2=l2)
    restore = _break(be, Case("tiny", 16, broken=broken))
    read = from_deepgemm_sm90_fp8(be.l1, be.l2)
    inp = make_inputs(g, 16, seed=22)
    good = moe_forward(inp, kw, DEEPGEMM_SM90_FP8, g)
    bad = moe_forward(inp, read, DEEPGEMM_SM90_FP8, g)
    assert calc_diff(bad, good) > 1e-2
    restore()
    assert be.l1 is l1 and be.l2 is l2


def test_build_plans_runs_a_lane_one_at_a_time_beside_the_pool():
    """megamoe.fused.build: jobs of one lane never overlap (deep_gemm's JIT is not thread-safe, and builds
    that launch must not run beside a launch); jobs without a lane run in parallel; failures come back."""
    import random
    import threading
    import time as _time

    from megamoe.fused.build import build_plans

    spans: dict = {}
    lock = threading.Lock()

    def job(key, fail=False):
        def f():
            t0 = _time.perf_counter()
            _time.sleep(random.uniform(0.02, 0.04))
            with lock:
                spans[key] = (t0, _time.perf_counter())
            if fail:
                raise RuntimeError(f"no plan {key}")
        return f

    serial = [("dg", t) for t in range(random.randint(3, 5))]
    free = [("fi", t) for t in range(4)]
    bad = ("fi", "bad")
    jobs = {k: job(k) for k in serial + free}
    jobs[bad] = job(bad, fail=True)
    errors = build_plans(jobs, {k: "deep_gemm" for k in serial}, max_workers=8)
    assert [(k, str(e)) for k, e, _ in errors] == [(bad, f"no plan {bad}")] and "RuntimeError" in errors[0][2]
    assert set(spans) == set(jobs)  # every job ran, the failing one too
    lane = sorted(spans[k] for k in serial)
    assert all(a[1] <= b[0] for a, b in zip(lane, lane[1:])), "jobs of one lane overlapped"
    pool = sorted(spans[k] for k in free)
    assert any(a[1] > b[0] for a, b in zip(pool, pool[1:])), "jobs without a lane did not run in parallel"


def test_repeat_check_counts_and_describes_differing_relaunches():
    """A fake backend whose third relaunch leaves one row unwritten (still NaN) and changes another."""
    from types import SimpleNamespace

    from megamoe.check.matrix import _repeat_check

    gen = torch.Generator().manual_seed(3)
    t, h = 6, 16
    good = torch.randn(t, h, generator=gen).to(torch.bfloat16)
    topk = torch.tensor([[0, 1], [2, -1], [-1, -1], [3, 4], [5, 6], [7, -1]])
    calls = {"n": 0, "block_m": set()}

    class Fake:
        y = torch.empty(t, h, dtype=torch.bfloat16)

        def stage(self, inp, m):
            pass

        def launch(self, m, block_m=None):
            calls["n"] += 1
            calls["block_m"].add(block_m)
            if calls["n"] == 3:  # rows 1 and 4: one never written, one off in one element
                self.y[[0, 2, 3, 5]] = good[[0, 2, 3, 5]]
                self.y[4] = good[4]
                self.y[4, 7] = good[4, 7] * 2 + 1
            else:
                self.y.copy_(good)
            return self.y

    out = _repeat_check(Fake(), SimpleNamespace(topk_idx=topk), t, 24, good.clone(), 5, t)
    assert calls["block_m"] == {24}  # every relaunch runs the case's BLOCK_M, not the plan's own
    assert out["repeats"] == 5 and out["repeats_differing"] == 1 and out["repeat_rows_differing_max"] == 2
    seen = {r["token"]: r for r in out["repeat_rows_seen"]}
    assert set(seen) == {1, 4} and all(r["relaunch"] == 2 for r in seen.values())
    assert seen[1]["routed_slots"] == 1 and seen[1]["nan"] == h and seen[1]["elements_differing"] == h
    assert seen[4]["routed_slots"] == 2 and seen[4]["nan"] == 0 and seen[4]["elements_differing"] == 1
    written = (good[4, 7] * 2 + 1).to(torch.bfloat16)  # what the fake stored, in bf16
    assert seen[4]["max_abs_change"] == abs(float(written) - float(good[4, 7])) > 0

"""The fused staging kernel (megamoe.staging.stage_into) against the reference quantizer, bit for bit.

Tiers: the torch path on CPU (always); the Triton kernel under Triton's CPU interpreter (``slow``,
skipped without triton); the Triton kernel on CUDA (``gpu``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from megamoe.formats import E4M3_MAX, e4m3_satfinite
from megamoe.geometry import PRESETS
from megamoe.layouts.staging import per_token_cast_to_fp8
from megamoe.staging import padding_scale, stage_into, stage_reference, triton_available
from megamoe.staging.checks import POISON, StagingCase, allocate_buffers, check_staged, edge_x, make_case
from megamoe.staging.selfcheck import ODD_TOKENS, check_nonfinite, default_cases, run_cases
from megamoe.testing import assert_bitwise_equal, first_mismatch

CASES = default_cases()


def _stage(case: StagingCase, backend: str = "torch", device="cpu", **kw):
    x, idx, w, bufs = make_case(case, device)
    a = stage_into(x, idx, w, *bufs.views(), case.agreed, num_experts=PRESETS[case.preset].num_experts,
                   backend=backend, **kw)
    return a, x, idx, w, bufs


# ------------------------------------------------------------------------------ torch path, CPU
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_torch_path_bitwise(case):
    a, x, idx, w, bufs = _stage(case)
    assert a == case.agreed
    check_staged(bufs, x, idx, w, a, case.id)


def test_every_preset_and_odd_token_count_covered():
    ids = {c.id for c in CASES}
    for p in PRESETS:
        for t in ODD_TOKENS:
            assert any(i.startswith(f"{p}-T{t}-") for i in ids), (p, t)


def test_padding_rows_are_the_reference_zero_rows():
    """Rows [T, A): x zeros, sf the reference's scale of a zero row, idx -1, weight 0."""
    case = StagingCase("small", 5, pad=4, spare=1)
    a, x, idx, w, bufs = _stage(case)
    q0, sf0 = per_token_cast_to_fp8(torch.zeros(4, PRESETS["small"].hidden, dtype=torch.bfloat16))
    assert_bitwise_equal(bufs.x[5:a], q0, "padding x")
    assert_bitwise_equal(bufs.x_sf[5:a], sf0, "padding x_sf")
    assert sf0[0, 0].view(torch.int32).item() == padding_scale().view(torch.int32).item()
    assert (bufs.topk_idx[5:a] == -1).all() and (bufs.topk_weights[5:a] == 0).all()


def test_weights_copied_not_rescaled():
    """The router applied routed_scaling once; staging must copy the weights bit for bit."""
    case = StagingCase("tiny", 37)
    a, x, idx, w, bufs = _stage(case)
    assert_bitwise_equal(bufs.topk_weights[: case.tokens], w, "staged weights (routed scaling applied twice?)")
    # A broken variant that scales again is caught by the same check.
    assert first_mismatch(w * 1.5, bufs.topk_weights[: case.tokens])


def test_true_division_variant_is_rejected():
    """sf = amax / 448 (a true division, as the DeepGEMM source reads on a CPU tensor) is not the target:
    the bitwise checker must see the difference on random inputs."""
    x, *_ = make_case(StagingCase("dsv4-flash", 37), "cpu")
    xv = x.view(37, -1, 128).float()
    amax = xv.abs().amax(dim=2).clamp(min=1e-4)
    sf_div = amax / 448.0
    q_div = e4m3_satfinite(xv * torch.reciprocal(sf_div).unsqueeze(2)).view(37, -1)
    q, sf = per_token_cast_to_fp8(x)
    assert first_mismatch(sf_div, sf), "true division unexpectedly matched the multiply form"
    assert first_mismatch(q_div, q)


def test_edge_values_cover_ties_and_subnormals():
    """edge_x really hits RTNE ties (sf = 1 groups of e4m3 midpoints) and e4m3 subnormal codes."""
    x = edge_x(16, 512, torch.Generator().manual_seed(0))
    q, sf = per_token_cast_to_fp8(x)
    assert (sf == 1.0).any(), "no sf = 1 group: ties would not be exact"
    codes = q.view(torch.uint8) & 0x7F
    assert ((codes > 0) & (codes < 8)).any(), "no e4m3 subnormal code"
    assert (q.view(torch.uint8) == 0x80).any(), "no negative zero"
    assert (codes == 0x7E).any(), "no 448"
    assert torch.isfinite(q.float()).all() and q.float().abs().max() <= E4M3_MAX


def test_rows_past_agreed_untouched():
    case = StagingCase("small", 3, pad=2, spare=6)
    _, _, _, _, bufs = _stage(case)
    for t in bufs.views():
        assert (t[case.agreed:].contiguous().view(torch.uint8) == POISON).all()


def test_returns_agreed_default_is_t():
    x, idx, w, bufs = make_case(StagingCase("tiny", 3), "cpu")
    assert stage_into(x, idx, w, *bufs.views(), num_experts=8, backend="torch") == 3


def test_nonfinite_raises_torch():
    out = check_nonfinite(backend="torch", device="cpu")
    assert out == {"nan": "raised", "inf": "raised", "route": "raised"}


# ------------------------------------------------------------------------------ validation
def _args(**over):
    x, idx, w, bufs = make_case(StagingCase("tiny", 3), "cpu")
    d = dict(x=x, topk_idx=idx, topk_weights=w, out_x=bufs.x, out_x_sf=bufs.x_sf, out_topk_idx=bufs.topk_idx,
             out_topk_weights=bufs.topk_weights, num_experts=8)
    d.update(over)
    return d


@pytest.mark.parametrize(
    "over, err, match",
    [
        (lambda d: {"x": d["x"].float()}, TypeError, "x must have dtype torch.bfloat16, got torch.float32"),
        (lambda d: {"x": d["x"][:, :200]}, ValueError, "multiple of 128, got H=200"),
        (lambda d: {"x": d["x"][0]}, ValueError, r"x must be 2-D \[T, H\]"),
        (lambda d: {"out_x": d["out_x"][:, :128]}, ValueError, r"out_x must have shape \(8, 256\), got \(8, 128\)"),
        (lambda d: {"out_x": d["out_x"].view(torch.uint8)}, TypeError, "out_x must have dtype torch.float8_e4m3fn"),
        (lambda d: {"out_x_sf": d["out_x_sf"][:, :1]}, ValueError, r"out_x_sf must have shape \(8, 2\)"),
        (lambda d: {"out_x_sf": d["out_x_sf"].double()}, TypeError, "out_x_sf must have dtype torch.float32"),
        (lambda d: {"topk_weights": d["topk_weights"][:, :1]}, ValueError, r"topk_weights must have shape \(3, 2\)"),
        (lambda d: {"topk_idx": d["topk_idx"].float()}, TypeError, "topk_idx must have dtype"),
        (lambda d: {"out_topk_idx": d["out_topk_idx"][:, :1]}, ValueError, r"out_topk_idx must have shape \(8, 2\)"),
        (lambda d: {"out_topk_weights": d["out_topk_weights"].half()}, TypeError, "out_topk_weights must have dtype"),
        (lambda d: {"out_x_sf": torch.empty(8, 2, device="meta")}, ValueError, "out_x_sf is on meta but x is on cpu"),
        (lambda d: {"num_tokens_agreed": 9}, ValueError, "num_tokens_agreed=9, capacity C=8"),
        (lambda d: {"num_tokens_agreed": 2}, ValueError, "T=3, num_tokens_agreed=2"),
        (lambda d: {"num_tokens_agreed": 4.0}, TypeError, "num_tokens_agreed must be an int"),
        (lambda d: {"backend": "cuda"}, ValueError, "backend must be one of"),
        (lambda d: {"cast": "rtz"}, ValueError, "cast must be one of"),
    ],
    ids=lambda v: v if isinstance(v, str) and len(v) < 30 else None,
)
def test_validation_before_launch(over, err, match):
    d = _args()
    d.update(over(d))
    before = [t.clone() for t in (d["out_x"].view(torch.uint8), d["out_x_sf"], d["out_topk_idx"], d["out_topk_weights"])
              if t.device.type == "cpu"]
    with pytest.raises(err, match=match):
        stage_into(**d)
    after = [t for t in (d["out_x"].view(torch.uint8) if d["out_x"].dtype == torch.float8_e4m3fn else d["out_x"],
                         d["out_x_sf"], d["out_topk_idx"], d["out_topk_weights"]) if t.device.type == "cpu"]
    for b, a in zip(before, after):
        if b.shape == a.shape:
            assert torch.equal(b.view(torch.uint8) if b.dtype != torch.uint8 else b,
                               a.view(torch.uint8) if a.dtype != torch.uint8 else a), "buffer written before the error"


def test_triton_on_cpu_without_interpreter_says_so():
    if not triton_available():
        with pytest.raises(RuntimeError, match="triton cannot be imported"):
            stage_into(**_args(), backend="triton")
        return
    from megamoe.staging import triton_stage

    if triton_stage.is_interpreted():
        pytest.skip("TRITON_INTERPRET=1 is set in this process")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        stage_into(**_args(), backend="triton")


# ------------------------------------------------------------------------------ Triton, interpreter
def _interpret(*args: str) -> list[dict]:
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "megamoe.staging.selfcheck", "--device", "cpu", *args],
                          env=env, capture_output=True, text=True, timeout=600)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if not rows:
        raise AssertionError(f"selfcheck printed nothing (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return rows


@pytest.mark.slow
@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_triton_interpreter_bitwise():
    """Every case of the matrix through the Triton kernel under TRITON_INTERPRET=1 (integer RTNE cast)."""
    rows = _interpret("--backend", "triton", "--cast", "bits")
    bad = [f"{r['case']}: {r['error']}" for r in rows if "case" in r and not r["ok"]]
    assert not bad, "\n".join(bad)
    assert rows[-1]["nonfinite"] == {"nan": "raised", "inf": "raised", "route": "raised", "flag": "set", "route_flag": "set"}


@pytest.mark.slow
@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
def test_triton_interpreter_hw_cast_is_not_rtne():
    """Finding kept as a test: the interpreter's fp32 -> float8e4nv conversion is not RTNE (it rounds
    half-up on the first dropped bit and ORs a mantissa carry into the exponent, so e.g. 1.9375 -> 1.0),
    which is why the kernel has an integer RTNE cast. Skips once a Triton release fixes it."""
    rows = _interpret("--backend", "triton", "--cast", "hw", "--presets", "small", "--tokens", "37")
    if all(r["ok"] for r in rows if "case" in r):
        pytest.skip("this Triton's interpreter casts fp32 -> e4m3 bit-exactly now")
    assert any("staged x," in r.get("error", "") for r in rows if "case" in r)


# ------------------------------------------------------------------------------ Triton, CUDA
gpu = pytest.mark.skipif(not (torch.cuda.is_available() and triton_available()), reason="needs CUDA and triton")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("cast", ["hw", "bits"])
def test_triton_cuda_bitwise(cast):
    rows = run_cases(CASES, backend="triton", device="cuda", cast=cast)
    bad = [f"{r['case']}: {r['error']}" for r in rows if not r["ok"]]
    assert not bad, "\n".join(bad)


@pytest.mark.gpu
@gpu
def test_triton_cuda_nonfinite():
    assert check_nonfinite(backend="triton", device="cuda") == {"nan": "raised", "inf": "raised", "route": "raised",
                                                                "flag": "set", "route_flag": "set"}


@pytest.mark.gpu
@gpu
def test_triton_cuda_matches_cpu_reference():
    """The GPU kernel against the reference run on the CPU (the multiply form is device-independent)."""
    case = StagingCase("dsv4-flash", 129, edge=True)
    x, idx, w, bufs = make_case(case, "cuda")
    stage_into(x, idx, w, *bufs.views(), case.agreed, num_experts=PRESETS[case.preset].num_experts, backend="triton")
    ref = stage_reference(x.cpu(), idx.cpu(), w.cpu(), case.agreed)
    for got, want, name in zip(bufs.views(), ref, ("x", "x_sf", "topk_idx", "topk_weights")):
        assert_bitwise_equal(got[: case.agreed].cpu(), want, f"cuda vs cpu reference {name}")

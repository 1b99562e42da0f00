"""FP8 activation staging, bit-exact against an independent NumPy formulation of DeepGEMM on CUDA.

The oracle does the arithmetic in NumPy float32 (not torch) and rounds to e4m3 by a table search
with explicit ties-to-even (not a cast), then the library must match it bit for bit.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from megamoe.layouts.staging import (
    dequantize_per_token_fp8,
    per_token_cast_to_fp8,
    per_token_cast_to_fp8_ue8m0_packed,
)
from megamoe.testing import assert_bitwise_equal, calc_diff

# Non-negative finite e4m3 values; their index is the code (codes 0..126 ascend with value).
_E4M3_POS = np.array(
    [math.ldexp(m / 8, -6) if e == 0 else math.ldexp(1 + m / 8, e - 7) for e in range(16) for m in range(8)][:127],
    dtype=np.float64,
)


def e4m3_rn_np(v: np.ndarray) -> np.ndarray:
    """Round float32 values to e4m3 (nearest, ties to the even code, saturate at 448) -> float32."""
    a = np.minimum(np.abs(v.astype(np.float64)), 448.0)
    hi = np.clip(np.searchsorted(_E4M3_POS, a, side="left"), 1, 126)
    lo = hi - 1
    dlo, dhi = a - _E4M3_POS[lo], _E4M3_POS[hi] - a
    pick = np.where(dlo < dhi, lo, np.where(dhi < dlo, hi, np.where(lo % 2 == 0, lo, hi)))
    return (np.sign(v) * _E4M3_POS[pick]).astype(np.float32)


def deepgemm_per_token_cast_oracle(x: torch.Tensor, gran: int = 128, division: bool = False):
    """DeepGEMM's per_token_cast_to_fp8 as it runs on CUDA: sf = amax * fl32(1/448) (or, with
    ``division``, the CPU true division amax / 448), q = e4m3(x * (1 / sf))."""
    xf = x.float().numpy().astype(np.float32)
    t, h = xf.shape
    g = xf.reshape(t, h // gran, gran)
    amax = np.maximum(np.abs(g).max(axis=2), np.float32(1e-4))
    sf = (amax / np.float32(448.0)) if division else (amax * np.float32(1.0 / 448.0))
    inv = np.float32(1.0) / sf
    q = e4m3_rn_np(g * inv[:, :, None]).reshape(t, h)
    return torch.from_numpy(q), torch.from_numpy(sf.astype(np.float32))


@dataclass
class StageCase:
    name: str
    tokens: int
    hidden: int
    kind: str  # normal | huge | tiny | zeros-rows | outliers | mixed
    dtype: torch.dtype = torch.bfloat16

    def __str__(self) -> str:
        return self.name


CASES = [
    StageCase("T1-H128-normal", 1, 128, "normal"),
    StageCase("T7-H512-zero-rows", 7, 512, "zeros-rows"),
    StageCase("T33-H512-outliers", 33, 512, "outliers"),
    StageCase("T5-H256-huge", 5, 256, "huge"),
    StageCase("T9-H384-tiny", 9, 384, "tiny"),
    StageCase("T17-H1024-mixed", 17, 1024, "mixed"),
    StageCase("T3-H4096-dsv4", 3, 4096, "normal"),
    StageCase("T11-H256-fp32", 11, 256, "mixed", torch.float32),
    StageCase("T6-H256-fp16", 6, 256, "normal", torch.float16),
]


def make_x(case: StageCase, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(case.tokens, case.hidden, generator=gen)
    if case.kind == "zeros-rows":
        x[::3] = 0.0
        x[1, 128:256] = 0.0  # one zero group inside a live row
    elif case.kind == "outliers":
        x[:, torch.randperm(case.hidden, generator=gen)[:5]] *= 100.0
    elif case.kind == "huge":
        x = x * 1e36
    elif case.kind == "tiny":
        x = x * 1e-6  # below the 1e-4 amax floor: the floor sets the scale
        x[0] *= 1e-30
    elif case.kind == "mixed":
        x = x * torch.exp2(torch.randint(-30, 30, (case.tokens, case.hidden // 128, 1), generator=gen).float()).repeat_interleave(128, 1)[..., 0]
        x[0, :128] = 1e-4 * 0.999  # amax right at the floor
        x[-1, -128:] = 0.0
    return x.to(case.dtype)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_per_token_cast_bit_exact(case):
    x = make_x(case)
    assert torch.isfinite(x).all() and x.abs().max() > 0
    q, sf = per_token_cast_to_fp8(x)
    q_o, sf_o = deepgemm_per_token_cast_oracle(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape
    assert sf.dtype == torch.float32 and sf.shape == (case.tokens, case.hidden // 128)
    assert_bitwise_equal(sf, sf_o, f"{case}: scales")
    assert_bitwise_equal(q.float(), q_o, f"{case}: e4m3 values")
    # What the kernel sees is close to x (FP8 keeps 3 mantissa bits).
    if case.kind not in ("tiny",):
        assert calc_diff(dequantize_per_token_fp8(q, sf), x.float()) < 1e-3


def test_true_division_variant_differs():
    """The multiply matters: DeepGEMM's source reads amax / 448, which on a CPU tensor is a true
    division; the library must follow the GPU (multiply by fl32(1/448)), and the two really differ."""
    x = torch.randn(64, 512, generator=torch.Generator().manual_seed(0)).bfloat16()
    q, sf = per_token_cast_to_fp8(x)
    q_div, sf_div = deepgemm_per_token_cast_oracle(x, division=True)
    q_mul, sf_mul = deepgemm_per_token_cast_oracle(x)
    assert_bitwise_equal(sf, sf_mul, "scales vs the multiply form")
    assert_bitwise_equal(q.float(), q_mul, "values vs the multiply form")
    n_sf = int((sf_div != sf).sum())
    n_q = int((q_div != q.float()).sum())
    assert n_sf > 0, "the true division gave the same scales: the test no longer shows the multiply matters"
    assert n_q > 0, f"{n_sf} scales differ but no FP8 code does"
    with pytest.raises(AssertionError, match="bitwise mismatch"):
        assert_bitwise_equal(sf, sf_div, "scales vs the division form")


@pytest.mark.parametrize("h", [100, 130, 200, 64])
def test_hidden_not_multiple_of_128_rejected(h):
    with pytest.raises(ValueError, match=rf"multiple of gran=128, got H={h}"):
        per_token_cast_to_fp8(torch.randn(4, h).bfloat16())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_non_finite_rejected(bad):
    x = torch.randn(4, 256).bfloat16()
    x[2, 131] = bad
    with pytest.raises(ValueError, match=r"NaN or Inf \(first at \[token, channel\] = \[2, 131\]\)"):
        per_token_cast_to_fp8(x)


def test_bad_shape_and_dtype_rejected():
    with pytest.raises(ValueError, match="x must be 2-D"):
        per_token_cast_to_fp8(torch.randn(2, 3, 128).bfloat16())
    with pytest.raises(TypeError, match="x must be bfloat16, float16 or float32"):
        per_token_cast_to_fp8(torch.ones(2, 128, dtype=torch.int32))


def test_zero_tokens():
    q, sf = per_token_cast_to_fp8(torch.empty(0, 256, dtype=torch.bfloat16))
    assert q.shape == (0, 256) and sf.shape == (0, 2)


# ------------------------------------------------------------------------------------- SM100
def ue8m0_oracle(x: torch.Tensor, gran: int = 32):
    xf = x.float().tolist()
    inv448 = struct.unpack("<f", struct.pack("<f", 1 / 448))[0]
    f32 = lambda v: struct.unpack("<f", struct.pack("<f", v))[0]  # noqa: E731
    qs, packed = [], []
    for row in xf:
        qrow, brow = [], []
        for g0 in range(0, len(row), gran):
            grp = row[g0 : g0 + gran]
            y = f32(max(max(abs(v) for v in grp), f32(1e-4)) * inv448)
            m, e = math.frexp(y)
            k = e - 1 if m == 0.5 else e  # ceil(log2 y)
            brow.append(k + 127)
            qrow += [v * math.ldexp(1.0, -k) for v in grp]  # exact: a power of two
        qs.append(qrow)
        packed.append([struct.unpack("<i", bytes(brow[i : i + 4]))[0] for i in range(0, len(brow), 4)])
    q = e4m3_rn_np(np.array(qs, dtype=np.float32))
    return torch.from_numpy(q), torch.tensor(packed, dtype=torch.int32)


@pytest.mark.parametrize("case", [CASES[1], CASES[2], CASES[5]], ids=str)
def test_ue8m0_packed_sm100(case):
    x = make_x(case, seed=3)
    q, packed = per_token_cast_to_fp8_ue8m0_packed(x)
    q_o, packed_o = ue8m0_oracle(x)
    assert packed.dtype == torch.int32 and packed.shape == (case.tokens, case.hidden // 128)
    assert_bitwise_equal(packed, packed_o, f"{case}: packed UE8M0 scales")
    assert_bitwise_equal(q.float(), q_o, f"{case}: e4m3 values")


def test_ue8m0_needs_groups_of_four():
    with pytest.raises(ValueError, match="multiple of 4"):
        per_token_cast_to_fp8_ue8m0_packed(torch.randn(2, 96).bfloat16())


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES[:6], ids=str)
def test_same_bits_on_cuda(case):
    """The multiply is spelled out, so CUDA staging gives the CPU bits (and DeepGEMM's, measured)."""
    x = make_x(case)
    q, sf = per_token_cast_to_fp8(x)
    qc, sfc = per_token_cast_to_fp8(x.cuda())
    assert_bitwise_equal(sfc.cpu(), sf, f"{case}: scales on CUDA vs CPU")
    assert_bitwise_equal(qc.cpu().float(), q.float(), f"{case}: values on CUDA vs CPU")

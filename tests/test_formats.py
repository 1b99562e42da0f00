"""Codecs, bit by bit, against independent formulations written here in plain Python.

Every oracle below is deliberately not the library's method: brute-force nearest-grid search with
explicit ties-to-even instead of thresholds, ``math.ldexp`` / ``math.frexp`` instead of exponent-field
bit tricks, ``struct`` instead of shifts, an e4m3 table built from the bit layout instead of a cast.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import pytest
import torch

from megamoe import formats as F
from megamoe.testing import assert_bitwise_equal, first_mismatch

E2M1_TABLE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


# ------------------------------------------------------------------------------ Python oracles
def e2m1_code_oracle(x: float) -> int:
    """Nearest signed e2m1 magnitude, ties to the even magnitude index, saturating; no -0."""
    ax = min(abs(x), 6.0)
    best = min(range(8), key=lambda i: (abs(ax - E2M1_TABLE[i]), i % 2))
    return best | (8 if (x < 0 and best != 0) else 0)


def e4m3_value_of_code(c: int) -> float:
    """e4m3fn bit layout: s eeee mmm, bias 7, exponent 0 = subnormal, s1111111 = NaN, no inf."""
    s, e, m = c >> 7, (c >> 3) & 0xF, c & 7
    if e == 15 and m == 7:
        return math.nan
    v = math.ldexp(m / 8, -6) if e == 0 else math.ldexp(1 + m / 8, e - 7)
    return -v if s else v


E4M3_CODES = [e4m3_value_of_code(c) for c in range(256)]
E4M3_FINITE = sorted({(v, c) for c, v in enumerate(E4M3_CODES) if not math.isnan(v) and not (v == 0 and c)})


def e4m3_rn_satfinite_oracle(x: float) -> float:
    """Nearest finite e4m3 by exhaustive search, ties to the even code (mantissa LSB 0), +-448 cap."""
    if math.isnan(x):
        return math.nan
    x = max(-448.0, min(448.0, x))
    v, _ = min(E4M3_FINITE, key=lambda vc: (abs(x - vc[0]), vc[1] & 1))
    return math.copysign(v, x) if v == 0 else v


def e8m0_oracle(x: float, rounding: str) -> int:
    m, e = math.frexp(x)  # x = m * 2**e, 0.5 <= m < 1, exact
    k = e - 1 if (m == 0.5 or rounding == "floor") else e
    return max(0, min(254, k + 127))


def interesting_floats(gen: torch.Generator, n: int = 600) -> list[float]:
    """Grid points, exact midpoints, their float32 neighbours, random values over many octaves."""
    vals = [0.0, -0.0, 1e-30, -1e-30, 7.0, -7.0, 1e6, -1e6]
    mids = [(a + b) / 2 for a, b in zip(E2M1_TABLE, E2M1_TABLE[1:])]
    for v in E2M1_TABLE + mids:
        f = torch.tensor([v], dtype=torch.float32)
        for u in (f, torch.nextafter(f, torch.tensor([-1.0])), torch.nextafter(f, torch.tensor([100.0]))):
            vals += [u.item(), -u.item()]
    vals += (torch.randn(n, generator=gen) * 3).tolist()
    vals += (torch.randn(n, generator=gen) * torch.exp2(torch.randint(-12, 12, (n,), generator=gen).float())).tolist()
    return vals


# ------------------------------------------------------------------------------------- e2m1
def test_e2m1_decode_all_codes():
    codes = torch.arange(16, dtype=torch.uint8)
    want = torch.tensor([E2M1_TABLE[c & 7] * (-1 if c & 8 else 1) for c in range(16)], dtype=torch.float32)
    assert_bitwise_equal(F.e2m1_decode(codes), want, "e2m1_decode (uint8)")
    # int8 input and high-nibble garbage: only the low nibble counts.
    assert_bitwise_equal(F.e2m1_decode((codes | 0x30).view(torch.int8)), want, "e2m1_decode (int8)")


def test_e2m1_encode_vs_brute_force(gen):
    vals = interesting_floats(gen)
    x = torch.tensor(vals, dtype=torch.float32)
    want = torch.tensor([e2m1_code_oracle(v) for v in x.tolist()], dtype=torch.uint8)
    assert_bitwise_equal(F.e2m1_encode(x), want, "e2m1_encode vs brute-force nearest (ties to even)")


def test_e2m1_encode_exact_ties_go_to_even():
    # 0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2.0, 2.5 -> 2.0, 3.5 -> 4.0, 5.0 -> 4.0
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0])
    want = torch.tensor([0, 2, 2, 4, 4, 6, 6, 0, 8 | 6], dtype=torch.uint8)
    assert_bitwise_equal(F.e2m1_encode(x), want, "e2m1 ties")


def test_e2m1_encode_rejects_nan():
    with pytest.raises(ValueError, match="NaN"):
        F.e2m1_encode(torch.tensor([1.0, float("nan")]))
    with pytest.raises(TypeError, match="x must be a floating"):
        F.e2m1_encode(torch.tensor([1, 2]))


def test_pack_unpack_nibble_order(gen):
    codes = torch.randint(0, 16, (3, 5, 64), generator=gen, dtype=torch.uint8)
    packed = F.pack_e2m1(codes)
    flat_c, flat_p = codes.reshape(-1, 64).tolist(), packed.reshape(-1, 32).tolist()
    for row_c, row_p in zip(flat_c, flat_p):
        assert row_p == [row_c[2 * i] | (row_c[2 * i + 1] << 4) for i in range(32)], "byte i = K[2i] low | K[2i+1] high"
    assert_bitwise_equal(F.unpack_e2m1(packed), codes, "unpack(pack(codes))")
    assert_bitwise_equal(F.unpack_e2m1(packed.view(torch.int8)), codes, "unpack of int8 storage")
    raw = torch.randint(0, 256, (7, 16), generator=gen, dtype=torch.uint8)
    assert_bitwise_equal(F.pack_e2m1(F.unpack_e2m1(raw)), raw, "pack(unpack(bytes))")


def test_pack_rejects_odd_k():
    with pytest.raises(ValueError, match="even"):
        F.pack_e2m1(torch.zeros(2, 3, dtype=torch.uint8))


# ------------------------------------------------------------------------------------- E8M0
def test_e8m0_to_float_all_bytes():
    b = torch.arange(256, dtype=torch.uint8)
    want = torch.tensor([math.nan if i == 255 else math.ldexp(1.0, i - 127) for i in range(256)], dtype=torch.float32)
    got = F.e8m0_to_float(b)
    assert torch.isnan(got[255]) and torch.isnan(want[255])
    assert_bitwise_equal(got[:255], want[:255], "e8m0_to_float vs math.ldexp")
    if hasattr(torch, "float8_e8m0fnu"):
        assert_bitwise_equal(F.e8m0_to_float(b.view(torch.float8_e8m0fnu))[:255], want[:255], "float8_e8m0fnu input")


@pytest.mark.parametrize("rounding", ["ceil", "floor"])
def test_float_to_e8m0_vs_frexp(gen, rounding):
    mags = torch.exp2(torch.rand(2000, generator=gen) * 300 - 150)  # 2**-150 .. 2**150 (fp32: subnormals, inf)
    x = mags[torch.isfinite(mags) & (mags > 0)]
    x = torch.cat([x, torch.exp2(torch.arange(-149, 128, dtype=torch.float32))])  # exact powers of two
    want = torch.tensor([e8m0_oracle(v, rounding) for v in x.tolist()], dtype=torch.uint8)
    assert_bitwise_equal(F.float_to_e8m0(x, rounding=rounding), want, f"float_to_e8m0({rounding}) vs frexp")
    normal = x[(x >= 2.0**-126) & (x < 2.0**127)]
    assert_bitwise_equal(F.float_to_e8m0(normal, rounding=rounding),
                         torch.tensor([e8m0_oracle(v, rounding) for v in normal.tolist()], dtype=torch.uint8),
                         "normal-only path")


def test_float_to_e8m0_exact_and_rejects():
    p = torch.exp2(torch.arange(-20, 20, dtype=torch.float32))
    assert F.float_to_e8m0(p, rounding="exact").tolist() == list(range(107, 147))
    with pytest.raises(ValueError, match="not a power of two"):
        F.float_to_e8m0(torch.tensor([3.0]), rounding="exact")
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="finite positive"):
            F.float_to_e8m0(torch.tensor([1.0, bad]))
    with pytest.raises(ValueError, match="rounding"):
        F.float_to_e8m0(torch.tensor([1.0]), rounding="nearest")


def test_ue8m0_x4_little_endian_vs_struct(gen):
    b = torch.randint(0, 256, (3, 16), generator=gen, dtype=torch.uint8)
    b[0, :4] = torch.tensor([0xFF, 0x00, 0x80, 0xFF], dtype=torch.uint8)  # sign bit of the int32 set
    packed = F.pack_ue8m0_x4(b)
    assert packed.dtype == torch.int32 and packed.shape == (3, 4)
    want = [[struct.unpack("<i", bytes(row[4 * j : 4 * j + 4]))[0] for j in range(4)] for row in b.tolist()]
    assert packed.tolist() == want, "pack_ue8m0_x4 vs struct '<i'"
    assert_bitwise_equal(F.unpack_ue8m0_x4(packed), b, "unpack_ue8m0_x4(pack)")
    with pytest.raises(ValueError, match="multiple of 4"):
        F.pack_ue8m0_x4(torch.zeros(2, 6, dtype=torch.uint8))
    # Zero rows (an EP rank with no tokens) pack to an empty [0, G/4].
    assert F.pack_ue8m0_x4(torch.zeros(0, 8, dtype=torch.uint8)).shape == (0, 2)
    assert F.unpack_ue8m0_x4(torch.zeros(0, 2, dtype=torch.int32)).shape == (0, 8)


# ------------------------------------------------------------------------------------- e4m3
def test_e4m3_table_matches_torch():
    got = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    want = torch.tensor(E4M3_CODES, dtype=torch.float32)
    assert torch.isnan(got[[127, 255]]).all()
    keep = [c for c in range(256) if c not in (127, 255)]
    assert_bitwise_equal(got[keep], want[keep], "e4m3 codes vs bit-layout table")
    assert max(v for v, _ in E4M3_FINITE) == F.E4M3_MAX and min(v for v, _ in E4M3_FINITE if v > 0) == 2.0**-9


def e4m3_test_values(gen) -> torch.Tensor:
    mids = [(a + b) / 2 for (a, _), (b, _) in zip(E4M3_FINITE, E4M3_FINITE[1:])]
    rand = torch.randn(1500, generator=gen) * torch.exp2(torch.randint(-12, 10, (1500,), generator=gen).float())
    extra = [460.0, 464.0, 470.0, 1e4, -1e4, 2.0**-10, 2.0**-10 * 3, -(2.0**-11), 0.0]
    return torch.cat([torch.tensor(mids), rand, torch.tensor(extra)]).float()


def test_e4m3_satfinite_vs_exhaustive_search(gen):
    x = e4m3_test_values(gen)
    want = torch.tensor([e4m3_rn_satfinite_oracle(v) for v in x.tolist()], dtype=torch.float32)
    got = F.e4m3_satfinite(x)
    assert got.dtype == torch.float8_e4m3fn
    assert_bitwise_equal(got.float(), want, "e4m3_satfinite vs nearest-of-table (ties to even)")
    assert torch.isnan(F.e4m3_satfinite(torch.tensor([float("nan")])).float()).all()


def test_e4m3_flush_saturate_rule(gen):
    x = e4m3_test_values(gen)
    want = torch.tensor(
        [0.0 if abs(v) < 2.0**-6 else e4m3_rn_satfinite_oracle(v) for v in x.tolist()], dtype=torch.float32
    )
    # Compare values (the flush gives +0 for tiny negatives, which is what the decoder writes).
    got = F.e4m3_flush_saturate(x).float()
    assert first_mismatch(got + 0.0, want + 0.0) == "", first_mismatch(got + 0.0, want + 0.0)


# ------------------------------------------------------------------------------------- MXFP4
def mxfp4_quantize_oracle(w: list[list[float]], block: int = 32) -> tuple[list[list[int]], list[list[int]]]:
    """Per-group loop: smallest 2**k with amax / 2**k <= 6 (zero group: byte 127), codes by brute force."""
    codes, scales = [], []
    for row in w:
        rc, rs = [], []
        for g0 in range(0, len(row), block):
            grp = row[g0 : g0 + block]
            amax = max(abs(v) for v in grp)
            if amax == 0:
                k = 0
            else:
                k = -200
                while amax / math.ldexp(1.0, k) > 6.0:
                    k += 1
            k = max(-127, min(127, k))
            rs.append(k + 127)
            rc += [e2m1_code_oracle(v / math.ldexp(1.0, k)) for v in grp]
        codes.append(rc)
        scales.append(rs)
    return codes, scales


@dataclass
class MXCase:
    name: str
    rows: int
    k: int
    scale_pow: tuple[int, int]  # per-row magnitude 2**U(lo, hi)

    def __str__(self) -> str:
        return self.name


MX_CASES = [
    MXCase("unit-r4-k64", 4, 64, (0, 0)),
    MXCase("spread-r6-k128", 6, 128, (-10, 8)),
    MXCase("tiny-r3-k96", 3, 96, (-40, -30)),
]


@pytest.mark.parametrize("case", MX_CASES, ids=str)
def test_quantize_mxfp4_vs_group_loop(case, gen):
    w = torch.randn(case.rows, case.k, generator=gen)
    lo, hi = case.scale_pow
    w = w * torch.exp2(torch.randint(lo, hi + 1, (case.rows, 1), generator=gen).float())
    w[0, :32] = 0.0  # an all-zero group
    w[-1, 32:64] = w[-1, 32:64] / w[-1, 32:64].abs().max() * 6.0 * 2.0**lo  # amax exactly 6 * 2**lo
    packed, sb = F.quantize_mxfp4(w)
    codes_o, scales_o = mxfp4_quantize_oracle(w.tolist())
    assert_bitwise_equal(sb, torch.tensor(scales_o, dtype=torch.uint8), f"{case}: E8M0 scale bytes")
    assert_bitwise_equal(F.unpack_e2m1(packed), torch.tensor(codes_o, dtype=torch.uint8), f"{case}: e2m1 codes")
    # Dequantize vs a loop, and the value round trip.
    deq = F.dequantize_mxfp4(packed, sb)
    want = [[E2M1_TABLE[c & 7] * (-1 if c & 8 else 1) * math.ldexp(1.0, s - 127) for c, s in
             zip(rc, [rs[j // 32] for j in range(case.k)])] for rc, rs in zip(codes_o, scales_o)]
    assert_bitwise_equal(deq, torch.tensor(want, dtype=torch.float32), f"{case}: dequantize")
    p2, s2 = F.quantize_mxfp4(deq)
    assert torch.equal(F.dequantize_mxfp4(p2, s2), deq), f"{case}: quantize(dequantize(q)) changed values"


def test_mxfp4_byte_round_trip_when_groups_hit_six(gen):
    # Every group holds a +-6 code, so the scale is determined and quantize(dequantize(b)) == b bitwise.
    codes = torch.randint(0, 16, (5, 128), generator=gen, dtype=torch.uint8)
    codes[codes == 8] = 0  # no negative zero: it re-encodes as +0
    codes[:, ::32] = 7
    sb = torch.randint(100, 150, (5, 4), generator=gen, dtype=torch.uint8)
    packed = F.pack_e2m1(codes)
    p2, s2 = F.quantize_mxfp4(F.dequantize_mxfp4(packed, sb))
    assert_bitwise_equal(p2, packed, "packed round trip")
    assert_bitwise_equal(s2, sb, "scale round trip")


def test_mxfp4_rejects():
    with pytest.raises(ValueError, match="multiple of 32"):
        F.quantize_mxfp4(torch.randn(2, 48))
    with pytest.raises(ValueError, match="NaN or Inf"):
        F.quantize_mxfp4(torch.tensor([[float("inf")] + [0.0] * 31]))
    with pytest.raises(ValueError, match="scale_bytes must have shape"):
        F.dequantize_mxfp4(torch.zeros(2, 32, dtype=torch.uint8), torch.zeros(2, 3, dtype=torch.uint8))



@pytest.mark.parametrize("rule", ["e4m3_flush_saturate", "e4m3_satfinite"])
def test_mxfp4_decode_table_vs_oracle(rule):
    """Every (E8M0 byte, e2m1 code) pair against the Python oracles: 2**(b-127) * e2m1, then the rule."""
    table = F.mxfp4_decode_table(getattr(F, rule))
    want = []
    for b in range(256):
        for c in range(16):
            v = E2M1_TABLE[c & 7] * (-1.0 if c & 8 else 1.0) * math.ldexp(1.0, b - 127)
            if b == 255:
                want.append(math.nan)
            elif rule == "e4m3_flush_saturate" and abs(v) < 2.0**-6:
                want.append(0.0)
            else:
                want.append(e4m3_rn_satfinite_oracle(v))
    want = torch.tensor(want, dtype=torch.float32)
    assert torch.equal(table.isnan(), want.isnan()) and int(want.isnan().sum()) == 16  # byte 255 only
    ok = ~want.isnan()
    assert first_mismatch(table[ok] + 0.0, want[ok] + 0.0) == "", first_mismatch(table[ok] + 0.0, want[ok] + 0.0)


@pytest.mark.parametrize("rule", ["e4m3_flush_saturate", "e4m3_satfinite"])
def test_dequantize_mxfp4_lookup_matches_elementwise(rule, gen):
    """The lookup gives the bits of dequantize + decode, element by element, over leading dims."""
    decode = getattr(F, rule)
    packed = torch.randint(0, 256, (3, 5, 48), generator=gen, dtype=torch.uint8)
    sb = torch.randint(0, 256, (3, 5, 3), generator=gen, dtype=torch.uint8)
    sb[0, 0] = torch.tensor([0, 254, 255], dtype=torch.uint8)  # the extremes and the NaN byte
    got = F.dequantize_mxfp4_lookup(packed, sb, F.mxfp4_decode_table(decode))
    assert_bitwise_equal(got, decode(F.dequantize_mxfp4(packed, sb)).float(), rule)


def test_dequantize_mxfp4_lookup_rejects():
    table = F.mxfp4_decode_table(F.e4m3_satfinite)
    with pytest.raises(ValueError, match="scale_bytes must have shape"):
        F.dequantize_mxfp4_lookup(torch.zeros(2, 32, dtype=torch.uint8), torch.zeros(2, 3, dtype=torch.uint8), table)
    with pytest.raises(ValueError, match="table must be float32"):
        F.dequantize_mxfp4_lookup(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 1, dtype=torch.uint8), table[:16])


# ------------------------------------------------------------------------------------- FP8 block
def test_quantize_fp8_block_vs_loop(gen):
    w = torch.randn(256, 384, generator=gen) * torch.exp2(torch.randint(-8, 8, (256, 1), generator=gen).float())
    w[:128, :128] = 0.0  # a zero block: amax clamped to 1e-4
    q, sf = F.quantize_fp8_block(w)
    assert q.shape == (256, 384) and sf.shape == (2, 3)
    inv448 = struct.unpack("<f", struct.pack("<f", 1 / 448))[0]
    f32 = lambda v: struct.unpack("<f", struct.pack("<f", v))[0]  # noqa: E731  round to float32
    for bn in range(2):
        for bk in range(3):
            blk = w[bn * 128 : (bn + 1) * 128, bk * 128 : (bk + 1) * 128]
            amax = max(float(blk.abs().max()), f32(1e-4))
            s = f32(amax * inv448)
            assert sf[bn, bk].item() == s, f"block ({bn}, {bk}): sf {sf[bn, bk].item()!r} != {s!r}"
            inv = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(s, dtype=torch.float32)
            want = (blk * inv).clamp(-448, 448).to(torch.float8_e4m3fn)
            assert_bitwise_equal(q[bn * 128 : (bn + 1) * 128, bk * 128 : (bk + 1) * 128], want, f"block ({bn}, {bk})")

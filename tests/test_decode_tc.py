"""megamoe.decode's tensor-core path on a CPU: its weight layout bit for bit, what prepare refuses or repairs,
the reference's group-scaled GEMM against a plain float64 sum where the tensor-core model is exact, and both
Triton stages under the interpreter (in a subprocess) against their twins and the reference."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="needs triton 3.6 (its CPU interpreter): pip install -e \".[test]\"")

from megamoe.decode.layout_tc import (  # noqa: E402
    _expert_codes, e4m3_bytes, expert_operands, pack_pair, prepare_tc_weights, unpack_pair)
from megamoe.formats import E2M1_MAGNITUDES, pack_e2m1, unpack_e2m1  # noqa: E402
from megamoe.recipe import MEGAMOE_DECODE_TC, get_recipe  # noqa: E402
from megamoe.reference.gemm import group_scaled_gemm  # noqa: E402
from megamoe.staging import triton_available  # noqa: E402
from megamoe.weights import MXFP4Weights  # noqa: E402

from decode_selfcheck import DecodeCase, interpreter_rows as run_interpreted, passed_order  # noqa: E402
from decode_tc_selfcheck import (  # noqa: E402
    CPU_CASES, ORDER_CONFIGS, ROUTE_CASES, SPLIT_CASES, flipped_route, passed_tc, run_tc_case)


def checkpoint_from_tc(tw) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """All experts' codes and bytes back in checkpoint order (the inverse of prepare, after its canonical bytes):
    (l1 codes [E, 2I, H], l1 bytes [E, 2I, H/32], l2 codes [E, H, I], l2 bytes [E, H, I/32])."""
    return tuple(torch.stack(t) for t in zip(*(_expert_codes(tw, e) for e in range(tw.num_experts))))


def test_every_code_decodes_to_e2m1_times_2_pow_minus_6():
    codes = torch.arange(16, dtype=torch.uint8)
    got = e4m3_bytes(codes).view(torch.float8_e4m3fn).double()
    mag = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float64)[codes.long() & 7]
    want = torch.where(codes >= 8, -mag, mag) * 2.0**-6
    assert torch.equal(got, want) and got[8].item() == 0.0 and torch.signbit(got[8])


def test_every_code_pair_decodes_bytewise_and_wordwise(gen):
    """All 256 (lo, hi) pairs: the stored byte decodes to both codes' e4m3 bytes. Then the pairs four to a 32-bit
    word in random order, decoded as the kernel does on the GPU: whole-word shifts, so bits cross byte boundaries
    before the masks clear them."""
    lo, hi = (c.flatten() for c in torch.meshgrid(torch.arange(16, dtype=torch.uint8),
                                                   torch.arange(16, dtype=torch.uint8), indexing="ij"))
    byte = pack_pair(lo, hi)
    assert torch.equal(torch.sort(byte).values, torch.arange(256, dtype=torch.uint8))  # a bijection
    got_lo, got_hi = unpack_pair(byte)
    assert torch.equal(got_lo, e4m3_bytes(lo)) and torch.equal(got_hi, e4m3_bytes(hi))
    shuffled = byte[torch.randperm(256, generator=gen)]
    words = shuffled.view(torch.int32).long() & 0xFFFFFFFF  # 64 words, four pairs each
    word_lo = words & 0x9C9C9C9C
    word_hi = ((words << 2) & 0x8C8C8C8C) | ((words >> 2) & 0x10101010)
    as_bytes = lambda w: w.to(torch.int32).view(torch.uint8)  # noqa: E731
    want_lo, want_hi = unpack_pair(shuffled)
    assert torch.equal(as_bytes(word_lo), want_lo) and torch.equal(as_bytes(word_hi), want_hi)


def test_prepare_roundtrips_and_operands_are_the_checkpoint(weights_for):
    g, w = weights_for("tiny")
    tw = prepare_tc_weights(w)
    c1, s1, c2, s2 = checkpoint_from_tc(tw)
    assert torch.equal(c1, unpack_e2m1(w.l1)) and torch.equal(c2, unpack_e2m1(w.l2))
    assert torch.equal(s1, w.l1_scale) and torch.equal(s2, w.l2_scale)
    w1, sf1, w2, sf2 = expert_operands(tw, 3)  # e2m1 * 2**-6 and 2**(s - 121): their product is the weight
    want1, want2 = w.dequantize_expert(3)
    per_weight = lambda sf: sf.repeat_interleave(32, dim=-1).double()  # noqa: E731
    assert torch.equal(w1.double() * per_weight(sf1), want1.double())
    assert torch.equal(w2.double() * per_weight(sf2), want2.double())


def test_prepare_refuses_bytes_outside_the_window_and_repairs_zero_groups(weights_for, gen):
    g, w = weights_for("tiny")
    lo, hi = MEGAMOE_DECODE_TC.min_scale_byte, MEGAMOE_DECODE_TC.max_scale_byte
    assert (lo, hi) == (20, 236)
    codes = unpack_e2m1(w.l1).clone()
    codes[2, 5, 32:64] = 3  # a nonzero group
    for bad in (lo - 1, hi + 1):
        s = w.l1_scale.clone()
        s[2, 5, 1] = bad
        with pytest.raises(ValueError, match=rf"byte {bad} at \[expert, row, group\] = \[2, 5, 1\].*outside 20..236"):
            prepare_tc_weights(MXFP4Weights(pack_e2m1(codes), s, w.l2, w.l2_scale))
    s = w.l1_scale.clone()
    s[2, 5, 1] = 0xFF
    with pytest.raises(ValueError, match="0xFF"):  # NaN: refused already by the weights' own check
        prepare_tc_weights(MXFP4Weights(pack_e2m1(codes), s, w.l2, w.l2_scale))
    s = w.l1_scale.clone()
    codes[1, 7, 64:96] = 0  # an all-zero group: its byte does not matter and becomes 127
    s[1, 7, 2] = 5
    tw = prepare_tc_weights(MXFP4Weights(pack_e2m1(codes), s, w.l2, w.l2_scale))
    _, s1, _, _ = checkpoint_from_tc(tw)
    assert s1[1, 7, 2] == 127 and torch.equal(s1[1, 7, :2], s[1, 7, :2])


def test_group_scaled_gemm_is_the_exact_sum_where_every_rounding_is_exact(gen):
    """Small-integer x, e2m1 weights, power-of-two scales: every group sum, block sum and promotion is exact,
    so the recipe must give the float64 sum of x * w * scales (an independent computation)."""
    m, n, k = 3, 5, 256
    x = torch.randint(-4, 5, (m, k), generator=gen).float()
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    w = e4m3_bytes(codes).view(torch.float8_e4m3fn).float()
    sb = torch.randint(118, 124, (n, k // 32), generator=gen)
    sf = torch.ldexp(torch.ones(n, k // 32), sb - 121)
    x_sf = torch.ldexp(torch.ones(m, k // 128), torch.randint(-3, 3, (m, k // 128), generator=gen))
    want = torch.einsum("mk,nk->mn", x.double() * x_sf.repeat_interleave(128, 1).double(),
                        w.double() * sf.repeat_interleave(32, 1).double())
    for mma in ("exact-block", "sm90-fp8-tc-operands"):
        got = group_scaled_gemm(x, x_sf, w, sf, 128, mma)
        assert torch.equal(got.double(), want), mma


def test_group_scaled_gemm_rounds_where_the_tensor_cores_do(gen):
    """Wide-range x: the tensor-core model must differ from the exact block sum somewhere (it keeps 13 bits)."""
    x = (torch.randn(4, 128, generator=gen) * 100).to(torch.float8_e4m3fn).float()
    codes = torch.randint(0, 16, (64, 128), generator=gen, dtype=torch.uint8)
    w = e4m3_bytes(codes).view(torch.float8_e4m3fn).float()
    sf, x_sf = torch.ones(64, 4), torch.ones(4, 1)
    a = group_scaled_gemm(x, x_sf, w, sf, 128, "exact-block")
    b = group_scaled_gemm(x, x_sf, w, sf, 128, "sm90-fp8-tc-operands")
    assert not torch.equal(a, b) and (a - b).abs().max() < 1e-2 * a.abs().max()


def test_recipe_and_backend_registered():
    from megamoe.fused.megamoe_decode import MegaMoEDecodeTC
    from megamoe.fused.registry import BACKENDS

    r = get_recipe("megamoe-decode-tc")
    assert r is MEGAMOE_DECODE_TC and r.weight_decode == "e4m3_group" and r.mma == "sm90-fp8-tc-operands"
    assert BACKENDS["megamoe-decode-tc"] is MegaMoEDecodeTC and MegaMoEDecodeTC.recipe is r
    with pytest.raises(ValueError, match="at most 64 tokens per rank"):
        MegaMoEDecodeTC("dsv4-flash", capacity=65)


def test_pdl_launch_attribute_comes_with_the_kernels_wait():
    """A kernel launched with programmatic dependent launch may start before the previous launch has finished:
    the launch attribute must never be asked for without the kernels' own wait (PDL), and never under the
    interpreter (no GPU instruction there). The backend asks for it at every count."""
    from megamoe.decode.tc import _opts, tc_launch_config

    on = _opts(4, 3, 80, interpret=False, pdl=True)
    off = _opts(4, 3, 80, interpret=False, pdl=False)
    assert on["launch_pdl"] is True and on["PDL"] is True
    assert "launch_pdl" not in off and off["PDL"] is False
    assert _opts(4, 3, 80, interpret=True, pdl=True) == {}
    assert all(tc_launch_config(t, 6).pdl for t in (1, 2, 8, 64))
    assert [tc_launch_config(t, 6).tc_l1_maxnreg for t in (1, 8, 16, 64)] == [80, 80, 72, 72]
    assert all(tc_launch_config(t, 6).tc_pack4 for t in (1, 8, 64))
    assert [tc_launch_config(t, 6).tc_split for t in (1, 2, 8, 64)] == [2, 1, 1, 1]
    assert [tc_launch_config(t, 6).tc_route for t in (1, 2, 4, 5, 8)] == [True, True, True, False, False]


def test_split_k_is_refused_where_it_cannot_run():
    """Bad split settings fail before any launch, naming the setting: parts outside 1, 2, 4; a split without the
    packed passes; more tokens than the buffers' split scratch; parts that do not divide L1's K blocks."""
    from megamoe.decode import LaunchConfig
    from megamoe.decode.tc import _split

    with pytest.raises(ValueError, match=r"tc_split must be one of \(1, 2, 4\), got 3"):
        LaunchConfig(tc_split=3)

    class Buf:
        split_tokens = 2

    class TW:
        hidden = 4096

    ok = LaunchConfig(tc_pack4=True, tc_split=2)
    assert _split(TW, Buf, 2, ok) == 2 and _split(TW, Buf, 64, LaunchConfig(tc_pack4=True)) == 1
    with pytest.raises(ValueError, match=r"tc_split=2 needs tc_pack4=True.*split_tokens \(2;.*num_tokens=3"):
        _split(TW, Buf, 3, ok)
    with pytest.raises(ValueError, match="tc_split=2 needs tc_pack4=True.*tc_pack4=False"):
        _split(TW, Buf, 1, LaunchConfig(tc_split=2))
    TW.hidden = 256
    with pytest.raises(ValueError, match="tc_split=4 must divide gate/up's 2 K blocks"):
        _split(TW, Buf, 1, LaunchConfig(tc_pack4=True, tc_split=4))


def test_route_in_l1_is_refused_past_its_slots():
    """L1 routing for itself sorts the step's slots in every program: past 64 (tokens x top-k) it is refused before
    any launch, naming the setting and the count; without it nothing is sorted (0)."""
    from megamoe.decode import LaunchConfig
    from megamoe.decode.tc import _route_slots

    class Buf:
        num_topk = 6

    assert _route_slots(Buf, 1, LaunchConfig(tc_route=True)) == 8
    assert _route_slots(Buf, 10, LaunchConfig(tc_route=True)) == 64
    assert _route_slots(Buf, 100, LaunchConfig()) == 0
    with pytest.raises(ValueError, match=r"tc_route .* num_tokens \* top-k must be <= 64, got 11 \* 6 = 66"):
        _route_slots(Buf, 11, LaunchConfig(tc_route=True))


@pytest.fixture(scope="module")
def interpreter_rows():
    return run_interpreted(Path(__file__).with_name("decode_tc_selfcheck.py"))


@pytest.mark.slow
@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
@pytest.mark.parametrize("pack", (0, 1), ids=("pack0", "pack1"))
@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: c.id)
def test_triton_interpreter(interpreter_rows, case, pack):
    """l1_tc / l2_tc bitwise equal to their twins, the whole path within 1e-6 of the reference, poison kept,
    repeatable; a scale byte off by one must be caught. With and without the packed passes (pack1: experts
    with at most 4 rows take four groups per MMA)."""
    row = interpreter_rows[f"{case.id}-pack{pack}"]
    assert passed_tc(row), json.dumps(row, indent=1)


@pytest.mark.slow
@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
@pytest.mark.parametrize("split", (2, 4), ids=("split2", "split4"))
@pytest.mark.parametrize("case", SPLIT_CASES, ids=lambda c: c.id)
def test_triton_interpreter_split_k(interpreter_rows, case, split):
    """L1's packed K loop in 2 and 4 parts, the last part replaying the promotion chain from the others' terms:
    the same checks as unsplit (the twins know nothing of the split), poison kept, repeatable (the parts'
    counters reset themselves). Under the interpreter the sums are exact, so this checks which terms are added,
    not their order; test_k_group_order_under_the_interpreter checks the order, and the GPU test on real inputs."""
    row = interpreter_rows[f"{case.id}-pack1-split{split}"]
    assert row["split"] == split and passed_tc(row), json.dumps(row, indent=1)


@pytest.mark.slow
@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
@pytest.mark.parametrize("case_id", [f"{c.id}-pack1-route{int(flipped_route(c))}" for c in ROUTE_CASES]
                         + [f"{c.id}-pack1-split2-route{int(flipped_route(c))}" for c in SPLIT_CASES])
def test_triton_interpreter_route_either_way(interpreter_rows, case_id):
    """The other choice of L1 routing for itself than the backend's launch (whose rows the tests above check):
    with it, route's outputs (written by L1's extra program) equal route_torch's and each program's own work item
    gives the twins' L1 / L2 outputs; without it, the route launch the tensor-core path runs (no x32, nothing
    zeroed) gives route_torch's metadata. Packed passes, passes of 16 rows (the skewed case), L1 split in two."""
    row = interpreter_rows[case_id]
    assert row["route_in_l1"] == case_id.endswith("route1") and passed_tc(row), json.dumps(row, indent=1)


ORDER_IDS = [f"pack{int(pack)}-split{split}" for pack, split in ORDER_CONFIGS]


@pytest.fixture(scope="module")
def order_rows():  # seconds: its own small run, not the self-check above (the test's name does not start with
    # test_triton_interpreter, so conftest does not start that one for it)
    return run_interpreted(Path(__file__).with_name("decode_tc_selfcheck.py"), args=("--order",))


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
@pytest.mark.parametrize("pack,split", ORDER_CONFIGS, ids=ORDER_IDS)
def test_k_group_order_under_the_interpreter(order_rows, pack, split):
    """The order of the K groups, which the exact-sum inputs above hide by design, made visible: every 32-K group
    of a weight row holds one product (x = 1.0 and a code of +-1.0, so the group sum is exact in any matmul, the
    interpreter's included) worth A = 2**24, 1 or -A through its scale byte. In FP32 (A + 1) - A = 0 (A + 1 rounds
    to A) but (-A + 1) + A = 1, so a row whose groups hold A, 1, -A in ascending K is 0 in the recipe's order
    and 1 if they are added in reverse; its mirror -A, 1, A the other way round. Rows hold the three in one
    128-K block (L1's group order within a block), in three blocks (L1's promotion order, across the split K's
    parts) and in L2's groups within and across its K iterations (``decode_tc_selfcheck.L1_ORDER_ROWS``,
    ``L2_ORDER_ROWS``). l1_out and slot_out must equal their twins (the recipe's ``group_scaled_gemm``) bit for
    bit and the values the tables give for ascending K; unpacked and packed passes, L1's K in 1, 2 and 4 parts.
    Reversing the groups in the kernel or in the recipe fails it."""
    row = order_rows[f"order-pack{int(pack)}-split{split}"]
    assert passed_order(row), json.dumps(row, indent=1)


# On the GPU: the interpreter's cases with real inputs (bit equality, the recipe's tensor-core model), plus
# production-size steps: one token, and eight with masked slots.
GPU_CASES = CPU_CASES + (DecodeCase("dsv4-flash", 1, seed=21), DecodeCase("dsv4-flash", 8, routing="masked", seed=22))


@pytest.mark.gpu
@pytest.mark.parametrize("pack", (False, True), ids=("pack0", "pack1"))
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.id)
def test_on_the_gpu(case, pack):
    """l1_tc / l2_tc bitwise equal to their twins, the whole path bit-identical to the reference, poison kept,
    a relaunch identical; a scale byte off by one must be caught. With and without the packed passes."""
    row = run_tc_case(case, "cuda", pack)
    assert passed_tc(row) and (case.broken or not row["interpreter"]), json.dumps(row, indent=1, default=str)


@pytest.mark.gpu
@pytest.mark.parametrize("split", (2, 4), ids=("split2", "split4"))
@pytest.mark.parametrize("case", SPLIT_CASES + (DecodeCase("dsv4-flash", 1, seed=23),
                                                DecodeCase("dsv4-flash", 2, seed=24)), ids=lambda c: c.id)
def test_split_k_on_the_gpu(case, split):
    """The split K on real inputs, where the order of the FP32 additions shows: the whole path bit-identical to
    the reference (which knows nothing of the split), stages equal to their twins, a relaunch identical."""
    row = run_tc_case(case, "cuda", True, split)
    assert passed_tc(row) and row["split"] == split, json.dumps(row, indent=1, default=str)

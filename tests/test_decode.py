"""megamoe.decode on a CPU: the weight layout bit for bit, what prepare refuses, the torch twins against
the eager reference, and every Triton stage under Triton's interpreter (in a subprocess, since
TRITON_INTERPRET must be set before triton is imported) against its twin and the reference."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

# megamoe.decode's kernels are Triton (its torch twins live beside them): without triton installed (CI installs
# it; the `fused` extra has it) the whole module is skipped with this reason.
pytest.importorskip("triton", reason="needs triton 3.6 (its CPU interpreter): pip install -e \".[test]\"")

from megamoe.decode import DecodeBuffers, TileShape, checkpoint_from_decode, moe_decode_torch, prepare_decode_weights
from megamoe.decode.layout import MAX_SCALE_SPREAD, pack_words, unpack_words
from megamoe.formats import E2M1_MAGNITUDES, pack_e2m1
from megamoe.recipe import MEGAMOE_DECODE, get_recipe
from megamoe.decode.layout import MAX_SCALE_BYTE
from megamoe.reference import moe_forward
from megamoe.staging import stage_into, triton_available
from megamoe.testing import assert_bitwise_equal
from megamoe.inputs import make_inputs
from megamoe.weights import MXFP4Weights

from decode_selfcheck import (CPU_CASES, ORDER_CONFIGS, DecodeCase, interpreter_rows as run_interpreted, passed,
                              order_id, passed_order, run_case)


def _e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    mag = torch.tensor(E2M1_MAGNITUDES)[codes.long() & 7]
    return torch.where(codes.long() >= 8, -mag, mag)


def decode_pair_torch(words: torch.Tensor, p: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernel's pair-p decode (``triton_gemv._pair``) computes: int32 words -> (lo, hi) float32 =
    e2m1 * 2**-14."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    h = ((w << (3 * p)) & 0x0E000E00) | ((w << p) & 0x80008000)

    def f16(v):  # 16 bits -> the fp16 they spell, as float32 (exact, subnormals included)
        return (v - ((v >> 15) << 16)).to(torch.int16).view(torch.float16).float()

    return f16(h & 0xFFFF), f16(h >> 16)


def test_words_roundtrip_and_decode_every_code(gen):
    codes = torch.randint(0, 16, (5, 64), generator=gen, dtype=torch.uint8)
    codes[0, :16] = torch.arange(16, dtype=torch.uint8)  # every code, -0 included
    words = pack_words(codes)
    assert words.dtype == torch.int32 and words.shape == (5, 8)
    assert_bitwise_equal(unpack_words(words), codes, "pack_words / unpack_words")
    for p in range(4):  # the kernel's decode of pair p is e2m1 * 2**-14, exactly
        lo, hi = decode_pair_torch(words, p)
        assert_bitwise_equal(lo, _e2m1_values(codes[:, 2 * p :: 8]) * 2.0**-14, f"pair {p} lo")
        assert_bitwise_equal(hi, _e2m1_values(codes[:, 2 * p + 1 :: 8]) * 2.0**-14, f"pair {p} hi")


@pytest.mark.parametrize("tiles", [None, (TileShape(32, 4), TileShape(64, 2))], ids=["default", "small-tiles"])
def test_prepare_roundtrips_the_checkpoint(weights_for, tiles):
    g, w = weights_for("small")
    dw = prepare_decode_weights(w, *(tiles or ()))
    back = checkpoint_from_decode(dw)
    for name in ("l1", "l1_scale", "l2", "l2_scale"):
        assert_bitwise_equal(getattr(back, name), getattr(w, name), name)
    assert dw.nbytes_per_expert() == sum(getattr(w, n)[0].numel() for n in ("l1", "l1_scale", "l2", "l2_scale"))


def _one_expert(scale_bytes: list[int], gen) -> MXFP4Weights:
    """tiny-shaped weights (E=1, I=128, H=256) whose l1 row 0 holds the given scale bytes in its first
    128-K block (4 groups), every code nonzero there."""
    e, i, h = 1, 128, 256
    codes1 = torch.randint(1, 8, (e, 2 * i, h), generator=gen, dtype=torch.uint8)
    s1 = torch.full((e, 2 * i, h // 32), 120, dtype=torch.uint8)
    s1[0, 0, :4] = torch.tensor(scale_bytes, dtype=torch.uint8)
    codes2 = torch.randint(0, 16, (e, h, i), generator=gen, dtype=torch.uint8)
    return MXFP4Weights(pack_e2m1(codes1), s1, pack_e2m1(codes2), torch.full((e, h, i // 32), 118, dtype=torch.uint8))


def test_prepare_refuses_what_it_cannot_compute_exactly(gen):
    prepare_decode_weights(_one_expert([100, 110, 100 + MAX_SCALE_SPREAD, 110], gen))  # 24 binades: exact
    with pytest.raises(ValueError, match="span 25 binades"):
        prepare_decode_weights(_one_expert([100, 110, 125, 110], gen))
    with pytest.raises(ValueError, match=r"l1_scale holds 1 E8M0 byte\(s\) 0xFF.*first at \[0, 0, 2\]"):
        prepare_decode_weights(_one_expert([120, 120, 255, 120], gen))
    with pytest.raises(ValueError, match="253 > 252 at"):
        prepare_decode_weights(_one_expert([240, 240, 253, 240], gen))


def test_global_scales_fold_exactly_or_are_refused(weights_for):
    g, w = weights_for("tiny")
    e = w.num_experts
    gs = torch.exp2(torch.arange(e, dtype=torch.float32) - 3)  # 2**-3 .. 2**4
    scaled = MXFP4Weights(w.l1, w.l1_scale, w.l2, w.l2_scale, gs, gs.flip(0))
    back = checkpoint_from_decode(prepare_decode_weights(scaled))
    for x in range(e):
        for a, b in zip(back.dequantize_expert(x), scaled.dequantize_expert(x)):
            assert_bitwise_equal(a, b, f"expert {x} with its global scale folded in")
    with pytest.raises(ValueError, match="powers of two"):
        prepare_decode_weights(MXFP4Weights(w.l1, w.l1_scale, w.l2, w.l2_scale, gs * 1.5, None))


def test_recipe_is_registered_and_rounds_exp_in_float64():
    r = get_recipe("megamoe-decode")
    assert r is MEGAMOE_DECODE and r.weight_decode == "exact" and r.l2_group == 32 and r.silu_exp == "fp64-rounded"
    assert r.max_scale_byte == MAX_SCALE_BYTE  # what prepare refuses is what the recipe says
    with pytest.raises(ValueError, match="silu_exp"):
        r.with_(silu_exp="fast")


@pytest.mark.parametrize("tokens,routing", [(1, {}), (9, {"mask_prob": 0.3}), (12, {"skew": 2.0})])
def test_torch_twins_equal_the_reference(weights_for, tokens, routing):
    """The four twins on the decode buffers give the reference's bits (recipe megamoe-decode)."""
    g, w = weights_for("tiny")
    inp = make_inputs(g, tokens, seed=300 + tokens, outlier_channels=3, **routing)
    buf = DecodeBuffers.allocate(g, tokens + 2, "cpu")
    stage_into(inp.x, inp.topk_idx, inp.topk_weights, buf.x_q, buf.x_sf, buf.topk_idx, buf.topk_weights, tokens,
               num_experts=g.num_experts, backend="torch")
    buf.poison_()
    y = moe_decode_torch(prepare_decode_weights(w), buf, tokens, g.clamp)
    assert_bitwise_equal(y, moe_forward(inp, w, MEGAMOE_DECODE, g), "moe_decode_torch vs moe_forward")
    assert torch.isnan(buf.y[tokens:].float()).all(), "rows past T were written"


def test_buffers_refuse_more_than_64_tokens(weights_for):
    g, _ = weights_for("tiny")
    with pytest.raises(ValueError, match=r"capacity \(tokens per rank\) must be in \[1, 64\], got 65"):
        DecodeBuffers.allocate(g, 65, "cpu")


@pytest.fixture(scope="module")
def interpreter_rows():
    return run_interpreted(Path(__file__).with_name("decode_selfcheck.py"))


@pytest.mark.slow
@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: c.id)
def test_triton_interpreter(interpreter_rows, case):
    """Each Triton stage bitwise equal to its twin, the whole path bit-identical to the reference, rows
    past the step still poisoned; a broken layout must be caught (calc_diff > 1e-3)."""
    row = interpreter_rows[case.id]
    assert passed(row), json.dumps(row, indent=1)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CPU_CASES + (DecodeCase("dsv4-flash", 8, 1, "masked", seed=21),), ids=lambda c: c.id)
def test_on_the_gpu(case):
    """The interpreter's cases on the GPU with the same bar (each stage equal to its twin, bit-identical to the
    reference, repeatable, poison kept; broken layouts caught), plus a production-size step."""
    row = run_case(case, "cuda")
    assert passed(row), json.dumps(row, indent=1, default=str)


@pytest.fixture(scope="module")
def order_rows():  # seconds: its own small run (the name below does not start with test_triton_interpreter, so
    # conftest does not start the self-check above for it)
    return run_interpreted(Path(__file__).with_name("decode_selfcheck.py"), args=("--order",))


@pytest.mark.skipif(not triton_available(), reason="triton is not installed")
@pytest.mark.parametrize("config", ORDER_CONFIGS, ids=lambda c: order_id(*c))
def test_k_block_order_under_the_interpreter(order_rows, config):
    """The order of the promotion blocks, made visible by construction, in seconds (the slow self-check above
    sees it only where its random inputs happen to round differently). x = 1.0 at every K, and each nonzero 32-K
    group of a weight row holds one product (a code of +-1.0: exact in any order) worth A = 2**24, 1 or -A
    through its scale byte. In FP32 (A + 1) - A = 0 but (-A + 1) + A = 1, so a row with A, 1, -A in three blocks
    (L1's 128 K, L2's 32 K) is 0 in ascending K and 1 if the promotions run in reverse, its mirror -A, 1, A the
    other way round (``decode_selfcheck.L1_ORDER_ROWS``, ``L2_ORDER_ROWS``). A, 1, -A inside one 128-K block is
    1: this path sums a block's groups exactly (float64), so their order is invisible by design. l1_out and
    slot_out must equal their twins (the recipe's ``promoted_gemm``) bit for bit and the tables' values; blocks
    within one K iteration (16 and 8 groups per iteration) and across iterations (4 groups, with the prefetch
    and two tokens per pass). Reversing the blocks in the kernel or in the recipe fails it."""
    row = order_rows[order_id(*config)]
    assert passed_order(row), json.dumps(row, indent=1)


def test_backend_registered_refuses_large_steps_and_plans_tokens_per_pass():
    from megamoe.check.matrix import default_cases
    from megamoe.fused.megamoe_decode import MegaMoEDecode, default_block_m
    from megamoe.fused.registry import BACKENDS

    assert BACKENDS["megamoe-decode"] is MegaMoEDecode and MegaMoEDecode.recipe is MEGAMOE_DECODE
    assert MegaMoEDecode.graph_capturable and MegaMoEDecode.allows_zero_tokens
    with pytest.raises(ValueError, match="at most 64 tokens per rank"):
        MegaMoEDecode("dsv4-flash", capacity=65)
    be = MegaMoEDecode("dsv4-flash", capacity=64)
    assert [be.plan(t).block_m for t in (1, 16, 17, 64)] == [1, 1, 2, 2] == [default_block_m(t) for t in (1, 16, 17, 64)]
    # the prefetch measured faster: L1 at every count, L2 up to 8 tokens (megamoe_decode.default_launch_config)
    assert [(be.launch_config(t).l1_prefetch, be.launch_config(t).l2_prefetch) for t in (1, 8, 9, 64)] == \
        [(True, True), (True, True), (True, False), (True, False)]
    assert be.plan(1, 4).block_m == 4 and be.plan(1, 4).forced and be.launch_config(1, 4).l2_prefetch
    assert not be.plan(1).forced and be.launch_config(1).block_m == 1  # nothing pinned by the calls above
    be = MegaMoEDecode("dsv4-flash", capacity=64, force_block_m=4)  # the instance's default for calls that pass none
    assert be.plan(1).block_m == 4 and be.plan(1).forced and be.launch_config(1).block_m == 4
    cases = default_cases("megamoe-decode", be.legal_block_ms(), True, max_tokens=MegaMoEDecode.max_tokens_per_rank)
    assert cases and max(c.launch_tokens for c in cases) == 64

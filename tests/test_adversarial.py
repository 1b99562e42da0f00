"""Adversarial inputs, as a table by category: every entry point refuses clearly (naming the argument, the
expected and the actual value), repairs exactly (checked by an independent decode), or computes the right
answer (checked against an independent computation). No silent corruption, no unflagged NaN.

The audit behind it found, among others: (1) E8M0 0xFF treated as 2**128, (2) no lower bound on the
DeepGEMM SM90 FP4 window, (3) ranks never agreeing on their setup, (4) ``stage_into`` writing bad expert
ids, (5) NaN / negative parameters accepted; each has its cases (``finding``), and so has each of the
smaller ones ("also-..."). Types, independent decoders and helpers: ``adversarial_support.py``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import tempfile
from pathlib import Path

import pytest
import torch

from adversarial_support import (
    BF16_MAX, DIST_RECIPE, TINY, Case, CLIExit, Correct, Exact, Refused, cli, close_to, decoded_differently,
    dense_exact, dist_global_step, dist_worker, fwd, independent_table, inputs, legal_bytes, mutated, ranges,
    same_values, staged_untouched, values_of, with_, zero_group,
)
from megamoe.distributed.agreement import RankInputError, SetupMismatchError
from megamoe.formats import WEIGHT_DECODERS, exact_scale_bytes, mxfp4_decode_table, scale_byte_window
from megamoe.recipe import RECIPES
from megamoe.validate import NonFiniteOutputError

NAN_BYTE = r"E8M0 byte\(s\) 0xFF, which is NaN, not a scale"
NONFINITE = r"holds \d+ NaN / Inf value\(s\) in \d+ row\(s\) .* although every input was finite"


# ------------------------------------------------------------------------------------ scale bytes
@functools.lru_cache(maxsize=1)
def _real_like(wf=None):
    """Gaussian weights quantized to MXFP4, one expert with H = 1024, rows spread over 2**+-3 (as real
    checkpoints' per-row scales spread): their scale bytes reach below 119."""
    from megamoe.geometry import Geometry
    from megamoe.weights import quantize_experts_mxfp4, random_dense_expert

    g = Geometry("wide", num_experts=1, num_topk=1, hidden=1024, intermediate=128)
    w1, w2 = random_dense_expert(g, gen=torch.Generator().manual_seed(11), row_spread=3.0)
    return quantize_experts_mxfp4(w1[None], w2[None])


def _counts_in_message(get_weights, decode="e4m3_rn"):
    """The refusal's 'N of M weights decode differently (Z to zero' against an independent count."""
    def check(msg, wf):
        w = get_weights(wf)
        e, t = re.search(r"expert (\d+) (l[12]):", msg).groups()
        n, m, z = (int(v.replace(",", "")) for v in re.search(
            r"([\d,]+) of ([\d,]+) weights decode differently \(([\d,]+) to zero", msg).groups())
        packed, scale = getattr(w, t)[int(e)], getattr(w, f"{t}_scale")[int(e)]
        assert (n, z) == decoded_differently(packed, scale, decode) and n > 0
        assert m == packed.numel() * 2
    return check


def _byte_at(value, lo=124, hi=130, where=(0, 0, 0)):
    """Legal bytes with one nonzero group's byte set to ``value`` (its codes made nonzero)."""
    w = legal_bytes(lo=lo, hi=hi)
    l1, s = w.l1.clone(), w.l1_scale.clone()
    e, row, g = where
    l1[e, row, 16 * g: 16 * g + 16] |= 0x11
    s[where] = value
    return dataclasses.replace(w, l1=l1, l1_scale=s)


def _bytes_0_and_1(wf=None):
    """Expert 0 L1 row 0: group 0 at byte 0, group 1 at byte 1, both with nonzero codes."""
    w = _byte_at(0, where=(0, 0, 0))
    l1, s = w.l1.clone(), w.l1_scale.clone()
    l1[0, 0, 16:32] |= 0x11
    s[0, 0, 1] = 1
    return dataclasses.replace(w, l1=l1, l1_scale=s)


def _gs(value, byte_shift):
    """Legal bytes moved by ``byte_shift`` (the repair must move them back) under l1 global scale ``value``."""
    w = legal_bytes(lo=125, hi=127)
    return dataclasses.replace(w, l1_scale=(w.l1_scale.int() + byte_shift).to(torch.uint8),
                               l1_global_scale=torch.full((2,), value), l2_global_scale=torch.ones(2))


def _loss_is_independent(w, decode, expect_changed):
    """decode_loss per expert and tensor == the independent count; something lost iff ``expect_changed``."""
    def check(losses):
        for loss in losses:
            packed, scale = getattr(w, loss.tensor)[loss.expert], getattr(w, f"{loss.tensor}_scale")[loss.expert]
            assert (loss.changed, loss.to_zero) == decoded_differently(packed, scale, decode)
        assert (sum(x.changed for x in losses) > 0) == expect_changed
    return check


def _in_window_and(check, recipe):
    def both(w):
        assert ranges("analyze_ranges", w, recipe).ok
        check(w)
    return both


def _layout(name, **kw):
    def run(w):
        from megamoe import layouts

        return getattr(layouts, name)(w, **kw)
    return run


def _zero_group_ff(num_experts=2):
    """Expert 0 L1 row 3, group 1: all codes zero, scale byte 0xFF (written after construction)."""
    return mutated(zero_group(legal_bytes(num_experts=num_experts), 0, 3, 1), "l1_scale", (0, 3, 1), 255)


EXPERT_253 = mutated(legal_bytes(num_experts=8), "l1_scale", 0, 253)  # expert 0 L1: 4 * 2**126 overflows float32
ROUTED_TO_0 = dataclasses.replace(inputs(), topk_idx=torch.tensor([[0, 1]] * 6))
SCALE = [
    Case("scale", "0xFF repaired as 2**128",
         lambda wf: ranges("repair_ranges", mutated(legal_bytes(), "l1_scale", 1, 255), "flashinfer-mxfp4"),
         Refused(ValueError, rf"scale ranges for flashinfer-mxfp4: weights.l1_scale holds 2048 {NAN_BYTE} "
                             r"\(first at \[1, 0, 0\]\)"), "1"),
    Case("scale", "0xFF on an all-zero group, range check",
         lambda wf: ranges("check_ranges", _zero_group_ff(), "deepgemm-sm90-fp4"),
         Refused(ValueError, rf"holds 1 {NAN_BYTE} \(first at \[0, 3, 1\]\); 0xFF is refused even on all-zero groups"),
         "1"),
    Case("scale", "0xFF on an all-zero group, reference", lambda wf: fwd(_zero_group_ff(8), "deepgemm-sm90-fp4"),
         Refused(ValueError, rf"reference: weights.l1_scale holds 1 {NAN_BYTE}"), "1"),
    Case("scale", "0xFF on an all-zero group, SM90 FP4 layout",
         lambda wf: _layout("to_deepgemm_sm90_fp4", check=False)(_zero_group_ff()),
         Refused(ValueError, rf"to_deepgemm_sm90_fp4: weights.l1_scale holds 1 {NAN_BYTE}"), "1"),
    Case("scale", "0xFF, FlashInfer layout unchecked",
         lambda wf: _layout("to_flashinfer_sm90", check=False)(_zero_group_ff()),
         Refused(ValueError, rf"to_flashinfer_sm90: weights.l1_scale holds 1 {NAN_BYTE}"), "1"),
    Case("scale", "0xFF on a nonzero group, SM100 layout",
         lambda wf: _layout("to_deepgemm_sm100_fp4")(mutated(legal_bytes(), "l2_scale", (1, 7, 2), 255)),
         Refused(ValueError, rf"deepgemm-sm100-fp4: weights.l2_scale holds 1 {NAN_BYTE} \(first at \[1, 7, 2\]\)"), "1"),
    Case("scale", "0xFF at construction",
         lambda wf: dataclasses.replace(legal_bytes(), l2_scale=torch.full_like(legal_bytes().l2_scale, 255)),
         Refused(ValueError, rf"MXFP4Weights: weights.l2_scale holds 2048 {NAN_BYTE}"), "1"),
    Case("scale", "0xFF folded", lambda wf: _layout("fold_global_scales")(mutated(_gs(1.0, 0), "l2_scale", 0, 255)),
         Refused(ValueError, rf"fold_global_scales: weights.l2_scale holds 1024 {NAN_BYTE}"), "1"),
    Case("scale", "0xFF measured", lambda wf: ranges("decode_loss", mutated(legal_bytes(), "l1_scale", 0, 255), "exact"),
         Refused(ValueError, rf"decode loss for exact: weights.l1_scale holds 2048 {NAN_BYTE}"), "1"),
    Case("scale", "DeepGEMM FP4 below 119", lambda wf: ranges("check_ranges", _real_like(wf), "deepgemm-sm90-fp4"),
         Refused(ValueError, r"expert 0 l1: \d+ scale groups below byte 119 and 0 above byte 133 \(offending bytes "
                             r"\[(\d+, )*118\];.*decodes only bytes 119..133 exactly \([\d,]+ of [\d,]+ weights decode "
                             r"differently .*no exact repair exists", _counts_in_message(_real_like)), "2"),
    Case("scale", "DeepGEMM FP4 below 119, repair", lambda wf: ranges("repair_ranges", _real_like(wf), "deepgemm-sm90-fp4"),
         Refused(ValueError, r"expert 0 l1: .*offending bytes .*weights decode differently",
                 _counts_in_message(_real_like)), "2"),
    Case("scale", "DeepGEMM FP4 bytes 0 and 1", lambda wf: ranges("check_ranges", _bytes_0_and_1(), "deepgemm-sm90-fp4"),
         Refused(ValueError, r"offending bytes \[0, 1\];", _counts_in_message(_bytes_0_and_1)), "2"),
    Case("scale", "DeepGEMM FP4 bytes 0 and 1 measured", lambda wf: ranges("decode_loss", _bytes_0_and_1(), "deepgemm-sm90-fp4"),
         Correct(_loss_is_independent(_bytes_0_and_1(), "e4m3_rn", expect_changed=True)), "2"),
    Case("scale", "DeepGEMM FP4 byte 118", lambda wf: ranges("check_ranges", _byte_at(118), "deepgemm-sm90-fp4"),
         Refused(ValueError, r"1 scale groups below byte 119 .*offending bytes \[118\]"), "2"),
    Case("scale", "DeepGEMM FP4 byte 119 is exact", lambda wf: ranges("decode_loss", _byte_at(119), "deepgemm-sm90-fp4"),
         Correct(_loss_is_independent(_byte_at(119), "e4m3_rn", expect_changed=False)), "2"),
    Case("scale", "DeepGEMM FP4 byte 134", lambda wf: ranges("check_ranges", _byte_at(134), "deepgemm-sm90-fp4"),
         Refused(ValueError, r"0 scale groups below byte 119 and 1 above byte 133 .*offending bytes \[134\]"), "2"),
    Case("scale", "FlashInfer byte 121 rebased",
         lambda wf: ranges("repair_ranges", _byte_at(121, 122, 128), "flashinfer-mxfp4"),
         Exact(_in_window_and(same_values(_byte_at(121, 122, 128)), "flashinfer-mxfp4"))),
    Case("scale", "FlashInfer byte 134 rebased",
         lambda wf: ranges("repair_ranges", _byte_at(134, 124, 130), "flashinfer-mxfp4"),
         Exact(_in_window_and(same_values(_byte_at(134, 124, 130)), "flashinfer-mxfp4"))),
    Case("scale", "FlashInfer raw bytes measured",
         lambda wf: (ranges("decode_loss", _real_like(wf), "flashinfer-mxfp4"), _real_like(wf)),
         Correct(lambda r: _loss_is_independent(r[1], "e4m3_flush_saturate", expect_changed=True)(r[0]))),
    Case("scale", "exact decode, byte 253", lambda wf: ranges("check_ranges", EXPERT_253, "exact"),
         Refused(ValueError, r"expert 0 l1: 0 scale groups below byte 0 and \d+ above byte 252 .*offending bytes \[253\]")),
    Case("scale", "exact decode of byte 253 overflows", lambda wf: fwd(EXPERT_253, "exact", ROUTED_TO_0),
         Refused(NonFiniteOutputError, rf"reference \(exact\): y of rank 0 {NONFINITE}")),
    Case("scale", "subnormal global scale, inexact",
         lambda wf: ranges("repair_ranges", _gs(3 * 2.0**-148, -5), "flashinfer-mxfp4"),
         Refused(ValueError, r"l1_global_scale\[0\] = .* times 2\*\*-2 \(the rebase of expert 0 l1\) is .*float32 "
                             r"holds only as .*the repair would change the expert's values"), "also-subnormal"),
    Case("scale", "subnormal global scale, subnormal result",
         lambda wf: ranges("repair_ranges", _gs(3 * 2.0**-140, -4), "flashinfer-mxfp4"),
         Refused(ValueError, r"l1_global_scale\[0\] .*\(a subnormal, zero or overflow\)"), "also-subnormal"),
    Case("scale", "subnormal global scale, exact",
         lambda wf: ranges("repair_ranges", _gs(2.0**-140, 21), "flashinfer-mxfp4"),
         Exact(_in_window_and(same_values(_gs(2.0**-140, 21)), "flashinfer-mxfp4")), "also-subnormal"),
]


# ------------------------------------------------------------------------------------ activations
def _bf16_max_rows():
    """Rows 1..3 at +-the bf16 maximum: finite inputs whose FP32 accumulators overflow in a kernel recipe."""
    inp = inputs(4, seed=1)
    x = inp.x.clone()
    x[1], x[2] = BF16_MAX, -BF16_MAX
    x[3, ::2], x[3, 1::2] = BF16_MAX, -BF16_MAX
    return dataclasses.replace(inp, x=x)


def _staged_bf16_max(_):
    from megamoe.staging import stage_into
    from megamoe.staging.checks import allocate_buffers

    inp, bufs = _bf16_max_rows(), allocate_buffers(4, TINY)
    stage_into(inp.x, inp.topk_idx, inp.topk_weights, *bufs.views(), num_experts=8, backend="torch")
    return inp, bufs


def _staged_is_exact(r):
    """Row 1 (all +max): every code 448 (0x7E) and sf = fl32(fl32(max) * fl32(1/448)), computed with struct."""
    import struct

    inp, bufs = r
    f32 = lambda v: struct.unpack("f", struct.pack("f", v))[0]  # noqa: E731
    assert (bufs.x[1].view(torch.uint8) == 0x7E).all() and (bufs.x[2].view(torch.uint8) == 0xFE).all()
    assert float(bufs.x_sf[1, 0]) == f32(f32(float(BF16_MAX)) * f32(1 / 448))


W_TINY = legal_bytes(lo=122, hi=126, num_experts=8)
ACTIVATIONS = [
    Case("activations", "NaN x, reference", lambda wf: fwd(W_TINY, inp=with_(inputs(), "x", (2, 7), float("nan"))),
         Refused(ValueError, r"rank 0: x contains NaN or Inf \(first at \[token, channel\] = \[2, 7\]; 1 of 1536 elements\)")),
    Case("activations", "Inf x, reference", lambda wf: fwd(W_TINY, inp=with_(inputs(), "x", (0, 0), float("-inf"))),
         Refused(ValueError, r"x contains NaN or Inf \(first at \[token, channel\] = \[0, 0\]")),
    Case("activations", "float16 x", lambda wf: fwd(W_TINY, inp=dataclasses.replace(inputs(), x=inputs().x.half())),
         Refused(TypeError, r"rank 0: x must be bfloat16, got torch.float16")),
    Case("activations", "bf16 max, exact recipe", lambda wf: fwd(W_TINY, "exact", _bf16_max_rows()),
         Correct(close_to(dense_exact(_bf16_max_rows(), W_TINY))), "also-bf16-max"),
    Case("activations", "bf16 max, FlashInfer recipe", lambda wf: fwd(W_TINY, "flashinfer-mxfp4", _bf16_max_rows()),
         Refused(NonFiniteOutputError, rf"reference \(flashinfer-mxfp4\): y of rank 0 {NONFINITE}; an FP32 accumulator"),
         "also-bf16-max"),
    Case("activations", "bf16 max, DeepGEMM FP8 recipe", lambda wf: fwd(__import__("megamoe.testing", fromlist=["x"])
         .fp8_block_weights(W_TINY), "deepgemm-sm90-fp8", _bf16_max_rows()),
         Refused(NonFiniteOutputError, rf"y of rank 0 {NONFINITE}"), "also-bf16-max"),
    Case("activations", "bf16 max, staging", _staged_bf16_max, Correct(_staged_is_exact), "also-bf16-max"),
    Case("activations", "ordinary x, exact recipe", lambda wf: fwd(W_TINY, "exact", inputs(6, seed=3)),
         Correct(close_to(dense_exact(inputs(6, seed=3), W_TINY)))),
]


# ------------------------------------------------------------------------------------ routing
def _route(bias=None, logits=None):
    from megamoe.reference.routing import route

    return route(torch.randn(4, 8) if logits is None else logits, TINY, bias)


def _nan_at(n, i, v=float("nan")):
    b = 0.1 * torch.randn(n)
    b[i] = v
    return b


def _masked_and_negative():
    inp = inputs(5, seed=4)
    idx, w = inp.topk_idx.clone(), inp.topk_weights.clone()
    idx[2] = -1  # every slot masked: a zero row
    w[3, 0] = -w[3, 0]  # a negative routing weight is a number like any other
    return dataclasses.replace(inp, topk_idx=idx, topk_weights=w)


def _zero_row_and(want):
    def check(y):
        assert (y[2] == 0).all()
        close_to(want)(y)
    return check


ROUTING = [
    Case("routing", "NaN router bias", lambda wf: _route(_nan_at(8, 3)),
         Refused(ValueError, r"route: bias contains NaN or Inf \(first at \[expert\] = \[3\]"), "5"),
    Case("routing", "Inf router bias", lambda wf: _route(_nan_at(8, 5, float("inf"))),
         Refused(ValueError, r"route: bias contains NaN or Inf \(first at \[expert\] = \[5\]"), "5"),
    Case("routing", "integer router bias", lambda wf: _route(torch.zeros(8, dtype=torch.int64)),
         Refused(TypeError, r"route: bias must be a floating tensor on cpu, got torch.int64")),
    Case("routing", "NaN logits", lambda wf: _route(logits=torch.full((2, 8), float("nan"))),
         Refused(ValueError, r"route: router logits contains NaN or Inf \(first at \[token, expert\] = \[0, 0\]")),
    Case("routing", "logits that underflow softplus", lambda wf: _route(logits=torch.full((2, 8), -200.0)),
         Refused(NonFiniteOutputError, r"route: topk_weights holds 4 NaN / Inf .*sum to 0 in float32")),
    Case("routing", "expert id 999, reference", lambda wf: fwd(W_TINY, inp=with_(inputs(), "topk_idx", (1, 0), 999)),
         Refused(ValueError, r"rank 0: topk_idx must be in \[-1, 7\] \(-1 = masked\), got values in \[\d+, 999\] "
                             r"\(first bad token 1: \[999, \d\]\)"), "4"),
    Case("routing", "expert id -2, reference", lambda wf: fwd(W_TINY, inp=with_(inputs(), "topk_idx", (4, 1), -2)),
         Refused(ValueError, r"topk_idx must be in \[-1, 7\] .*got values in \[-2, \d\]")),
    Case("routing", "expert twice in a token, reference",
         lambda wf: fwd(W_TINY, inp=with_(inputs(), "topk_idx", (3, 1), int(inputs().topk_idx[3, 0]))),
         Refused(ValueError, r"rank 0: topk_idx: token 3 routes to the same expert twice"), "4"),
    Case("routing", "Inf routing weight", lambda wf: fwd(W_TINY, inp=with_(inputs(), "topk_weights", (4, 1), float("inf"))),
         Refused(ValueError, r"topk_weights contains NaN or Inf \(first at \[token, slot\] = \[4, 1\]")),
    Case("routing", "int32 ids, reference", lambda wf: fwd(W_TINY, inp=dataclasses.replace(
         inputs(), topk_idx=inputs().topk_idx.int())), Refused(TypeError, r"rank 0: topk_idx must be int64, got torch.int32")),
    Case("routing", "masked token and a negative weight", lambda wf: fwd(W_TINY, "exact", _masked_and_negative()),
         Correct(_zero_row_and(dense_exact(_masked_and_negative(), W_TINY)))),
]


# ------------------------------------------------------------------------------------ geometry
def _geom(**kw):
    return TINY.with_(**kw)


GEOMETRY = [
    Case("geometry", "NaN clamp", lambda wf: _geom(clamp=float("nan")),
         Refused(ValueError, r"Geometry 'tiny': clamp must be finite, got nan"), "5"),
    Case("geometry", "negative clamp", lambda wf: _geom(clamp=-10.0),
         Refused(ValueError, r"Geometry 'tiny': clamp must be > 0, got -10.0"), "5"),
    Case("geometry", "zero clamp", lambda wf: _geom(clamp=0.0), Refused(ValueError, r"clamp must be > 0, got 0.0"), "5"),
    Case("geometry", "infinite clamp", lambda wf: _geom(clamp=float("inf")),
         Refused(ValueError, r"clamp must be finite, got inf"), "5"),
    Case("geometry", "negative routed_scaling", lambda wf: _geom(routed_scaling=-1.5),
         Refused(ValueError, r"Geometry 'tiny': routed_scaling must be > 0, got -1.5"), "5"),
    Case("geometry", "NaN routed_scaling", lambda wf: _geom(routed_scaling=float("nan")),
         Refused(ValueError, r"routed_scaling must be finite, got nan"), "5"),
    Case("geometry", "string clamp", lambda wf: _geom(clamp="10"),
         Refused(TypeError, r"clamp must be a real number, got str '10'")),
    Case("geometry", "float expert count", lambda wf: _geom(num_experts=8.0),
         Refused(TypeError, r"Geometry 'tiny': num_experts must be an int, got float 8.0")),
    Case("geometry", "hidden not a multiple of 128", lambda wf: _geom(hidden=200),
         Refused(ValueError, r"hidden must be a positive multiple of 128, got 200")),
    Case("geometry", "top-k above E", lambda wf: _geom(num_topk=9), Refused(ValueError, r"num_topk must be in \[1, 8\], got 9")),
    Case("geometry", "negative shared experts", lambda wf: _geom(num_shared_experts=-1),
         Refused(ValueError, r"num_shared_experts must be >= 0, got -1")),
    Case("geometry", "norm_topk_prob as a string", lambda wf: _geom(norm_topk_prob="yes"),
         Refused(TypeError, r"norm_topk_prob must be a bool, got 'yes'")),
    Case("geometry", "ranks that do not divide E", lambda wf: TINY.experts_per_rank(3),
         Refused(ValueError, r"num_ranks must divide num_experts=8, got num_ranks=3")),
    Case("geometry", "float rank count", lambda wf: TINY.experts_per_rank(2.0),
         Refused(TypeError, r"num_ranks must be an int, got float 2.0")),
    Case("geometry", "float BLOCK_M, reference", lambda wf: fwd(W_TINY, block_m=1.5),
         Refused(TypeError, r"block_m must be an int, got float 1.5")),
    Case("geometry", "BLOCK_M 0, reference", lambda wf: fwd(W_TINY, block_m=0),
         Refused(ValueError, r"block_m must be >= 1, got 0")),
]


# ------------------------------------------------------------------------------------ fused backends (CPU-checkable)
def _cpu(name="flashinfer-mxfp4", capacity=8):
    """A real backend class whose device reads as the CPU: check_inputs and launch's checks run here."""
    from megamoe.fused.registry import BACKENDS

    be = BACKENDS[name](TINY, capacity=capacity)
    be.__class__ = type(f"CPU{type(be).__name__}", (type(be),), {"device": property(lambda self: torch.device("cpu"))})
    return be


def _backend(name="flashinfer-mxfp4", **kw):
    from megamoe.fused.registry import BACKENDS

    return BACKENDS[name](TINY, **kw)


class _ToyKernel:
    """A FusedBackend on the CPU whose 'kernel' is y = bf16((q * x_sf) @ W^T) in FP32 over the staged buffer:
    enough to show that ``run`` reports what an overflowing kernel returns."""

    @staticmethod
    def make():
        from megamoe.fused.base import FusedBackend
        from megamoe.staging.checks import allocate_buffers

        class Toy(FusedBackend):
            name, recipe, allows_zero_tokens = "toy-cpu", RECIPES["exact"], True
            device = torch.device("cpu")

            def launch(self, m):
                b = self.buf
                x = (b.x[:m].float().view(m, -1, 128) * b.x_sf[:m, :, None]).view(m, -1)
                return (x @ self.w.T).to(torch.bfloat16)

        be = Toy(TINY, capacity=8)
        be.buf, be.w = allocate_buffers(8, TINY), torch.randn(TINY.hidden, TINY.hidden, generator=torch.Generator().manual_seed(0))
        be._prepared = be._allocated = True
        return be


def _toy_expected(inp):
    from megamoe.layouts.staging import dequantize_per_token_fp8, per_token_cast_to_fp8

    be = _ToyKernel.make()
    return (dequantize_per_token_fp8(*per_token_cast_to_fp8(inp.x)) @ be.w.T).to(torch.bfloat16)


def _fp8(w_mx, name, index, value):
    from megamoe.layouts.deepgemm_sm90 import fp8_block_weights_for_kernel, to_fp8_block

    w = to_fp8_block(w_mx)
    t = getattr(w, name)
    (t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t)[index] = value  # after construction
    return fp8_block_weights_for_kernel(w, "deepgemm-sm90-fp8")


BACKEND = [
    Case("backend", "capacity 8.9", lambda wf: _backend(capacity=8.9),
         Refused(TypeError, r"flashinfer-mxfp4: capacity \(max tokens per rank\) must be an int, got float 8.9"), "also-int"),
    Case("backend", "capacity 0", lambda wf: _backend(capacity=0),
         Refused(ValueError, r"capacity \(max tokens per rank\) must be >= 1, got 0")),
    Case("backend", "capacity as a string", lambda wf: _backend(capacity="8"),
         Refused(TypeError, r"capacity \(max tokens per rank\) must be an int, got str '8'")),
    Case("backend", "force_block_m 8.0", lambda wf: _backend(capacity=8, force_block_m=8.0),
         Refused(TypeError, r"force_block_m must be an int, got float 8.0")),
    Case("backend", "num_tokens 6.9, check_inputs", lambda wf: _cpu().check_inputs(inputs(6), 6.9),
         Refused(TypeError, r"flashinfer-mxfp4: num_tokens must be an int, got float 6.9"), "also-int"),
    Case("backend", "num_tokens True, check_inputs", lambda wf: _cpu().check_inputs(inputs(1), True),
         Refused(TypeError, r"num_tokens must be an int, got bool True")),
    Case("backend", "num_tokens 6.9, launch", lambda wf: _cpu().launch(6.9),
         Refused(TypeError, r"flashinfer-mxfp4 launch: num_tokens must be an int, got float 6.9"), "also-int"),
    Case("backend", "launch past capacity", lambda wf: _cpu().launch(9),
         Refused(ValueError, r"flashinfer-mxfp4 launch: num_tokens must be in \[0, 8\], got 9")),
    Case("backend", "expert id 999", lambda wf: _cpu().check_inputs(with_(inputs(), "topk_idx", (1, 0), 999)),
         Refused(ValueError, r"flashinfer-mxfp4: topk_idx must be in \[-1, 7\]"), "4"),
    Case("backend", "expert twice in a token", lambda wf: _cpu("deepgemm-sm90-fp8").check_inputs(
         with_(inputs(), "topk_idx", (3, 1), int(inputs().topk_idx[3, 0]))),
         Refused(ValueError, r"deepgemm-sm90-fp8: topk_idx: token 3 routes to the same expert twice"), "4"),
    Case("backend", "NaN x", lambda wf: _cpu().check_inputs(with_(inputs(), "x", (5, 255), float("nan"))),
         Refused(ValueError, r"flashinfer-mxfp4: x contains NaN or Inf \(first at \[token, channel\] = \[5, 255\]")),
    Case("backend", "NaN routing weight", lambda wf: _cpu().check_inputs(with_(inputs(), "topk_weights", (0, 0), float("nan"))),
         Refused(ValueError, r"topk_weights contains NaN or Inf")),
    Case("backend", "x on another device", lambda wf: _cpu().check_inputs(inputs().to("meta")),
         Refused(ValueError, r"flashinfer-mxfp4: x is on meta but the backend runs on cpu")),
    Case("backend", "zero tokens, FlashInfer", lambda wf: _cpu().check_inputs(inputs(0)),
         Refused(ValueError, r"the kernel needs at least one token \(got 0\)")),
    Case("backend", "FP8 block scale 0", lambda wf: _fp8(W_TINY, "l1_scale", (2, 1, 0), 0.0),
         Refused(ValueError, r"deepgemm-sm90-fp8: FP8 block weights l1_scale must be > 0, got 0.0 at \[expert, block row, "
                             r"block column\] = \[2, 1, 0\]"), "also-fp8-scale"),
    Case("backend", "FP8 block scale negative", lambda wf: _fp8(W_TINY, "l2_scale", (0, 0, 0), -0.5),
         Refused(ValueError, r"FP8 block weights l2_scale must be > 0, got -0.5"), "also-fp8-scale"),
    Case("backend", "FP8 block value NaN", lambda wf: _fp8(W_TINY, "l2", (1, 2, 3), 0x7F),
         Refused(ValueError, r"FP8 block weights l2 contains NaN or Inf \(first at \[expert, row, column\] = \[1, 2, 3\]")),
    Case("backend", "FP8 block scale negative at construction", lambda wf: dataclasses.replace(
         __import__("megamoe.layouts", fromlist=["x"]).to_fp8_block(W_TINY), l1_scale=-torch.ones(8, 2, 2)),
         Refused(ValueError, r"FP8BlockWeights: FP8 block weights l1_scale must be > 0, got -1.0"), "also-fp8-scale"),
    Case("backend", "kernel output overflows, run", lambda wf: _ToyKernel.make().run(_bf16_max_rows()),
         Refused(NonFiniteOutputError, rf"toy-cpu: y {NONFINITE}; the kernel's FP32 accumulators overflowed"), "also-bf16-max"),
    Case("backend", "kernel output, run", lambda wf: _ToyKernel.make().run(inputs(5, seed=7)),
         Correct(lambda y: torch.equal(y, _toy_expected(inputs(5, seed=7))) or pytest.fail("toy y differs"))),
]


# ------------------------------------------------------------------------------------ staging
def _stage(inp=None, **kw):
    from megamoe.staging import stage_into

    inp = inp if inp is not None else inputs(3)
    kw.setdefault("num_experts", 8)
    return staged_untouched(lambda b: stage_into(inp.x, inp.topk_idx, inp.topk_weights, *b.views(), backend="torch", **kw))


def _stage_int32():
    """int32 ids stage to the same routing as int64 ids, and every other byte is the reference's."""
    from megamoe.staging import stage_into, stage_reference
    from megamoe.staging.checks import allocate_buffers

    inp = inputs(5, seed=8, mask_prob=0.3)
    bufs = allocate_buffers(8, TINY, idx_dtype=torch.int32)
    stage_into(inp.x, inp.topk_idx.int(), inp.topk_weights, *bufs.views(), 7, num_experts=8, backend="torch")
    return bufs, stage_reference(inp.x, inp.topk_idx, inp.topk_weights, 7)


def _same_as_reference(r):
    bufs, ref = r
    for got, want in zip(bufs.views(), ref):
        assert torch.equal(got[:7].contiguous().view(torch.uint8), want.to(got.dtype).contiguous().view(torch.uint8))


STAGING = [
    Case("staging", "expert id 999", lambda wf: _stage(with_(inputs(3), "topk_idx", (1, 0), 999)),
         Refused(ValueError, r"stage_into: topk_idx must be in \[-1, 7\] \(-1 = masked\), got values in \[\d+, 999\]"), "4"),
    Case("staging", "expert twice in a token", lambda wf: _stage(with_(inputs(3), "topk_idx", (2, 1), int(inputs(3).topk_idx[2, 0]))),
         Refused(ValueError, r"stage_into: topk_idx: token 2 routes to the same expert twice"), "4"),
    Case("staging", "expert id -5", lambda wf: _stage(with_(inputs(3), "topk_idx", (0, 1), -5)),
         Refused(ValueError, r"stage_into: topk_idx must be in \[-1, 7\]"), "4"),
    Case("staging", "NaN routing weight", lambda wf: _stage(with_(inputs(3), "topk_weights", (2, 0), float("nan"))),
         Refused(ValueError, r"stage_into: topk_weights contains NaN or Inf \(first at \[token, slot\] = \[2, 0\]")),
    Case("staging", "NaN x", lambda wf: _stage(with_(inputs(3), "x", (1, 9), float("nan"))),
         Refused(ValueError, r"x contains NaN or Inf \(first at \[token, channel\] = \[1, 9\]")),
    Case("staging", "no expert count", lambda wf: _stage(num_experts=None) if False else
         staged_untouched(lambda b: __import__("megamoe.staging", fromlist=["x"]).stage_into(
             inputs(3).x, inputs(3).topk_idx, inputs(3).topk_weights, *b.views())),
         Refused(TypeError, r"missing 1 required keyword-only argument: 'num_experts'"), "4"),
    Case("staging", "expert count 8.5", lambda wf: _stage(num_experts=8.5),
         Refused(TypeError, r"stage_into: num_experts must be an int, got float 8.5")),
    Case("staging", "agreed count 4.0", lambda wf: _stage(num_tokens_agreed=4.0),
         Refused(TypeError, r"stage_into: num_tokens_agreed must be an int or None, got float 4.0")),
    Case("staging", "agreed count True", lambda wf: _stage(num_tokens_agreed=True),
         Refused(TypeError, r"num_tokens_agreed must be an int or None, got bool True")),
    Case("staging", "error flag of the wrong dtype", lambda wf: _stage(error_flag=torch.zeros(1)),
         Refused(TypeError, r"stage_into: error_flag must have dtype torch.int32, got torch.float32")),
    Case("staging", "int32 ids", lambda wf: _stage_int32(), Correct(_same_as_reference)),
]


# ------------------------------------------------------------------------------------ checkpoints
LAYER = 3


def _ckpt(tweak, **load):
    """Write legal weights as a 2-shard checkpoint, let ``tweak(directory)`` break it, then load it."""
    from megamoe.layouts.checkpoint import load_layer, write_checkpoint

    with tempfile.TemporaryDirectory() as d:
        write_checkpoint(d, LAYER, W_TINY, num_files=2, write_index=load.pop("index", True))
        tweak(Path(d))
        return load_layer(d, LAYER, **load)


def _index(d, weight_map):
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _extra_tensor(d):
    from safetensors.torch import save_file

    save_file({f"layers.{LAYER}.ffn.experts.bias": torch.zeros(8)}, str(d / "extra.safetensors"))
    wm = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    _index(d, {**wm, f"layers.{LAYER}.ffn.experts.bias": "extra.safetensors"})


def _ff_in_shard(d):
    from safetensors.torch import load_file, save_file

    path = d / "model-00002-of-00002.safetensors"
    tensors = load_file(str(path))
    name = f"layers.{LAYER}.ffn.experts.5.w3.scale"
    s = tensors[name].view(torch.uint8).clone()
    s[7, 3] = 255
    tensors[name] = s.view(torch.float8_e8m0fnu)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _bitwise(want):
    def check(w):
        for name in ("l1", "l1_scale", "l2", "l2_scale"):
            assert torch.equal(getattr(w, name), getattr(want, name)), name
    return check


CHECKPOINTS = [
    Case("checkpoint", "a directory named x.safetensors", lambda wf: _ckpt(lambda d: (d / "x.safetensors").mkdir(), index=False),
         Refused(ValueError, r"x.safetensors: named like a safetensors shard but is not a regular file"), "also-ckpt"),
    Case("checkpoint", "weight_map given as a list", lambda wf: _ckpt(lambda d: _index(d, ["a", "b"])),
         Refused(ValueError, r"model.safetensors.index.json: 'weight_map' must be an object of tensor name -> shard file "
                             r"name, got list"), "also-ckpt"),
    Case("checkpoint", "an extra experts.bias tensor", lambda wf: _ckpt(_extra_tensor),
         Refused(ValueError, rf"tensor 'layers.{LAYER}.ffn.experts.bias' in .*extra.safetensors is not a routed-expert "
                             rf"tensor of layer {LAYER}"), "also-ckpt"),
    Case("checkpoint", "weight_map values that are not names", lambda wf: _ckpt(lambda d: _index(d, {"a": 3})),
         Refused(ValueError, r"'weight_map' must be an object .*got a dict with non-string entries"), "also-ckpt"),
    Case("checkpoint", "0xFF in a scale tensor", lambda wf: _ckpt(_ff_in_shard),
         Refused(ValueError, rf"layers.{LAYER}.ffn.experts.5.w3.scale in .*model-00002-of-00002.safetensors holds 1 "
                             rf"{NAN_BYTE} \(first at \[7, 3\]\)"), "1"),
    Case("checkpoint", "expert 1.5", lambda wf: _ckpt(lambda d: None, experts=[0, 1.5]),
         Refused(TypeError, r"load_layer: experts\[i\] must be an int, got float 1.5")),
    Case("checkpoint", "an expert twice", lambda wf: _ckpt(lambda d: None, experts=[2, 2]),
         Refused(ValueError, r"load_layer: experts must be distinct, got \[2, 2\]")),
    Case("checkpoint", "round trip", lambda wf: _ckpt(lambda d: None), Correct(_bitwise(W_TINY))),
]


# ------------------------------------------------------------------------------------ distributed (two gloo ranks)
_DIST: dict = {}


def _dist(name):
    """The case's outcome on both ranks (one spawn for every case): the value of rank 0 and 1, or the error
    both raised (the same type on both; the message of each)."""
    if not _DIST:
        from megamoe.distributed import spawn

        _DIST.update(enumerate(spawn(dist_worker, 2, timeout_s=120)))
    r0, r1 = _DIST[0][name], _DIST[1][name]
    if r0[0] == r1[0] == "ok":
        return r0[1], r1[1]
    assert r0[0] == r1[0] == "error" and r0[1] == r1[1], f"the ranks ended differently: {r0} / {r1}"
    cls = {"SetupMismatchError": SetupMismatchError, "RankInputError": RankInputError}[r0[1]]
    raise cls(r0[2] if r0[2] == r1[2] else f"rank 0: {r0[2]} || rank 1: {r1[2]}")


def _dist_bitwise(use_local_weights=False):
    """Both ranks' y equal moe_forward_ep on the same global step, bit for bit."""
    def check(ys):
        from megamoe.reference import moe_forward_ep

        step, w = dist_global_step()
        want = moe_forward_ep(step, w, DIST_RECIPE, TINY).y
        for r in (0, 1):
            assert torch.equal(ys[r], want[r]), f"rank {r}"
    return check


MISMATCH = r"the 2 ranks of the group disagree on their setup .*\n  "
DISTRIBUTED = [
    Case("distributed", "every rank agrees", lambda wf: _dist("agree"), Correct(_dist_bitwise())),
    Case("distributed", "clamp differs", lambda wf: _dist("clamp"),
         Refused(SetupMismatchError, MISMATCH + r"geometry: ranks \[0\]: Geometry\(.*clamp=10.0.*; ranks \[1\]: .*clamp=20.0"), "3"),
    Case("distributed", "recipe differs", lambda wf: _dist("recipe"),
         Refused(SetupMismatchError, MISMATCH + r"recipe: ranks \[0\]: Recipe\(name='flashinfer-mxfp4'.*; ranks \[1\]: "
                                                r"Recipe\(name='deepgemm-sm90-fp4'"), "3"),
    Case("distributed", "recipe width differs", lambda wf: _dist("recipe width"),
         Refused(SetupMismatchError, MISMATCH + r"recipe: ranks \[0\]: .*x_gran=128.*; ranks \[1\]: .*x_gran=64"), "3"),
    Case("distributed", "one weight bit differs", lambda wf: _dist("weights"),
         Refused(SetupMismatchError, MISMATCH + r"weight bytes: ranks \[0\]: sha256 [0-9a-f]{16}; ranks \[1\]: sha256"), "3"),
    Case("distributed", "scheme differs", lambda wf: _dist("scheme"),
         Refused(SetupMismatchError, MISMATCH + r"scheme: ranks \[0\]: 'allgather_reducescatter'; ranks \[1\]: 'all_to_all'"),
         "3"),
    Case("distributed", "top-k differs", lambda wf: _dist("top-k"),
         Refused(SetupMismatchError, MISMATCH + r"geometry: ranks \[0\]: .*num_topk=2.*; ranks \[1\]: .*num_topk=1"), "3"),
    Case("distributed", "one rank's inputs refused", lambda wf: _dist("bad inputs"),
         Refused(RankInputError, r"1 of the 2 ranks refused their own arguments before any collective; every rank stops:\n"
                                 r"  rank 1: ValueError: rank 1: topk_idx must be in \[-1, 7\]"), "3"),
    Case("distributed", "all experts on one rank, its own on the other", lambda wf: _dist("weights held"),
         Refused(SetupMismatchError, r"weights_held: ranks \[0\]: 'all experts'; ranks \[1\]: \"this rank's experts only\""),
         "3"),
    Case("distributed", "every rank holds its own experts", lambda wf: _dist("local weights"), Correct(_dist_bitwise())),
    Case("distributed", "launcher capacity differs", lambda wf: _dist("capacity"),
         Refused(SetupMismatchError, MISMATCH + r"max_tokens_per_rank: ranks \[0\]: 8; ranks \[1\]: 16"), "3"),
    Case("distributed", "launcher step, NaN on one rank", lambda wf: _dist("launcher step"),
         Refused(RankInputError, r"rank 0: ranks \[1\] of 2 refused their own step before the launch; every rank stops \|\| "
                                 r"rank 1: .*this rank \(rank 1\): ValueError: rank 1: x contains NaN or Inf"), "3"),
    Case("distributed", "launcher step after a refusal", lambda wf: _dist("launcher agrees"), Correct(_dist_bitwise())),
    Case("distributed", "step count 6.9", lambda wf: _dist("step count"),
         Refused(RankInputError, r"ranks \[1\] of 2 refused their own step .*num_tokens must be a non-negative int, got 6.9"),
         "also-int"),
]


# ------------------------------------------------------------------------------------ command line
def _ok_and(text):
    def check(r):
        assert r[0] == 0 and text in r[1], r
    return check


CLI = [
    Case("cli", "negative token count", lambda wf: cli("check", "--preset", "tiny", "--tokens", "-5"),
         Refused(CLIExit, r"rc=2: megamoe check: tokens must be >= 0, got -5")),
    Case("cli", "token count 6.9", lambda wf: cli("check", "--preset", "tiny", "--tokens", "6.9"),
         Refused(CLIExit, r"rc=2: .*argument --tokens: invalid int value: '6.9'"), "also-int"),
    Case("cli", "ranks that do not divide E", lambda wf: cli("check", "--preset", "tiny", "--ranks", "3"),
         Refused(CLIExit, r"rc=2: megamoe check: num_ranks must divide num_experts=8, got num_ranks=3")),
    Case("cli", "BLOCK_M 0", lambda wf: cli("check", "--preset", "tiny", "--block-m", "0"),
         Refused(CLIExit, r"rc=2: megamoe check: block_m must be positive, got 0")),
    Case("cli", "an unknown recipe", lambda wf: cli("check", "--recipes", "nope"),
         Refused(CLIExit, r"rc=2: .*argument --recipes: invalid choice: 'nope'")),
    Case("cli", "gloo ranks that do not divide E", lambda wf: cli("check", "--preset", "tiny", "--dist", "--ranks", "3"),
         Refused(CLIExit, r"rc=2: megamoe check --dist: num_ranks must divide num_experts=8, got num_ranks=3")),
    Case("cli", "bench on 0 ranks", lambda wf: cli("bench", "--ranks", "0"),
         Refused(CLIExit, r"rc=2: megamoe bench: --ranks must be >= 1, got 0")),
    Case("cli", "zero tokens", lambda wf: cli("check", "--preset", "tiny", "--tokens", "0", "--recipes", "flashinfer-mxfp4"),
         Correct(_ok_and("all checks passed"))),
]


# ------------------------------------------------------------------------------------ the tests
CASES = SCALE + ACTIVATIONS + ROUTING + GEOMETRY + BACKEND + STAGING + CHECKPOINTS + DISTRIBUTED + CLI


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_case(case, weights_for):
    if isinstance(case.expect, Refused):
        with pytest.raises(case.expect.error) as info:
            case.run(weights_for)
        msg = str(info.value)
        assert re.search(case.expect.pattern, msg, re.S), f"{case.id}: the message does not say it:\n{msg}"
        if case.expect.check is not None:
            case.expect.check(msg, weights_for)
    else:  # Exact or Correct: no exception, and the result checks out against the independent computation
        case.expect.check(case.run(weights_for))


def test_table_covers_every_finding_and_category():
    findings = {c.finding for c in CASES}
    assert {"1", "2", "3", "4", "5"} <= findings
    assert {"also-fp8-scale", "also-bf16-max", "also-subnormal", "also-int", "also-ckpt"} <= findings
    counts = {cat: sum(c.category == cat for c in CASES) for cat in dict.fromkeys(c.category for c in CASES)}
    print("\ncases per category:", counts, "total", len(CASES))
    assert len({c.id for c in CASES}) == len(CASES), "case names must be unique"


# ------------------------------------------------------------------------------------ the windows, byte by byte
@pytest.mark.parametrize("decode", list(WEIGHT_DECODERS))
def test_decode_table_matches_an_independent_decode(decode):
    """All 256 bytes x 16 codes of each decode rule against the rule written out here."""
    ours = mxfp4_decode_table(WEIGHT_DECODERS[decode]).view(256, 16).tolist()
    theirs = independent_table(decode)
    for b in range(256):
        for c in range(16):
            a, t = ours[b][c], theirs[b][c]
            assert (a == t) or (a != a and t != t), f"{decode}: byte {b} code {c}: {a} vs {t}"


@pytest.mark.parametrize("decode", list(WEIGHT_DECODERS))
def test_windows_derived_from_the_decode_rule(decode):
    """A byte is legal iff all 16 codes decode exactly; the window is what that gives, and 0xFF never is."""
    theirs = independent_table(decode)
    legal = [b for b in range(256) if all(theirs[b][c] == math_value(b, c) for c in range(16))]
    assert tuple(legal) == exact_scale_bytes(decode)
    assert scale_byte_window(decode) == (legal[0], legal[-1]) and 255 not in legal
    assert {"exact": (0, 252), "e4m3_flush_saturate": (122, 133), "e4m3_rn": (119, 133)}[decode] == (legal[0], legal[-1])


def math_value(b, c):
    from adversarial_support import E2M1

    return (-1.0 if c & 8 else 1.0) * E2M1[c & 7] * 2.0 ** (b - 127)


@pytest.mark.parametrize("name", list(RECIPES))
def test_recipe_windows_agree_with_the_derivation(name):
    r = RECIPES[name]
    want = scale_byte_window(r.weight_decode) if r.weight_format == "mxfp4" else (None, None)
    assert (r.min_scale_byte, r.max_scale_byte) == want
    with pytest.raises(ValueError, match="init=False"):
        r.with_(min_scale_byte=0)  # a window is derived, never set by hand

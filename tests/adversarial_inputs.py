"""Adversarial cases: activations, routing, geometry, staging (``ACTIVATIONS``, ``ROUTING``, ``GEOMETRY``,
``STAGING``)."""

from __future__ import annotations

import dataclasses

import torch

from adversarial_support import (
    NONFINITE, BF16_MAX, TINY, W_TINY, Case, Correct, Refused, _bf16_max_rows, close_to, dense_exact, fwd, inputs,
    staged_untouched, with_,
)
from megamoe.staging import stage_into
from megamoe.testing import fp8_block_weights
from megamoe.validate import NonFiniteOutputError


# ------------------------------------------------------------------------------------ activations
def _staged_bf16_max(_):
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
    Case("activations", "bf16 max, DeepGEMM FP8 recipe", lambda wf: fwd(fp8_block_weights(W_TINY), "deepgemm-sm90-fp8",
                                                                          _bf16_max_rows()),
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
         Refused(ValueError, r"Geometry 'tiny': clamp must be finite or \+inf, got nan"), "5"),
    Case("geometry", "negative clamp", lambda wf: _geom(clamp=-10.0),
         Refused(ValueError, r"Geometry 'tiny': clamp must be > 0, got -10.0"), "5"),
    Case("geometry", "zero clamp", lambda wf: _geom(clamp=0.0), Refused(ValueError, r"clamp must be > 0, got 0.0"), "5"),
    # +inf is "no clamp" (the kernels' own default; DeepSeek-V3 configs have no swiglu_limit): a value, not an error
    Case("geometry", "infinite clamp is no clamp", lambda wf: fwd(W_TINY, "exact", g=_geom(clamp=float("inf"))),
         Correct(close_to(dense_exact(inputs(), W_TINY, g=_geom(clamp=float("inf"))))), "5"),
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


# ------------------------------------------------------------------------------------ staging
def _stage(inp=None, **kw):
    inp = inp if inp is not None else inputs(3)
    kw.setdefault("num_experts", 8)
    return staged_untouched(lambda b: stage_into(inp.x, inp.topk_idx, inp.topk_weights, *b.views(), backend="torch", **kw))


def _stage_int32():
    """int32 ids stage to the same routing as int64 ids, and every other byte is the reference's."""
    from megamoe.staging import stage_reference
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
    Case("staging", "no expert count", lambda wf: staged_untouched(lambda b: stage_into(
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

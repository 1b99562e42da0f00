"""Adversarial cases of the second round: the decode path (``DECODE``), state that changes between steps
(``IN_PLACE``), strided edge shapes at the Triton entry points (``STRIDED``), messages that must name the right
culprit (``MESSAGES``) and sums whose result depends on their order (``ORDER``). Cases marked "interpreter" run the
Triton kernels under TRITON_INTERPRET=1 in one subprocess (``adversarial_interpreter.py``); the others run in the
test process (the decode path's torch twins, the reference, the checks).
"""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from adversarial_interpreter import outcome
from adversarial_support import NAN_BYTE, NONFINITE, TINY, W_TINY, Case, Correct, Refused, fwd, inputs, with_
from megamoe.validate import NonFiniteOutputError

ROW_GROUP = (3, 2)  # the [row, group] of l1_scale that the in-place cases write


# ------------------------------------------------------------------------------------ decode
def _dw(w=W_TINY, tc: bool = False):
    from megamoe.decode import prepare_decode_weights, prepare_tc_weights

    return prepare_tc_weights(w) if tc else prepare_decode_weights(w)


def _staged(tokens=3, capacity=4, seed=60, **stage):
    """Decode buffers of ``tiny`` with ``tokens`` tokens staged by the checked ``stage_into``."""
    from megamoe.decode import DecodeBuffers
    from megamoe.staging import stage_into

    buf = DecodeBuffers.allocate(TINY, capacity, "cpu", split_tokens=stage.pop("split_tokens", 0))
    inp = inputs(tokens, seed=seed)
    stage.setdefault("num_experts", TINY.num_experts)
    stage_into(inp.x, inp.topk_idx, inp.topk_weights, buf.x_q, buf.x_sf, buf.topk_idx, buf.topk_weights,
               backend="torch", **stage)
    return buf, inp


def _twin(dw=None, buf=None, num_tokens=3, clamp=None, cfg=None):
    from megamoe.decode import LaunchConfig, moe_decode_torch

    dw = _dw() if dw is None else dw
    buf = _staged()[0] if buf is None else buf
    return moe_decode_torch(dw, buf, num_tokens, TINY.clamp if clamp is None else clamp, cfg or LaunchConfig())


def _launch(dw=None, buf=None, num_tokens=3, clamp=None, cfg=None):
    """moe_decode (the Triton launches) where the checks refuse before any kernel: nothing may be written."""
    from megamoe.decode import LaunchConfig, moe_decode

    buf = _staged()[0] if buf is None else buf
    buf.poison_()
    try:
        return moe_decode(_dw() if dw is None else dw, buf, num_tokens, TINY.clamp if clamp is None else clamp,
                          cfg or LaunchConfig())
    finally:
        assert torch.isnan(buf.y.float()).all() and torch.isnan(buf.l2_x).all(), "a kernel ran before the refusal"


def _hand_written(index, value, name="topk_idx"):
    """Buffers whose staged routing was then written by hand (not through stage_into)."""
    buf, _ = _staged()
    getattr(buf, name)[index] = value
    return buf


def _past_staged():
    buf, _ = _staged(4)
    inp = inputs(2, seed=61)
    from megamoe.staging import stage_into

    stage_into(inp.x, inp.topk_idx, inp.topk_weights, buf.x_q, buf.x_sf, buf.topk_idx, buf.topk_weights,
               num_experts=8, backend="torch")
    return buf


def _equals_reference(r):
    y, inp = r
    from megamoe.recipe import MEGAMOE_DECODE
    from megamoe.reference import moe_forward

    want = moe_forward(inp, W_TINY, MEGAMOE_DECODE, TINY)
    assert torch.equal(y.view(torch.int16), want.view(torch.int16)) and y.abs().sum() > 0


def _twin_on_staged(tokens):
    buf, inp = _staged(tokens)
    return _twin(buf=buf, num_tokens=tokens).clone(), inp


def _strided_field(name):
    buf, _ = _staged()
    t = getattr(buf, name)
    wide = torch.empty(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)[..., ::2]
    setattr(buf, name, wide)  # after construction: the launch's own check must see it
    return buf


def _alloc(**kw):
    from megamoe.decode import DecodeBuffers

    kw.setdefault("capacity", 4)
    return DecodeBuffers.allocate(TINY, kw.pop("capacity"), "cpu", **kw)


def _tiles(l1, l2):
    from megamoe.decode import TileShape, prepare_decode_weights

    return prepare_decode_weights(W_TINY, TileShape(*l1), TileShape(*l2))


def _cfg(**kw):
    from megamoe.decode import LaunchConfig

    return LaunchConfig(**kw)


GEOM = r"the weights are \(H, I, experts\) = \(512, 256, 16\) but the buffers were allocated for \(256, 128, 8\)"
PAST = r"num_tokens=4 but only 2 token\(s\) are staged in these buffers"
DECODE = [
    Case("decode", "expert id 999 staged by hand, twin", lambda wf: _twin(buf=_hand_written((1, 0), 999)),
         Refused(ValueError, r"moe_decode_torch: staged: topk_idx must be in \[-1, 7\] \(-1 = masked\), got values in "
                             r"\[\d, 999\] \(first bad token 1: \[999, \d\]\)"), "4"),
    Case("decode", "expert id -3 staged by hand, twin", lambda wf: _twin(buf=_hand_written((2, 1), -3)),
         Refused(ValueError, r"moe_decode_torch: staged: topk_idx must be in \[-1, 7\] .*first bad token 2")),
    Case("decode", "NaN routing weight staged by hand, twin",
         lambda wf: _twin(buf=_hand_written((0, 1), float("nan"), "topk_weights")),
         Refused(ValueError, r"moe_decode_torch: staged: topk_weights contains NaN or Inf \(first at \[token, slot\] = "
                             r"\[0, 1\]")),
    Case("decode", "ids staged against 16 experts on buffers of 8, launch", lambda wf: _launch(buf=_staged(
         num_experts=16)[0]), Refused(ValueError, r"moe_decode: the staged expert ids were given against "
                                                  r"num_experts=16 but the buffers route over a layer of 8 experts")),
    Case("decode", "NaN clamp, launch", lambda wf: _launch(clamp=float("nan")),
         Refused(ValueError, r"moe_decode: clamp must be finite or \+inf, got nan"), "5"),
    Case("decode", "NaN clamp, twin", lambda wf: _twin(clamp=float("nan")),
         Refused(ValueError, r"moe_decode_torch: clamp must be finite or \+inf, got nan"), "5"),
    Case("decode", "NaN clamp, interpreter", lambda wf: outcome("decode_nan_clamp"),
         Refused(ValueError, r"moe_decode: clamp must be finite or \+inf, got nan"), "5"),
    Case("decode", "zero clamp, launch", lambda wf: _launch(clamp=0.0), Refused(ValueError, r"clamp must be > 0, got 0.0")),
    Case("decode", "negative clamp, twin", lambda wf: _twin(clamp=-1.0), Refused(ValueError, r"clamp must be > 0, got -1.0")),
    Case("decode", "clamp as a string, launch", lambda wf: _launch(clamp="10"),
         Refused(TypeError, r"moe_decode: clamp must be a real number, got str '10'")),
    Case("decode", "weights of another geometry, launch", lambda wf: _launch(dw=_dw(wf("small")[1])),
         Refused(ValueError, "moe_decode: " + GEOM)),
    Case("decode", "weights of another geometry, twin", lambda wf: _twin(dw=_dw(wf("small")[1])),
         Refused(ValueError, "moe_decode_torch: " + GEOM)),
    Case("decode", "weights of another geometry, tensor cores", lambda wf: _launch(dw=_dw(wf("small")[1], tc=True)),
         Refused(ValueError, "moe_decode: " + GEOM)),
    Case("decode", "weights of another geometry, interpreter", lambda wf: outcome("decode_other_geometry"),
         Refused(ValueError, "moe_decode: " + GEOM)),
    Case("decode", "launch past the staged rows", lambda wf: _launch(buf=_past_staged(), num_tokens=4),
         Refused(ValueError, "moe_decode: " + PAST)),
    Case("decode", "launch past the staged rows, twin", lambda wf: _twin(buf=_past_staged(), num_tokens=4),
         Refused(ValueError, "moe_decode_torch: " + PAST)),
    Case("decode", "launch past the staged rows, interpreter", lambda wf: outcome("decode_past_staged"),
         Refused(ValueError, "moe_decode: " + PAST)),
    Case("decode", "launch on buffers nothing was staged into", lambda wf: _launch(buf=_alloc(), num_tokens=1),
         Refused(ValueError, r"num_tokens=1 but only 0 token\(s\) are staged in these buffers")),
    Case("decode", "launch past capacity", lambda wf: _launch(num_tokens=5),
         Refused(ValueError, r"moe_decode: num_tokens must be in \[0, 4\], got 5")),
    Case("decode", "num_tokens 2.5", lambda wf: _launch(num_tokens=2.5),
         Refused(TypeError, r"moe_decode: num_tokens must be an int, got float 2.5"), "also-int"),
    Case("decode", "staged rows, twin", lambda wf: _twin_on_staged(3), Correct(_equals_reference)),
    Case("decode", "staged rows, interpreter", lambda wf: outcome("decode_staged_rows"),
         Correct(lambda r: r == {"bitwise": True, "nonzero": True} or pytest.fail(str(r)))),
    Case("decode", "capacity 65", lambda wf: _alloc(capacity=65),
         Refused(ValueError, r"DecodeBuffers.allocate: capacity \(tokens per rank\) must be in \[1, 64\], got 65")),
    Case("decode", "capacity 0", lambda wf: _alloc(capacity=0),
         Refused(ValueError, r"capacity \(tokens per rank\) must be in \[1, 64\], got 0")),
    Case("decode", "capacity 2.0", lambda wf: _alloc(capacity=2.0),
         Refused(TypeError, r"DecodeBuffers.allocate: capacity \(tokens per rank\) must be an int, got float 2.0")),
    Case("decode", "split scratch past capacity", lambda wf: _alloc(split_tokens=5),
         Refused(ValueError, r"split_tokens must be in \[0, 4\], got 5")),
    Case("decode", "L2 group 64", lambda wf: _alloc(l2_group=64), Refused(ValueError, r"l2_group must be in \[32, 32\], got 64")),
    Case("decode", "more local experts than the layer's", lambda wf: _alloc(num_local=9),
         Refused(ValueError, r"num_local must be in \[1, 8\], got 9")),
    Case("decode", "local experts past the layer's end", lambda wf: _alloc(num_local=4, expert_lo=5),
         Refused(ValueError, r"expert_lo must be in \[0, 4\], got 5")),
    Case("decode", "tile of 24 rows", lambda wf: _tiles((32, 4), (24, 2)),
         Refused(ValueError, r"TileShape: bn must be a power of two \(a Triton block size\), got 24")),
    Case("decode", "L1 tile of 64 rows", lambda wf: _tiles((64, 4), (64, 2)),
         Refused(ValueError, r"prepare_decode_weights: l1_tile.bn must be 32 \(gate/up's rows per program are one down "
                             r"requant group\), got 64")),
    Case("decode", "L1 tile of 2 groups", lambda wf: _tiles((32, 2), (64, 2)),
         Refused(ValueError, r"l1_tile.groups must be 4..64 \(1 to 16 promotion blocks of 128 K\), got 2")),
    Case("decode", "L2 tile wider than I", lambda wf: _tiles((32, 4), (64, 8)),
         Refused(ValueError, r"l2_tile TileShape\(bn=64, groups=8\) must divide its GEMM: 256 rows by bn=64 and K=128 "
                             r"by bk=256")),
    Case("decode", "tile groups 0", lambda wf: _tiles((32, 4), (64, 0)),
         Refused(ValueError, r"TileShape: groups must be >= 1, got 0")),
    Case("decode", "three warps", lambda wf: _cfg(l1_warps=3),
         Refused(ValueError, r"LaunchConfig: l1_warps must be one of \(1, 2, 4, 8, 16\), got 3")),
    Case("decode", "pdl as an int", lambda wf: _cfg(pdl=1), Refused(TypeError, r"LaunchConfig: pdl must be a bool, got int 1")),
    Case("decode", "split K past the buffers' scratch, tensor cores", lambda wf: _launch(
         dw=_dw(tc=True), cfg=_cfg(tc_pack4=True, tc_split=2)),
         Refused(ValueError, r"LaunchConfig.tc_split=2 needs tc_pack4=True and num_tokens <= the buffers' split_tokens "
                             r"\(0;")),
    Case("decode", "a strided output buffer", lambda wf: _launch(buf=_strided_field("y")),
         Refused(ValueError, r"moe_decode: y must be contiguous \(a kernel reads it as a dense row-major array\), got "
                             r"strides \(512, 2\) for shape \(4, 256\)")),
    Case("decode", "buffers of the wrong dtype", lambda wf: dataclasses.replace(_staged()[0], x32=torch.zeros(4, 256)
                                                                               .double()),
         Refused(TypeError, r"DecodeBuffers: x32 must have dtype torch.float32, got torch.float64")),
    Case("decode", "checkpoint weights handed to the launch", lambda wf: _launch(dw=W_TINY),
         Refused(TypeError, r"moe_decode: dw must be DecodeWeights or TCWeights .*got MXFP4Weights")),
    Case("decode", "FP8 block weights handed to prepare", lambda wf: _dw(__import__("megamoe.testing", fromlist=["x"])
                                                                          .fp8_block_weights(W_TINY)),
         Refused(TypeError, r"prepare_decode_weights: weights must be MXFP4Weights, got FP8BlockWeights")),
]


# ------------------------------------------------------------------------------------ state changed in place
def _write(kind: str, t: torch.Tensor, index, value) -> None:
    """Write ``value`` at ``index`` of ``t`` the way ``kind`` does; some of these bump torch's version counter
    (an index assignment, an in-place op under no_grad), some do not (``.data``, numpy, the storage)."""
    if kind == "index":
        t[index] = value
    elif kind == "data.copy_":
        new = t.clone()
        new[index] = value
        t.data.copy_(new)
    elif kind == "numpy view":
        t.numpy()[index] = value
    elif kind == "no_grad op":
        with torch.no_grad():
            t.add_(torch.where(torch.arange(t.numel()).view(t.shape) == _flat(t, index), value - t, 0).to(t.dtype))
    elif kind == "storage":
        t.untyped_storage()[t.storage_offset() + _flat(t, index) * t.element_size()] = value
    else:
        raise ValueError(kind)


def _flat(t, index) -> int:
    return int(torch.arange(t.numel()).view(t.shape)[index])


WRITES = ("index", "data.copy_", "numpy view", "no_grad op", "storage")


def _read_expert(seed=0):
    """An expert the 6-token step of ``inputs(seed=0)`` reads (its token 0, slot 0)."""
    return int(inputs().topk_idx[0, 0])


def _reference_after(kind):
    """The reference called once (checks cached, if any), then a 0xFF written into an expert it reads."""
    w = dataclasses.replace(W_TINY, l1_scale=W_TINY.l1_scale.clone())
    fwd(w, "flashinfer-mxfp4")
    _write(kind, w.l1_scale, (_read_expert(), *ROW_GROUP), 255)
    return fwd(w, "flashinfer-mxfp4")


def _digest_follows(kind):
    """setup_fingerprint's weight bytes after a one-byte write: (digest before, after, of a fresh copy)."""
    from megamoe.distributed.agreement import setup_fingerprint

    w = dataclasses.replace(W_TINY, l2=W_TINY.l2.clone())
    before = setup_fingerprint(TINY, "exact", w)["weight bytes"][1]
    _write(kind, w.l2, (3, 5, 7), int(w.l2[3, 5, 7]) ^ 1)
    after = setup_fingerprint(TINY, "exact", w)["weight bytes"][1]
    fresh = setup_fingerprint(TINY, "exact", dataclasses.replace(w, l2=w.l2.clone()))["weight bytes"][1]
    return before, after, fresh


def _digest_moved(r):
    before, after, fresh = r
    assert after != before and after == fresh, r


def _repair_after(kind):
    from megamoe.layouts.ranges import repair_ranges

    w = dataclasses.replace(W_TINY, l2_scale=W_TINY.l2_scale.clone())
    repair_ranges(w, "flashinfer-mxfp4")
    _write(kind, w.l2_scale, (6, 1, 0), 255)
    return repair_ranges(w, "flashinfer-mxfp4")


def _window_check_after(kind):
    """A range check passes (answered by the scale bytes alone), then a byte above the window is written into a
    nonzero group of expert 6's l2: the next check refuses it, whether or not the write moved torch's version counter
    (a check that kept its first answer per object or version would pass it)."""
    from megamoe.layouts.ranges import check_ranges, repair_ranges

    w = repair_ranges(dataclasses.replace(W_TINY, l2_scale=W_TINY.l2_scale.clone()), "flashinfer-mxfp4")
    check_ranges(w, "flashinfer-mxfp4")
    _write(kind, w.l2_scale, (6, 1, 0), 140)
    return check_ranges(w, "flashinfer-mxfp4")


def _unread_expert_untouched():
    """A 0xFF in an expert this step does not read: the step is computed (what it reads is right), and equals the
    step on the clean weights bit for bit."""
    inp = inputs(2)
    unread = sorted(set(range(8)) - set(inp.topk_idx.flatten().tolist()))[0]
    w = dataclasses.replace(W_TINY, l1_scale=W_TINY.l1_scale.clone())
    w.l1_scale.data[unread, 0, 0] = 255
    return fwd(w, "flashinfer-mxfp4", inp), fwd(W_TINY, "flashinfer-mxfp4", inp)


IN_PLACE = [
    *(Case("in-place", f"0xFF written by {k}, reference", lambda wf, k=k: _reference_after(k),
           Refused(ValueError, rf"reference: weights.l1_scale holds 1 {NAN_BYTE} \(first at expert {_read_expert()}, "
                               rf"\[row, group\] = \[{ROW_GROUP[0]}, {ROW_GROUP[1]}\], of the experts this call reads\)"),
           "1") for k in WRITES),
    *(Case("in-place", f"one weight bit flipped by {k}, setup digest", lambda wf, k=k: _digest_follows(k),
           Correct(_digest_moved), "3") for k in WRITES),
    *(Case("in-place", f"0xFF written by {k}, range repair", lambda wf, k=k: _repair_after(k),
           Refused(ValueError, rf"scale ranges for flashinfer-mxfp4: weights.l2_scale holds 1 {NAN_BYTE} \(first at "
                               r"\[6, 1, 0\]\)"), "1") for k in WRITES),
    *(Case("in-place", f"byte above the window written by {k} after a range check passed",
           lambda wf, k=k: _window_check_after(k),
           Refused(ValueError, r"1 expert tensor\(s\) out of range for flashinfer-mxfp4; first without an exact repair: "
                               r"expert 6 l2: 0 scale groups below byte 122 and 1 above byte 133 \(offending bytes "
                               r"\[140\]")) for k in WRITES),
    Case("in-place", "0xFF in an expert the step does not read", lambda wf: _unread_expert_untouched(),
         Correct(lambda r: torch.equal(*r) or pytest.fail("y changed"))),
]


# ------------------------------------------------------------------------------------ strided edge shapes
def _stage_torch(x=None, out_x=None, capacity=1, agreed=None):
    from megamoe.staging import stage_into
    from megamoe.staging.checks import allocate_buffers

    x = torch.randn(1, TINY.hidden).to(torch.bfloat16) if x is None else x
    t = x.shape[0]
    views = list(allocate_buffers(capacity, TINY).views())
    if out_x is not None:
        views[0] = out_x
    idx, w = torch.tensor([1, 5] * t).view(t, 2), torch.tensor([0.75, 0.25] * t).view(t, 2)
    return stage_into(x, idx, w, *views, agreed, num_experts=8, backend="torch")


STRIDE_X = r"stage_into: x must be contiguous along H \(stride\(1\) == 1; any row stride\), got strides \(512, 2\) " \
           r"for shape \(1, 256\)"
STRIDE_OUT = r"stage_into: out_x must be contiguous along H \(stride\(1\) == 1; any row stride\), got strides \(512, 2\)"
STRIDED = [
    Case("strided", "1-token x, stride 2 along H, interpreter", lambda wf: outcome("strided_one_token_x"),
         Refused(ValueError, STRIDE_X)),
    Case("strided", "1-token x, stride 2 along H, torch", lambda wf: _stage_torch(
         torch.randn(1, 512).to(torch.bfloat16)[:, ::2]), Refused(ValueError, STRIDE_X)),
    Case("strided", "capacity-1 out_x, stride 2 along H, interpreter", lambda wf: outcome("strided_capacity_one_out_x"),
         Refused(ValueError, STRIDE_OUT)),
    Case("strided", "capacity-1 out_x, stride 2 along H, torch", lambda wf: _stage_torch(
         out_x=torch.empty(1, 512, dtype=torch.float8_e4m3fn)[:, ::2]), Refused(ValueError, STRIDE_OUT)),
    Case("strided", "1-token x cut from a wider row, interpreter", lambda wf: outcome("one_token_any_row_stride"),
         Correct(lambda r: r == [True] * 4 or pytest.fail(str(r)))),
    Case("strided", "0-token strided x, two padding rows, interpreter", lambda wf: outcome("zero_tokens_strided_x"),
         Correct(lambda r: r == [True] * 4 or pytest.fail(str(r)))),
    Case("strided", "decode weights replaced by a strided copy", lambda wf: dataclasses.replace(
         _dw(), l2_scales=_dw().l2_scales.transpose(-1, -2).contiguous().transpose(-1, -2)),
         Refused(ValueError, r"DecodeWeights: l2_scales must be contiguous \(a kernel reads it as a dense row-major "
                             r"array\)")),
    Case("strided", "tensor-core scales replaced by a strided copy", lambda wf: dataclasses.replace(
         _dw(tc=True), l1_scales=_dw(tc=True).l1_scales.transpose(-1, -2).contiguous().transpose(-1, -2)),
         Refused(ValueError, r"TCWeights: l1_scales must be contiguous")),
    Case("strided", "1-row staged block replaced by a strided one", lambda wf: _launch(buf=_strided_field("x_sf")),
         Refused(ValueError, r"moe_decode: x_sf must be contiguous")),
]


# ------------------------------------------------------------------------------------ messages
def _decode_scale_written(tc: bool):
    """Prepared weights whose scale byte of a touched expert is set to 0xFF after prepare, through the twin."""
    dw = _dw(tc=tc)
    buf, inp = _staged()
    e = int(inp.topk_idx[0, 0])
    if tc:
        dw.l1_scales.data[e, 1, 0, 5, 2] = (255 + 6) % 256  # stored s + 6: byte 0xFF
    else:
        dw.l1_scales.data[e, 0, 0, 0, 3, 2] = 255  # [E, I/bn, H/bk, half, bn, g]: gate row 3, group 2
    return _twin(dw, buf)


class _DecodeOnCPU:
    """The megamoe-decode backend on the CPU, its launch the torch twins' stages without the twin's own checks:
    what the Triton kernels compute, to see what ``run`` says of a non-finite y."""

    @staticmethod
    def run_with_nan_scale():
        from megamoe.decode import gemv, routing
        from megamoe.decode.moe import check_launch
        from megamoe.fused.megamoe_decode import MegaMoEDecode

        class CPU(MegaMoEDecode):
            device = torch.device("cpu")

            def launch(self, m):
                b, cfg = self.buf, self.launch_config(m)
                check_launch(self.dw, b, m, self.g.clamp, cfg)
                routing.route_torch(b.topk_idx, b.topk_weights, b.x_q, m, b.expert_lo, b.num_local, b)
                gemv.l1_torch(self.dw, b, m, self.g.clamp, cfg)
                gemv.l2_torch(self.dw, b, m, cfg)
                gemv.combine_torch(b, m, b.num_topk, cfg)
                return b.y[:m]

        be = CPU(TINY, capacity=4)
        be.dw, be.buf = _dw(), _alloc()
        be._prepared = be._allocated = True
        inp = inputs(3, seed=60)
        e = int(inp.topk_idx[1, 0])
        be.dw.l2_scales.numpy()[e, 2, 0, 7, 1] = 255  # [E, H/bn2, I/bk2, bn2, g2]: l2 row 2 * 64 + 7, group 1
        return be.run(inp), e


def _without_triton():
    from megamoe.fused.megamoe_decode import MegaMoEDecodeTC

    saved = sys.modules.get("triton")
    sys.modules["triton"] = None  # import triton now raises ImportError
    try:
        return MegaMoEDecodeTC.availability()
    finally:
        if saved is None:
            sys.modules.pop("triton", None)
        else:
            sys.modules["triton"] = saved


def _e_of(t, k=0, seed=60, tokens=3):
    return int(inputs(tokens, seed=seed).topk_idx[t, k])


MESSAGES = [
    Case("messages", "0xFF written into prepared decode weights, twin", lambda wf: _decode_scale_written(False),
         Refused(ValueError, rf"moe_decode_torch: DecodeWeights.l1_scales: expert {_e_of(0)}, l1 row 3 \(gate\), 32-K group "
                             r"2 holds scale byte 0xFF \(NaN\) \(prepare refuses it: was it written in place\?\)")),
    Case("messages", "0xFF written into prepared tensor-core weights, twin", lambda wf: _decode_scale_written(True),
         Refused(ValueError, rf"moe_decode_torch: TCWeights.l1_scales: expert {_e_of(0)}, l1 row 37 \(gate\), 32-K group 2 "
                             r"holds scale byte 255 \(stored 5; outside 20..236")),
    Case("messages", "NaN y from a scale byte, backend run", lambda wf: _DecodeOnCPU.run_with_nan_scale(),
         Refused(NonFiniteOutputError, rf"megamoe-decode: y {NONFINITE}; caused by the weights: DecodeWeights.l2_scales: "
                                       rf"expert {_e_of(1)}, l2 row 135, 32-K group 1 holds scale byte 0xFF")),
    Case("messages", "0xFF written into an FP8 block value, reference", lambda wf: fwd(_fp8_written(), "deepgemm-sm90-fp8"),
         Refused(ValueError, rf"reference: FP8 block weights l1 contains NaN or Inf \(first at \[expert, row, column\] "
                             rf"= \[{_read_expert()}, 4, 9\]")),
    Case("messages", "no GPU and no triton", lambda wf: _without_triton(),
         Correct(lambda r: (r[0] is False and "no GPU: torch.cuda.is_available() is False; package missing: triton not "
                            "importable" in r[1]) or pytest.fail(str(r)))),
]


def _fp8_written():
    from megamoe.testing import fp8_block_weights

    w = fp8_block_weights(W_TINY)
    w.l1.view(torch.uint8).numpy()[_read_expert(), 4, 9] = 0x7F
    return w


# ------------------------------------------------------------------------------------ order
def order_slots(buf) -> None:
    """Decode buffers of a top-4 geometry, two tokens, slot outputs whose FP32 sum depends on the order:
    token 0's slots 0, 1, 2 hold 2**24, 1, -2**24 (ascending: (2**24 + 1) - 2**24 = 0, the 1 lost to rounding;
    descending: (-2**24 + 1) + 2**24 = 1), token 1's the same reversed (ascending 1, descending 0); slot 3 masked."""
    k = buf.num_topk
    vals = torch.tensor([[2.0**24, 1.0, -(2.0**24)], [-(2.0**24), 1.0, 2.0**24]])
    buf.slot_row[: 2 * k] = -1
    row = 0
    for t in range(2):
        for s in range(3):
            buf.slot_row[t * k + s] = row
            buf.slot_out[row] = torch.full((buf.hidden,), float(vals[t, s])).to(torch.bfloat16).view(torch.int16)
            row += 1


def _combine_twin():
    from megamoe.decode import DecodeBuffers, LaunchConfig
    from megamoe.decode.gemv import combine_torch
    from megamoe.geometry import get_geometry

    g = get_geometry("small")
    buf = DecodeBuffers.allocate(g, 2, "cpu")
    order_slots(buf)
    combine_torch(buf, 2, g.num_topk, LaunchConfig())
    return buf.y[:2, :4].float().tolist()


def _reference_combine():
    from megamoe.recipe import get_recipe
    from megamoe.reference.pipeline import combine

    slots = torch.tensor([[2.0**24, 1.0, -(2.0**24), 7.0], [-(2.0**24), 1.0, 2.0**24, 7.0]])[:, :, None].expand(2, 4, 3)
    filled = torch.tensor([[True, True, True, False]] * 2)
    return combine(slots.to(torch.bfloat16), filled, get_recipe("flashinfer-mxfp4")).float().tolist()


def _group_order():
    """The decode-tc recipe's L1 GEMM (group_scaled_gemm, exact-block tensor-core sums) on one row whose three
    32-K group sums are 2**24, 1, -2**24 in ascending K: ascending gives 0, any other order of the three 1."""
    from megamoe.reference.gemm import group_scaled_gemm

    a = torch.zeros(1, 128)
    b = torch.zeros(1, 128)
    a[0, 0], a[0, 32], a[0, 64] = 256.0, 1.0, -256.0  # e4m3 values
    b[0, 0], b[0, 32], b[0, 64] = 1.0, 1.0, 1.0  # e4m3 weights e2m1 * 2**-6 (here 64 * 2**-6)
    sf = torch.tensor([[2.0**16, 1.0, 2.0**16, 1.0]])  # 2**(s - 121): 256 * 2**16 = 2**24
    return group_scaled_gemm(a, torch.ones(1, 1), b, sf, 128, "exact-block").tolist()


ORDER = [
    Case("order", "reference combine, ascending slots", lambda wf: _reference_combine(),
         Correct(lambda r: r == [[0.0] * 3, [1.0] * 3] or pytest.fail(str(r)))),
    Case("order", "decode combine twin, ascending slots", lambda wf: _combine_twin(),
         Correct(lambda r: r == [[0.0] * 4, [1.0] * 4] or pytest.fail(str(r)))),
    Case("order", "decode combine, interpreter", lambda wf: outcome("combine_order"),
         Correct(lambda r: r == [[0.0] * 4, [1.0] * 4] or pytest.fail(str(r)))),
    Case("order", "decode-tc K groups, ascending", lambda wf: _group_order(),
         Correct(lambda r: r == [[0.0]] or pytest.fail(str(r)))),
]

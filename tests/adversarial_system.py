"""Adversarial cases: the fused backends' CPU-checkable checks, checkpoints, two gloo ranks, the command
line (``BACKEND``, ``CHECKPOINTS``, ``DISTRIBUTED``, ``CLI``)."""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path

import pytest
import torch

from adversarial_support import (
    NAN_BYTE, NONFINITE, DIST_RECIPE, TINY, W_TINY, Case, CLIExit, Correct, Refused, _bf16_max_rows, cli,
    dist_global_step, dist_worker, inputs, with_,
)
from megamoe.distributed.agreement import RankInputError, SetupMismatchError
from megamoe.recipe import RECIPES
from megamoe.testing import fp8_block_weights
from megamoe.validate import NonFiniteOutputError


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
    # BLOCK_M is an argument of each call; one the backend cannot honour is refused before anything runs (the
    # backends here are neither prepared nor allocated: any other outcome would be another error)
    Case("backend", "block_m 48, FlashInfer plan", lambda wf: _backend(capacity=8).plan(1, 48),
         Refused(ValueError, r"flashinfer-mxfp4: block_m must be one of \(8, 24, 64\) \(or None\), got 48")),
    Case("backend", "block_m 16, decode-tc launch (fixed tile)", lambda wf: _backend("megamoe-decode-tc", capacity=8)
         .launch(1, 16), Refused(ValueError, r"megamoe-decode-tc: block_m must be None, its tile is fixed \(16 tokens "
                                             r"per MMA pass, the N of its tensor-core tile\): legal values \(\), got 16")),
    Case("backend", "block_m 64, DeepGEMM FP8 build", lambda wf: _backend("deepgemm-sm90-fp8", capacity=8)
         .build([64], block_m=64), Refused(ValueError, r"deepgemm-sm90-fp8: block_m must be None, its tile is fixed "
                                                       r"\(sgl-deep-gemm 0.1.5.post1 picks BLOCK_M in C\+\+.*got 64")),
    Case("backend", "block_m 8, DeepGEMM FP4 run", lambda wf: _backend("deepgemm-sm90-fp4", capacity=8)
         .run(inputs(2), block_m=8), Refused(ValueError, r"deepgemm-sm90-fp4: block_m must be None, its tile is fixed "
                                                         r"\(DeepGEMM picks .*\): legal values \(\), got 8")),
    Case("backend", "block_m 8.0, megamoe-decode run", lambda wf: _backend("megamoe-decode", capacity=8)
         .run(inputs(2), block_m=8.0), Refused(TypeError, r"megamoe-decode: block_m must be an int, got float 8.0")),
    Case("backend", "block_m 3, megamoe-decode build_jobs", lambda wf: _backend("megamoe-decode", capacity=8)
         .build_jobs([1, 2], 3), Refused(ValueError, r"megamoe-decode: block_m must be one of \(1, 2, 4\) \(or None\), "
                                                      r"got 3")),
    Case("backend", "force_block_m re-pinned after construction", lambda wf: setattr(
         _backend(capacity=8), "force_block_m", 24), Refused(AttributeError, r"force_block_m is fixed at construction.*"
                                                                               r"pass block_m= to plan, build, launch")),
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
         fp8_block_weights(W_TINY), l1_scale=-torch.ones(8, 2, 2)),
         Refused(ValueError, r"FP8BlockWeights: FP8 block weights l1_scale must be > 0, got -1.0"), "also-fp8-scale"),
    Case("backend", "kernel output overflows, run", lambda wf: _ToyKernel.make().run(_bf16_max_rows()),
         Refused(NonFiniteOutputError, rf"toy-cpu: y {NONFINITE}; the kernel's FP32 accumulators overflowed"), "also-bf16-max"),
    Case("backend", "kernel output, run", lambda wf: _ToyKernel.make().run(inputs(5, seed=7)),
         Correct(lambda y: torch.equal(y, _toy_expected(inputs(5, seed=7))) or pytest.fail("toy y differs"))),
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


def _stale_copy(d):
    """An old shard left in the folder: expert 5's w3 scale again, with other bytes, in zz-old.safetensors (it sorts
    last, so a loader that lets the last file win would read it)."""
    from safetensors.torch import load_file, save_file

    name = f"layers.{LAYER}.ffn.experts.5.w3.scale"
    t = load_file(str(d / "model-00002-of-00002.safetensors"))[name].view(torch.uint8).clone()
    save_file({name: (t ^ 1).view(torch.float8_e8m0fnu)}, str(d / "zz-old.safetensors"))


def _with_index_warned():
    """With the index, the stale shard is not read (the weights are the ones written) and is reported."""
    import warnings

    from megamoe.layouts.checkpoint import UnlistedShardWarning

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        w = _ckpt(_stale_copy)
    said = [str(x.message) for x in seen if issubclass(x.category, UnlistedShardWarning)]
    return w, said


def _index_followed(r):
    w, said = r
    _bitwise(W_TINY)(w)
    assert len(said) == 1 and "shard(s) ['zz-old.safetensors']" in said[0] and "not read" in said[0], said


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
    Case("checkpoint", "a tensor in two shards, no index", lambda wf: _ckpt(_stale_copy, index=False),
         Refused(ValueError, rf"tensor 'layers.{LAYER}.ffn.experts.5.w3.scale' is in two shards, \S*model-00002-of-00002"
                             rf".safetensors and \S*zz-old.safetensors, and there is no model.safetensors.index.json"),
         "also-ckpt"),
    Case("checkpoint", "a stale shard the index does not name", lambda wf: _with_index_warned(),
         Correct(_index_followed), "also-ckpt"),
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
CLI = [
    Case("cli", "negative token count", lambda wf: cli("check", "--preset", "tiny", "--tokens", "-5"),
         Refused(CLIExit, r"rc=2: .*argument --tokens: -5 tokens per rank is out of range \(expected 1 to 65536\)")),
    Case("cli", "token count 6.9", lambda wf: cli("check", "--preset", "tiny", "--tokens", "6.9"),
         Refused(CLIExit, r"rc=2: .*argument --tokens: '6.9' is not a whole number of tokens \(expected 1 to 65536\)"), "also-int"),
    Case("cli", "ranks that do not divide E", lambda wf: cli("check", "--preset", "tiny", "--ranks", "3"),
         Refused(CLIExit, r"rc=2: .*argument --ranks: 3 is not valid; expected a divisor of the 8 experts of 'tiny': \[1, 2, 4, 8\]")),
    Case("cli", "BLOCK_M 0", lambda wf: cli("check", "--preset", "tiny", "--block-m", "0"),
         Refused(CLIExit, r"rc=2: .*argument --block-m: 0 is not positive")),
    Case("cli", "an unknown recipe", lambda wf: cli("check", "--recipes", "nope"),
         Refused(CLIExit, r"rc=2: .*argument --recipes: 'nope' is not valid; expected names from flashinfer-mxfp4, deepgemm-sm90-fp4")),
    Case("cli", "gloo ranks that do not divide E", lambda wf: cli("check", "--preset", "tiny", "--dist", "--ranks", "3"),
         Refused(CLIExit, r"rc=2: .*argument --ranks: 3 is not valid; expected a divisor of the 8 experts of 'tiny'")),
    Case("cli", "bench on 0 ranks", lambda wf: cli("bench", "--ranks", "0"),
         Refused(CLIExit, r"rc=2: .*megamoe bench: error: argument --ranks: 0 is not positive")),
    Case("cli", "zero tokens", lambda wf: cli("check", "--preset", "tiny", "--tokens", "0", "--recipes", "flashinfer-mxfp4"),
         Refused(CLIExit, r"rc=2: .*argument --tokens: 0 tokens per rank is out of range \(expected 1 to 65536\)")),
]

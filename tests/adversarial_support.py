"""The pieces of ``test_adversarial.py``: the case table's types, decoders written from the format
definitions (independent of ``megamoe.formats``), and small helpers.

Each ``Case`` has a category, the audit finding it covers (``finding``: "1".."5", or "also-..."),
and one of three expected outcomes, each checked against something the library did not compute:

    Refused(error, pattern)   the call raises ``error`` whose message matches ``pattern`` (the argument,
                              what was expected, what was given)
    Exact(check)              an exact repair: ``check(result)`` compares against an independent decode
    Correct(check)            a right answer: ``check(result)`` compares against an independent computation

The distributed cases run in one spawned pair of gloo ranks (``dist_worker``), the rest in the test
process.
"""

from __future__ import annotations

import dataclasses
import math
import struct
from dataclasses import dataclass
from typing import Callable

import torch

from megamoe.geometry import get_geometry
from megamoe.layouts.random import random_mxfp4_bytes
from megamoe.inputs import MoEInputs, make_inputs

NAN_BYTE = r"E8M0 byte\(s\) 0xFF, which is NaN, not a scale"  # what a refused 0xFF says
NONFINITE = r"holds \d+ NaN / Inf value\(s\) in \d+ row\(s\) .* although every input was finite"
TINY = get_geometry("tiny")  # E=8, K=2, H=256, I=128
BF16_MAX = torch.finfo(torch.bfloat16).max
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


# ------------------------------------------------------------------------------------ the table
@dataclass(frozen=True)
class Refused:
    error: type
    pattern: str
    check: Callable | None = None  # check(message): what the message says, against an independent count


@dataclass(frozen=True)
class Exact:
    check: Callable


@dataclass(frozen=True)
class Correct:
    check: Callable


@dataclass(frozen=True)
class Case:
    category: str
    name: str
    run: Callable  # run(weights_for) -> result
    expect: Refused | Exact | Correct
    finding: str = ""

    @property
    def id(self) -> str:
        return f"{self.category}/{self.name}"


# ------------------------------------------------------------------------------------ independent decoders
def values_of(packed: torch.Tensor, scale: torch.Tensor, gs: torch.Tensor | None = None) -> torch.Tensor:
    """MXFP4 [..., K/2] + E8M0 [..., K/32] (+ global scale [E]) -> float64 [..., K], from the format's
    definition: low nibble first, bit 3 the sign, E8M0 byte b = 2**(b - 127), 0xFF NaN."""
    p = packed.to(torch.int64)
    codes = torch.stack((p & 15, p >> 4), dim=-1).reshape(*p.shape[:-1], -1)
    mag = torch.tensor(E2M1, dtype=torch.float64)[codes & 7]
    val = torch.where(codes >= 8, -mag, mag)
    pow2 = torch.tensor([2.0 ** (b - 127) for b in range(255)] + [float("nan")], dtype=torch.float64)
    val = val * pow2[scale.to(torch.int64)].repeat_interleave(32, dim=-1)
    if gs is not None:
        val = val * gs.double().view(-1, *([1] * (val.ndim - 1)))
    return val


def all_values(w) -> list[torch.Tensor]:
    return [values_of(w.l1, w.l1_scale, w.l1_global_scale), values_of(w.l2, w.l2_scale, w.l2_global_scale)]


def _e4m3_positive() -> list[tuple[float, int]]:
    """(value, byte) of every finite non-negative e4m3fn byte, from its bit fields (bias 7, subnormals)."""
    out = []
    for byte in range(0x7F):
        e, m = byte >> 3, byte & 7
        out.append(((m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7), byte))
    return out


E4M3 = _e4m3_positive()


def e4m3_rn(v: float, flush: bool = False) -> float:
    """Round to nearest e4m3 (ties to an even mantissa), saturating at 448; ``flush``: |v| < 2**-6 -> 0."""
    a = abs(v)
    if flush and a < 2.0**-6:
        return 0.0
    if a >= 448:
        return math.copysign(448.0, v)
    best = min(E4M3, key=lambda vb: (abs(vb[0] - a), vb[1] & 1))
    return math.copysign(best[0], v)


def exact_f32(v: float) -> float:
    try:
        return struct.unpack("f", struct.pack("f", v))[0]
    except OverflowError:
        return math.copysign(math.inf, v)


def tc_group_exact(v: float) -> float:
    """megamoe-decode-tc: exact iff the scaled sums of its bytes stay normal and finite. A group's tensor-core
    sum of e4m3 x and e2m1 * 2**-6 weights is a multiple of 2**-25 and at most 32 * 448 * 6 / 64; four of them
    times 2**(b - 121) must stay within [2**-126, FP32 max]. Stated per value: v = e2m1 * 2**(b - 127)."""
    if v == 0:
        return 0.0
    lowest_byte = next(b for b in range(256) if 2.0**-25 * 2.0 ** (b - 121) >= 2.0**-126)
    highest_byte = max(b for b in range(256) if 4 * 32 * 448 * 6 / 64 * 2.0 ** (b - 121) < 2.0**128)
    ok = 0.5 * 2.0 ** (lowest_byte - 127) <= abs(v) <= 6 * 2.0 ** (highest_byte - 127)
    return exact_f32(v) if ok else math.nan


INDEPENDENT = {"exact": exact_f32, "e4m3_flush_saturate": lambda v: e4m3_rn(v, flush=True), "e4m3_rn": e4m3_rn,
               "e4m3_group": tc_group_exact}


def independent_table(decode: str) -> list[list[float]]:
    """[256][16]: what the decode rule makes of e2m1(code) * 2**(byte - 127); byte 0xFF is NaN."""
    rows = []
    for b in range(256):
        row = []
        for c in range(16):
            if b == 255:
                row.append(math.nan)
                continue
            v = math.copysign(E2M1[c & 7], -1.0 if c & 8 else 1.0) * 2.0 ** (b - 127)
            row.append(INDEPENDENT[decode](v))
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------------ helpers
def legal_bytes(seed=0, lo=124, hi=130, num_experts=2):
    return random_mxfp4_bytes(TINY, seed=seed, num_experts=num_experts, scale_bytes=(lo, hi))


def poke(w, name, index, value):
    """A copy of w whose tensor ``name`` has ``value`` at ``index`` (the copy is re-validated)."""
    t = getattr(w, name).clone()
    t[index] = value
    return dataclasses.replace(w, **{name: t})


def zero_group(w, e, row, g):
    """Expert e, L1 row ``row``: group g's codes all zero (so only its scale byte could matter)."""
    l1 = w.l1.clone()
    l1[e, row, 16 * g: 16 * (g + 1)] = 0
    return dataclasses.replace(w, l1=l1)


def inputs(t=6, seed=0, g=TINY, **kw) -> MoEInputs:
    return make_inputs(g, t, seed=seed, **kw)


def with_(inp: MoEInputs, name: str, index, value) -> MoEInputs:
    t = getattr(inp, name).clone()
    t[index] = value
    return dataclasses.replace(inp, **{name: t})


def fwd(w, recipe="exact", inp=None, g=TINY, **kw):
    from megamoe.reference import moe_forward

    return moe_forward(inp if inp is not None else inputs(), w, recipe, g, **kw)


def ranges(fn, w, recipe):
    from megamoe.layouts import ranges as r

    return getattr(r, fn)(w, recipe)


def same_values(before):
    """Exact repair check: the repaired weights decode (independently) to the same float64 values."""
    def check(after):
        for a, b in zip(all_values(before), all_values(after)):
            assert torch.equal(a, b), "the repair changed a value"
    return check


def dense_exact(inp: MoEInputs, w, g=TINY) -> torch.Tensor:
    """The layer in float64 from the independent decode: per token, sum over its slots of
    w_k * (silu(min(gate, c)) * clamp(up, -c, c)) @ W2^T."""
    w1s, w2s = values_of(w.l1, w.l1_scale), values_of(w.l2, w.l2_scale)
    x = inp.x.double()
    y = torch.zeros(x.shape[0], g.hidden, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(g.num_topk):
            e = int(inp.topk_idx[t, k])
            if e < 0:
                continue
            h = w1s[e] @ x[t]
            gate, up = h[: g.intermediate].clamp(max=g.clamp), h[g.intermediate:].clamp(-g.clamp, g.clamp)
            y[t] += float(inp.topk_weights[t, k]) * (w2s[e] @ (gate * torch.sigmoid(gate) * up))
    return y


def close_to(want, tol=1e-12):
    """|got - want| <= tol * max |want| everywhere (float64 sums in another order), and finite."""
    def check(got):
        assert torch.isfinite(got).all()
        err = (got.double() - want.double()).abs().max()
        assert err <= tol * want.abs().max(), (float(err), float(want.abs().max()))
    return check


def mutated(w, name, index, value):
    """A fresh, valid copy of w, then ``value`` written at ``index`` of ``name`` in place (as a user's
    ``w.l1_scale[5] = 255`` does after construction, where no constructor looks)."""
    w = dataclasses.replace(w, **{name: getattr(w, name).clone()})
    getattr(w, name)[index] = value
    return w


class CLIExit(Exception):
    """A CLI run that exited non-zero: 'rc=N: <what it printed>'."""


def cli(*argv: str) -> tuple[int, str]:
    """megamoe.cli.main(argv) in this process -> (0, output), or raise CLIExit('rc=N: output')."""
    import contextlib
    import io

    from megamoe.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        try:
            rc = main(list(argv))
        except SystemExit as exc:  # argparse
            rc = exc.code
    out = " ".join(buf.getvalue().split())
    if rc:
        raise CLIExit(f"rc={rc}: {out}")
    return rc, out


def staged_untouched(run):
    """Call run(bufs) with poisoned staging buffers; whatever it raises, the buffers must be untouched."""
    from megamoe.staging.checks import POISON, allocate_buffers

    bufs = allocate_buffers(8, TINY)
    try:
        return run(bufs)
    finally:
        for t in bufs.views():
            assert bool((t.contiguous().view(torch.uint8) == POISON).all()), "a refused call wrote the buffer"


def decoded_differently(packed: torch.Tensor, scale: torch.Tensor, decode: str) -> tuple[int, int]:
    """(weights whose decode differs from the exact value, nonzero weights decoded to 0), counted with the
    independent decoders (one call per distinct value)."""
    vals = values_of(packed, scale).flatten()
    uniq, inverse = torch.unique(vals, return_inverse=True)
    dec = torch.tensor([INDEPENDENT[decode](float(v)) for v in uniq], dtype=torch.float64)[inverse]
    return int((dec != vals).sum()), int(((dec == 0) & (vals != 0)).sum())


W_TINY = legal_bytes(lo=122, hi=126, num_experts=8)  # legal FlashInfer bytes, all 8 experts of ``tiny``


def _bf16_max_rows():
    """Rows 1..3 at +-the bf16 maximum: finite inputs whose FP32 accumulators overflow in a kernel recipe."""
    inp = inputs(4, seed=1)
    x = inp.x.clone()
    x[1], x[2] = BF16_MAX, -BF16_MAX
    x[3, ::2], x[3, 1::2] = BF16_MAX, -BF16_MAX
    return dataclasses.replace(inp, x=x)


# ------------------------------------------------------------------------------------ two gloo ranks
DIST_RECIPE = "flashinfer-mxfp4"


def dist_global_step():
    """The step of both ranks (5 and 3 tokens) and the weights every rank holds."""
    from megamoe.distributed.check import fast_random_weights

    return [inputs(5, seed=10), inputs(3, seed=11)], fast_random_weights(TINY, seed=1)


def dist_worker(rank: int, world: int) -> dict:
    """Every distributed case in turn on this rank, in one process group: {case: ("ok", value) or
    ("error", exception type name, message)}. After a refusal both ranks have run the same collectives,
    so the group is ready for the next case."""
    from megamoe.distributed import FusedEPLauncher, ReferenceEPBackend, agree_on_step, moe_forward_dist
    from megamoe.recipe import get_recipe

    g = TINY
    step, w = dist_global_step()
    mine = step[rank]
    other = rank == 1  # the rank that differs
    out = {}

    def attempt(name, fn):
        try:
            out[name] = ("ok", fn())
        except Exception as exc:  # noqa: BLE001 - every outcome is recorded and judged by the test
            out[name] = ("error", type(exc).__name__, str(exc))

    def forward(inp=mine, weights=w, recipe=DIST_RECIPE, geometry=g, **kw):
        return moe_forward_dist(inp, weights, recipe, geometry, **kw)

    g1 = g.with_(num_topk=1)
    flipped = mutated(w, "l2", (3, 5, 7), int(w.l2[3, 5, 7]) ^ 1)
    bad = with_(mine, "topk_idx", (0, 0), 999)
    local = w.experts(4 * rank, 4 * rank + 4)
    attempt("agree", lambda: forward())
    attempt("clamp", lambda: forward(geometry=g.with_(clamp=20.0) if other else g))
    attempt("recipe", lambda: forward(recipe="deepgemm-sm90-fp4" if other else DIST_RECIPE))
    attempt("recipe width", lambda: forward(recipe=get_recipe(DIST_RECIPE).with_(x_gran=64) if other else DIST_RECIPE))
    attempt("weights", lambda: forward(weights=flipped if other else w))
    attempt("scheme", lambda: forward(scheme="all_to_all" if other else "allgather_reducescatter"))
    attempt("top-k", lambda: forward(inp=inputs(3, seed=11, g=g1) if other else mine, geometry=g1 if other else g))
    attempt("bad inputs", lambda: forward(inp=bad if other else mine))
    attempt("weights held", lambda: forward(weights=local if other else w))
    attempt("local weights", lambda: forward(weights=local))
    attempt("capacity", lambda: type(FusedEPLauncher(ReferenceEPBackend(g, DIST_RECIPE), w, g, require_hopper=False,
                                                      max_tokens_per_rank=16 if other else 8)).__name__)
    launcher = FusedEPLauncher(ReferenceEPBackend(g, DIST_RECIPE), w, g, require_hopper=False)
    nan_x = with_(mine, "x", (1, 2), float("nan"))
    attempt("launcher step", lambda: launcher.step(nan_x if other else mine)[0])
    attempt("launcher agrees", lambda: launcher.step(mine)[0])
    attempt("step count", lambda: agree_on_step(None, 6.9 if other else 3).agreed)
    return out

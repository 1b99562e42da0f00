"""The adversarial cases that run Triton kernels on the CPU: one subprocess under TRITON_INTERPRET=1 (it must be set
before triton is imported) runs every case below and prints {case: outcome} as JSON; ``outcome(name)`` in the test
process runs it once and replays each case's result or error (``adversarial_decode.py`` holds the table).

Each case returns a JSON value the table checks, or raises; errors are recorded as (type name, message).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


# ------------------------------------------------------------------------------------ the cases (subprocess side)
def _tiny():
    from adversarial_support import TINY, W_TINY

    return TINY, W_TINY


def _staged(tokens: int, capacity: int = 4, seed: int = 60):
    """Decode buffers of ``tiny`` with ``tokens`` tokens staged (checked staging), and that step."""
    from megamoe.decode import DecodeBuffers
    from megamoe.inputs import make_inputs
    from megamoe.staging import stage_into

    g, _ = _tiny()
    buf = DecodeBuffers.allocate(g, capacity, "cpu")
    inp = make_inputs(g, tokens, seed=seed)
    stage_into(inp.x, inp.topk_idx, inp.topk_weights, buf.x_q, buf.x_sf, buf.topk_idx, buf.topk_weights,
               num_experts=g.num_experts, backend="torch")
    return buf, inp


def decode_past_staged():
    """Four tokens staged, then two: a launch of four would return two rows of the earlier step."""
    from megamoe.decode import moe_decode, prepare_decode_weights
    from megamoe.inputs import make_inputs
    from megamoe.staging import stage_into

    g, w = _tiny()
    buf, _ = _staged(4)
    inp = make_inputs(g, 2, seed=61)
    stage_into(inp.x, inp.topk_idx, inp.topk_weights, buf.x_q, buf.x_sf, buf.topk_idx, buf.topk_weights,
               num_experts=g.num_experts, backend="triton")
    buf.poison_()
    try:
        return moe_decode(prepare_decode_weights(w), buf, 4, g.clamp).tolist()
    finally:
        assert torch.isnan(buf.y.float()).all(), "a kernel ran before the refusal"


def decode_staged_rows():
    """Three staged tokens through the Triton launches: the reference's bits (recipe megamoe-decode)."""
    from megamoe.decode import moe_decode, prepare_decode_weights
    from megamoe.recipe import MEGAMOE_DECODE
    from megamoe.reference import moe_forward

    g, w = _tiny()
    buf, inp = _staged(3)
    y = moe_decode(prepare_decode_weights(w), buf, 3, g.clamp)
    want = moe_forward(inp, w, MEGAMOE_DECODE, g)
    return {"bitwise": bool(torch.equal(y.view(torch.int16), want.view(torch.int16))), "nonzero": bool(y.abs().sum() > 0)}


def decode_nan_clamp():
    from megamoe.decode import moe_decode, prepare_decode_weights

    g, w = _tiny()
    buf, _ = _staged(2)
    return moe_decode(prepare_decode_weights(w), buf, 2, float("nan")).tolist()


def decode_other_geometry():
    from megamoe.decode import moe_decode, prepare_decode_weights
    from megamoe.geometry import get_geometry
    from megamoe.weights import random_mxfp4_weights

    g, _ = _tiny()
    buf, _ = _staged(2)
    other = random_mxfp4_weights(get_geometry("small"), seed=3)
    return moe_decode(prepare_decode_weights(other), buf, 2, g.clamp).tolist()


def _stage_triton(x, out_x=None, capacity: int = 1, agreed=None):
    from megamoe.staging import stage_into
    from megamoe.staging.checks import allocate_buffers

    g, _ = _tiny()
    t = x.shape[0]
    bufs = allocate_buffers(capacity, g)
    idx = torch.tensor([1, 5] * t, dtype=torch.int64).view(t, 2)
    w = torch.tensor([0.75, 0.25] * t, dtype=torch.float32).view(t, 2)
    views = list(bufs.views())
    if out_x is not None:
        views[0] = out_x
    stage_into(x, idx, w, *views, agreed, num_experts=g.num_experts, backend="triton")
    return views, idx, w


def strided_one_token_x():
    """x [1, H] with stride 2 along H (every other channel of a wider row)."""
    g, _ = _tiny()
    x = torch.randn(1, 2 * g.hidden).to(torch.bfloat16)[:, ::2]
    _stage_triton(x)


def strided_capacity_one_out_x():
    g, _ = _tiny()
    out = torch.empty(1, 2 * g.hidden, dtype=torch.float8_e4m3fn)[:, ::2]
    _stage_triton(torch.randn(1, g.hidden).to(torch.bfloat16), out_x=out)


def one_token_any_row_stride():
    """x [1, H] cut from a wider row (row stride 2H, unit stride along H): staged bit for bit as the reference."""
    from megamoe.staging import stage_reference

    g, _ = _tiny()
    x = (torch.randn(1, 2 * g.hidden) * 3).to(torch.bfloat16)[:, g.hidden:]
    views, idx, w = _stage_triton(x, capacity=2, agreed=2)
    want = stage_reference(x.contiguous(), idx, w, 2)
    return [bool(torch.equal(got[:2].contiguous().view(torch.uint8), ref.to(got.dtype).contiguous().view(torch.uint8)))
            for got, ref in zip(views, want)]


def zero_tokens_strided_x():
    """No token (a strided empty x): nothing to read, two padding rows written as the reference's."""
    from megamoe.staging import stage_reference

    g, _ = _tiny()
    x = torch.randn(3, 2 * g.hidden).to(torch.bfloat16)[:0, ::2]
    views, idx, w = _stage_triton(x, capacity=2, agreed=2)
    want = stage_reference(torch.zeros(0, g.hidden, dtype=torch.bfloat16), idx, w, 2)
    return [bool(torch.equal(got[:2].contiguous().view(torch.uint8), ref.to(got.dtype).contiguous().view(torch.uint8)))
            for got, ref in zip(views, want)]


def combine_order():
    """The Triton combine on slot outputs whose FP32 sum depends on the order: (2**24 + 1) - 2**24 is 0 in
    ascending slot order, 1 in descending."""
    from adversarial_decode import order_slots
    from megamoe.decode import DecodeBuffers, LaunchConfig
    from megamoe.decode.gemv import combine
    from megamoe.geometry import get_geometry

    g = get_geometry("small")  # top-4: three slots to sum
    buf = DecodeBuffers.allocate(g, 2, "cpu")
    order_slots(buf)
    combine(buf, 2, g.num_topk, LaunchConfig())
    return buf.y[:2, :4].float().tolist()


CASES = {f.__name__: f for f in (decode_past_staged, decode_staged_rows, decode_nan_clamp, decode_other_geometry,
                                 strided_one_token_x, strided_capacity_one_out_x, one_token_any_row_stride,
                                 zero_tokens_strided_x, combine_order)}


def main() -> None:
    out = {}
    for name, fn in CASES.items():
        try:
            out[name] = ["ok", fn()]
        except Exception as exc:  # noqa: BLE001 - every outcome is recorded and judged by the table
            out[name] = ["error", type(exc).__name__, str(exc)]
    print(json.dumps(out))


# ------------------------------------------------------------------------------------ the test process's side
_RESULTS: dict = {}


def outcome(name: str):
    """The case's result under the interpreter (one subprocess for all), or its error raised again here."""
    if not _RESULTS:
        root = HERE.parent
        env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(root), str(HERE)]))
        proc = subprocess.run([sys.executable, "-c", "import adversarial_interpreter as a; a.main()"], cwd=HERE,
                              env=env, capture_output=True, text=True, timeout=600)
        lines = proc.stdout.strip().splitlines()
        if proc.returncode or not lines:
            raise RuntimeError(f"the interpreter run failed (rc={proc.returncode}):\n{proc.stderr[-3000:]}")
        _RESULTS.update(json.loads(lines[-1]))
    r = _RESULTS[name]
    if r[0] == "ok":
        return r[1]
    errors = {"ValueError": ValueError, "TypeError": TypeError, "AssertionError": AssertionError}
    raise errors.get(r[1], RuntimeError)(r[2])

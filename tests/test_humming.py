"""The Humming backends' CPU side: the checkpoint <-> schema relabelling, the W4A8 scale rebase against an
independent emulation of Humming's CUDA source, the window's refusal and its lossy opt-in, the staging rule,
the recipe, the glue kernels (Triton interpreter) against their torch twins, and the refusal without the package.

The rebase emulation below follows ``process_mxfp4.cuh`` (humming-kernels 0.1.20) instruction by instruction on
float32 bit patterns (numpy keeps subnormals, as the kernel, built without fast math, does); the module under
test instead rounds on the e2m1 grid. Byte-for-byte agreement with the kernel itself is the GPU probe's
(``lab/humming/probe.py``).
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch

from megamoe.formats import dequantize_mxfp4
from megamoe.geometry import get_geometry
from megamoe.layouts.humming import (W4A8_SCALE_SPAN, check_humming_window, from_humming_mxfp4, humming_kernel_weights,
                                     humming_window, rebase_fused_e8m0, to_humming_mxfp4)
from megamoe.recipe import HUMMING_W4A8, HUMMING_W4A16
from megamoe.weights import MXFP4Weights, random_mxfp4_weights


# ------------------------------------------------------------------------------ an independent emulation
def _f32(bits: int) -> np.float32:
    return np.array([bits], dtype=np.uint32).view(np.float32)[0]


def _bits(x: np.float32) -> int:
    return int(np.array([x], dtype=np.float32).view(np.uint32)[0])


def _cuda_code(code: int, delta: int) -> int:
    """process_mxfp4_w4a8's per-nibble arithmetic, transcribed."""
    code = 0 if code == 8 else code
    if not delta:
        return code
    val = _f32(((code & 0x8) << 28) | ((code & 0x7) << 22))  # dequant_fp4_val
    factor = _f32((0x3F800000 - (delta << 23)) & 0xFFFFFFFF)
    val = np.float32(val * factor)
    mask = 0x81C00000
    rz = _f32(_bits(val) & mask)
    ru = _f32(((_bits(val) + 0x00200000) & 0xFFFFFFFF) & mask)
    rn = ru if abs(val - rz) >= abs(val - ru) else rz
    b = _bits(rn)
    return ((b & 0x80000000) >> 28) | ((b & 0x01C00000) >> 22)


def _emulated_rebase(codes: torch.Tensor, scale: torch.Tensor, span: int):
    """humming.transform.process_fused_e8m0_scale (TENSOR weight_scale_2, FP8 activations), transcribed."""
    e = codes.shape[0]
    s = scale.view(e, -1).to(torch.int16)
    mx, mn = s.amax(-1, keepdim=True), s.amin(-1, keepdim=True)
    rng = torch.minimum(mx - mn, torch.full_like(mx, span))
    new_min = mx - rng
    delta = (torch.maximum(s, new_min) - s).view(scale.shape)
    new_scale = (torch.maximum(s, new_min) - new_min + 1).view(scale.shape)
    ws2 = (2.0 ** (new_min.double() - 127) / 2).float().view(-1)
    out = codes.clone()
    flat_c, flat_d = out.view(-1, 16), delta.reshape(-1)
    for gi in range(flat_c.shape[0]):
        d = int(flat_d[gi])
        for j in range(16):
            byte = int(flat_c[gi, j])
            flat_c[gi, j] = _cuda_code(byte & 0xF, d) | (_cuda_code(byte >> 4, d) << 4)
    return out, new_scale.to(torch.uint8), ws2


def _wide_weights(seed: int, experts: int = 3, n: int = 8, k: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """codes [E, N, K/2] with every nibble value, bytes spread over 20 binades so that many groups fall below."""
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (experts, n, k // 2), generator=gen, dtype=torch.uint8)
    scale = (torch.randint(100, 121, (experts, n, k // 32), generator=gen)).to(torch.uint8)
    return codes, scale


def test_code_rewrite_matches_the_cuda_arithmetic_for_every_pair():
    from megamoe.layouts.humming import _SHRUNK

    for d in range(32):
        for c in range(16):
            assert int(_SHRUNK[d, c]) == _cuda_code(c, d), f"delta {d} code {c}"


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rebase_matches_the_emulated_transform(seed):
    codes, scale = _wide_weights(seed)
    got = rebase_fused_e8m0(codes, scale)
    want_codes, want_scale, want_ws2 = _emulated_rebase(codes, scale, W4A8_SCALE_SPAN)
    assert torch.equal(got.codes, want_codes)
    assert torch.equal(got.scale, want_scale)
    assert torch.equal(got.weight_scale_2, want_ws2)
    assert int((got.codes != codes).sum()) > 0, "the inputs must exercise the rewrite"


def test_kernel_weights_are_the_rebased_values():
    """e2m1(code') x 2**byte' x weight_scale_2 of the rebase equals the exact value of humming_kernel_weights."""
    l1, l1_scale = _wide_weights(5, experts=2, n=64, k=64)  # [E, 2I, H/2] with I = 32, H = 64
    l2, l2_scale = _wide_weights(6, experts=2, n=64, k=32)  # [E, H, I/2]
    w = MXFP4Weights(l1, l1_scale, l2, l2_scale)
    k = humming_kernel_weights(w)
    r = rebase_fused_e8m0(w.l1, w.l1_scale)
    kernel_vals = dequantize_mxfp4(r.codes, torch.zeros_like(r.scale) + 127).double() \
        * torch.exp2(r.scale.double().repeat_interleave(32, -1)) * r.weight_scale_2.double().view(-1, 1, 1)
    assert torch.equal(dequantize_mxfp4(k.l1, k.l1_scale).double(), kernel_vals)


def test_schema_relabelling_round_trips_and_keeps_the_bytes():
    w = random_mxfp4_weights(get_geometry("tiny"), seed=3)
    sub = to_humming_mxfp4(w)
    assert sub["w13"].weight.data_ptr() == w.l1.data_ptr()  # a relabelling: no copy, gate rows then up rows
    back = from_humming_mxfp4(sub)
    for name in ("l1", "l1_scale", "l2", "l2_scale"):
        assert torch.equal(getattr(back, name), getattr(w, name))
    with pytest.raises(ValueError, match="global scales"):
        to_humming_mxfp4(dataclasses.replace(w, l1_global_scale=torch.ones(w.num_experts)))


def test_window_refuses_names_the_tensor_and_accepts_on_opt_in():
    from megamoe.check.matrix import below_window

    w = random_mxfp4_weights(get_geometry("tiny"), seed=4)
    assert check_humming_window(w) is None  # real-like random weights span ~4 binades per tensor
    assert humming_kernel_weights(w).l1.data_ptr() == w.l1.data_ptr() or torch.equal(humming_kernel_weights(w).l1, w.l1)
    low = below_window(w, seed=1)
    with pytest.raises(ValueError, match=r"expert \d+ l[12]: bytes \d+\.\.\d+ are exact, \d+ groups go down to byte"):
        check_humming_window(low, who="humming-w4a8")
    loss = check_humming_window(low, accept_lossy=True)
    assert loss["weights_changed"] > 0 and loss["weights_to_zero"] > 0
    entries = humming_window(low)
    assert sum(x.weights_changed for x in entries) == loss["weights_changed"]
    # The kernel weights differ from the checkpoint exactly where the report says.
    k = humming_kernel_weights(low)
    changed = int((dequantize_mxfp4(k.l1, k.l1_scale) != dequantize_mxfp4(low.l1, low.l1_scale)).sum()) + \
        int((dequantize_mxfp4(k.l2, k.l2_scale) != dequantize_mxfp4(low.l2, low.l2_scale)).sum())
    assert changed == loss["weights_changed"]


def test_check_ranges_applies_the_relative_window():
    from megamoe.check.matrix import below_window
    from megamoe.layouts.ranges import check_ranges

    w = random_mxfp4_weights(get_geometry("tiny"), seed=6)
    check_ranges(w, HUMMING_W4A8)
    check_ranges(below_window(w), HUMMING_W4A16)  # bf16 activations: no window
    with pytest.raises(ValueError, match="W4A8 window"):
        check_ranges(below_window(w), HUMMING_W4A8)


# ------------------------------------------------------------------------------ staging and recipe
def test_div448_scale_is_the_ieee_quotient_and_differs_from_deepgemms_rule():
    from megamoe.layouts.staging import _INV_448_FP32, fp8_scale_div448

    gen = torch.Generator().manual_seed(0)
    amax = (torch.rand(20000, generator=gen) * torch.exp2(torch.randint(-30, 30, (20000,), generator=gen).float()))
    got = fp8_scale_div448(amax)
    want = torch.from_numpy(np.maximum(amax.numpy() / np.float32(448), np.float32(1e-30)))
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    mul = amax * _INV_448_FP32
    assert int((mul.view(torch.int32) != got.view(torch.int32)).sum()) > 1000  # the two rules really differ


def test_humming_recipes_run_and_their_choices_change_the_result():
    from megamoe.inputs import make_inputs
    from megamoe.reference import moe_forward
    from megamoe.testing import calc_diff

    g = get_geometry("tiny")
    w = random_mxfp4_weights(g, seed=7)
    inp = make_inputs(g, 9, seed=8, mask_prob=0.3)
    y8 = moe_forward(inp, w, HUMMING_W4A8.with_(mma="exact-block"), g)
    y16 = moe_forward(inp, w, HUMMING_W4A16, g)
    exact = moe_forward(inp, w, "exact", g)
    assert calc_diff(y16, exact) < calc_diff(y8, exact) < 1e-2  # bf16 activations are closer to exact than FP8
    for change in ({"routing_weight": "before-requant"}, {"fp8_scale_rule": "mul-inv448"}, {"swiglu_bf16": False}):
        other = moe_forward(inp, w, HUMMING_W4A8.with_(mma="exact-block", **change), g)
        assert not torch.equal(other.view(torch.int16), y8.view(torch.int16)), f"{change} changed nothing"


def test_combine_at_the_weights_is_an_ordered_fma_chain():
    """Reversing the slot order changes the rounded result on inputs chosen for it (a wrong order shows)."""
    from megamoe.reference.pipeline import combine

    gen = torch.Generator().manual_seed(1)
    t, k, h = 64, 6, 256
    slots = (torch.randn(t, k, h, generator=gen) * torch.exp2(torch.randint(-8, 8, (t, k, 1), generator=gen).float()))
    slots = slots.to(torch.bfloat16)
    w = torch.rand(t, k, generator=gen)
    filled = torch.rand(t, k, generator=gen) > 0.2
    y = combine(slots, filled, HUMMING_W4A8, w)
    rev = combine(slots.flip(1), filled.flip(1), HUMMING_W4A8, w.flip(1))
    assert not torch.equal(y.view(torch.int16), rev.view(torch.int16))
    acc = torch.zeros(t, h, dtype=torch.float64)
    for s in range(k):  # the FMA written out: exact product, one rounding of the sum to FP32
        fma = torch.from_numpy((slots[:, s].double() * w[:, s:s + 1].double() + acc).numpy().astype(np.float32))
        acc = torch.where(filled[:, s:s + 1], fma.double(), acc)
    assert torch.equal(y.view(torch.int16), acc.float().to(torch.bfloat16).view(torch.int16))
    assert (y[~filled.any(1)] == 0).all()


# ------------------------------------------------------------------------------ glue kernels
def test_glue_kernels_match_their_twins_under_the_interpreter():
    """align (twice in a row, an expert with no slot, masked slots), SwiGLU past the clamp both ways, and the
    combine with a NaN row in a masked slot, each against its torch twin (``humming_glue_check.py``), in a
    subprocess: TRITON_INTERPRET must be set before the kernels are defined."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton", reason="the glue kernels run under the Triton interpreter")
    script = Path(__file__).with_name("humming_glue_check.py")
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) >= 6 and all(r["ok"] for r in results), results


# ------------------------------------------------------------------------------ the backend without the package
def test_backend_refuses_with_every_reason():
    from megamoe.fused.base import BackendUnavailable
    from megamoe.fused.registry import available_backends, make_backend

    rows = {name: (ok, why) for name, ok, why in available_backends()}
    for name in ("humming-w4a8", "humming-w4a16"):
        ok, why = rows[name]
        if ok:
            pytest.skip("humming-kernels and a Hopper GPU are here")
        if not torch.cuda.is_available():
            assert "no GPU" in why
        try:
            import humming  # noqa: F401
        except ImportError:
            assert "humming-kernels" in why and "megamoe[humming]" in why
        be = make_backend(name, "tiny", capacity=4)
        with pytest.raises(BackendUnavailable, match=name):
            be.prepare(random_mxfp4_weights(get_geometry("tiny"), seed=0))


def _cfg(block_m: int, stream_k: bool = True) -> dict:
    return {"block_shape": [block_m, 128, 128], "use_stream_k": stream_k}


# The shape of Humming 0.1.20's W4A8 lists at the small geometry on an H100 (lab/humming/tuning_lists.py prints
# them): the gate/up list holds block M 40 up to 2304 rows, the down list changes block M several times below it.
_GATE_UP = [[0, 2304, _cfg(40)], [2304, 2784, _cfg(48)], [2784, 1 << 30, _cfg(56)]]
_DOWN = [[0, 984, _cfg(40)], [984, 1008, _cfg(48)], [1008, 1016, _cfg(40)], [1016, 1136, _cfg(48)],
         [1136, 1152, _cfg(56)], [1152, 1168, _cfg(48)], [1168, 1344, _cfg(56)], [1344, 2304, _cfg(64)],
         [2304, 2784, _cfg(48)], [2784, 1 << 30, _cfg(56)]]


@pytest.mark.parametrize("rows, down_lo", [(256, None), (984, None), (1200, 1008), (2048, 1008), (2400, None)])
def test_the_down_gemm_always_reads_the_slots_in_the_aligned_block(rows, down_lo):
    """vLLM aligns the slots to the gate/up config's block M and hands the down GEMM its own list; where that list's
    pick has another block M (1200 rows: 56 against 40), the kernel would read a misaligned index. pick_configs then
    gives the down GEMM its list's config of the aligned block M nearest the row count, and says so."""
    from megamoe.fused.humming import pick_configs

    bm, c13, c2, note = pick_configs(_GATE_UP, _DOWN, rows)
    assert int(c2["block_shape"][0]) == bm == int(c13["block_shape"][0])
    if down_lo is None:
        assert note is None
        assert next(c for lo, hi, c in _DOWN if lo < rows <= hi) is c2  # vLLM's own pick, untouched
    else:
        assert note is not None and f"rows ({down_lo}," in note and "re-picked" in note
        assert next(c for lo, hi, c in _DOWN if lo == down_lo) is c2


def test_forced_block_m_and_configs_missing_from_a_list_are_named():
    from megamoe.fused.humming import pick_configs

    bm, c13, c2, note = pick_configs(_GATE_UP, _DOWN, 6, block_m=56)
    assert (bm, c13, c2, note) == (56, _GATE_UP[2][2], _DOWN[4][2], None)
    with pytest.raises(ValueError, match="block_m=72 is in no gate/up tuning config"):
        pick_configs(_GATE_UP, _DOWN, 6, block_m=72)
    with pytest.raises(ValueError, match="no config of block M 40"):
        pick_configs(_GATE_UP, [[0, 1 << 30, _cfg(48)]], 6)


@pytest.mark.parametrize("value, expected", [(None, False), ("0", False), ("1", True)])
def test_batch_invariance_is_read_as_vllm_reads_it(monkeypatch, value, expected):
    from megamoe.fused.humming import batch_invariant_from_env

    if value is None:
        monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
    else:
        monkeypatch.setenv("VLLM_BATCH_INVARIANT", value)
    assert batch_invariant_from_env() is expected

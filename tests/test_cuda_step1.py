"""The 1-token CUDA step (megamoe/decode/cuda_step1.py, cuda/step1.cu): on a CPU, what it refuses and why, that its
source builds with nvcc into a library whose constants agree with the Python side's, and that its order of tiles
takes every tile once without deadlock (tests/cuda/schedule_check.cu); on an SM90 GPU, the launch against the
Triton launches and the reference, bit for bit (selfcheck_step1)."""

from __future__ import annotations

import ctypes
import re
import subprocess
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="needs triton 3.6 (its CPU interpreter): pip install -e \".[test]\"")

from megamoe.decode import cuda_step1  # noqa: E402
from megamoe.decode.layout_tc import prepare_tc_weights  # noqa: E402
from megamoe.decode.gemv import LaunchConfig  # noqa: E402
from megamoe.decode.moe import DecodeBuffers, one_cuda_launch  # noqa: E402
from megamoe.decode.selfcheck import case_weights, geometry_of  # noqa: E402
from megamoe.decode.selfcheck_step1 import CASES, Y_RIGHT_MODES, passed_step1, run_step1_case  # noqa: E402
from megamoe.decode.tc import tc_launch_config  # noqa: E402


def test_geometry_limits_name_what_is_wrong():
    assert cuda_step1.geometry_limits(4096, 2048, 6) is None  # DeepSeek-V4-Flash
    assert "multiples of 1024" in cuda_step1.geometry_limits(4096 + 512, 2048, 6)
    assert "intermediate <= 2048, got 4096, 3072" in cuda_step1.geometry_limits(4096, 3072, 6)  # 72 terms > 48
    assert "top-k <= 8, got 9" == cuda_step1.geometry_limits(4096, 2048, 9)


def test_unsupported_says_why_before_any_launch():
    g = geometry_of("tiny")
    tw = prepare_tc_weights(case_weights("tiny", "cpu"))
    buf = DecodeBuffers.allocate(g, 2, "cpu")
    assert cuda_step1.unsupported(tw, buf, 2) == "one token per step only, got 2"
    assert cuda_step1.unsupported(tw, buf, 1) == "needs a CUDA device (not the interpreter)"


def test_asking_for_the_step_where_it_cannot_run_warns_and_falls_back():
    g = geometry_of("tiny")
    tw = prepare_tc_weights(case_weights("tiny", "cpu"))
    buf = DecodeBuffers.allocate(g, 2, "cpu")
    wanted = LaunchConfig(tc_cuda_step1=True)
    with pytest.warns(RuntimeWarning, match=r"cannot run here \(needs a CUDA device \(not the interpreter\)\)"):
        assert not one_cuda_launch(tw, buf, 1, wanted)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not asked for, or not one token: nothing to say
        assert not one_cuda_launch(tw, buf, 1, LaunchConfig())
        assert not one_cuda_launch(tw, buf, 2, wanted)


def test_the_backend_runs_the_triton_launches_at_one_token():
    """The CUDA step has the same bits and is a little faster on the H200 (run 36), but it builds with nvcc on first
    use, so the backend's launch leaves it off (``LaunchConfig.tc_cuda_step1`` turns it on)."""
    assert not tc_launch_config(1, 6).tc_cuda_step1


@pytest.mark.skipif(cuda_step1.nvcc() is None, reason="no nvcc on this machine")
def test_source_builds_and_agrees_with_the_python_constants(tmp_path):
    lib_path = cuda_step1.build(tmp_path)
    assert cuda_step1.build(tmp_path) == lib_path  # cached by the sources' hash
    lib = ctypes.CDLL(str(lib_path))
    for name in ("megamoe_step1_parts", "megamoe_step1_max_terms", "megamoe_step1_threads"):
        getattr(lib, name).restype = ctypes.c_int
    assert lib.megamoe_step1_parts() == cuda_step1.PARTS
    assert lib.megamoe_step1_max_terms() == cuda_step1.MAX_TERMS
    assert lib.megamoe_step1_threads() == 128 * cuda_step1.PARTS + 128
    out = (ctypes.c_int * 64)()
    n = lib.megamoe_step1_instances(out, 64)
    assert sorted(out[:n]) == sorted(cuda_step1.INSTANCES)


@pytest.mark.skipif(cuda_step1.nvcc() is None, reason="no nvcc on this machine")
def test_the_tile_order_takes_every_tile_once_and_cannot_deadlock(tmp_path):
    """tests/cuda/schedule_check.cu runs the kernel's own Schedule on the host over 1,575 grids, expert counts, tiles
    per expert and lags (and a hand-made order that must deadlock, so the check can fail)."""
    _host_check(tmp_path, "schedule_check", "1575 cases, 0 failed")


def _host_check(tmp_path, name: str, last_line: str) -> None:
    """Build tests/cuda/<name>.cu for the host with nvcc, run it: exit 0 and `last_line` last."""
    exe = tmp_path / name
    build = subprocess.run([cuda_step1.nvcc(), "-std=c++17", "-gencode", "arch=compute_90a,code=sm_90a", "-o",
                            str(exe), str(Path(__file__).with_name("cuda") / f"{name}.cu")], capture_output=True,
                           text=True)
    assert build.returncode == 0, build.stderr[-4000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip().endswith(last_line), run.stdout[-4000:]


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.routing}-{c.seed}")
def test_step1_matches_the_triton_launches_and_the_reference(case):
    row = run_step1_case(case, repeats=4)
    assert passed_step1(row), row


def test_an_unknown_probe_mode_is_refused_before_anything_is_built():
    unknown = 2 * max(cuda_step1.MODES.values())
    with pytest.raises(ValueError, match=f"mode must be a sum of MODES' flags .* got {unknown}"):
        cuda_step1.step1(None, None, 0.0, mode=unknown)
    with pytest.raises(ValueError, match="got -1"):
        cuda_step1.step1(None, None, 0.0, mode=-1)
    m = cuda_step1.MODES
    with pytest.raises(ValueError, match=r"\(touch\+ahead\): besides .* one of \['the step', 'empty'"):
        cuda_step1.step1(None, None, 0.0, mode=m["touch"] | m["ahead"])


def test_the_selfcheck_takes_only_the_variants_meant_to_keep_the_bits():
    """A probe mode that leaves y wrong (no wait, relaxed, bare, ...) cannot be checked bit for bit: refused by name
    before anything runs."""
    assert set(Y_RIGHT_MODES) <= set(cuda_step1.MODES)
    for mode in ("no-wait", "regs-l1+relaxed"):
        with pytest.raises(ValueError, match=rf"mode must be of .*'regs'.* got '{re.escape(mode)}'"):
            run_step1_case(CASES[0], mode=mode)
    with pytest.raises(ValueError, match=r"mode 'touch\+ahead' is no kernel instance's"):
        run_step1_case(CASES[0], mode="touch+ahead")


def test_the_step_sync_buffer_holds_the_counts_then_the_ll_words():
    """DecodeBuffers.step_sync: the counts (zero between launches), then probe modes ll / ll-combine's launch count
    and LL words at an 8-byte boundary, as cuda/step1_probes.cuh's LLRows places them (kMaxTopK = 8 items of
    I/4 + I/32 input words, then 8 items of H/2 output words)."""
    g = geometry_of("dsv4-flash")
    buf = DecodeBuffers.allocate(g, 2, "cpu", split_tokens=1)
    assert cuda_step1.count_words(g.hidden) == g.hidden // 64 + 9
    base = (g.hidden // 64 + 8 + 2) & ~1  # LLRows::count, in int32 words
    assert buf.step_sync.dtype == torch.int32 and buf.step_sync.numel() == cuda_step1.sync_words(g.hidden,
                                                                                                 g.intermediate)
    ll_words = 1 + 8 * (g.intermediate // 4 + g.intermediate // 32) + 8 * g.hidden // 2
    assert buf.step_sync.numel() == base + 2 * ll_words
    assert not buf.step_sync.any()


@pytest.mark.skipif(cuda_step1.nvcc() is None, reason="no nvcc on this machine")
def test_every_cta_of_an_ll_launch_gets_one_flag_and_each_launch_a_new_one(tmp_path):
    """tests/cuda/ll_flag_check.cu runs the LL probe modes' launch_flag and launch_share on the host over 1,600
    launches of 1 to 1,024 CTAs in random interleavings (and a control whose flags must repeat, so the check can
    fail)."""
    _host_check(tmp_path, "ll_flag_check", "1600 launches, 0 failed")

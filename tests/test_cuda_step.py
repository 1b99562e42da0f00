"""The 1-token CUDA step (megamoe/decode/cuda_step.py, cuda/cuda_step.cu): on a CPU, what it refuses and why, that
its source builds with nvcc into a library of one kernel instance whose constants agree with the Python side's, and
that its order of tiles takes every tile once without deadlock (tests/cuda/schedule_check.cu). The step on an SM90
GPU, bit for bit against the Triton launches and the reference, and its probe modes: lab/cuda_step/."""

from __future__ import annotations

import ctypes
import re
import subprocess
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="needs triton 3.6 (its CPU interpreter): pip install -e \".[test]\"")

from megamoe.decode import cuda_step  # noqa: E402
from megamoe.decode.layout_tc import prepare_tc_weights  # noqa: E402
from megamoe.decode.gemv import LaunchConfig  # noqa: E402
from megamoe.decode.moe import DecodeBuffers, one_cuda_launch  # noqa: E402
from megamoe.decode.tc import tc_launch_config  # noqa: E402

from decode_selfcheck import case_weights, geometry_of  # noqa: E402


def test_geometry_limits_name_what_is_wrong():
    assert cuda_step.geometry_limits(4096, 2048, 6) is None  # DeepSeek-V4-Flash
    assert "multiples of 1024" in cuda_step.geometry_limits(4096 + 512, 2048, 6)
    assert "intermediate <= 2048, got 4096, 3072" in cuda_step.geometry_limits(4096, 3072, 6)  # 72 terms > 48
    assert "top-k <= 8, got 9" == cuda_step.geometry_limits(4096, 2048, 9)


def test_unsupported_says_why_before_any_launch():
    g = geometry_of("tiny")
    tw = prepare_tc_weights(case_weights("tiny", "cpu"))
    buf = DecodeBuffers.allocate(g, 2, "cpu")
    assert cuda_step.unsupported(tw, buf, 2) == "one token per step only, got 2"
    assert cuda_step.unsupported(tw, buf, 1) == "needs a CUDA device (not the interpreter)"


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
    """The CUDA step has the same bits but is only level with the Triton launches on the H200 and slower on the H100
    (issue 47's decision), so the backend's launch leaves it off (``LaunchConfig.tc_cuda_step1`` turns it on)."""
    assert not tc_launch_config(1, 6).tc_cuda_step1


def test_the_step_sync_buffer_holds_the_counts_only():
    """DecodeBuffers.step_sync: a combine count per 64 columns, the gate/up tiles done per item (kMaxTopK = 8) and the
    CTAs done, zero between launches; nothing a probe mode keeps (the lab allocates its own)."""
    g = geometry_of("dsv4-flash")
    buf = DecodeBuffers.allocate(g, 2, "cpu", split_tokens=1)
    assert cuda_step.sync_words(g.hidden) == g.hidden // 64 + 9
    assert buf.step_sync.dtype == torch.int32 and buf.step_sync.numel() == g.hidden // 64 + 9
    assert not buf.step_sync.any()


def test_the_launch_takes_the_tensors_in_the_kernels_order():
    """tensor_pointers: the weights' four, then the buffers' sixteen, in Params' order (cuda_step_params.cuh), each
    the tensor's own address."""
    params = (Path(cuda_step.SOURCE).parent / "cuda_step_params.cuh").read_text()
    fields = params[params.index("struct Params {"):params.index("float clamp;")]
    declared = re.findall(r"\*\s*(\w+);", fields)  # the pointer fields, before the scalars
    names = [*cuda_step.WEIGHT_TENSORS, *cuda_step.BUFFER_TENSORS]
    renamed = {"topk_weights": "topk_w", "step_sync": "sync"}  # the buffers' names -> Params'
    assert [renamed.get(n, n) for n in names] == declared
    g = geometry_of("tiny")
    tw = prepare_tc_weights(case_weights("tiny", "cpu"))
    buf = DecodeBuffers.allocate(g, 2, "cpu")
    ptrs = cuda_step.tensor_pointers(tw, buf)
    assert len(ptrs) == 20 and ptrs[0] == tw.l1_codes.data_ptr() and ptrs[4] == buf.x_q.data_ptr()
    assert ptrs[19] == buf.step_sync.data_ptr() and ptrs[18] == buf.y.data_ptr()


@pytest.mark.skipif(cuda_step.nvcc() is None, reason="no nvcc on this machine")
def test_source_builds_one_instance_that_agrees_with_the_python_constants(tmp_path):
    lib_path = cuda_step.build(tmp_path)
    assert cuda_step.build(tmp_path) == lib_path  # cached by the sources' hash
    lib = ctypes.CDLL(str(lib_path))
    for name in ("megamoe_cuda_step_parts", "megamoe_cuda_step_max_terms"):
        getattr(lib, name).restype = ctypes.c_int
    assert lib.megamoe_cuda_step_parts() == cuda_step.PARTS
    assert lib.megamoe_cuda_step_max_terms() == cuda_step.MAX_TERMS
    symbols = subprocess.run(["nm", "-C", str(lib_path)], capture_output=True, text=True).stdout
    assert "::step1_kernel(" in symbols and "step1_kernel<" not in symbols  # the step alone: no probe instances


@pytest.mark.skipif(cuda_step.nvcc() is None, reason="no nvcc on this machine")
def test_the_tile_order_takes_every_tile_once_and_cannot_deadlock(tmp_path):
    """tests/cuda/schedule_check.cu runs the kernel's own Schedule on the host over 1,575 grids, expert counts, tiles
    per expert and lags (and a hand-made order that must deadlock, so the check can fail)."""
    exe = tmp_path / "schedule_check"
    build = subprocess.run([cuda_step.nvcc(), "-std=c++17", "-gencode", "arch=compute_90a,code=sm_90a", "-o",
                            str(exe), str(Path(__file__).with_name("cuda") / "schedule_check.cu")],
                           capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-4000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip().endswith("1575 cases, 0 failed"), run.stdout[-4000:]

"""The 1-token tensor-core step in one persistent CUDA launch (``cuda/cuda_step.cu``): route, the gate/up GEMM,
the down GEMM and the combine of ``moe_decode``'s three Triton launches, with the same outputs bit for bit (recipe
megamoe-decode-tc).

    step(tw, buf, clamp)   buf's staged token 0 -> route's outputs, l2_q, l2_sf, slot_out, y[0]

Why CUDA here: at one token the Triton launches stream each K loop close to a plain read of its bytes, but the
step pays three ramps and tails around them (docs/decode-kernel-tc.md, "Where the time goes"). This kernel keeps
one CTA per SM and streams the CTA's gate/up and then down blocks through a ring of shared-memory stages
(``cp.async.bulk`` with mbarriers, which Triton does not expose), so the down GEMM's weights load while the gate/up
GEMM finishes; each down tile waits only for its own expert's gate/up tiles, and two signal warps keep those
cross-CTA waits off the computing warpgroups. It is not faster than the Triton launches (docs/decode-kernel-tc.md,
"The 1-token CUDA step": a recorded negative result), so the Triton launches are the backend's 1-token path and this
step is opt-in: ``LaunchConfig.tc_cuda_step1`` turns it on. The kernel is the step alone, without probe code; the
probe modes, and the step with the hooks they use, are the lab's (lab/cuda_step/).

The kernel is built from its source with nvcc on first use (``build``; cached by the source's hash under
``$MEGAMOE_CACHE`` or ``~/.cache/megamoe``) and called through ctypes. ``unsupported`` says why a step cannot
take it (no SM90 GPU, no nvcc, more than one token, a geometry past its shared-memory budget); ``moe_decode`` then
runs the Triton launches, which give the same bits, and at 1 token warns why (``moe.one_cuda_launch``).
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch

from ..nvcc import build_shared, find_nvcc

LAG = 2  # gate/up rounds a down tile waits after its item's last gate/up round (cuda_step_params.cuh's Schedule)
MAX_TOPK = 8  # cuda/cuda_step_ops.cuh's kMaxTopK
# The launch's tensors, in the order of the kernel's Params (cuda/cuda_step_params.cuh; cuda/cuda_step.cu's launch
# takes their 20 pointers so): the weights' (TCWeights), then the buffers' (DecodeBuffers).
WEIGHT_TENSORS = ("l1_codes", "l1_scales", "l2_codes", "l2_scales")
BUFFER_TENSORS = ("x_q", "x_sf", "topk_idx", "topk_weights", "num_touched", "touched", "seg_start", "seg_count",
                  "row_token", "row_weight", "slot_row", "l2_q", "l2_sf", "slot_out", "y", "step_sync")


def sync_words(hidden: int) -> int:
    """int32 words of ``DecodeBuffers.step_sync``, the counts the step keeps between its CTAs: a combine count per
    64 columns, gate/up tiles done per item, CTAs done. Each is back at zero after every launch."""
    return hidden // 64 + MAX_TOPK + 1


SOURCE = Path(__file__).with_name("cuda") / "cuda_step.cu"
NVCC_FLAGS = ("-O3", "-gencode", "arch=compute_90a,code=sm_90a", "--fmad=false", "-Xcompiler", "-fPIC", "-shared")


def nvcc() -> str | None:
    """The nvcc to build with (``megamoe.nvcc.find_nvcc``: ``$CUDA_HOME/bin/nvcc``, else the one on PATH)."""
    return find_nvcc()


def build(out_dir: str | os.PathLike | None = None) -> Path:
    """Compile ``cuda/cuda_step.cu`` into a shared library (once per source, headers and flags) and return its path.
    Cached by hash under ``out_dir``, else ``$MEGAMOE_CACHE`` or ``~/.cache/megamoe``."""
    parts = SOURCE.parent.glob("cuda_step*.cuh")
    return build_shared(SOURCE.stem, SOURCE, parts, NVCC_FLAGS, out_dir, what="the 1-token CUDA step", exe=nvcc())


@functools.lru_cache(maxsize=None)
def _library() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build()))
    p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    lib.megamoe_cuda_step_launch.argtypes = [p, f] + [i] * 10 + [p]
    lib.megamoe_cuda_step_launch.restype = i
    lib.megamoe_cuda_step_fixed_smem.argtypes = [i, i]
    lib.megamoe_cuda_step_prepare.argtypes = [i, i]
    for name in ("megamoe_cuda_step_prepare", "megamoe_cuda_step_fixed_smem", "megamoe_cuda_step_stage_bytes",
                 "megamoe_cuda_step_max_terms", "megamoe_cuda_step_parts"):
        getattr(lib, name).restype = i
    return lib


PARTS = 4  # computing warpgroups per CTA, each a quarter of every tile's K (cuda/cuda_step_ops.cuh's kParts)
MAX_TERMS = 48  # terms of a tile's last three quarters the kernel keeps in shared memory (kMaxTerms)


def geometry_limits(hidden: int, intermediate: int, num_topk: int) -> str | None:
    """Why the kernel cannot take this geometry (None if it can): a quarter of a tile's K is whole stages of two
    128-K blocks; the last three quarters' terms fit in ``MAX_TERMS`` (gate/up: 3 hidden / 512 blocks; down: 3
    intermediate / 128 groups); the top-k fits in the kernel's per-thread slot list."""
    if hidden % 1024 or intermediate % 1024:
        return f"hidden and intermediate must be multiples of 1024, got {hidden}, {intermediate}"
    if 3 * hidden // 512 > MAX_TERMS or 3 * intermediate // 128 > MAX_TERMS:
        return (f"hidden <= {512 * MAX_TERMS // 3} and intermediate <= {128 * MAX_TERMS // 3}, got {hidden}, "
                f"{intermediate}")
    if num_topk > 8:
        return f"top-k <= 8, got {num_topk}"
    return None


def device_index(dev: torch.device) -> int:
    """The CUDA device a tensor on ``dev`` lives on (``cuda`` without an index: the current one)."""
    return dev.index if dev.index is not None else torch.cuda.current_device()


def unsupported(tw, buf, num_tokens: int) -> str | None:
    """Why this step cannot run as one CUDA launch (None when it can). Host-side only: no sync, no launch."""
    if num_tokens != 1:
        return f"one token per step only, got {num_tokens}"
    dev = tw.l1_codes.device
    if dev.type != "cuda" or buf.interpret:
        return "needs a CUDA device (not the interpreter)"
    return _unsupported_here(device_index(dev), tw.hidden, tw.intermediate, buf.num_topk)


@functools.lru_cache(maxsize=None)
def _unsupported_here(device_index: int, hidden: int, intermediate: int, num_topk: int) -> str | None:
    if torch.cuda.get_device_capability(device_index) != (9, 0):
        return "needs SM90 (compute capability 9.0: wgmma, cp.async.bulk)"
    return geometry_limits(hidden, intermediate, num_topk) or (
        "no nvcc to build it with (CUDA_HOME/bin or PATH)" if nvcc() is None else None)


@functools.lru_cache(maxsize=None)
def launch_shape(device_index: int, hidden: int, intermediate: int) -> tuple[int, int, int]:
    """(CTAs, ring stages, dynamic shared memory bytes): one CTA per SM, as many stages as the SM's shared memory
    holds beside the kernel's fixed buffers, a multiple of the computing warpgroups (stages go round them)."""
    lib = _library()
    props = torch.cuda.get_device_properties(device_index)
    budget = getattr(props, "shared_memory_per_block_optin", 232448)
    fixed = lib.megamoe_cuda_step_fixed_smem(hidden, intermediate) + 8
    stages = (budget - fixed) // lib.megamoe_cuda_step_stage_bytes() // PARTS * PARTS
    if stages < 2 * PARTS:
        raise RuntimeError(f"the 1-token CUDA step needs {2 * PARTS} ring stages, the device's shared memory gives "
                           f"{stages}")
    if (lib.megamoe_cuda_step_parts(), lib.megamoe_cuda_step_max_terms()) != (PARTS, MAX_TERMS):
        raise RuntimeError("cuda_step.PARTS / MAX_TERMS disagree with the built kernel's kParts / kMaxTerms")
    smem = fixed + stages * lib.megamoe_cuda_step_stage_bytes()
    err = lib.megamoe_cuda_step_prepare(device_index, smem)
    if err < 0:
        raise RuntimeError(f"the 1-token CUDA step was built with {-err} registers per thread; its setmaxnreg split "
                           f"(cuda/cuda_step_ops.cuh's kComputeRegs / kOtherRegs) needs at least 96")
    if err:
        raise RuntimeError(f"the 1-token CUDA step cannot have {smem} bytes of shared memory: CUDA error {err}")
    return props.multi_processor_count, stages, smem


def tensor_pointers(tw, buf) -> ctypes.Array:
    """The launch's tensors (``WEIGHT_TENSORS`` of ``tw``, ``BUFFER_TENSORS`` of ``buf``) as the kernel's Params takes
    them: a C array of their device pointers."""
    tensors = [getattr(tw, n) for n in WEIGHT_TENSORS] + [getattr(buf, n) for n in BUFFER_TENSORS]
    return (ctypes.c_void_p * len(tensors))(*(t.data_ptr() for t in tensors))


def step(tw, buf, clamp: float) -> torch.Tensor:
    """One launch for the staged token 0 of ``buf`` -> y[:1] (a view of ``buf.y``). Call ``unsupported`` first."""
    lib = _library()
    dev = tw.l1_codes.device
    index = device_index(dev)
    if buf.x_q.device != dev:
        raise ValueError(f"the weights are on {dev} but the buffers on {buf.x_q.device}")
    ctas, stages, smem = launch_shape(index, tw.hidden, tw.intermediate)
    if buf.step_sync.dtype != torch.int32 or buf.step_sync.numel() < sync_words(tw.hidden):
        raise ValueError(f"buf.step_sync must be int32 with at least {sync_words(tw.hidden)} elements, got "
                         f"{buf.step_sync.dtype} [{buf.step_sync.numel()}]")
    stream = torch.cuda.current_stream(dev).cuda_stream
    err = lib.megamoe_cuda_step_launch(tensor_pointers(tw, buf), ctypes.c_float(clamp), tw.hidden, tw.intermediate,
                                       buf.num_topk, buf.expert_lo, buf.num_local, stages, LAG, ctas, smem, index,
                                       ctypes.c_void_p(stream))
    if err:
        raise RuntimeError(f"the 1-token CUDA step failed to launch: CUDA error {err}")
    return buf.y[:1]

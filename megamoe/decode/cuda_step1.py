"""The 1-token tensor-core step in one persistent CUDA launch (``cuda/step1.cu``): route, L1, L2 and the combine
of ``moe_decode``'s three Triton launches, with the same outputs bit for bit (recipe megamoe-decode-tc).

    step1(tw, buf, clamp)   buf's staged token 0 -> route's outputs, l2_q, l2_sf, slot_out, y[0]

Why CUDA here: at one token the Triton launches stream each K loop close to a plain read of its bytes, but the
step pays three ramps and tails around them (docs/decode-kernel-tc.md, "Where the time goes"). This kernel keeps
one CTA per SM and streams the CTA's L1 and then L2 blocks through a ring of shared-memory stages
(``cp.async.bulk`` with mbarriers, which Triton does not expose), so L2's weights load while L1 finishes; each L2
tile waits only for its own expert's L1 tiles, and two signal warps keep those cross-CTA waits off the computing
warpgroups. It is level with the Triton launches on the H200 and slower on the H100, and no variant tried was 3%
faster (docs/decode-kernel-tc.md, "The 1-token CUDA step": a recorded negative result), so the Triton launches stay
the backend's 1-token path and this step is opt-in: ``LaunchConfig.tc_cuda_step1`` turns it on.

The kernel is built from its source with nvcc on first use (``build``; cached by the source's hash under
``$MEGAMOE_CACHE`` or ``~/.cache/megamoe``) and called through ctypes. ``unsupported`` says why a step cannot
take it (no SM90 GPU, no nvcc, more than one token, a geometry past its shared-memory budget); ``moe_decode`` then
runs the Triton launches, which give the same bits, and at 1 token warns why (``moe.one_cuda_launch``).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import torch

STAMP_POINTS = ("set up", "last L1 block asked for", "last block asked for", "L1 done", "last L2 input in",
                "done", "entered")  # the stamps' columns 0..6 (``step1(stamps=...)``)
TRACE_SLOTS = 160  # step1(trace=...): per CTA, when each stage was issued and when each block was found landed
INFLIGHT = 0  # stages the load warp keeps on their way at most (0: no bound but the ring's free stages)
LAG = 2  # L1 rounds an L2 tile waits after its item's last L1 round (cuda/step1_params.cuh's Schedule)
# step1(mode=...): step1_params.cuh's kMode*
MODES = {"bare": 1, "no-scales": 2, "prefetch": 4, "no-load": 8, "touch": 16, "empty": 32, "plain": 64, "ahead": 128,
         "no-wait": 256, "relaxed": 512, "regs": 1024, "regs-l1": 2048, "ll": 4096, "ll-combine": 8192}
RUNTIME_FLAGS = ("bare", "no-scales", "prefetch", "no-load", "plain")  # read at run time by any kernel instance
# The probe modes compiled into kernel instances of their own (cuda/step1.cu's kInstances; a test compares them):
# a mode's other flags must be exactly one of these.
INSTANCES = tuple(sum(MODES[f] for f in names) for names in (
    (), ("empty",), ("touch",), ("ahead",), ("no-wait",), ("relaxed",), ("regs",), ("regs", "no-wait"), ("regs-l1",),
    ("ll",), ("ll", "regs-l1"), ("ll-combine",), ("ll", "ll-combine"), ("ll", "ll-combine", "regs-l1")))
MAX_TOPK = 8  # cuda/step1_ops.cuh's kMaxTopK


def mode_error(mode: int) -> str | None:
    """Why ``step1`` cannot launch probe mode ``mode`` (None when it can): not a sum of ``MODES``' flags, or flags
    besides ``RUNTIME_FLAGS`` that no kernel instance compiles (``INSTANCES``)."""
    if mode < 0 or mode & ~sum(MODES.values()):
        return f"mode must be a sum of MODES' flags {MODES}, got {mode}"
    if mode & ~sum(MODES[f] for f in RUNTIME_FLAGS) not in INSTANCES:
        names = lambda m: "+".join(k for k, v in MODES.items() if m & v) or "the step"  # noqa: E731
        return (f"mode {mode} ({names(mode)}): besides {RUNTIME_FLAGS} its flags must be those of one kernel "
                f"instance, one of {[names(m) for m in INSTANCES]}")
    return None


def count_words(hidden: int) -> int:
    """int32 words of the step's counts at the start of ``DecodeBuffers.step_sync``: a combine count per 64
    columns, L1 tiles done per item, CTAs done. Each is back at zero after every launch."""
    return hidden // 64 + MAX_TOPK + 1


def sync_words(hidden: int, intermediate: int) -> int:
    """int32 words ``DecodeBuffers.step_sync`` holds: the counts, then (8-byte aligned) probe modes ll and
    ll-combine's launch count, each item's L2 input row and each item's L2 outputs as LL words, 8 bytes each
    (cuda/step1_probes.cuh's LLRows)."""
    ll_words = 1 + MAX_TOPK * (intermediate // 4 + intermediate // 32) + MAX_TOPK * hidden // 2
    return (count_words(hidden) + 1) // 2 * 2 + 2 * ll_words
SOURCE = Path(__file__).with_name("cuda") / "step1.cu"
NVCC_FLAGS = ("-O3", "-gencode", "arch=compute_90a,code=sm_90a", "--fmad=false", "-Xcompiler", "-fPIC", "-shared")


def nvcc() -> str | None:
    """The nvcc to build with: ``$CUDA_HOME/bin/nvcc``, else the one on PATH."""
    home = os.environ.get("CUDA_HOME")
    if home and (Path(home) / "bin" / "nvcc").exists():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def build(out_dir: str | os.PathLike | None = None) -> Path:
    """Compile ``cuda/step1.cu`` into a shared library (once per source and flags) and return its path."""
    exe = nvcc()
    if exe is None:
        raise RuntimeError("building the 1-token CUDA step needs nvcc (CUDA_HOME/bin or PATH)")
    parts = sorted(SOURCE.parent.glob("step1*.cu*"))  # the kernel and the headers it includes
    key = hashlib.sha256(b"".join(f.read_bytes() for f in parts) + " ".join(NVCC_FLAGS).encode()).hexdigest()[:16]
    root = Path(out_dir or os.environ.get("MEGAMOE_CACHE", Path.home() / ".cache" / "megamoe"))
    lib = root / f"step1-{key}.so"
    if not lib.exists():
        root.mkdir(parents=True, exist_ok=True)
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")
        run = subprocess.run([exe, *NVCC_FLAGS, "-o", str(tmp), str(SOURCE)], capture_output=True, text=True)
        if run.returncode:
            raise RuntimeError(f"nvcc failed on {SOURCE.name}:\n{run.stderr[-4000:]}")
        tmp.replace(lib)
    return lib


@functools.lru_cache(maxsize=None)
def _library() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build()))
    p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    lib.megamoe_step1_launch.argtypes = [p] * 22 + [f] + [i] * 12 + [p]
    lib.megamoe_step1_launch.restype = i
    lib.megamoe_step1_fixed_smem.argtypes = [i, i]
    lib.megamoe_step1_prepare.argtypes = [i, i]
    for name in ("megamoe_step1_prepare", "megamoe_step1_fixed_smem", "megamoe_step1_stage_bytes",
                 "megamoe_step1_max_terms", "megamoe_step1_threads", "megamoe_step1_parts"):
        getattr(lib, name).restype = i
    return lib


PARTS = 4  # computing warpgroups per CTA, each a quarter of every tile's K (cuda/step1.cu's kParts)
MAX_TERMS = 48  # terms of a tile's last three quarters the kernel keeps in shared memory (kMaxTerms)


def geometry_limits(hidden: int, intermediate: int, num_topk: int) -> str | None:
    """Why the kernel cannot take this geometry (None if it can): a quarter of a tile's K is whole stages of two
    128-K blocks; the last three quarters' terms fit in ``MAX_TERMS`` (L1: 3 hidden / 512 blocks; L2: 3
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
    fixed = lib.megamoe_step1_fixed_smem(hidden, intermediate) + 8
    stages = (budget - fixed) // lib.megamoe_step1_stage_bytes() // PARTS * PARTS
    if stages < 2 * PARTS:
        raise RuntimeError(f"the 1-token CUDA step needs {2 * PARTS} ring stages, the device's shared memory gives "
                           f"{stages}")
    if (lib.megamoe_step1_parts(), lib.megamoe_step1_max_terms()) != (PARTS, MAX_TERMS):
        raise RuntimeError("cuda_step1.PARTS / MAX_TERMS disagree with the built kernel's kParts / kMaxTerms")
    smem = fixed + stages * lib.megamoe_step1_stage_bytes()
    err = lib.megamoe_step1_prepare(device_index, smem)
    if err < 0:
        raise RuntimeError(f"the 1-token CUDA step was built with {-err} registers per thread; its setmaxnreg split "
                           f"(cuda/step1_ops.cuh's kComputeRegs / kOtherRegs) needs at least 96")
    if err:
        raise RuntimeError(f"the 1-token CUDA step cannot have {smem} bytes of shared memory: CUDA error {err}")
    return props.multi_processor_count, stages, smem


def step1(tw, buf, clamp: float, *, stages: int | None = None, stamps: torch.Tensor | None = None,
          mode: int = 0, inflight: int | None = None, lag: int | None = None,
          trace: torch.Tensor | None = None) -> torch.Tensor:
    """One launch for the staged token 0 of ``buf`` -> y[:1] (a view of ``buf.y``). Call ``unsupported`` first.

    For probes only: ``stages`` fewer ring stages than fit; ``stamps`` int64 [CTAs, 8] gets when each CTA reached
    its points (``STAMP_POINTS``); ``trace`` int64 [CTAs, 1 + ``PARTS``, ``TRACE_SLOTS``] when the load warp
    issued each stage (row 0) and when warpgroup w found each of its stages landed (row 1 + w); ``mode``
    (``MODES``) a probe variant (``step1_params.cuh`` says which leave y wrong); ``inflight`` a bound on the stages
    on their way; ``lag`` L1 rounds between an item's last L1 tiles and its L2 tiles in each CTA's order (``LAG``)."""
    if (why := mode_error(mode)) is not None:
        raise ValueError(why)
    lib = _library()
    dev = tw.l1_codes.device
    index = device_index(dev)
    if buf.x_q.device != dev:
        raise ValueError(f"the weights are on {dev} but the buffers on {buf.x_q.device}")
    ctas, most, smem = launch_shape(index, tw.hidden, tw.intermediate)
    stages = most if stages is None else stages
    if not (2 * PARTS <= stages <= most and stages % PARTS == 0):
        raise ValueError(f"stages must be a multiple of {PARTS} in [{2 * PARTS}, {most}], got {stages}")
    if trace is not None and (trace.dtype != torch.int64 or tuple(trace.shape) != (ctas, 1 + PARTS, TRACE_SLOTS)):
        raise ValueError(f"trace must be int64 [{ctas}, {1 + PARTS}, {TRACE_SLOTS}], got {trace.dtype} "
                         f"{tuple(trace.shape)}")
    if buf.step_sync.dtype != torch.int32 or buf.step_sync.numel() < sync_words(tw.hidden, tw.intermediate):
        raise ValueError(f"buf.step_sync must be int32 with at least {sync_words(tw.hidden, tw.intermediate)} "
                         f"elements, got {buf.step_sync.dtype} [{buf.step_sync.numel()}]")
    if stamps is not None and (stamps.dtype != torch.int64 or tuple(stamps.shape) != (ctas, 8)):
        raise ValueError(f"stamps must be int64 [{ctas}, 8], got {stamps.dtype} {tuple(stamps.shape)}")
    ptr = lambda t: ctypes.c_void_p(t.data_ptr())  # noqa: E731
    stream = torch.cuda.current_stream(dev).cuda_stream
    err = lib.megamoe_step1_launch(
        ptr(tw.l1_codes), ptr(tw.l1_scales), ptr(tw.l2_codes), ptr(tw.l2_scales), ptr(buf.x_q), ptr(buf.x_sf),
        ptr(buf.topk_idx), ptr(buf.topk_weights), ptr(buf.num_touched), ptr(buf.touched), ptr(buf.seg_start),
        ptr(buf.seg_count), ptr(buf.row_token), ptr(buf.row_weight), ptr(buf.slot_row), ptr(buf.l2_q), ptr(buf.l2_sf),
        ptr(buf.slot_out), ptr(buf.y), ptr(buf.step_sync),
        ctypes.c_void_p(None if stamps is None else stamps.data_ptr()),
        ctypes.c_void_p(None if trace is None else trace.data_ptr()), ctypes.c_float(clamp), tw.hidden,
        tw.intermediate, buf.num_topk, buf.expert_lo, buf.num_local, stages, int(mode),
        INFLIGHT if inflight is None else inflight, LAG if lag is None else lag, ctas, smem, index,
        ctypes.c_void_p(stream))
    if err:
        raise RuntimeError(f"the 1-token CUDA step failed to launch: CUDA error {err}")
    return buf.y[:1]

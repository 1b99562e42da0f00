"""The 1-token CUDA step with its probe modes: the step's kernel as the library had it at 1a7f0ec, with the probe
hooks the library's step no longer carries (probe_kernel/), compiled once per probe mode with the lab's hooks
(probe_step.cu, probes.cuh), and launched with every knob the studies turn.

    step(tw, buf, clamp, *, sync=None, stages=None, stamps=None, mode=0, inflight=None, lag=None, trace=None)

``mode`` 0 is the step itself as the studies measured it (instance 0 of this library: 1a7f0ec's library step, byte for
byte in SASS; the library's step now is the same code without the probe modes' reads: sass_same.py), so a probe run
times the step and its variants from one build. The LL modes keep words past the step's counts: give
them ``sync_buffer``'s tensor (``buf.step_sync`` holds the counts only).
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from megamoe.decode import cuda_step  # noqa: E402
from megamoe.nvcc import build_shared  # noqa: E402

SOURCE = Path(__file__).with_name("probe_step.cu")
STAMP_POINTS = ("set up", "last L1 block asked for", "last block asked for", "L1 done", "last L2 input in",
                "done", "entered")  # the stamps' columns 0..6 (``step(stamps=...)``; L1 the gate/up GEMM, L2 down)
TRACE_SLOTS = 160  # step(trace=...): per CTA, when each stage was issued and when each block was found landed
INFLIGHT = 0  # stages the load warp keeps on their way at most (0: no bound but the ring's free stages)
LAG = cuda_step.LAG  # the step's: gate/up rounds a down tile waits after its item's last gate/up round
# step(mode=...): probe_kernel/cuda_step_params.cuh's kMode* (probes.cuh says what each asks)
MODES = {"bare": 1, "no-scales": 2, "prefetch": 4, "no-load": 8, "touch": 16, "empty": 32, "plain": 64, "ahead": 128,
         "no-wait": 256, "relaxed": 512, "regs": 1024, "regs-l1": 2048, "ll": 4096, "ll-combine": 8192}
RUNTIME_FLAGS = ("bare", "no-scales", "prefetch", "no-load", "plain")  # read at run time by any kernel instance
# The probe modes compiled into kernel instances of their own (probe_step.cu's kInstances; a test compares them):
# a mode's other flags must be exactly one of these.
INSTANCES = tuple(sum(MODES[f] for f in names) for names in (
    (), ("empty",), ("touch",), ("ahead",), ("no-wait",), ("relaxed",), ("regs",), ("regs", "no-wait"), ("regs-l1",),
    ("ll",), ("ll", "regs-l1"), ("ll-combine",), ("ll", "ll-combine"), ("ll", "ll-combine", "regs-l1")))
LL_MODES = MODES["ll"] | MODES["ll-combine"]


def mode_error(mode: int) -> str | None:
    """Why ``step`` cannot launch probe mode ``mode`` (None when it can): not a sum of ``MODES``' flags, or flags
    besides ``RUNTIME_FLAGS`` that no kernel instance compiles (``INSTANCES``)."""
    if mode < 0 or mode & ~sum(MODES.values()):
        return f"mode must be a sum of MODES' flags {MODES}, got {mode}"
    if mode & ~sum(MODES[f] for f in RUNTIME_FLAGS) not in INSTANCES:
        names = lambda m: "+".join(k for k, v in MODES.items() if m & v) or "the step"  # noqa: E731
        return (f"mode {mode} ({names(mode)}): besides {RUNTIME_FLAGS} its flags must be those of one kernel "
                f"instance, one of {[names(m) for m in INSTANCES]}")
    return None


def sync_words(hidden: int, intermediate: int) -> int:
    """int32 words the LL modes' sync buffer holds: the step's counts (``cuda_step.sync_words``), then (8-byte
    aligned) the launch count, each item's down-GEMM input row and each item's down outputs as LL words, 8 bytes
    each (probes.cuh's LLRows)."""
    ll_words = 1 + cuda_step.MAX_TOPK * (intermediate // 4 + intermediate // 32) + cuda_step.MAX_TOPK * hidden // 2
    return (cuda_step.sync_words(hidden) + 1) // 2 * 2 + 2 * ll_words


def sync_buffer(tw, device) -> torch.Tensor:
    """A zeroed sync buffer for every mode (``sync_words``), kept across launches like ``buf.step_sync``."""
    return torch.zeros(sync_words(tw.hidden, tw.intermediate), dtype=torch.int32, device=device)


def build(out_dir: str | os.PathLike | None = None) -> Path:
    """Compile probe_step.cu (every instance) as the library builds its step (``cuda_step.build``: its flags, cached
    by the hash of the sources: probes.cuh and the kernel's copy in probe_kernel/)."""
    parts = {*SOURCE.parent.glob("*.cuh"), *SOURCE.parent.glob("probe_kernel/*.cuh")}
    return build_shared(SOURCE.stem, SOURCE, parts, cuda_step.NVCC_FLAGS, out_dir, what="the CUDA step's probe "
                        "instances", exe=cuda_step.nvcc())


@functools.lru_cache(maxsize=None)
def _library() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build()))
    p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
    lib.lab_step_launch.argtypes = [p, p, p, f] + [i] * 12 + [p]
    lib.lab_step_prepare.argtypes = [i, i]
    lib.lab_step_instances.argtypes = [p, i]
    for name in ("lab_step_launch", "lab_step_prepare", "lab_step_instances"):
        getattr(lib, name).restype = i
    return lib


@functools.lru_cache(maxsize=None)
def launch_shape(device_index: int, hidden: int, intermediate: int) -> tuple[int, int, int]:
    """(CTAs, ring stages, dynamic shared memory bytes): the library's (``cuda_step.launch_shape``), with this
    library's instances prepared for it."""
    shape = cuda_step.launch_shape(device_index, hidden, intermediate)
    err = _library().lab_step_prepare(device_index, shape[2])
    if err:
        raise RuntimeError(f"the probe instances cannot be prepared for {shape[2]} bytes of shared memory: "
                           f"{'registers per thread ' + str(-err) if err < 0 else 'CUDA error ' + str(err)}")
    return shape


def step(tw, buf, clamp: float, *, sync: torch.Tensor | None = None, stages: int | None = None,
         stamps: torch.Tensor | None = None, mode: int = 0, inflight: int | None = None, lag: int | None = None,
         trace: torch.Tensor | None = None) -> torch.Tensor:
    """One launch for the staged token 0 of ``buf`` -> y[:1] (a view of ``buf.y``). Call
    ``cuda_step.unsupported`` first.

    ``sync`` int32 (``sync_words``; the LL modes need it, the others may use ``buf.step_sync``); ``stages`` fewer
    ring stages than fit; ``stamps`` int64 [CTAs, 8] gets when each CTA reached its points (``STAMP_POINTS``);
    ``trace`` int64 [CTAs, 1 + ``cuda_step.PARTS``, ``TRACE_SLOTS``] when the load warp issued each stage (row 0)
    and when warpgroup w found each of its stages landed (row 1 + w); ``mode`` (``MODES``) a probe variant
    (probes.cuh says which leave y wrong); ``inflight`` a bound on the stages on their way; ``lag`` gate/up rounds
    between an item's last gate/up tiles and its down tiles in each CTA's order (``LAG``)."""
    if (why := mode_error(mode)) is not None:
        raise ValueError(why)
    lib = _library()
    dev = tw.l1_codes.device
    index = cuda_step.device_index(dev)
    if buf.x_q.device != dev:
        raise ValueError(f"the weights are on {dev} but the buffers on {buf.x_q.device}")
    ctas, most, smem = launch_shape(index, tw.hidden, tw.intermediate)
    parts = cuda_step.PARTS
    stages = most if stages is None else stages
    if not (2 * parts <= stages <= most and stages % parts == 0):
        raise ValueError(f"stages must be a multiple of {parts} in [{2 * parts}, {most}], got {stages}")
    if trace is not None and (trace.dtype != torch.int64 or tuple(trace.shape) != (ctas, 1 + parts, TRACE_SLOTS)):
        raise ValueError(f"trace must be int64 [{ctas}, {1 + parts}, {TRACE_SLOTS}], got {trace.dtype} "
                         f"{tuple(trace.shape)}")
    sync = buf.step_sync if sync is None else sync
    need = sync_words(tw.hidden, tw.intermediate) if mode & LL_MODES else cuda_step.sync_words(tw.hidden)
    if sync.dtype != torch.int32 or sync.numel() < need or sync.device != dev:
        raise ValueError(f"sync must be int32 with at least {need} elements on {dev} (mode {mode}; the LL modes': "
                         f"sync_buffer), got {sync.dtype} [{sync.numel()}] on {sync.device}")
    if stamps is not None and (stamps.dtype != torch.int64 or tuple(stamps.shape) != (ctas, 8)):
        raise ValueError(f"stamps must be int64 [{ctas}, 8], got {stamps.dtype} {tuple(stamps.shape)}")
    pointer = lambda t: ctypes.c_void_p(None if t is None else t.data_ptr())  # noqa: E731
    stream = torch.cuda.current_stream(dev).cuda_stream
    tensors = cuda_step.tensor_pointers(tw, buf)
    tensors[len(tensors) - 1] = sync.data_ptr()  # Params' last: the counts (and the LL modes' words past them)
    err = lib.lab_step_launch(
        tensors, pointer(stamps), pointer(trace), ctypes.c_float(clamp), tw.hidden,
        tw.intermediate, buf.num_topk, buf.expert_lo, buf.num_local, stages, int(mode),
        INFLIGHT if inflight is None else inflight, LAG if lag is None else lag, ctas, smem, index,
        ctypes.c_void_p(stream))
    if err:
        raise RuntimeError(f"the 1-token CUDA step (probe mode {mode}) failed to launch: CUDA error {err}")
    return buf.y[:1]

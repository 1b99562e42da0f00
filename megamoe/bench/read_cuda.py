"""The persistent read in CUDA (``read_kernel.cu``): the fastest single-launch read megamoe has, one of
``ReadCeiling``'s candidates. Every thread issues 128-bit ``ld.global.nc.L1::no_allocate`` loads in a grid-stride
loop; each block writes the xor of what it read to ``out[block]``.

    build(arch)                      the shared library, compiled with nvcc once per source, flags and arch
                                     (cached by their hash under ``$MEGAMOE_CACHE`` or ``~/.cache/megamoe``)
    cuda_blocks(n_words, per_sm, sms)  the grid: ``per_sm`` blocks on each SM, no more than there is work for
    read_cuda(buf, out)              read every int32 word of ``buf`` once with ``out.numel()`` blocks

Triton cannot emit the ``.nc`` read-only path (``read_kernel`` says which hints it can); the Triton persistent
read is the fallback where nvcc is missing or the build fails. The library is called through ctypes (no torch
headers to compile: a build takes about a second) on the caller's current stream.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch

from ..nvcc import build_shared, find_nvcc as nvcc  # noqa: F401  (nvcc: the ceiling asks whether there is one)
from .read_kernel import check_read_args

SOURCE = Path(__file__).with_name("read_kernel.cu")
NVCC_FLAGS = ("-O3", "-Xcompiler", "-fPIC", "-shared")
THREADS = 128  # read_kernel.cu's kThreads (the library is asked; a mismatch raises)


def arch_of(device) -> str:
    """nvcc's architecture for ``device``: "90a" on SM90 (as megamoe's other CUDA sources), else e.g. "80"."""
    major, minor = torch.cuda.get_device_capability(device)
    return f"{major}{minor}" + ("a" if (major, minor) == (9, 0) else "")


def build(arch: str = "90a", out_dir: str | os.PathLike | None = None) -> Path:
    """Compile ``read_kernel.cu`` for ``arch`` (e.g. "90a") into a shared library, once per source, flags and
    arch, and return its path. Raises RuntimeError without nvcc or when nvcc fails (its message in the error)."""
    flags = (*NVCC_FLAGS, "-gencode", f"arch=compute_{arch},code=sm_{arch}")
    exe = nvcc()  # this module's name for the lookup (a test replaces it)
    if exe is None:
        raise RuntimeError("building the CUDA read needs nvcc (CUDA_HOME/bin or PATH)")
    return build_shared("read", SOURCE, (), flags, out_dir, what="the CUDA read", exe=exe, note=f"arch {arch}")


@functools.lru_cache(maxsize=None)
def library(arch: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build(arch)))
    lib.megamoe_read_launch.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_longlong, ctypes.c_void_p,
                                        ctypes.c_int, ctypes.c_void_p]
    lib.megamoe_read_launch.restype = ctypes.c_int
    lib.megamoe_read_threads.restype = ctypes.c_int
    if lib.megamoe_read_threads() != THREADS:
        raise RuntimeError(f"read_cuda.THREADS = {THREADS}, read_kernel.cu's kThreads = {lib.megamoe_read_threads()}")
    return lib


def cuda_blocks(n_words: int, per_sm: int, sms: int) -> int:
    """Blocks of the CUDA read of ``n_words`` int32 words: ``per_sm`` on each of ``sms`` SMs, but no more than
    one per ``THREADS`` 16-byte words (a block with nothing to read only adds a start), and at least one."""
    return max(1, min(per_sm * sms, -(-(n_words // 4) // THREADS)))


def read_cuda(buf: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Read every int32 word of the contiguous, 16-byte aligned ``buf`` [n] once with ``out.numel()`` blocks on
    the current stream; ``out`` [blocks] int32 gets each block's xor. Returns ``out``."""
    check_read_args(buf, out)
    if buf.device.type != "cuda":
        raise ValueError(f"buf must be on a CUDA device, got {buf.device}")
    dev = buf.device.index if buf.device.index is not None else torch.cuda.current_device()
    lib = library(arch_of(dev))
    err = lib.megamoe_read_launch(dev, buf.data_ptr(), buf.numel(), out.data_ptr(), out.numel(),
                                  torch.cuda.current_stream(dev).cuda_stream)
    if err:
        raise RuntimeError(f"the CUDA read's launch of {out.numel()} blocks failed: CUDA error {err}")
    return out

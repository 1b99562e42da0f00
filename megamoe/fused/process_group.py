"""The process group the symmetric buffers rendezvous over.

The fused kernels allocate NVLink symmetric memory collectively over a ``torch.distributed``
group. A caller with several ranks passes its expert-parallel group; a caller with none gets a
1-rank group here (NCCL on 127.0.0.1 at a free port, gloo where NCCL is missing), created once per
process and reused.
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist

_OWN_GROUP = None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_group(group=None, backend: str | None = None):
    """Return ``group`` if given, else the default group if one is initialised, else a 1-rank group
    the library creates (and owns) on 127.0.0.1."""
    global _OWN_GROUP
    if group is not None:
        return group
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this build of PyTorch")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    port = _free_port()
    store = dist.TCPStore("127.0.0.1", port, 1, is_master=True)
    kwargs = {}
    if backend == "nccl" and torch.cuda.is_available():
        kwargs["device_id"] = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group(backend, store=store, rank=0, world_size=1, **kwargs)
    _OWN_GROUP = dist.group.WORLD
    return _OWN_GROUP


def owns_group() -> bool:
    """True when the current default group was created by ``ensure_group``."""
    return _OWN_GROUP is not None and dist.is_initialized()


def destroy_own_group() -> None:
    """Tear down the group ``ensure_group`` created (no-op otherwise)."""
    global _OWN_GROUP
    if owns_group():
        dist.destroy_process_group()
    _OWN_GROUP = None

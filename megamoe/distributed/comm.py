"""Moving rows between ranks, bytes exactly: row records, ragged all-gather, all-to-all.

Every payload travels as a uint8 record per row (``pack_rows``), so any dtype (e4m3, bf16, int64,
float64) moves bit for bit over gloo and NCCL alike, and one collective carries all of a row's fields.

    pack_rows([t_i [N, ...]])  -> uint8 [N, B]        B = sum of the fields' bytes per row
    unpack_rows(rec, specs)    -> [t_i [N, ...]]
    all_gather_ragged(rec)     -> [rec_s [N_s, B] for every rank s]   (counts gathered first, padded to max)
    all_to_all_ragged([rec_d]) -> [rec_s [N_sd, B] received from every rank s]
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class FieldSpec:
    """One field of a row record: dtype and the per-row shape (the row tensor is [N, *shape])."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def spec_of(t: torch.Tensor) -> FieldSpec:
    return FieldSpec(t.dtype, tuple(t.shape[1:]))


def pack_rows(fields: list[torch.Tensor]) -> torch.Tensor:
    """fields[i] [N, ...] (any dtypes, one N) -> uint8 [N, B], the bytes of each row side by side."""
    n = fields[0].shape[0]
    parts = []
    for i, t in enumerate(fields):
        if t.shape[0] != n:
            raise ValueError(f"pack_rows: field {i} has {t.shape[0]} rows, expected {n}")
        flat = t.contiguous().reshape(n, math.prod(t.shape[1:]))
        parts.append(flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat)
    return torch.cat(parts, dim=1) if parts else torch.empty(n, 0, dtype=torch.uint8)


def unpack_rows(rec: torch.Tensor, specs: list[FieldSpec]) -> list[torch.Tensor]:
    """uint8 [N, B] -> [t_i [N, *specs[i].shape]] (inverse of pack_rows)."""
    want = sum(s.nbytes for s in specs)
    if rec.dtype != torch.uint8 or rec.ndim != 2 or rec.shape[1] != want:
        raise ValueError(f"unpack_rows: expected uint8 [N, {want}], got {rec.dtype} {tuple(rec.shape)}")
    n, out, col = rec.shape[0], [], 0
    for s in specs:
        chunk = rec[:, col : col + s.nbytes].contiguous()
        col += s.nbytes
        out.append(chunk.view(s.dtype).reshape(n, *s.shape))
    return out


# torch >= 2.13 renames the tensor collectives; older builds only have the *_tensor names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def comm_device(group=None) -> torch.device:
    """Where this group's collectives take their tensors: the current CUDA device for NCCL, else CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_counts(n: int, group=None) -> list[int]:
    """Every rank's n, in rank order (one int64 all-gather)."""
    dev = comm_device(group)
    world = dist.get_world_size(group)
    out = torch.zeros(world, dtype=torch.int64, device=dev)
    _all_gather_single(out, torch.tensor([n], dtype=torch.int64, device=dev), group=group)
    return [int(c) for c in out.cpu()]


def all_gather_ragged(rec: torch.Tensor, group=None, counts: list[int] | None = None) -> list[torch.Tensor]:
    """uint8 [N_r, B] on every rank r (ragged N, 0 allowed) -> [uint8 [N_s, B] for s in ranks].

    all_gather needs equal sizes: gather the counts, pad every rank to max N, gather, unpad.
    """
    counts = counts if counts is not None else all_gather_counts(rec.shape[0], group)
    world, width = len(counts), rec.shape[1]
    n_max = max(counts)
    if n_max == 0:
        return [rec.new_empty(0, width) for _ in range(world)]
    dev = comm_device(group)
    padded = torch.zeros(n_max, width, dtype=torch.uint8, device=dev)
    padded[: rec.shape[0]] = rec.to(dev)
    out = torch.empty(world * n_max, width, dtype=torch.uint8, device=dev)
    _all_gather_single(out, padded, group=group)
    return [out[s * n_max : s * n_max + c].to(rec.device) for s, c in enumerate(counts)]


def all_to_all_ragged(send: list[torch.Tensor], group=None) -> list[torch.Tensor]:
    """send[d] uint8 [N_d, B]: rows for rank d (ragged, 0 allowed) -> [uint8 [N_s, B] received from s].

    Two all-to-alls: the counts, then the rows (all_to_all_single with split sizes). A backend without
    all-to-all raises a clear error naming the allgather_reducescatter scheme as the fallback.
    """
    world = dist.get_world_size(group)
    if len(send) != world:
        raise ValueError(f"all_to_all_ragged: need one send buffer per rank ({world}), got {len(send)}")
    width = send[0].shape[1]
    dev = comm_device(group)
    send_counts = torch.tensor([s.shape[0] for s in send], dtype=torch.int64, device=dev)
    recv_counts = torch.empty_like(send_counts)
    try:
        dist.all_to_all_single(recv_counts, send_counts, group=group)
    except RuntimeError as exc:
        if "not support" in str(exc).lower() or "unsupported" in str(exc).lower():
            raise NotImplementedError(
                f"backend {dist.get_backend(group)!r} has no all_to_all in this torch build ({exc}); "
                "use scheme='allgather_reducescatter'"
            ) from exc
        raise
    recv = [int(c) for c in recv_counts.cpu()]
    flat_send = torch.cat([s.to(dev) for s in send]) if send else torch.empty(0, width, dtype=torch.uint8, device=dev)
    flat_recv = torch.empty(sum(recv), width, dtype=torch.uint8, device=dev)
    # Every rank enters the collective, even with nothing to send or receive.
    dist.all_to_all_single(flat_recv, flat_send, output_split_sizes=recv,
                           input_split_sizes=[s.shape[0] for s in send], group=group)
    out, off = [], 0
    for c in recv:
        out.append(flat_recv[off : off + c].to(send[0].device))
        off += c
    return out

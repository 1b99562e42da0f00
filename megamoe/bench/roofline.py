"""Napkin floors for one MoE step: the bytes it must move and the FLOPs it must do, over the ceilings.

    weight bytes     distinct experts routed in the step (on the rank) x expert_weight_bytes(bytes/weight)
    activation bytes x staged e4m3 [T, H] + fp32 scales [T, H/128] read, y bf16 [T, H] written,
                     topk_idx int64 + topk_weights fp32 [T, K] read
    FLOPs            routed (unmasked) rows x flops_per_routed_row = 2 (2I H + H I) per (token, slot)
    floor            max(bytes / copy bandwidth, FLOPs / FP8 rate); ``bound`` names the larger term
    read             the measured time of the fastest plain read of the same bytes (``ceilings.ReadCeiling``):
                     the size-aware ceiling; "of read" = read time / kernel time, beside "of floor". Beside it the
                     kernel that read fastest and the streaming read's time (the ceiling until issue 47)

Bytes per weight: MXFP4 = 4 bits + one E8M0 byte per 32 = 0.53125; FP8 block = 1 + 4 / (128 * 128).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ..geometry import Geometry
from .ceilings import Ceilings

BYTES_PER_WEIGHT = {
    "mxfp4": 0.5 + 1 / 32,  # 0.53125
    "fp8_block": 1 + 4 / (128 * 128),
    "bf16": 2.0,
}


def bytes_per_weight(weight_format: str) -> float:
    try:
        return BYTES_PER_WEIGHT[weight_format]
    except KeyError:
        raise ValueError(f"unknown weight format {weight_format!r}; expected one of {sorted(BYTES_PER_WEIGHT)}") from None


def distinct_experts(topk_idx: torch.Tensor, lo: int = 0, hi: int | None = None) -> int:
    """Number of distinct experts in [lo, hi) that at least one unmasked slot routes to."""
    idx = topk_idx.reshape(-1)
    idx = idx[idx >= lo]
    if hi is not None:
        idx = idx[idx < hi]
    return int(torch.unique(idx).numel())


def routed_rows(topk_idx: torch.Tensor) -> int:
    return int((topk_idx >= 0).sum())


@dataclass
class Floor:
    num_tokens: int
    experts_touched: int
    routed_rows: int
    weight_bytes: float
    activation_bytes: float
    flops: float
    hbm_us: float
    compute_us: float
    weight_format: str
    read_us: float | None = None  # the fastest plain read of ``bytes``, measured (None: not measured)
    read_kernel: str | None = None  # which read that was (a ``ceilings.ReadCandidate`` name)
    read_us_stream: float | None = None  # the streaming read of ``bytes`` (None: not a candidate here)

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.activation_bytes

    @property
    def floor_us(self) -> float:
        return max(self.hbm_us, self.compute_us)

    @property
    def bound(self) -> str:
        return "HBM" if self.hbm_us >= self.compute_us else "FP8"

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(bytes=self.bytes, floor_us=self.floor_us, bound=self.bound)
        return d


def activation_bytes(g: Geometry, num_tokens: int) -> float:
    t, h, k = num_tokens, g.hidden, g.num_topk
    return t * h * 1 + t * (h // 128) * 4 + t * h * 2 + t * k * (8 + 4)


def step_floor(
    g: Geometry,
    topk_idx: torch.Tensor,
    ceilings: Ceilings,
    weight_format: str = "mxfp4",
    *,
    expert_range: tuple[int, int] | None = None,
    read=None,
) -> Floor:
    """The floor of one step whose routing is ``topk_idx`` [T, K] (-1 = masked); ``read``: a
    ``ceilings.ReadCeiling`` whose measured reads of the step's bytes go into ``read_us`` (the fastest),
    ``read_kernel`` and ``read_us_stream``."""
    t = topk_idx.shape[0]
    lo, hi = expert_range or (0, g.num_experts)
    n_exp = distinct_experts(topk_idx, lo, hi)
    rows = routed_rows(topk_idx) if expert_range is None else int(((topk_idx >= lo) & (topk_idx < hi)).sum())
    wbytes = n_exp * g.expert_weight_bytes(bytes_per_weight(weight_format))
    abytes = activation_bytes(g, t)
    flops = float(rows * g.flops_per_routed_row())
    hbm_us = (wbytes + abytes) / (ceilings.copy_gbps * 1e9) * 1e6
    compute_us = flops / (ceilings.fp8_tflops * 1e12) * 1e6
    rec = {} if read is None else read.record(wbytes + abytes)
    return Floor(t, n_exp, rows, wbytes, abytes, flops, hbm_us, compute_us, weight_format, rec.get("us"),
                 rec.get("best"), rec.get("stream_us"))


def achieved(floor: Floor, time_us: float, ceilings: Ceilings) -> dict:
    """TFLOP/s, GB/s (of the floor's bytes), their fractions of the ceilings, and the time as a fraction of
    the floor and of a plain read of the same bytes (when measured: the fastest read, and the streaming read
    beside it), for a measured time."""
    s = time_us * 1e-6
    tflops = floor.flops / s / 1e12 if s > 0 else float("nan")
    gbps = floor.bytes / s / 1e9 if s > 0 else float("nan")
    return {
        "tflops": tflops,
        "gbps": gbps,
        "frac_fp8_peak": tflops / ceilings.fp8_tflops,
        "frac_copy_bw": gbps / ceilings.copy_gbps,
        "floor_us": floor.floor_us,
        "frac_of_floor": floor.floor_us / time_us if time_us > 0 else float("nan"),  # 1.0 = at the floor
        "bound": floor.bound,
        "read_us": floor.read_us,
        "frac_of_read": _frac(floor.read_us, time_us),  # 1.0 = as fast as the fastest read
        "read_kernel": floor.read_kernel,
        "read_us_stream": floor.read_us_stream,
        "frac_of_read_stream": _frac(floor.read_us_stream, time_us),
    }


def _frac(read_us: float | None, time_us: float) -> float | None:
    return read_us / time_us if read_us and time_us > 0 else None

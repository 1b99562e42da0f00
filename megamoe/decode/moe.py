"""The whole decode path on staged inputs: ``moe_decode`` (four Triton launches, or two with
``LaunchConfig.fused``: routing, then L1 + L2 + combine in one, ``triton_fused.py``) beside
``moe_decode_torch`` (the twins of the four stages). Given ``TCWeights`` (``layout_tc.py``) instead of
``DecodeWeights``, L1 and L2 are the tensor-core GEMVs of ``tc.py`` (recipe megamoe-decode-tc). Both read a
``DecodeBuffers`` that ``stage`` filled.

    route    topk_idx, topk_weights, x_q -> pool order, work items, x32      (routing.py)
    l1       gate/up GEMV, SwiGLU, routing weight, FP8 requant per 32      (gemv.py)
    l2       down GEMV -> bf16 per (token, slot)
    combine  FP32 slot-ordered sum, one bf16 rounding

No host sync and no allocation after ``DecodeBuffers.allocate``: every grid is sized from the token
count alone (W = min(E_l, T K) work items; programs past ``num_touched`` exit at once), so one call can
be captured in a CUDA graph and replayed after each ``stage``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, fields

import torch

from ..geometry import Geometry
from . import cuda_step, gemv, routing, tc
from .gemv import LaunchConfig
from .layout import DecodeWeights
from .layout_tc import TCWeights

MAX_TOKENS = 64  # the routing kernel sorts all T * K slots in one program


@dataclass
class DecodeBuffers:
    """Everything the four launches read or write, for ``capacity`` tokens (C), S = C * K pool rows,
    W = min(E_l, S) work items.

        x_q e4m3 [C, H], x_sf fp32 [C, H/128], topk_idx int64 [C, K], topk_weights fp32 [C, K]   staged
        x32 fp32 [C, H]                       e4m3 values of x_q
        num_touched int32 [1]; touched, seg_start, seg_count int32 [W]
        row_token int32 [S], row_weight fp32 [S], slot_row int32 [S]
        l1_out fp32 [S, 2I] (written when LaunchConfig.store_l1), l2_q uint8 [S, I], l2_x fp32 [S, I],
        l2_sf fp32 [S, I/32], slot_out int16 (bf16 bits) [S, H], y bf16 [C, H]
        counters int32 [W + C * H/32 + 1]  the fused launch's done[W], tile counts [C, H/BN2] and error flag
        step_sync int32 [cuda_step.sync_words(H)]   the 1-token CUDA step's combine counts, L1 tiles done per
                                           item (up to 8) and CTAs done
        split_terms fp32 [S', H/128, 2I], split_counts int32 [W' * I/32]   the tensor-core L1's split K
                                           (``LaunchConfig.tc_split``) for up to ``split_tokens`` tokens:
                                           S' = split_tokens * K pool rows, W' = min(E_l, S') work items
        stamps int64 [2, P, 16] or None    set by a caller that wants the tensor-core L1's (0) and L2's (1)
                                           timeline, P >= each launch's programs (``stamps.stamp_buffer``)
    """

    x_q: torch.Tensor
    x_sf: torch.Tensor
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    x32: torch.Tensor
    num_touched: torch.Tensor
    touched: torch.Tensor
    seg_start: torch.Tensor
    seg_count: torch.Tensor
    row_token: torch.Tensor
    row_weight: torch.Tensor
    slot_row: torch.Tensor
    l1_out: torch.Tensor
    l2_q: torch.Tensor
    l2_x: torch.Tensor
    l2_sf: torch.Tensor
    slot_out: torch.Tensor
    y: torch.Tensor
    counters: torch.Tensor
    split_terms: torch.Tensor
    split_counts: torch.Tensor
    step_sync: torch.Tensor
    num_local: int = 0
    expert_lo: int = 0
    stamps: torch.Tensor | None = None

    @property
    def interpret(self) -> bool:
        """Whether the Triton kernels run under the CPU interpreter (TRITON_INTERPRET=1 before import)."""
        from ..staging.triton_stage import is_interpreted

        return is_interpreted()

    @classmethod
    def allocate(cls, g: Geometry, capacity: int, device, *, num_local: int | None = None, expert_lo: int = 0,
                 l2_group: int = 32, split_tokens: int = 0) -> "DecodeBuffers":
        if not 0 < capacity <= MAX_TOKENS:
            raise ValueError(f"capacity must be in [1, {MAX_TOKENS}] tokens per rank, got {capacity}")
        h, i, k = g.hidden, g.intermediate, g.num_topk
        el = g.num_experts if num_local is None else num_local
        s = capacity * k
        w = min(el, s)
        s_split = min(capacity, split_tokens) * k
        f32, i32 = torch.float32, torch.int32

        def e(*shape, dtype=f32):
            return torch.empty(shape, dtype=dtype, device=device)

        return cls(
            x_q=e(capacity, h, dtype=torch.float8_e4m3fn), x_sf=e(capacity, h // 128),
            topk_idx=torch.full((capacity, k), -1, dtype=torch.int64, device=device), topk_weights=e(capacity, k),
            x32=e(capacity, h), num_touched=torch.zeros(1, dtype=i32, device=device), touched=e(w, dtype=i32),
            seg_start=e(w, dtype=i32), seg_count=e(w, dtype=i32), row_token=e(s, dtype=i32), row_weight=e(s),
            slot_row=e(s, dtype=i32), l1_out=e(s, 2 * i), l2_q=e(s, i, dtype=torch.uint8), l2_x=e(s, i),
            l2_sf=e(s, i // l2_group), slot_out=e(s, h, dtype=torch.int16), y=e(capacity, h, dtype=torch.bfloat16),
            counters=torch.zeros(w + capacity * (h // 32) + 1, dtype=i32, device=device),
            split_terms=e(s_split, h // 128, 2 * i),
            split_counts=torch.zeros(min(el, s_split) * (i // 32), dtype=i32, device=device),
            step_sync=torch.zeros(cuda_step.sync_words(h), dtype=i32, device=device),
            num_local=el, expert_lo=expert_lo,
        )

    @property
    def capacity(self) -> int:
        return self.x_q.shape[0]

    @property
    def num_topk(self) -> int:
        return self.topk_idx.shape[1]

    @property
    def split_tokens(self) -> int:
        """Tokens a launch with a split K (``LaunchConfig.tc_split`` > 1) may have."""
        return self.split_terms.shape[0] // self.num_topk

    def max_work(self, num_tokens: int) -> int:
        """Work items a launch of num_tokens tokens can have: min(E_l, T K)."""
        return min(self.num_local, num_tokens * self.num_topk)

    def poison_(self) -> None:
        """Every output region to NaN / 0x7F bytes, so that an element no stage wrote shows."""
        for f in fields(self):
            t = getattr(self, f.name)
            if isinstance(t, torch.Tensor) and f.name not in ("x_q", "x_sf", "topk_idx", "topk_weights", "counters",
                                                                 "split_counts", "step_sync"):
                if t.dtype.is_floating_point:
                    t.fill_(float("nan"))
                else:
                    t.view(torch.uint8).fill_(0x7F)


def _check(dw: DecodeWeights, buf: DecodeBuffers, num_tokens: int) -> None:
    if not 0 <= num_tokens <= buf.capacity:
        raise ValueError(f"num_tokens must be in [0, {buf.capacity}] (the buffers' capacity), got {num_tokens}")
    if dw.num_experts != buf.num_local:
        raise ValueError(f"the weights hold {dw.num_experts} experts but the buffers route over {buf.num_local}")


def one_cuda_launch(tw: TCWeights, buf: DecodeBuffers, num_tokens: int, cfg: LaunchConfig) -> bool:
    """Whether ``moe_decode`` runs this step as the one CUDA launch (``LaunchConfig.tc_cuda_step1``, 1 token). When
    the config asks for it at 1 token and this machine cannot run it, a RuntimeWarning says why (once per reason
    and call site, Python's default filter) and the Triton launches run instead: the same bits, another speed."""
    if not cfg.tc_cuda_step1 or num_tokens != 1:
        return False
    why = cuda_step.unsupported(tw, buf, num_tokens)
    if why is not None:
        warnings.warn(f"LaunchConfig.tc_cuda_step1: the 1-token CUDA step cannot run here ({why}); the Triton "
                      "launches run instead, with the same bits", RuntimeWarning, stacklevel=3)
    return why is None


def moe_decode(dw: DecodeWeights | TCWeights, buf: DecodeBuffers, num_tokens: int, clamp: float,
               cfg: LaunchConfig = LaunchConfig()) -> torch.Tensor:
    """The Triton launches (four; three when the tensor-core L1 routes for itself, ``LaunchConfig.tc_route``; one
    CUDA launch with ``LaunchConfig.tc_cuda_step1`` at 1 token where ``cuda_step`` can run, the same bits) on the
    first num_tokens staged tokens -> y [num_tokens, H] bf16 (a view of ``buf.y``). No host sync."""
    _check(dw, buf, num_tokens)
    tensor_cores = isinstance(dw, TCWeights)  # the tensor-core GEMVs (recipe megamoe-decode-tc) read x_q itself
    if tensor_cores and one_cuda_launch(dw, buf, num_tokens, cfg):
        return cuda_step.step(dw, buf, clamp)  # the whole 1-token step in one launch, the same bits
    if not (tensor_cores and cfg.tc_route):  # (tc_route: L1 routes for itself)
        routing.route(buf.topk_idx, buf.topk_weights, buf.x_q, num_tokens, buf.expert_lo, buf.num_local, buf,
                      cfg.pdl, full=not tensor_cores)
    if tensor_cores:
        tc.l1_tc(dw, buf, num_tokens, clamp, cfg)
        tc.l2_tc(dw, buf, num_tokens, cfg)
        gemv.combine(buf, num_tokens, buf.num_topk, cfg)
    elif cfg.fused:
        gemv.fused(dw, buf, num_tokens, clamp, cfg)
    else:
        gemv.l1(dw, buf, num_tokens, clamp, cfg)
        gemv.l2(dw, buf, num_tokens, cfg)
        gemv.combine(buf, num_tokens, buf.num_topk, cfg)
    return buf.y[:num_tokens]


def moe_decode_torch(dw: DecodeWeights | TCWeights, buf: DecodeBuffers, num_tokens: int, clamp: float,
                     cfg: LaunchConfig = LaunchConfig()) -> torch.Tensor:
    """``moe_decode`` through the four stages' torch twins (host syncs; for checking)."""
    _check(dw, buf, num_tokens)
    routing.route_torch(buf.topk_idx, buf.topk_weights, buf.x_q, num_tokens, buf.expert_lo, buf.num_local, buf)
    if isinstance(dw, TCWeights):
        tc.l1_tc_torch(dw, buf, num_tokens, clamp, cfg)
        tc.l2_tc_torch(dw, buf, num_tokens, cfg)
    else:
        gemv.l1_torch(dw, buf, num_tokens, clamp, cfg)
        gemv.l2_torch(dw, buf, num_tokens, cfg)
    gemv.combine_torch(buf, num_tokens, buf.num_topk, cfg)
    return buf.y[:num_tokens]

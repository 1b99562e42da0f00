"""The unfused peer: DeepGEMM contiguous grouped FP8 GEMMs with the library's own dispatch,
SwiGLU + FP8 requant and combine in PyTorch (what a framework runs without a fused kernel).

    stage    per_token_cast_to_fp8 (megamoe.layouts.staging), written into preallocated buffers
    layout   on device: stable sort of the slots' experts, segments aligned to
             deep_gemm.get_mk_alignment_for_contiguous_layout(), unused rows expert -1
    dispatch index_select of x codes / scales into the pool (padding rows: zero codes, scale 1)
    L1       deep_gemm.m_grouped_fp8_gemm_nt_contiguous -> bf16 [P, 2I]   (gate | up, not interleaved)
    SwiGLU   clamp, silu(g) * u * topk_weight in FP32, then per_token_cast_to_fp8's rule per 128 (continuous)
    L2       deep_gemm.m_grouped_fp8_gemm_nt_contiguous -> bf16 [P, H]
    combine  megamoe.reference.pipeline.combine's rule (FP32 slot-ordered sum, one bf16 rounding)

Its numerics are ``DEEPGEMM_STAGED_FP8``: the L1 output is rounded to bf16 by the GEMM before the
SwiGLU, and the L2 activation scale is DeepGEMM's staging rule (amax floored at 1e-4, continuous).

``launch`` does no host sync and its glue allocates nothing: every tensor it writes is a view of a
buffer made once by ``allocate`` (``StagedBuffers``), and every shape it uses is fixed by
``num_tokens`` alone. So one launch can be captured in a CUDA graph (after ``build``, which
JIT-compiles the GEMMs) and replayed after each ``stage``. What DeepGEMM takes internally (e.g. for
its scale-layout transform) comes from the caching allocator, or from the graph's pool under capture.

The price of no sync: the pool is sized for the worst routing of ``num_tokens`` tokens
(``pool_rows_bound``), so the grouped GEMMs also run over 128-row blocks that no slot uses. Their
``m_indices`` are -1 and DeepGEMM skips their MMAs, but it still loads their tiles, which the
host-synced layout (sized from the routing) did not do.

The layout and glue are plain functions (``device_layout``, ``staged_forward``) over a
``StagedBuffers`` with the grouped GEMM passed in, so they run on a CPU with a stand-in GEMM.
"""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass, fields
from typing import Callable

import torch

from ..geometry import Geometry
from ..inputs import MoEInputs
from ..layouts.staging import _INV_448_FP32, per_token_cast_to_fp8, per_token_cast_to_fp8_into
from ..recipe import DEEPGEMM_SM90_FP8, Recipe
from ..weights import FP8BlockWeights
from .base import FusedBackend, Plan, kernel_availability

DEEPGEMM_STAGED_FP8 = DEEPGEMM_SM90_FP8.with_(
    name="deepgemm-staged-fp8",
    kernel="deep_gemm.m_grouped_fp8_gemm_nt_contiguous x2 + torch glue (sgl-deep-gemm 0.1.5.post1)",
    gate_up_bf16=True,
    l2_group=128,
    l2_scale="continuous",
    l2_amax_floor=1e-4,
)

# m_grouped_fp8_gemm_nt_contiguous((a, a_sf), (b, b_sf), out, m_indices): a e4m3 [P, K], a_sf fp32
# [P, K/128], b e4m3 [E, N, K], b_sf fp32 [E, N/128, K/128], out bf16 [P, N], m_indices int32 [P].
GroupedGemm = Callable[[tuple, tuple, torch.Tensor, torch.Tensor], None]


def pool_rows_bound(num_tokens: int, num_topk: int, num_experts: int, align: int) -> int:
    """The most pool rows ``num_tokens`` tokens can need: sum over experts of
    ceil(count_e / align) * align, maximised over routings with sum(count_e) <= N = num_tokens * K.

    With s experts non-empty, the blocks are at most s + floor((N - s) / align), which does not
    decrease with s; so the bound is n + floor((N - n) / align) blocks with n = min(E, N). It is
    reached (one slot on each of n - 1 experts, the rest on one), and it is at most one block below
    round_up(N + E * (align - 1), align)."""
    n_slots = num_tokens * num_topk
    n = min(num_experts, n_slots)
    return (n + (n_slots - n) // align) * align


@dataclass
class StagedBuffers:
    """Everything ``stage`` and ``launch`` write, allocated once for ``capacity`` tokens.

    N = capacity * K slots, Pm = pool_rows_bound(capacity), S = Pm + N (pool rows, then one private
    sink row per slot: masked slots are scattered there, so no index is written twice).

        x_q      uint8 (e4m3 codes) [capacity + 1, H]  staged x; row ``capacity`` is all zero codes
        x_sf     fp32 [capacity + 1, H/128]            its scales; row ``capacity`` is 1.0
        idx      int64 [capacity, K]                   staged routing, rows past T are -1
        w        fp32 [capacity, K]                    staged routing weights, rows past T are 0
        key, skey      int32 [N]   expert of each slot (masked -> E), and sorted (stable)
        order          int64 [N]   flat slot t * K + k of each sorted position
        dest           int64 [N]   pool row of each sorted position (sink rows for masked slots)
        tmp            int64 [N]
        wsort          fp32 [N]
        pos            int64 [N]   arange
        experts        int32 [E + 1]  arange
        bounds         int64 [E + 1]  first sorted position of each expert (E: the masked slots)
        padded         int64 [E]      counts rounded up to align
        starts         int64 [E + 1]  pool row of each expert's segment; starts[E] = Pm (the sink)
        row_token      int64 [S]   token of each pool row (``capacity``, the zero row, on padding)
        row_weight     fp32 [S]    routing weight of each pool row (0 on padding)
        m_indices      int32 [S]   expert of each pool row, -1 on padding (DeepGEMM's layout)
        slot_row       int64 [N]   pool row of each slot, Pm (a zero row of ``l2_out``) if masked
        filled         bool [capacity, K]
        pool_x   uint8 (e4m3) [Pm, H],  pool_sf fp32 [Pm, H/128]
        h        bf16 [Pm, 2I]                         L1 output
        ws_a, ws_b     fp32 [Pm, I]   SwiGLU / requant workspaces
        l2_q     uint8 (e4m3) [Pm, I],  l2_sf fp32 [Pm, I/128],  l2_inv fp32 [Pm, I/128]
        l2_out   bf16 [Pm + 1, H]                      L2 output; row Pm stays zero
        slots    bf16 [N, H]                           per-slot outputs gathered for the combine
        acc, acc_tmp   fp32 [capacity, H]
        y        bf16 [capacity, H]
        inv448   fp32 []                               fl32(1/448), on the device
    """

    x_q: torch.Tensor
    x_sf: torch.Tensor
    idx: torch.Tensor
    w: torch.Tensor
    key: torch.Tensor
    skey: torch.Tensor
    order: torch.Tensor
    dest: torch.Tensor
    tmp: torch.Tensor
    wsort: torch.Tensor
    pos: torch.Tensor
    experts: torch.Tensor
    bounds: torch.Tensor
    padded: torch.Tensor
    starts: torch.Tensor
    row_token: torch.Tensor
    row_weight: torch.Tensor
    m_indices: torch.Tensor
    slot_row: torch.Tensor
    filled: torch.Tensor
    pool_x: torch.Tensor
    pool_sf: torch.Tensor
    h: torch.Tensor
    ws_a: torch.Tensor
    ws_b: torch.Tensor
    l2_q: torch.Tensor
    l2_sf: torch.Tensor
    l2_inv: torch.Tensor
    l2_out: torch.Tensor
    slots: torch.Tensor
    acc: torch.Tensor
    acc_tmp: torch.Tensor
    y: torch.Tensor
    inv448: torch.Tensor
    g: Geometry = None  # type: ignore[assignment]
    capacity: int = 0
    align: int = 0
    max_pool_rows: int = 0

    @classmethod
    def allocate(cls, g: Geometry, capacity: int, align: int, device) -> "StagedBuffers":
        e, k, h, i = g.num_experts, g.num_topk, g.hidden, g.intermediate
        if capacity <= 0 or align <= 0:
            raise ValueError(f"capacity and align must be positive, got {capacity}, {align}")
        n = capacity * k
        pm = pool_rows_bound(capacity, k, e, align)
        s = pm + n

        def z(*shape, dtype):
            return torch.zeros(shape, dtype=dtype, device=device)

        i64, i32, f32, bf16, u8 = torch.int64, torch.int32, torch.float32, torch.bfloat16, torch.uint8
        buf = cls(
            x_q=z(capacity + 1, h, dtype=u8), x_sf=z(capacity + 1, h // 128, dtype=f32),
            idx=torch.full((capacity, k), -1, dtype=i64, device=device), w=z(capacity, k, dtype=f32),
            key=z(n, dtype=i32), skey=z(n, dtype=i32), order=z(n, dtype=i64), dest=z(n, dtype=i64),
            tmp=z(n, dtype=i64), wsort=z(n, dtype=f32), pos=torch.arange(n, dtype=i64, device=device),
            experts=torch.arange(e + 1, dtype=i32, device=device), bounds=z(e + 1, dtype=i64),
            padded=z(e, dtype=i64), starts=z(e + 1, dtype=i64),
            row_token=torch.full((s,), capacity, dtype=i64, device=device), row_weight=z(s, dtype=f32),
            m_indices=torch.full((s,), -1, dtype=i32, device=device), slot_row=torch.full((n,), pm, dtype=i64, device=device),
            filled=z(capacity, k, dtype=torch.bool),
            pool_x=z(pm, h, dtype=u8), pool_sf=torch.ones(pm, h // 128, dtype=f32, device=device),
            h=z(pm, 2 * i, dtype=bf16), ws_a=z(pm, i, dtype=f32), ws_b=z(pm, i, dtype=f32),
            l2_q=z(pm, i, dtype=u8), l2_sf=torch.ones(pm, i // 128, dtype=f32, device=device),
            l2_inv=torch.ones(pm, i // 128, dtype=f32, device=device), l2_out=z(pm + 1, h, dtype=bf16),
            slots=z(n, h, dtype=bf16), acc=z(capacity, h, dtype=f32), acc_tmp=z(capacity, h, dtype=f32),
            y=z(capacity, h, dtype=bf16),
            inv448=_INV_448_FP32.to(device),  # fl32(1/448), staging's own constant
            g=g, capacity=capacity, align=align, max_pool_rows=pm,
        )
        buf.x_sf[capacity] = 1.0
        buf.starts[e] = pm
        return buf

    def tensors(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), torch.Tensor)}

    def pool_rows(self, num_tokens: int) -> int:
        return pool_rows_bound(num_tokens, self.g.num_topk, self.g.num_experts, self.align)


def stage_into(buf: StagedBuffers, inputs: MoEInputs, num_tokens: int) -> None:
    """FP8-stage validated inputs (T tokens) into ``buf``; rows T..num_tokens-1 are padding routed
    to -1 with weight 0 (their x rows are never read)."""
    t = inputs.num_tokens
    if not t <= num_tokens <= buf.capacity:
        raise ValueError(f"need T={t} <= num_tokens={num_tokens} <= capacity={buf.capacity}")
    if t:
        q, sf = per_token_cast_to_fp8(inputs.x)
        buf.x_q[:t].copy_(q.view(torch.uint8))
        buf.x_sf[:t].copy_(sf)
        buf.idx[:t].copy_(inputs.topk_idx)
        buf.w[:t].copy_(inputs.topk_weights)
    buf.idx[t:num_tokens].fill_(-1)
    buf.w[t:num_tokens].fill_(0.0)


def device_layout(buf: StagedBuffers, num_tokens: int) -> int:
    """The contiguous grouped layout of the first ``num_tokens`` staged tokens, on device, without a
    host sync: returns P = pool_rows_bound(num_tokens) (a host int fixed by num_tokens) and writes
    ``m_indices[:P]``, ``row_token[:P]``, ``row_weight[:P]`` and ``slot_row[:num_tokens * K]``.

    Expert e's rows are [starts[e], starts[e] + count_e), in (token, slot) order, then padding to a
    multiple of ``align``; every row past the last used segment is padding too (expert -1). This is
    ``megamoe.reference.dispatch.build_layout`` row for row, followed by unused blocks."""
    g, e_n, k = buf.g, buf.g.num_experts, buf.g.num_topk
    n = num_tokens * k
    p = buf.pool_rows(num_tokens)
    key, skey, order, dest, tmp = buf.key[:n], buf.skey[:n], buf.order[:n], buf.dest[:n], buf.tmp[:n]
    # Expert of each slot, masked (-1) -> E: the floor remainder maps -1 to E and keeps 0..E-1.
    torch.remainder(buf.idx[:num_tokens].view(-1), e_n + 1, out=key)
    # Stable: inside one expert, positions keep the flat (token, slot) order, as build_layout's.
    torch.sort(key, stable=True, out=(skey, order))
    # bounds[e] = first sorted position of expert e, so count_e = bounds[e + 1] - bounds[e].
    torch.searchsorted(skey, buf.experts, out=buf.bounds)
    a = buf.align
    torch.sub(buf.bounds[1:], buf.bounds[:-1], out=buf.padded)
    buf.padded.add_(a - 1).div_(a, rounding_mode="floor").mul_(a)
    torch.cumsum(buf.padded[:-1], 0, out=buf.starts[1:e_n])  # starts[0] = 0 and starts[E] = Pm stay
    # Sorted position j of expert e goes to row starts[e] + (j - bounds[e]); masked slots (e = E)
    # go to their own sink rows Pm + (j - bounds[E]), past every pool row.
    torch.index_select(buf.starts, 0, skey, out=dest)
    torch.index_select(buf.bounds, 0, skey, out=tmp)
    dest.sub_(tmp).add_(buf.pos[:n])
    buf.m_indices[:p].fill_(-1)
    buf.row_token[:p].fill_(buf.capacity)
    buf.row_weight[:p].fill_(0.0)
    buf.m_indices.index_copy_(0, dest, skey)
    torch.div(order, k, rounding_mode="floor", out=tmp)
    buf.row_token.index_copy_(0, dest, tmp)
    torch.index_select(buf.w[:num_tokens].view(-1), 0, order, out=buf.wsort[:n])
    buf.row_weight.index_copy_(0, dest, buf.wsort[:n])
    # Each slot's pool row; masked slots (sink rows >= Pm) read row Pm of l2_out, which stays zero.
    buf.slot_row[:n].index_copy_(0, order, dest)
    buf.slot_row[:n].clamp_(max=buf.max_pool_rows)
    return p


def staged_forward(buf: StagedBuffers, num_tokens: int, weights: FP8BlockWeights, gemm: GroupedGemm,
                   recipe: Recipe = DEEPGEMM_STAGED_FP8) -> torch.Tensor:
    """The peer on the first ``num_tokens`` staged tokens -> y [num_tokens, H] bf16, a view of
    ``buf.y``. No host sync, no allocation (``gemm`` aside), shapes fixed by num_tokens."""
    if not (recipe.combine_bf16 and recipe.slot_output_bf16 and recipe.gate_up_bf16):
        raise ValueError(f"staged_forward implements bf16 slot outputs and combine, not recipe {recipe.name!r}")
    g = buf.g
    if num_tokens == 0:
        return buf.y[:0]
    p = device_layout(buf, num_tokens)
    e4m3 = torch.float8_e4m3fn
    torch.index_select(buf.x_q, 0, buf.row_token[:p], out=buf.pool_x[:p])
    torch.index_select(buf.x_sf, 0, buf.row_token[:p], out=buf.pool_sf[:p])
    m_idx = buf.m_indices[:p]
    h = buf.h[:p]
    gemm((buf.pool_x[:p].view(e4m3), buf.pool_sf[:p]), (weights.l1, weights.l1_scale), h, m_idx)
    # SwiGLU, in place, with the same FP32 operations in the same order as
    #   gt * (1.0 / (1.0 + torch.exp(-gt))) * up * w        (1.0 / t is t.reciprocal() * 1.0)
    i, c = g.intermediate, g.clamp
    gt, s = buf.ws_a[:p], buf.ws_b[:p]
    gt.copy_(h[:, :i]).clamp_(max=c)
    torch.neg(gt, out=s)
    s.exp_().add_(1.0).reciprocal_().mul_(gt)
    gt.copy_(h[:, i:]).clamp_(min=-c, max=c)  # gt now holds up
    s.mul_(gt).mul_(buf.row_weight[:p].unsqueeze(1))
    per_token_cast_to_fp8_into(s, buf.l2_q[:p].view(e4m3), buf.l2_sf[:p], buf.l2_inv[:p], gt, buf.inv448)
    out = buf.l2_out[:p]
    gemm((buf.l2_q[:p].view(e4m3), buf.l2_sf[:p]), (weights.l2, weights.l2_scale), out, m_idx)
    # Combine: megamoe.reference.pipeline.combine on slots [T, K, H] gathered from the pool, i.e.
    # acc = where(filled, acc + slot, acc) in FP32, slots in ascending order, one bf16 rounding.
    n, k = num_tokens * g.num_topk, g.num_topk
    slots = buf.slots[:n]
    torch.index_select(buf.l2_out, 0, buf.slot_row[:n], out=slots)
    slots = slots.view(num_tokens, k, g.hidden)
    filled = buf.filled[:num_tokens]
    torch.ge(buf.idx[:num_tokens], 0, out=filled)
    acc, tmp = buf.acc[:num_tokens], buf.acc_tmp[:num_tokens]
    acc.zero_()
    for j in range(k):
        tmp.copy_(slots[:, j]).add_(acc)  # slot + acc == acc + slot (IEEE addition commutes)
        torch.where(filled[:, j : j + 1], tmp, acc, out=acc)
    y = buf.y[:num_tokens]
    y.copy_(acc)
    return y


class StagedDeepGEMM(FusedBackend):
    name = "deepgemm-staged-fp8"
    recipe = DEEPGEMM_STAGED_FP8
    weight_format = "fp8_block"
    persistent = False
    fused = False
    kernel = DEEPGEMM_STAGED_FP8.kernel
    kernel_module = "deep_gemm"
    allows_zero_tokens = True
    # A promise: after build(), launch() does no host sync and its glue allocates nothing (every
    # buffer is made by allocate()), so one launch may be captured in a CUDA graph and replayed
    # after each stage() of the same token count.
    graph_capturable = True

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        from .deepgemm_fp8 import source_build_reason

        ok, why = kernel_availability(
            lambda: importlib.import_module("deep_gemm"), "deep_gemm",
            ("m_grouped_fp8_gemm_nt_contiguous", "get_mk_alignment_for_contiguous_layout"))
        return (False, source_build_reason(cls.name)) if ok and source_build_reason(cls.name) else (ok, why)

    fixed_tile = "the contiguous layout's M alignment, deep_gemm.get_mk_alignment_for_contiguous_layout()"

    def legal_block_ms(self, num_tokens: int | None = None) -> tuple[int, ...]:
        return ()  # fixed_tile

    def _deep_gemm(self):
        import deep_gemm as dg

        self._gemm = dg.m_grouped_fp8_gemm_nt_contiguous
        self.align = int(dg.get_mk_alignment_for_contiguous_layout())

    def _prepare(self, weights) -> None:
        from ..layouts.deepgemm_sm90 import fp8_block_weights_for_kernel

        self.kernel_weights = fp8_block_weights_for_kernel(weights, self.name)
        self._deep_gemm()

    def _allocate(self) -> None:
        # No symmetric buffer (one rank, plain tensors): the staged inputs, the layout, the pool and
        # every intermediate, for `capacity` tokens at their worst routing.
        if not hasattr(self, "align"):
            self._deep_gemm()
        self.buffers = StagedBuffers.allocate(self.g, self.capacity, self.align, self.device)
        self._build_lock = threading.Lock()

    def plan(self, num_tokens: int) -> Plan:
        return Plan(block_m=getattr(self, "align", 0), detail={"source": "contiguous-layout M alignment"})

    def _build_job(self, num_tokens: int):
        """DeepGEMM JIT-compiles per GEMM shape: run both GEMMs once on this token count's pool, with
        every row expert -1 (all MMAs skipped), so that a later capture compiles nothing."""
        p = self.buffers.pool_rows(num_tokens)

        def warm() -> None:
            buf, w, e4m3 = self.buffers, self.kernel_weights, torch.float8_e4m3fn
            skip = torch.full((p,), -1, dtype=torch.int32, device=self.device)
            with self._build_lock:
                self._gemm((buf.pool_x[:p].view(e4m3), buf.pool_sf[:p]), (w.l1, w.l1_scale), buf.h[:p], skip)
                self._gemm((buf.l2_q[:p].view(e4m3), buf.l2_sf[:p]), (w.l2, w.l2_scale), buf.l2_out[:p], skip)

        return ("pool-rows", p), warm

    def _stage(self, inputs: MoEInputs, m: int) -> None:
        stage_into(self.buffers, inputs, m)

    def launch(self, num_tokens: int) -> torch.Tensor:
        """The layout, both GEMMs and the glue on what ``stage`` wrote -> y [num_tokens, H] bf16 (a
        view of the output buffer, overwritten by the next launch). No host sync, no allocation:
        capturable in a CUDA graph (``graph_capturable``) once ``build`` has compiled the GEMMs for
        this token count. ``num_tokens`` must be the count the last ``stage`` returned."""
        if num_tokens != getattr(self, "_staged", None):
            raise ValueError(f"{self.name}: launch({num_tokens}) but the last stage() staged {getattr(self, '_staged', None)} tokens")
        return staged_forward(self.buffers, num_tokens, self.kernel_weights, self._gemm, self.recipe)

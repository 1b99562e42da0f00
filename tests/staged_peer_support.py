"""Helpers of tests/test_staged_peer.py: a CPU stand-in for DeepGEMM's grouped FP8 GEMM, the old host-synced
glue kept as the oracle of the peer's sync-free one, the routing cases and a layout comparison."""

from __future__ import annotations

import functools

import torch

from megamoe.fused.staged_deepgemm import DEEPGEMM_STAGED_FP8, StagedBuffers
from megamoe.geometry import get_geometry
from megamoe.inputs import MoEInputs, make_inputs
from megamoe.layouts.staging import per_token_cast_to_fp8
from megamoe.reference.dispatch import build_layout, dispatch_slot_values, undispatch
from megamoe.reference.gemm import promoted_gemm
from megamoe.reference.pipeline import combine
from megamoe.testing import first_mismatch, fp8_block_weights
from megamoe.weights import random_mxfp4_weights

ALIGN = 128  # deep_gemm.get_mk_alignment_for_contiguous_layout() on the H200


@functools.lru_cache(maxsize=None)
def fp8_weights(preset: str):
    g = get_geometry(preset)
    return g, fp8_block_weights(random_mxfp4_weights(g, seed=5))


# ------------------------------------------------------------------------------------ the GEMM stand-in
def standin_gemm(a_pair, b_pair, out, m_indices, *, align: int = ALIGN, unused: float | None = float("nan")):
    """deep_gemm.m_grouped_fp8_gemm_nt_contiguous on a CPU: a e4m3 [P, K] + fp32 [P, K/128], b e4m3
    [E, N, K] + fp32 [E, N/128, K/128] -> out[p] = bf16(sum over K of the dequantized products) for rows
    with m_indices[p] >= 0, exact per 128-K block then FP32 promotion in ascending K (each row depends
    on its own inputs only). Rows with -1 get ``unused`` (NaN: any read of them shows; None: left as
    they are; 0.0: what DeepGEMM writes for a skipped half-block).

    It also checks the layout DeepGEMM assumes: int32 m_indices of P rows, P a multiple of ``align``,
    and every ``align``-row block either all -1 or led by its expert, with no other expert in it."""
    (a, a_sf), (b, b_sf) = a_pair, b_pair
    p = a.shape[0]
    assert a.dtype == b.dtype == torch.float8_e4m3fn and a_sf.dtype == b_sf.dtype == torch.float32
    assert m_indices.dtype == torch.int32 and m_indices.shape == (p,) and out.shape == (p, b.shape[1])
    assert p % align == 0, f"pool rows {p} not a multiple of {align}"
    blocks = m_indices.view(-1, align)
    lead = blocks[:, :1]
    bad = ((blocks >= 0) & ((blocks != lead) | (lead < 0))).any(dim=1)
    assert not bad.any(), f"illegal contiguous layout in blocks {bad.nonzero()[:, 0].tolist()}"
    if unused is not None:
        out[m_indices < 0] = unused
    for e in m_indices[m_indices >= 0].unique().tolist():
        rows = (m_indices == e).nonzero()[:, 0]
        out[rows] = promoted_gemm(a[rows].float(), a_sf[rows], b[e].float(), b_sf[e], 128).to(torch.bfloat16)


# ------------------------------------------------------------------------------------ the old glue (oracle)
def old_staged_launch(inputs: MoEInputs, m: int, g, weights, gemm, align: int = ALIGN) -> torch.Tensor:
    """The peer as it was before it went sync-free (host-synced build_layout, pools sized from the
    routing, allocations per call), kept verbatim in substance as the bitwise oracle."""
    t = inputs.num_tokens
    q, sf = per_token_cast_to_fp8(inputs.x) if t else (inputs.x.to(torch.float8_e4m3fn), inputs.x.new_zeros(0, g.hidden // 128, dtype=torch.float32))
    idx, w = inputs.topk_idx, inputs.topk_weights
    if m > t:
        pad = m - t
        q = torch.cat([q, q.new_zeros(pad, q.shape[1])])
        sf = torch.cat([sf, sf.new_zeros(pad, sf.shape[1])])
        idx = torch.cat([idx, idx.new_full((pad, idx.shape[1]), -1)])
        w = torch.cat([w, w.new_zeros(pad, idx.shape[1])])
    lay = build_layout([idx], 0, g.num_experts, align)
    p = lay.num_pool_rows
    if p == 0:
        return torch.zeros(m, g.hidden, dtype=torch.bfloat16)

    def gather_rows(v):
        dt = torch.uint8 if v.dtype == torch.float8_e4m3fn else v.dtype
        out = torch.zeros((p, *v.shape[1:]), dtype=dt).view(v.dtype)
        out[lay.is_real] = v[lay.src_token[lay.is_real]]
        return out

    pool_x, pool_sf = gather_rows(q), gather_rows(sf)
    pool_w = dispatch_slot_values([w], lay).nan_to_num(0.0)
    e = torch.searchsorted(lay.padded_offsets[1:], torch.arange(p), right=True)
    m_idx = torch.where(lay.is_real, e, torch.full_like(e, -1)).to(torch.int32)
    h = torch.empty(p, 2 * g.intermediate, dtype=torch.bfloat16)
    gemm((pool_x, pool_sf), (weights.l1, weights.l1_scale), h, m_idx)
    i = g.intermediate
    gt = h[:, :i].float().clamp(max=g.clamp)
    up = h[:, i:].float().clamp(min=-g.clamp, max=g.clamp)
    vw = gt * (1.0 / (1.0 + torch.exp(-gt))) * up * pool_w.unsqueeze(1)
    q2, sf2 = per_token_cast_to_fp8(vw)
    out = torch.empty(p, g.hidden, dtype=torch.bfloat16)
    gemm((q2, sf2), (weights.l2, weights.l2_scale), out, m_idx)
    slots, filled = undispatch([out], [lay], 0, int(m), g.num_topk)
    return combine(slots, filled, DEEPGEMM_STAGED_FP8)


# ------------------------------------------------------------------------------------ routing cases
def routing_cases(g):
    e = g.num_experts
    return [
        dict(t=0, m=0),
        dict(t=0, m=3),  # only padding past T
        dict(t=1, m=1),
        dict(t=1, m=4),
        dict(t=7, m=7, mask_prob=0.3, outlier_channels=8),  # |gate|, |up| past the clamp
        dict(t=33, m=40, mask_prob=0.2, fully_masked_tokens=(0, 5, 32)),
        dict(t=64, m=64, empty_experts=(1, e - 1), x_scale=4.0, outlier_channels=4),
        dict(t=129, m=131, skew=2.0, mask_prob=0.1),  # hot experts: segments of several blocks
        dict(t=200, m=256, skew=3.0, empty_experts=(0,)),
    ]


def inputs_for(g, c, seed):
    r = {k: v for k, v in c.items() if k not in ("t", "m")}
    return make_inputs(g, c["t"], seed=seed, **r), c["m"]


def layout_mismatch(buf: StagedBuffers, idx: torch.Tensor, m: int, p: int) -> str:
    """'' when the device layout (P rows) equals build_layout's row for row, with only unused
    (expert -1, zero-row) rows after it, and every slot's row and every expert's (token, slot) set
    agree; else what differs."""
    g, cap = buf.g, buf.capacity
    padded_idx = torch.cat([idx, idx.new_full((m - idx.shape[0], g.num_topk), -1)])
    lay = build_layout([padded_idx], 0, g.num_experts, buf.align)
    pr = lay.num_pool_rows
    if p < pr or p != buf.pool_rows(m):
        return f"pool rows {p}, build_layout needs {pr}, bound {buf.pool_rows(m)}"
    mi, tok, wt = buf.m_indices[:p], buf.row_token[:p], buf.row_weight[:p]
    rows = torch.arange(pr)
    want_e = torch.where(lay.is_real, torch.searchsorted(lay.padded_offsets[1:], rows, right=True), -1)
    want_t = torch.where(lay.is_real, lay.src_token, cap)
    for what, got, want in (("m_indices", mi[:pr].long(), want_e), ("row_token", tok[:pr], want_t)):
        if not torch.equal(got, want):
            return f"{what}: {first_mismatch(got, want)}"
    if (mi[pr:] != -1).any() or (tok[pr:] != cap).any() or (wt[pr:] != 0).any():
        return "rows past the used segments are not padding"
    w = buf.w[:m]
    want_w = torch.where(lay.is_real, w[lay.src_token.clamp(min=0), lay.src_slot.clamp(min=0)], 0.0)
    if not torch.equal(wt[:pr], want_w):
        return f"row_weight: {first_mismatch(wt[:pr], want_w)}"
    # Every slot's pool row: its own (token, slot) for routed slots, the zero row for masked ones.
    sr = buf.slot_row[: m * g.num_topk].view(m, g.num_topk)
    routed = padded_idx >= 0
    if (sr[~routed] != buf.max_pool_rows).any():
        return "a masked slot has a pool row"
    tt, kk = routed.nonzero(as_tuple=True)
    r = sr[tt, kk]
    if (r >= pr).any() or r.unique().numel() != r.numel():
        return "slot rows outside the used segments, or shared"
    if not (torch.equal(lay.src_token[r], tt) and torch.equal(lay.src_slot[r], kk) and torch.equal(tok[r], tt)):
        return "slot_row does not point at the slot's own pool row"
    # The same (token, slot) set per expert.
    for e in range(g.num_experts):
        mine = (mi[r] == e).nonzero()[:, 0]
        ours = set(zip(tt[mine].tolist(), kk[mine].tolist()))
        want = set(zip(*(t.tolist() for t in (padded_idx == e).nonzero(as_tuple=True))))
        if ours != want:
            return f"expert {e}: slots {sorted(ours ^ want)[:4]} differ"
    return ""

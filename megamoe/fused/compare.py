"""Stage-level comparison of a kernel's buffer against the reference's intermediates.

Pool row order differs between the kernel (nondeterministic, BLOCK_M-padded) and the reference
(expert, token, slot), so rows are matched by content:

    token of kernel pool row r   = the staged token whose FP8 codes equal pool_x[r] (hash, then exact check)
    slot  of kernel pool row r   = among that token's reference rows, the one whose L2-input codes agree
                                   most with the kernel's (rows of different experts share ~nothing)

Then: fraction of identical L2-input FP8 codes over the matched rows, and the scales, decoded from the
kernel's buffer under each plausible layout (row-major [P, I/G], K-major [I/G, P], K-major with each
BLOCK_M block padded to 128 rows), reporting the layout that matched and its exact-match rate.
"""

from __future__ import annotations

import torch

from ..layouts.staging import per_token_cast_to_fp8


def _row_hash(rows_u8: torch.Tensor) -> torch.Tensor:
    """uint8 [R, H] -> int64 [R], a content hash (exactness is checked afterwards)."""
    r, h = rows_u8.shape
    w = torch.arange(1, h // 4 + 1, device=rows_u8.device, dtype=torch.int64) * 2654435761 % 1000003 + 1
    return (rows_u8.contiguous().view(torch.int32).to(torch.int64) * w).sum(dim=1)


def match_pool_tokens(pool_x: torch.Tensor, x_q: torch.Tensor) -> torch.Tensor:
    """pool_x e4m3 [P, H], x_q e4m3 [T, H] -> int64 [P]: the token of each pool row, -1 where none
    matches exactly (padding, poison, stale rows). Tokens with identical rows map to the first."""
    if x_q.shape[0] == 0 or pool_x.shape[0] == 0:
        return torch.full((pool_x.shape[0],), -1, dtype=torch.int64, device=pool_x.device)
    pu, xu = pool_x.view(torch.uint8), x_q.view(torch.uint8)
    hx, hp = _row_hash(xu), _row_hash(pu)
    order = torch.argsort(hx, stable=True)
    hs = hx[order]
    pos = torch.searchsorted(hs, hp).clamp(max=hs.numel() - 1)
    tok = order[pos]
    ok = (hs[pos] == hp) & (pu == xu[tok]).all(dim=1)
    return torch.where(ok, tok, torch.full_like(tok, -1))


def compare_l2_inputs(kernel: dict, ref_stage, inputs, num_topk: int, chunk: int = 4096) -> dict:
    """kernel: intermediates() of a backend; ref_stage: RankStages of the reference (keep_stages=True).

    Returns {'rows_matched', 'rows_expected', 'code_match', 'sf_match', 'sf_layout', 'slot_margin'}."""
    dev = kernel["pool_x"].device
    x_q, _ = per_token_cast_to_fp8(inputs.x.to(dev))
    tok = match_pool_tokens(kernel["pool_x"], x_q)
    lay = ref_stage.layout
    t = inputs.num_tokens
    table = torch.full((t, num_topk), -1, dtype=torch.int64, device=dev)
    real = (lay.src_token >= 0).to(dev)
    rrows = torch.nonzero(real).squeeze(1)
    table[lay.src_token.to(dev)[rrows], lay.src_slot.to(dev)[rrows]] = rrows
    ref_codes = ref_stage.l2_in.to(dev).view(torch.uint8)
    k_codes = kernel["l2_in"].view(torch.uint8)
    krows = torch.nonzero(tok >= 0).squeeze(1)
    best_ref = torch.full_like(krows, -1)
    best_agree = torch.zeros(krows.numel(), device=dev)
    margin = torch.ones(krows.numel(), device=dev)
    for s in range(0, krows.numel(), chunk):
        kr = krows[s : s + chunk]
        cand = table[tok[kr]]  # [R, K]
        valid = cand >= 0
        kc = k_codes[kr].unsqueeze(1)  # [R, 1, I]
        rc = ref_codes[cand.clamp(min=0)]  # [R, K, I]
        agree = (kc == rc).float().mean(dim=2).masked_fill(~valid, -1.0)
        top = agree.topk(min(2, num_topk), dim=1)
        best_agree[s : s + chunk] = top.values[:, 0]
        best_ref[s : s + chunk] = cand.gather(1, top.indices[:, :1]).squeeze(1)
        if num_topk > 1:
            margin[s : s + chunk] = top.values[:, 0] - top.values[:, 1].clamp(min=0)
    n = krows.numel()
    out = {
        "rows_expected": int(rrows.numel()),
        "rows_matched": int(n),
        "rows_duplicate": int(n - torch.unique(best_ref).numel()) if n else 0,
        "code_match": float(best_agree.mean()) if n else float("nan"),
        "code_match_min_row": float(best_agree.min()) if n else float("nan"),
        "slot_margin_min": float(margin.min()) if n else float("nan"),
    }
    if ref_stage.l2_in_sf is not None and n:
        ref_sf = ref_stage.l2_in_sf.to(dev)[best_ref]  # [R, I/G_ref]
        out.update(_match_scales(kernel, krows, ref_sf, kernel.get("block_m")))
    return out


def _match_scales(kernel: dict, krows: torch.Tensor, ref_sf: torch.Tensor, block_m) -> dict:
    """The kernel's scales of the matched rows against the reference's: exact-match rate and relative
    error (continuous FP32 scales differ in their last bits wherever the amax element does). A kernel
    that names its layout (``l2_in_sf_rowmajor`` + ``block_m``) is read with it; otherwise every
    plausible layout is tried and the one closest to the reference is kept."""
    ng = ref_sf.shape[1]
    cands: dict[str, torch.Tensor] = {}
    named = kernel.get("l2_in_sf_rowmajor")
    pool = kernel.get("l2_in_sf_pool")  # [P_sf, I/G]: the scales of pool row r are row r
    if pool is not None:
        cands["pool-rows"] = pool.float()[krows, :ng]
    elif named is not None and block_m:
        bm = int(block_m)
        idx = (krows // bm) * ((bm + 127) // 128 * 128) + krows % bm
        if int(idx.max()) < named.shape[0]:
            cands[f"row-major-padded-bm{bm}"] = named.float()[idx, :ng]
    else:
        raw = kernel.get("l2_in_sf_kmajor")
        if raw is None:
            raw = kernel.get("l2_in_sf_raw", named)
        if raw is None:
            return {}
        raw = raw.float() if raw.dtype.is_floating_point else raw.view(torch.float32)
        views = [raw]
        if raw.ndim == 2 and raw.shape[0] > raw.shape[1]:
            views.append(raw.reshape(raw.shape[1], raw.shape[0]))  # MN-major storage behind a [P, K] view
        for vi, raw in enumerate(views):
            _candidates(raw, krows, ng, cands, "" if vi == 0 else "reinterp-")
    best, best_key = None, None
    for name, v in cands.items():
        rel = (v / ref_sf - 1).abs().nan_to_num(float("inf"))
        key = (float((v == ref_sf).float().mean()), -float(rel.median()))
        if best_key is None or key > best_key:
            best, best_key = (name, rel), key
    if best is None:
        return {"sf_layout": "none", "sf_match": 0.0}
    name, rel = best
    return {"sf_layout": name, "sf_match": best_key[0], "sf_rel_median": float(rel.median()),
            "sf_rel_max": float(rel.max())}


def _candidates(raw, krows, ng, cands, prefix):
    if raw.ndim == 2:
        a, b = raw.shape
        if b >= ng and a > krows.max():
            cands[prefix + "row-major"] = raw[krows, :ng]
        if a >= ng and b > krows.max():
            cands[prefix + "k-major"] = raw[:ng, krows].T
        for bm in (8, 16, 24, 32, 64, 128):
            if a >= ng:
                idx = (krows // bm) * ((bm + 127) // 128 * 128) + krows % bm
                if idx.max() < b:
                    cands[f"{prefix}k-major-padded-bm{bm}"] = raw[:ng, idx].T
            if b >= ng:
                idx = (krows // bm) * ((bm + 127) // 128 * 128) + krows % bm
                if idx.max() < a:
                    cands[f"{prefix}row-major-padded-bm{bm}"] = raw[idx, :ng]

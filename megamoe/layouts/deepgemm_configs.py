"""DeepGEMM's SM90 Mega MoE launch configurations, restated from its C++ heuristics as pure functions.

    deepgemm_sm90_fp8_config(g, T, ...)   the ``MegaMoESM90Config`` of ``fp8_mega_moe`` for T tokens
    deepgemm_sm90_fp4_config(g, T, ...)   the same for the FP8 x FP4 kernel (DeepGEMM PR #323), plus
                                          the decode options its API passes to the kernel
                                          (who decodes FP4 -> e4m3: loader warps, assist warps,
                                          the math warpgroups; swap-AB; the pipeline's extra barriers)
    buffer_tokens_per_rank(capacity)      the token capacity DeepGEMM's buffer really holds (aligned to 384),
                                          which is what the heuristics read as ``num_max_tokens_per_rank``

Read from DeepGEMM PR #323's ``csrc/jit_kernels/heuristics/sm90_mega_moe.hpp`` and
``csrc/apis/sm90_mega.hpp`` (DeepGEMM at 8ddf7f9). The FP8 function reproduces every configuration the
H200 printed for sgl-deep-gemm 0.1.5.post1 (``DG_PRINT_CONFIGS``: the ``plan`` of each row of the cited
sweep, and ``bench/results/2026-12-02-h200-dg-probe.json``), block shape, stages and shared-memory bytes
alike (tests/test_kernel_anatomy.py). The FP4 function is checked against every configuration the FP4
kernel printed on the H200 (``bench/results/2026-12-03_nvidia-h200_deepgemm-fp4/``: both geometries, every
token count and capacity recorded there; tests/test_deepgemm_fp4_recorded_configs.py).

The dict keys are the C++ field names. Legend: T tokens on one rank, R ranks, E experts,
E_l = E / R, K top-k, H hidden, I intermediate.
"""

from __future__ import annotations

import math

from ..geometry import Geometry, get_geometry

SM90_SMEM_CAPACITY = 232448  # bytes of dynamic shared memory one H100 / H200 CTA may use
H200_NUM_SMS = 132
CANDIDATE_BLOCK_M = (8, 16, 32, 64, 96, 128, 192)
TOKEN_ALIGNMENT = 384  # lcm of the candidate BLOCK_Ms: DeepGEMM rounds a buffer's token capacity up to it


def _align(x: int, a: int) -> int:
    return -(-x // a) * a


def pool_tokens(num_ranks: int, num_max_tokens_per_rank: int, num_topk: int, num_experts_per_rank: int) -> int:
    """Rows of the dispatched pool: align(R * T_max * min(K, E_l) + E_l * 191, 384)."""
    rows = num_ranks * num_max_tokens_per_rank * min(num_topk, num_experts_per_rank)
    return _align(rows + num_experts_per_rank * (max(CANDIDATE_BLOCK_M) - 1), 384)


def buffer_tokens_per_rank(capacity: int) -> int:
    """The ``num_max_tokens_per_rank`` of a DeepGEMM SM90 buffer asked for ``capacity`` tokens: sgl_deep_gemm's
    ``get_symm_buffer_for_sm90_mega_moe`` rounds it up to ``TOKEN_ALIGNMENT`` (8192 -> 8448, 128 -> 384)."""
    if capacity <= 0:
        raise ValueError(f"capacity must be a positive token count, got {capacity}")
    return _align(capacity, TOKEN_ALIGNMENT)


def padded_sf_pool_tokens(num_pool_tokens: int) -> int:
    """Rows of the scale pools: the largest ``(P / BLOCK_M) * align(BLOCK_M, 128)`` over the candidates."""
    return max((num_pool_tokens // bm) * _align(bm, 128) for bm in CANDIDATE_BLOCK_M)


def _wave_pool_tokens(num_ranks, num_topk, t_max, experts_per_wave, block_m) -> int:
    all_tokens = t_max * num_ranks
    if experts_per_wave == 1:
        return all_tokens
    return min(all_tokens * experts_per_wave, _align(all_tokens * num_topk + experts_per_wave * (block_m - 1), block_m))


def _generic_experts_per_wave(e_local, num_tokens, num_topk, intermediate, block_m, block_n, num_sms, ring_tokens,
                              t_max, num_ranks) -> int:
    """``get_num_experts_per_wave_for_mega_moe``: the smallest wave that fills 2x the SMs at an even
    spread of rows, then the size in [that, 2 x that] whose last partial wave is fullest."""
    max_epw = e_local
    while max_epw > 0 and _wave_pool_tokens(num_ranks, num_topk, t_max, max_epw, block_m) > ring_tokens:
        max_epw -= 1
    if max_epw <= 0:
        raise ValueError("the pool cannot hold one expert's wave (buffer too small)")
    rows = num_tokens * num_topk / e_local
    l1_blocks = max(-(-math.ceil(rows) // block_m), 1) * (2 * intermediate // block_n)
    fill = -(-2 * num_sms // l1_blocks) if rows >= 1 else e_local
    if fill >= max_epw:
        return max_epw
    if l1_blocks >= num_sms:
        return fill
    best, best_tail = fill, -1.0
    for epw in range(fill, min(max_epw, 2 * fill) + 1):
        tail = 1.0 if e_local % epw == 0 else (e_local % epw) / epw
        if tail > best_tail:
            best, best_tail = epw, tail
    return best


def _stages(fixed: int, per_stage: int, cap: int = 0) -> tuple[int, int]:
    stages = (SM90_SMEM_CAPACITY - fixed) // per_stage
    if cap > 0:
        stages = min(stages, cap)
    if stages < 2:
        raise ValueError(f"shared memory holds {stages} pipeline stages; at least 2 are needed")
    return stages, fixed + stages * per_stage


def _dispatch_smem(num_experts: int, hidden: int, num_dispatch_warps: int) -> int:
    """Expert counters + one FP8 token row per dispatch warp (the pull's landing buffer)."""
    return _align(num_experts * 4, 1024) + _align(hidden * num_dispatch_warps, 1024)


def _check(g: Geometry, num_tokens: int, num_ranks: int, t_max: int) -> None:
    if num_ranks <= 0 or g.num_experts % num_ranks:
        raise ValueError(f"num_ranks must divide num_experts={g.num_experts}, got {num_ranks}")
    if not 0 < num_tokens <= t_max:
        raise ValueError(f"num_tokens must be in [1, num_max_tokens_per_rank={t_max}], got {num_tokens}")


def deepgemm_sm90_fp8_config(geometry, num_tokens: int, *, num_ranks: int = 1, num_max_tokens_per_rank: int = 8448,
                             num_sms: int = H200_NUM_SMS) -> dict:
    """``get_mega_moe_config_sm90`` (+ its swap-AB rule) for T = num_tokens on each of R ranks.

    BLOCK_M 128 x BLOCK_N 256 with 4 math warpgroups once the mean expert gets >= 64 rows (T R K / E),
    else BLOCK_M 64 with 2 math warpgroups (BLOCK_N 128; swap-AB while T <= 128); as many pipeline
    stages as shared memory holds. ``reuse_accum``: the running sum stays in the WGMMA accumulator
    (the large tile, when H < 7168; docs/kernel-numerics.md)."""
    g = get_geometry(geometry)
    _check(g, num_tokens, num_ranks, num_max_tokens_per_rank)
    e_local = g.num_experts // num_ranks
    rows = num_tokens * num_ranks * g.num_topk / g.num_experts
    split_mn = rows >= 64.0
    block_m, epi = (128, 512) if split_mn else (64, 256)
    swap_ab = not split_mn and num_tokens <= 128 and rows > 0
    bn256_decode = not split_mn and g.intermediate >= 3072 and rows >= 0.25 and g.hidden % 256 == 0
    block_n = 128 if swap_ab else (256 if split_mn or bn256_decode else 128)
    ring = pool_tokens(num_ranks, num_max_tokens_per_rank, g.num_topk, e_local)
    rows_local = num_tokens * g.num_topk / e_local
    epw = e_local if (rows_local < 1 or rows_local > 4) else _generic_experts_per_wave(
        e_local, num_tokens, g.num_topk, g.intermediate, block_m, block_n, num_sms, ring, num_max_tokens_per_rank,
        num_ranks)
    dispatch = non_epi = 64  # 512 epilogue threads, or the BLOCK_M 64 split-N path: both shrink to 2 + 2 warps
    cd = max(block_m * block_n // 2, block_m * block_n * 2, block_m * block_n // 2 * 5 if swap_ab else 0)
    fixed = _dispatch_smem(g.num_experts, g.hidden, dispatch // 32) + _align(cd, 1024) + (dispatch // 32 + 2 * epi // 32) * 8
    per_stage = block_m * 128 + block_n * 128 + _align(2 * block_m * 4, 128) + 16
    stages, smem = _stages(fixed, per_stage)
    return {"block_m": block_m, "block_n": block_n, "block_k": 128, "num_max_pool_tokens": ring,
            "num_experts_per_wave": epw, "num_stages": stages, "smem_size": smem,
            "num_dispatch_threads": dispatch, "num_non_epilogue_threads": non_epi, "num_epilogue_threads": epi,
            "swap_ab": swap_ab, "reuse_accum": split_mn and g.hidden < 7168}


# FP4 wave rules for BLOCK_M 64 x BLOCK_N 128: (min rows, max rows, min inclusive, E_l divisor, experts per
# wave; 0 = all). First match wins; below, the generic rule.
_FP4_FLASH_WAVES = ((0.75, 1.0, True, 16, 16), (1.5, 2.0, True, 16, 16), (3.0, 6.0, True, 16, 16),
                    (6.0, 12.0, True, 32, 32), (6.0, 12.0, True, 8, 8), (24.0, 32.0, True, 16, 16),
                    (12.0, 24.0, True, 32, 32), (12.0, 24.0, True, 8, 8), (32.0, 64.0, True, 16, 16))
_FP4_PRO_WAVES = ((0.0, 0.25, False, 16, 16), (0.25, 0.375, True, 16, 16), (0.375, 0.75, True, 16, 16),
                  (0.25, 1.0, True, 24, 24), (1.0, 1.5, True, 1, 0), (1.5, 3.0, True, 16, 16), (3.0, 6.0, True, 8, 8),
                  (6.0, 12.0, True, 16, 16), (6.0, 12.0, True, 8, 8), (12.0, 24.0, True, 24, 24),
                  (12.0, 24.0, True, 8, 8), (24.0, 64.0, True, 8, 8))
# Stage caps: (min, max, min inclusive, max inclusive, shape, cap); shape: flash (I <= 2048), pro (I >= 3072).
_FP4_STAGE_CAPS = ((6.0, 12.0, True, False, "flash", 4), (3.0, 6.0, False, False, "flash", 4),
                   (0.0, 0.25, False, False, "pro", 5), (0.375, 0.75, True, False, "pro", 5),
                   (1.5, 3.0, True, False, "pro", 5), (1.0, 1.5, True, False, "pro", 5),
                   (24.0, 64.0, True, False, "pro", 5), (0.375, 0.75, True, False, "any", 6),
                   (3.0, 6.0, False, False, "flash", 6), (1.5, 3.0, True, False, "not-pro", 6),
                   (1.5, 24.0, True, True, "any", 5))


def _in(e, lo, hi, lo_inc, hi_inc=False) -> bool:
    return (e >= lo if lo_inc else e > lo) and (e <= hi if hi_inc else e < hi)


def _fp4_decode_defaults(e: float, e_local: int, flash: bool, pro: bool, swap_ab_enabled: bool = True) -> dict:
    """``get_fp4_sm90_api_defaults``: who decodes FP4 -> e4m3 and which pipeline options the kernel gets,
    band by band (e = mean rows per local expert; the names are the C++ ones without ``fp4_`` / ``_shape_band``).
    ``swap_ab_enabled``: the ``DG_SM90_FP4_SWAP_AB`` switch (default on)."""
    middle = not flash and not pro
    lookahead, bigband = 3.0 <= e <= 6.0, 12.0 <= e <= 24.0
    b4_skip_decode = 0.5 <= e < 1.0
    pro_single_token = pro and 1.0 <= e < 1.5 and e_local % 8 == 0
    pro_split_n_mbarrier, pro_two_tokens = pro and 0 < e < 64, pro and 1.5 <= e < 3.0
    pro_mid_assist, pro_large_assist = pro and 6.0 <= e < 12.0, pro and 24.0 <= e < 64
    flash_two_tokens, flash_half_token = flash and 1.5 <= e < 2.0, flash and 0.375 <= e < 0.5
    flash_lookahead, flash_wide_load = flash and 3.0 <= e < 6.0, flash and 6.0 <= e < 64
    flash_split_n_mbarrier, flash_small_mbarrier = flash and 0.75 <= e < 64, flash and 0 < e < 0.5
    offload = e >= 64.0  # the BLOCK_M 128, 2-warpgroup decode-offload band
    shared_assist = (0 < e < 0.375 or flash_half_token or b4_skip_decode or lookahead or flash_split_n_mbarrier
                     or pro_mid_assist or pro_large_assist or bigband or offload)
    math_decodes = not (shared_assist or 1.0 <= e < 2.0 or pro_two_tokens)
    loaders_skip = shared_assist or pro_single_token or 1.5 <= e < 3.0
    return {
        "math_wg_participates_in_decode": math_decodes, "num_math_wg_decode_warps": 4 if math_decodes else 0,
        "first_decode_assist_warp": 2 if loaders_skip else 0,
        "wide_load_decode": pro_split_n_mbarrier or flash_half_token or flash_two_tokens or flash_wide_load,
        "early_b_decode": ((1.5 <= e <= 3.0 and not pro_two_tokens and not flash_two_tokens and not flash_lookahead)
                           or offload),
        "decode_done_mbarrier": (pro_split_n_mbarrier or flash_split_n_mbarrier or flash_small_mbarrier
                                 or (middle and (lookahead or bigband)) or offload),
        "l2_arrival_counter": (flash and 0.375 <= e < 0.75) or (pro and 0.25 <= e < 0.375),
        "ss_nsplit": offload,
        "swap_ab": swap_ab_enabled and (flash or pro) and 0 < e <= 24.0,
        "swap_ab_fast_amax": swap_ab_enabled and pro and 12.0 <= e <= 24.0,
    }


def deepgemm_sm90_fp4_config(geometry, num_tokens: int, *, num_ranks: int = 1, num_max_tokens_per_rank: int = 8448,
                             num_sms: int = H200_NUM_SMS, swap_ab_enabled: bool = True) -> dict:
    """``get_mega_moe_config_sm90_fp4`` with the API's decode defaults, for T = num_tokens per rank.

    BLOCK_N is always 128; BLOCK_M 128 once the mean expert gets >= 64 rows, else 64 with two math
    warpgroups splitting N. The non-epilogue warps are two TMA loaders plus, in the small-batch bands,
    decode-assist warps (192 or 320 threads); stages are capped per band. ``num_max_tokens_per_rank`` is
    the buffer's aligned capacity (``buffer_tokens_per_rank``); ``swap_ab_enabled`` is the
    ``DG_SM90_FP4_SWAP_AB`` switch."""
    g = get_geometry(geometry)
    _check(g, num_tokens, num_ranks, num_max_tokens_per_rank)
    e_local = g.num_experts // num_ranks
    e = num_tokens * g.num_topk / e_local  # mean rows per local expert (= T R K / E)
    flash, pro = g.intermediate <= 2048, g.intermediate >= 3072
    block_m, block_n = (128 if e >= 64 else 64), 128
    wgs = 2 if (e >= 64 or 0 < e < 0.375) else block_m // 64
    split_n_band = (flash or pro) and 0 < e < 64
    if block_m == 64 and split_n_band:
        wgs = 2
    small = block_m == 64 and block_n == 128
    assist_band = (block_m == 128 and wgs == 2 and e >= 64) or (small and 0 < e <= 24)
    dispatch = 64 if (small and split_n_band) or assist_band else 128
    non_epi = 320 if small and split_n_band else (192 if assist_band else 128)
    epw = None
    rules = _FP4_FLASH_WAVES if (small and flash) else _FP4_PRO_WAVES if (small and pro) else ()
    for lo, hi, lo_inc, div, n in rules:
        if _in(e, lo, hi, lo_inc) and (n == 0 or e_local % div == 0):
            epw = n or e_local
            break
    ring = pool_tokens(num_ranks, num_max_tokens_per_rank, g.num_topk, e_local)
    if epw is None:
        epw = e_local if (e < 1 or e > 4) else _generic_experts_per_wave(
            e_local, num_tokens, g.num_topk, g.intermediate, block_m, block_n, num_sms, ring, num_max_tokens_per_rank,
            num_ranks)
    cap = 0
    if small:
        for lo, hi, lo_inc, hi_inc, shape, c in _FP4_STAGE_CAPS:
            if _in(e, lo, hi, lo_inc, hi_inc) and {"any": True, "flash": flash, "pro": pro, "not-pro": not pro}[shape]:
                cap = c
                break
    decode = _fp4_decode_defaults(e, e_local, flash, pro, swap_ab_enabled)
    swap = decode["swap_ab"]
    epi = wgs * 128
    cd = max(block_m * block_n // 2, block_m * block_n * 2,
             block_m * block_n // 2 * (1 if decode["swap_ab_fast_amax"] else 5) if swap else 0)
    sf_gran = 64
    split_n_shares_sf = block_m == 64 and wgs > 1 and block_n // wgs >= 64 and block_n // wgs // 2 < sf_gran
    fixed = (_dispatch_smem(g.num_experts, g.hidden, dispatch // 32) + _align(cd, 1024)
             + (_align(128 * 4, 1024) if split_n_shares_sf else 0) + (dispatch // 32 + 2 * epi // 32) * 8)
    per_stage = (block_m * 128 + block_n * 128 + block_n * 64 + _align(128 // sf_gran * block_m * 4, 128)
                 + _align(block_n * 4, 128) + 16 + 8 * decode["early_b_decode"] + 8 * decode["decode_done_mbarrier"])
    stages, smem = _stages(fixed, per_stage, cap)
    return {"block_m": block_m, "block_n": block_n, "block_k": 128, "cluster_size": 1, "num_max_pool_tokens": ring,
            "num_padded_sf_pool_tokens": padded_sf_pool_tokens(ring), "swizzle_acts_mode": 128,
            "swizzle_weights_mode": 0, "num_experts_per_wave": epw, "num_stages": stages, "smem_size": smem,
            "num_stages_cap": cap, "num_dispatch_threads": dispatch, "num_non_epilogue_threads": non_epi,
            "num_epilogue_threads": epi, **decode}

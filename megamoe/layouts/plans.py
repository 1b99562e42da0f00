"""Plan / BLOCK_M models of the fused kernels as pure functions, pool sizes, and the data-parallel rule.

Every rank of one launch must pick the same plan (docs/kernel-contract.md, "BLOCK_M and ragged
data-parallel steps"). FlashInfer derives its plan from the token count, so every rank passes
``agreed_token_count`` (the step's max; short ranks pad with rows routed to -1, ``pad_to_token_count``).
DeepGEMM's SM90 heuristic reads a token count too; the fix there is one hint on every rank
(``deepgemm_plan_hint``: the mean tokens per EP rank).

Legend: T tokens on one rank, R ranks, E experts, E_l = E / R, K top-k, H hidden, I intermediate.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

# FlashInfer 0.7.4 constants (flashinfer/megamoe/heuristics.py, include/flashinfer/megamoe/layout.cuh).
SM90_SMEM_BYTES = 232448
H20_NUM_SMS = 78
H200_NUM_SMS = 132
POOL_CANDIDATE_BLOCK_M = (8, 16, 32, 64, 96, 128, 192)  # the pool must be addressable by each
POOL_LCM_BLOCK_M = 384
FLASHINFER_BLOCK_N = 256


def _align(x: int, a: int) -> int:
    return -(-x // a) * a


# ------------------------------------------------------------------------------------ pool sizes
def flashinfer_pool_tokens(num_ranks: int, num_max_tokens_per_rank: int, num_topk: int, num_experts_per_rank: int) -> int:
    """Rows of the dispatched token pool P: the worst case of received rows plus BLOCK_M padding.

        P = align(R * T_max * min(K, E_l) + E_l * (192 - 1), 384)

    Every received (token, slot) row could land on this rank (at most min(K, E_l) slots per token),
    and each local expert's segment pads to a multiple of BLOCK_M <= 192; 384 = lcm of the candidates.
    """
    for name, v in (("num_ranks", num_ranks), ("num_max_tokens_per_rank", num_max_tokens_per_rank),
                    ("num_topk", num_topk), ("num_experts_per_rank", num_experts_per_rank)):
        if v <= 0:
            raise ValueError(f"{name} must be positive, got {v}")
    rows = num_ranks * num_max_tokens_per_rank * min(num_topk, num_experts_per_rank)
    return _align(rows + num_experts_per_rank * (max(POOL_CANDIDATE_BLOCK_M) - 1), POOL_LCM_BLOCK_M)


def flashinfer_padded_sf_pool_tokens(num_pool_tokens: int, block_m: int) -> int:
    """Rows of the activation-scale pool for one BLOCK_M: (P / BLOCK_M) blocks of align(BLOCK_M, 128) rows."""
    return num_pool_tokens // block_m * _align(block_m, 128)


def flashinfer_sf_pool_tokens(num_pool_tokens: int) -> int:
    """The SF pool the symmetric buffer allocates: the max over every candidate BLOCK_M."""
    return max(flashinfer_padded_sf_pool_tokens(num_pool_tokens, bm) for bm in POOL_CANDIDATE_BLOCK_M)


# ------------------------------------------------------------------------------------ FlashInfer plan
@dataclass(frozen=True)
class FlashInferPlan:
    """The compile-time plan of ``flashinfer.megamoe.mxfp4_mega_moe`` (fields as in its ``FusedPlan``).

    Expert e's pool segment spans ceil(rows_e / block_m) blocks of block_m rows; the SF pool holds
    align(block_m, 128) rows per block. Each wave runs num_experts_per_wave local experts.
    """

    block_m: int
    block_n: int
    num_experts_per_wave: int
    num_stages: int
    smem_size: int
    swap_ab: bool
    use_mode2_row_decoder: bool
    single_active_dispatch_warp: bool
    use_interleaved_scheduler: bool
    rs_swap_ab: bool
    push_dispatch: bool
    no_clean_barrier: bool
    num_max_pool_tokens: int
    num_padded_sf_pool_tokens: int


def _check_flashinfer_args(num_sms, num_ranks, num_experts, num_topk, hidden, intermediate, num_max_tokens_per_rank, num_tokens):
    if num_sms <= 1:
        raise ValueError(f"num_sms must be > 1, got {num_sms}")
    if not (0 < num_ranks <= 32 and num_ranks & (num_ranks - 1) == 0):
        raise ValueError(f"num_ranks must be a power of two in [1, 32], got {num_ranks}")
    if num_experts <= 0 or num_experts % num_ranks:
        raise ValueError(f"num_experts must be a positive multiple of num_ranks={num_ranks}, got {num_experts}")
    if not 0 < num_topk <= min(32, num_experts):
        raise ValueError(f"num_topk must be in [1, {min(32, num_experts)}], got {num_topk}")
    if hidden <= 0 or hidden % 256:
        raise ValueError(f"hidden must be a positive multiple of 256, got {hidden}")
    if intermediate <= 0 or intermediate % 128:
        raise ValueError(f"intermediate must be a positive multiple of 128, got {intermediate}")
    if not 0 < num_tokens <= num_max_tokens_per_rank:
        raise ValueError(f"num_tokens must be in [1, num_max_tokens_per_rank={num_max_tokens_per_rank}], got {num_tokens}")


def flashinfer_mxfp4_plan(
    num_sms: int,
    num_ranks: int,
    num_experts: int,
    num_topk: int,
    hidden: int,
    intermediate: int,
    num_max_tokens_per_rank: int,
    num_tokens: int,
) -> FlashInferPlan:
    """FlashInfer 0.7.4's MXFP4 plan rule, restated (the same result as ``select_mxfp4_fused_plan``).

    Let fill(b) = b * E // (R * K): the per-rank token count at which an average local expert
    receives b rows (T * R * K / E rows per expert), and swap_limit = fill(24) * 78 // num_sms.

    1. BLOCK_M candidate: the first b in (8, 24, 32) with T <= fill(b) * 7 // 10, else 32.
    2. Experts per wave / stages: T <= 1: 24 / 8; T <= 8: 16 / 8; T <= 16: 24 / 8; else 48 / 8.
    3. swap-AB (tokens on the MMA's N side) iff T <= max(16, swap_limit).
       Register-source (RS) swap-AB iff swap-AB, BLOCK_M < 16, and not (num_sms > 78 and T <= 16).
    4. Without swap-AB: BLOCK_M = 64, 3 stages. Swap-AB without RS: 4 stages at BLOCK_M 8, else 3.
    5. Experts per wave = the largest divisor of E_l that is <= min(step 2, E_l).
    Fixed: BLOCK_N 256, mode-2 row decoder, interleaved scheduler, single dispatch warp iff swap-AB,
    no push dispatch, all of shared memory; pools from ``flashinfer_pool_tokens``.
    On an H200 (132 SMs) this yields BLOCK_M 8 / 24 / 64 for the presets, 32 on an H20 (78 SMs).
    """
    _check_flashinfer_args(num_sms, num_ranks, num_experts, num_topk, hidden, intermediate, num_max_tokens_per_rank, num_tokens)
    t, epr = num_tokens, num_experts // num_ranks

    def fill(b: int) -> int:
        return b * num_experts // (num_ranks * num_topk)

    swap_limit = fill(24) * H20_NUM_SMS // num_sms
    block_m = next((b for b in (8, 24, 32) if t <= fill(b) * 7 // 10), 32)
    wave = 24 if t <= 1 else 16 if t <= 8 else 24 if t <= 16 else 48
    stages = 8
    swap_ab = t <= max(16, swap_limit)
    rs = swap_ab and block_m < 16 and not (num_sms > H20_NUM_SMS and t <= 16)
    if not swap_ab:
        block_m, stages = 64, 3
    elif not rs:
        stages = 4 if block_m == 8 else 3
    wave = min(wave, epr)
    while epr % wave:
        wave -= 1
    pool = flashinfer_pool_tokens(num_ranks, num_max_tokens_per_rank, num_topk, epr)
    return FlashInferPlan(
        block_m=block_m, block_n=FLASHINFER_BLOCK_N, num_experts_per_wave=wave, num_stages=stages,
        smem_size=SM90_SMEM_BYTES, swap_ab=swap_ab, use_mode2_row_decoder=True,
        single_active_dispatch_warp=swap_ab, use_interleaved_scheduler=True, rs_swap_ab=rs,
        push_dispatch=False, no_clean_barrier=False, num_max_pool_tokens=pool,
        num_padded_sf_pool_tokens=flashinfer_sf_pool_tokens(pool),
    )


@functools.lru_cache(maxsize=256)
def flashinfer_block_m_ranges(
    num_sms: int, num_ranks: int, num_experts: int, num_topk: int, hidden: int, intermediate: int,
    num_max_tokens_per_rank: int,
) -> dict[int, tuple[range, ...]]:
    """BLOCK_M -> the token-count ranges (within 1..num_max_tokens_per_rank) whose plan uses it.

    To force a BLOCK_M, pass (on every rank) a token count from its range, padding with -1 routes.
    """
    out: dict[int, list[range]] = {}
    start, prev = 1, None
    for t in range(1, num_max_tokens_per_rank + 2):
        bm = None if t > num_max_tokens_per_rank else flashinfer_mxfp4_plan(
            num_sms, num_ranks, num_experts, num_topk, hidden, intermediate, num_max_tokens_per_rank, t).block_m
        if bm != prev:
            if prev is not None:
                out.setdefault(prev, []).append(range(start, t))
            start, prev = t, bm
    return {bm: tuple(rs) for bm, rs in out.items()}


def flashinfer_legal_block_ms(*args, num_tokens: int | None = None, **kwargs) -> tuple[int, ...]:
    """The BLOCK_M values the plan rule can produce (sorted); a test forces one by passing a token
    count from ``flashinfer_tokens_for_block_m`` (padding with -1 routes).

    Two call forms:
        flashinfer_legal_block_ms(num_sms, num_ranks, num_experts, num_topk, hidden, intermediate, num_max_tokens_per_rank)
        flashinfer_legal_block_ms(geometry, num_tokens=None, *, num_sms=132, num_ranks=1, num_max_tokens_per_rank=8192)
    and no arguments means DeepSeek-V4-Flash on one H200 rank. With ``num_tokens`` (a rank's real
    token count) only the BLOCK_Ms reachable by padding up to a count >= num_tokens are returned.
    H200: (8, 24, 64) for the presets at 1 and 8 ranks; an H20 (78 SMs) adds 32.
    """
    from ..geometry import Geometry, get_geometry

    if not args or isinstance(args[0], (Geometry, str)):
        g = get_geometry(args[0] if args else "dsv4-flash")
        if len(args) > 1:
            num_tokens = args[1]
        geo = (kwargs.pop("num_sms", H200_NUM_SMS), kwargs.pop("num_ranks", 1), g.num_experts, g.num_topk,
               g.hidden, g.intermediate, kwargs.pop("num_max_tokens_per_rank", 8192))
        if kwargs:
            raise TypeError(f"unexpected arguments {sorted(kwargs)}")
    else:
        geo = tuple(args) + tuple(kwargs.values())
        if len(geo) != 7:
            raise TypeError("expected (num_sms, num_ranks, num_experts, num_topk, hidden, intermediate, num_max_tokens_per_rank)")
    ranges = flashinfer_block_m_ranges(*geo)
    floor = 1 if num_tokens is None else max(1, int(num_tokens))
    return tuple(sorted(bm for bm, rs in ranges.items() if any(r.stop > floor for r in rs)))


def flashinfer_tokens_for_block_m(
    block_m: int, num_sms: int, num_ranks: int, num_experts: int, num_topk: int, hidden: int,
    intermediate: int, num_max_tokens_per_rank: int,
) -> range:
    """The first token-count range whose plan uses ``block_m``; ValueError when none does."""
    ranges = flashinfer_block_m_ranges(num_sms, num_ranks, num_experts, num_topk, hidden, intermediate, num_max_tokens_per_rank)
    if block_m not in ranges:
        raise ValueError(f"block_m={block_m} is never chosen for this geometry; legal: {sorted(ranges)}")
    return ranges[block_m][0]


# ------------------------------------------------------------------------------------ DeepGEMM SM90 plan
@dataclass(frozen=True)
class DeepGEMMSM90Plan:
    """A *model* of ``deep_gemm.fp8_mega_moe``'s SM90 tile choice (not the real heuristic).

    rows_per_expert = ceil(T_hint * R * K / E): mean pool rows per local expert. Expert e's pool
    segment spans ceil(rows_e / block_m) blocks; SF rows per block = align(block_m, 128).
    """

    block_m: int
    block_n: int
    swap_ab: bool
    rows_per_expert: int
    modelled: bool = True


DEEPGEMM_SWAP_AB_MAX_ROWS = 24


def deepgemm_sm90_fp8_plan(num_ranks: int, num_experts: int, num_topk: int, num_tokens_hint: int) -> DeepGEMMSM90Plan:
    """BLOCK_M 64 while the mean expert gets <= 64 rows, else 128; swap-AB at BLOCK_M 64 up to ~24 rows.

    sgl-deep-gemm 0.1.5.post1 chooses its SM90 plan inside the compiled ``_C.so`` (its
    ``MegaMoESM90Config`` is not in the Python or header sources), so this is a model of what the
    headers allow (``sm90_fp8_mega_moe.cuh``: BLOCK_M a multiple of 64; swap-AB only at BLOCK_M 64,
    BLOCK_N 128; the split-MN epilogue at BLOCK_M 128, BLOCK_N 256) and of docs/kernel-contract.md
    (BLOCK_M 64 / 128, swap-AB up to ~24 tokens per expert). Unverified: check on the H200.
    """
    if num_ranks <= 0 or num_experts <= 0 or num_experts % num_ranks:
        raise ValueError(f"num_ranks must divide num_experts; got num_ranks={num_ranks}, num_experts={num_experts}")
    if not 0 < num_topk <= num_experts:
        raise ValueError(f"num_topk must be in [1, {num_experts}], got {num_topk}")
    if num_tokens_hint < 0:
        raise ValueError(f"num_tokens_hint must be >= 0, got {num_tokens_hint}")
    rows = -(-num_tokens_hint * num_ranks * num_topk // num_experts)
    if rows <= 64:
        return DeepGEMMSM90Plan(64, 128, rows <= DEEPGEMM_SWAP_AB_MAX_ROWS, rows)
    return DeepGEMMSM90Plan(128, 256, False, rows)


# ------------------------------------------------------------------------------------ data-parallel rule
def _counts(per_rank_counts) -> list[int]:
    counts = [int(c) for c in (per_rank_counts.tolist() if isinstance(per_rank_counts, torch.Tensor) else per_rank_counts)]
    if not counts:
        raise ValueError("per_rank_counts must hold one token count per rank, got none")
    if min(counts) < 0:
        raise ValueError(f"per_rank_counts must be >= 0, got {counts}")
    return counts


def agreed_token_count(per_rank_counts) -> int:
    """FlashInfer: the one count every rank passes = max over ranks (>= 1, the kernel's minimum).

    Ranks with fewer tokens pad to it with rows routed to -1 (``pad_to_token_count``)."""
    return max(1, max(_counts(per_rank_counts)))


def deepgemm_plan_hint(per_rank_counts) -> int:
    """DeepGEMM: the hint every rank passes = ceil(mean tokens per EP rank) (>= 1)."""
    counts = _counts(per_rank_counts)
    return max(1, -(-sum(counts) // len(counts)))


def pad_to_token_count(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_tokens: int):
    """Append rows routed to -1 so this rank passes ``num_tokens`` (x [T, ...], idx int64 [T, K], w [T, K])."""
    t = x.shape[0]
    if topk_idx.shape[0] != t or topk_weights.shape[0] != t:
        raise ValueError(f"x, topk_idx and topk_weights must share T; got {x.shape[0]}, {topk_idx.shape[0]}, {topk_weights.shape[0]}")
    if num_tokens < t:
        raise ValueError(f"num_tokens={num_tokens} is below this rank's {t} tokens")
    pad = num_tokens - t
    return (
        torch.cat([x, x.new_zeros(pad, *x.shape[1:])]),
        torch.cat([topk_idx, topk_idx.new_full((pad, *topk_idx.shape[1:]), -1)]),
        torch.cat([topk_weights, topk_weights.new_zeros(pad, *topk_weights.shape[1:])]),
    )


@dataclass(frozen=True)
class PaddingWaste:
    """Pool rows of one step at one BLOCK_M: padded = sum_e ceil(n_e / block_m) * block_m."""

    block_m: int
    rows: int  # sum_e n_e
    padded_rows: int
    blocks: int

    @property
    def wasted_rows(self) -> int:
        return self.padded_rows - self.rows

    @property
    def fraction(self) -> float:
        """Share of padded pool rows that are padding (0 when the pool is empty)."""
        return self.wasted_rows / self.padded_rows if self.padded_rows else 0.0


def padding_waste(expert_counts, block_m: int) -> PaddingWaste:
    """Rows per local expert (list or int tensor [E_l]) -> padding cost at ``block_m``; empty experts cost 0."""
    if block_m <= 0:
        raise ValueError(f"block_m must be positive, got {block_m}")
    counts = _counts(expert_counts)
    blocks = sum(-(-n // block_m) for n in counts)
    return PaddingWaste(block_m, sum(counts), blocks * block_m, blocks)


def expert_counts(topk_idx: torch.Tensor, expert_range: range) -> list[int]:
    """Rows each expert of ``expert_range`` receives from topk_idx int64 [T, K] (-1 slots skipped)."""
    idx = topk_idx.reshape(-1)
    idx = idx[idx >= 0]
    hist = torch.bincount(idx, minlength=expert_range.stop)
    return [int(hist[e]) for e in expert_range]


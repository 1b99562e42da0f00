"""Dispatch and its inverse: token slots -> an expert-sorted, BLOCK_M-padded pool, and back.

Works for any number of source ranks; one rank is the list of one. Pool row order is deterministic
here (by expert, then source rank, token, slot); the kernels' order is not, but no value depends on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..validate import as_int, check_topk


@dataclass
class DispatchLayout:
    """The token pool of one (destination) rank owning experts [expert_lo, expert_lo + E_l).

    Indexing equation: local expert e owns pool rows [padded_offsets[e], padded_offsets[e] + counts[e]);
    rows from there up to padded_offsets[e + 1] are padding, padded_offsets[e + 1] - padded_offsets[e]
    = ceil(counts[e] / block_m) * block_m. Pool row r holds slot src_slot[r] of token src_token[r] of
    rank src_rank[r]; padding rows hold -1 in all three.

        counts          int64 [E_l]
        padded_offsets  int64 [E_l + 1]
        src_rank, src_token, src_slot   int64 [P]
    """

    counts: torch.Tensor
    padded_offsets: torch.Tensor
    src_rank: torch.Tensor
    src_token: torch.Tensor
    src_slot: torch.Tensor
    block_m: int
    expert_lo: int

    @property
    def num_local_experts(self) -> int:
        return self.counts.numel()

    @property
    def num_pool_rows(self) -> int:
        return self.src_token.numel()

    @property
    def num_routed_rows(self) -> int:
        return int(self.counts.sum())

    def rows_of(self, e: int) -> slice:
        """Pool rows holding real tokens of local expert e."""
        start = int(self.padded_offsets[e])
        return slice(start, start + int(self.counts[e]))

    @property
    def is_real(self) -> torch.Tensor:
        return self.src_token >= 0


def validate_topk(topk_idx: torch.Tensor, topk_weights: torch.Tensor | None, num_experts: int, what: str = "") -> None:
    """Shapes, dtypes and ranges of one rank's routing, checked before anything runs
    (``megamoe.validate.check_topk``: int64 ids in [-1, E), no expert twice in a token, finite weights)."""
    check_topk(topk_idx, topk_weights, num_experts, what)


def build_layout(
    topk_idx_per_rank: list[torch.Tensor], expert_lo: int, expert_hi: int, block_m: int = 1
) -> DispatchLayout:
    """Pool of the rank that owns experts [expert_lo, expert_hi), gathering from every source rank.

    topk_idx_per_rank[s]: int64 [T_s, K] of source rank s. Masked slots (-1) and slots routed to
    other ranks' experts are skipped.
    """
    if as_int("block_m", block_m) <= 0:
        raise ValueError(f"block_m must be positive, got {block_m}")
    device = topk_idx_per_rank[0].device
    num_local = expert_hi - expert_lo
    ranks, tokens, slots, experts = [], [], [], []
    for s, idx in enumerate(topk_idx_per_rank):
        mine = (idx >= expert_lo) & (idx < expert_hi)
        t, k = mine.nonzero(as_tuple=True)  # row-major: token then slot ascending
        ranks.append(torch.full_like(t, s))
        tokens.append(t)
        slots.append(k)
        experts.append(idx[t, k] - expert_lo)
    rank, token, slot, expert = (torch.cat(v) for v in (ranks, tokens, slots, experts))
    # Stable sort by expert keeps (rank, token, slot) order inside each expert.
    order = torch.sort(expert, stable=True).indices
    rank, token, slot, expert = rank[order], token[order], slot[order], expert[order]
    counts = torch.bincount(expert, minlength=num_local)
    padded = (counts + block_m - 1) // block_m * block_m
    padded_offsets = torch.zeros(num_local + 1, dtype=torch.int64, device=device)
    padded_offsets[1:] = torch.cumsum(padded, 0)
    num_rows = int(padded_offsets[-1])
    starts = torch.zeros(num_local, dtype=torch.int64, device=device)
    starts[1:] = torch.cumsum(counts, 0)[:-1]
    dest = padded_offsets[:-1][expert] + (torch.arange(expert.numel(), device=device) - starts[expert])
    out = [torch.full((num_rows,), -1, dtype=torch.int64, device=device) for _ in range(3)]
    for o, v in zip(out, (rank, token, slot)):
        o[dest] = v
    return DispatchLayout(counts, padded_offsets, out[0], out[1], out[2], block_m, expert_lo)


def dispatch(values_per_rank: list[torch.Tensor], layout: DispatchLayout, pad_value=float("nan")) -> torch.Tensor:
    """Gather per-token rows into the pool: values_per_rank[s] [T_s, ...] -> [P, ...].

    Padding rows are filled with ``pad_value`` (NaN by default) so that a stray read shows.
    """
    ref = values_per_rank[0]
    out = torch.empty((layout.num_pool_rows, *ref.shape[1:]), dtype=ref.dtype, device=ref.device)
    if out.dtype.is_floating_point:
        out.fill_(pad_value)
    else:
        out.fill_(-1)
    for s, v in enumerate(values_per_rank):
        rows = (layout.src_rank == s).nonzero(as_tuple=True)[0]
        out[rows] = v[layout.src_token[rows]]
    return out


def dispatch_slot_values(values_per_rank: list[torch.Tensor], layout: DispatchLayout) -> torch.Tensor:
    """Gather per-slot values (e.g. topk_weights [T_s, K]) into the pool: -> [P] (NaN on padding)."""
    ref = values_per_rank[0]
    out = torch.full((layout.num_pool_rows,), float("nan"), dtype=ref.dtype, device=ref.device)
    for s, v in enumerate(values_per_rank):
        rows = (layout.src_rank == s).nonzero(as_tuple=True)[0]
        out[rows] = v[layout.src_token[rows], layout.src_slot[rows]]
    return out


def undispatch(
    pool_rows: list[torch.Tensor], layouts: list[DispatchLayout], rank: int, num_tokens: int, num_topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of dispatch for source rank ``rank``: collect its slots from every destination pool.

    pool_rows[d] [P_d, H] with layouts[d] -> (slots [T, K, H], filled bool [T, K]). Unrouted slots are 0.
    Padding rows are never read.
    """
    h = pool_rows[0].shape[1:]
    out = torch.zeros((num_tokens, num_topk, *h), dtype=pool_rows[0].dtype, device=pool_rows[0].device)
    filled = torch.zeros((num_tokens, num_topk), dtype=torch.bool, device=pool_rows[0].device)
    for rows_d, lay in zip(pool_rows, layouts):
        r = (lay.src_rank == rank).nonzero(as_tuple=True)[0]
        t, k = lay.src_token[r], lay.src_slot[r]
        if filled[t, k].any():
            raise AssertionError("a slot was dispatched to two pools")
        out[t, k] = rows_d[r]
        filled[t, k] = True
    return out, filled

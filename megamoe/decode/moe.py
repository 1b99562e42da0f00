"""The whole decode path on staged inputs: ``moe_decode`` (four Triton launches) beside ``moe_decode_torch``
(the twins of the four stages). Given ``TCWeights`` (``layout_tc.py``) instead of ``DecodeWeights``, gate/up and down
are the tensor-core GEMVs of ``tc.py`` (recipe megamoe-decode-tc). Both read a ``DecodeBuffers`` that ``stage``
filled.

    route    topk_idx, topk_weights, x_q -> pool order, work items, x32      (routing.py)
    l1       gate/up GEMV, SwiGLU, routing weight, FP8 requant per 32      (gemv.py)
    l2       down GEMV -> bf16 per (token, slot)
    combine  FP32 slot-ordered sum, one bf16 rounding

No host sync and no allocation after ``DecodeBuffers.allocate``: every grid is sized from the token
count alone (W = min(E_l, T K) work items; programs past ``num_touched`` exit at once), so one call can
be captured in a CUDA graph and replayed after each ``stage``.

What is checked where (``check_launch``; errors name the argument, the expected and the actual value):

    construction   DecodeBuffers / DecodeWeights / TCWeights: every tensor's shape, dtype, device and contiguity
                   (the kernels index them as dense arrays), tiles and capacity (1..MAX_TOKENS)
    staging        ``stage_into``: shapes, strides, expert ids in [-1, E), finite routing weights and x (one host
                   sync), and a record of the rows staged and the E they were checked against
    each launch    on the host, no sync, before any kernel: num_tokens (0..capacity, and no more than the last
                   ``stage_into`` staged), clamp (> 0, finite or +inf), the weights against the buffers (H, I,
                   experts, device), the launch config against the weights; a structure check again only where a
                   buffer or weight tensor was replaced since. A CUDA graph replays the kernels alone.
"""

from __future__ import annotations

import operator
import warnings
from dataclasses import dataclass, fields

import torch

from ..geometry import Geometry
from ..recipe import MEGAMOE_DECODE
from ..validate import as_clamp, as_int, check_topk, expect_tensor
from . import cuda_step, gemv, routing, tc
from .bounds import MAX_TOKENS  # the token bound, stated once (importable without triton)
from .gemv import LaunchConfig
from .layout import DecodeWeights
from .layout_tc import TCWeights

DOWN_GROUP = MEGAMOE_DECODE.l2_group  # the down GEMM's activation scale group (both decode recipes: 32)


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
        step_sync int32 [cuda_step.sync_words(H)]   the 1-token CUDA step's combine counts, gate/up tiles done per
                                           item (up to 8) and CTAs done
        split_terms fp32 [S', H/128, 2I], split_counts int32 [W' * I/32]   the tensor-core gate/up's split K
                                           (``LaunchConfig.tc_split``) for up to ``split_tokens`` tokens:
                                           S' = split_tokens * K pool rows, W' = min(E_l, S') work items
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
    split_terms: torch.Tensor
    split_counts: torch.Tensor
    step_sync: torch.Tensor
    num_local: int = 0
    expert_lo: int = 0
    num_experts: int = 0  # the layer's E, that staged ids are checked against (0: expert_lo + num_local)

    def __post_init__(self) -> None:
        self.check()

    @property
    def interpret(self) -> bool:
        """Whether the Triton kernels run under the CPU interpreter (TRITON_INTERPRET=1 before import)."""
        from ..staging.triton_stage import is_interpreted

        return is_interpreted()

    @classmethod
    def allocate(cls, g: Geometry, capacity: int, device, *, num_local: int | None = None, expert_lo: int = 0,
                 l2_group: int = DOWN_GROUP, split_tokens: int = 0) -> "DecodeBuffers":
        who = "DecodeBuffers.allocate"
        if not isinstance(g, Geometry):
            raise TypeError(f"{who}: g must be a Geometry, got {type(g).__name__}")
        capacity = as_int("capacity (tokens per rank)", capacity, lo=1, hi=MAX_TOKENS, who=who)
        num_local = as_int("num_local", g.num_experts if num_local is None else num_local, lo=1, hi=g.num_experts, who=who)
        expert_lo = as_int("expert_lo", expert_lo, lo=0, hi=g.num_experts - num_local, who=who)
        as_int("l2_group", l2_group, lo=DOWN_GROUP, hi=DOWN_GROUP, who=who)
        split_tokens = as_int("split_tokens", split_tokens, lo=0, hi=capacity, who=who)
        if g.hidden % 128 or g.intermediate % DOWN_GROUP:
            raise ValueError(f"{who}: the decode kernels need hidden % 128 == 0 and intermediate % {DOWN_GROUP} == 0, "
                             f"got hidden={g.hidden}, intermediate={g.intermediate}")
        table = _tensor_table(capacity, g.hidden, g.num_topk, g.intermediate, num_local,
                              min(capacity, split_tokens) * g.num_topk)
        zeroed = ("num_touched", "split_counts", "step_sync")  # counts the launches expect at zero
        tensors = {n: (torch.zeros if n in zeroed else torch.empty)(shape, dtype=dt, device=device)
                   for n, (shape, dt) in table.items()}
        tensors["topk_idx"].fill_(-1)  # nothing staged: every slot masked
        buf = cls(**tensors, num_local=num_local, expert_lo=expert_lo, num_experts=g.num_experts)
        from ..staging.stage import record_staged

        record_staged(buf.topk_idx, 0, g.num_experts, True)  # nothing staged yet: every id -1
        return buf

    def _expected(self) -> dict:
        """name -> (shape, dtype) of every tensor, from the staged block's C, H, K, the down block's I and the
        split scratch's rows (``_tensor_table``)."""
        (c, h), k, i = self.x_q.shape, self.topk_idx.shape[1], self.l2_q.shape[1]
        return _tensor_table(c, h, k, i, self.num_local, self.split_terms.shape[0])

    def check(self, who: str = "DecodeBuffers") -> None:
        """Every tensor's shape, dtype, device (x_q's) and contiguity against the table (the kernels take raw
        pointers and index dense arrays), capacity 1..MAX_TOKENS, H % 128 == 0, I % 32 == 0, the expert range.
        Remembered per set of tensors (their ids), so a launch re-checks only after a field was replaced."""
        key = tuple(map(id, _all_fields(self)))
        if getattr(self, "_checked_key", None) == key:
            return
        for name in ("x_q", "topk_idx", "l2_q", "split_terms"):
            expect_tensor(name, getattr(self, name), who=who)
            if getattr(self, name).ndim < 1 + (name != "split_terms"):
                raise ValueError(f"{who}: {name} must be 2-D, got shape {tuple(getattr(self, name).shape)}")
        c, h = self.x_q.shape
        as_int("capacity (x_q's rows)", c, lo=1, hi=MAX_TOKENS, who=who)
        if h % 128 or self.l2_q.shape[1] % DOWN_GROUP or not self.l2_q.shape[1]:
            raise ValueError(f"{who}: H (x_q's columns) must be a multiple of 128 and I (l2_q's columns) of "
                             f"{DOWN_GROUP}, got H={h}, I={self.l2_q.shape[1]}")
        as_int("num_local", self.num_local, lo=1, who=who)
        as_int("expert_lo", self.expert_lo, lo=0, who=who)
        as_int("num_experts", self.num_experts, lo=0, who=who)
        if self.num_experts and self.expert_lo + self.num_local > self.num_experts:
            raise ValueError(f"{who}: local experts [{self.expert_lo}, {self.expert_lo + self.num_local}) must lie in "
                             f"the layer's [0, {self.num_experts})")
        if self.split_terms.shape[0] % self.topk_idx.shape[1]:
            raise ValueError(f"{who}: split_terms' rows must be split_tokens * K, got {self.split_terms.shape[0]} "
                             f"with K={self.topk_idx.shape[1]}")
        dev = self.x_q.device
        for name, (shape, dtype) in self._expected().items():
            expect_tensor(name, getattr(self, name), shape, dtype, dev, who, contiguous=True)
        self._checked_key = key

    @property
    def layer_experts(self) -> int:
        """The E that staged expert ids are checked against: the layer's (``allocate``), or the local range's end."""
        return self.num_experts or self.expert_lo + self.num_local

    @property
    def hidden(self) -> int:
        return self.x_q.shape[1]

    @property
    def intermediate(self) -> int:
        return self.l2_q.shape[1]

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
            if isinstance(t, torch.Tensor) and f.name not in ("x_q", "x_sf", "topk_idx", "topk_weights",
                                                                 "split_counts", "step_sync"):
                if t.dtype.is_floating_point:
                    t.fill_(float("nan"))
                else:
                    t.view(torch.uint8).fill_(0x7F)


def _tensor_table(c: int, h: int, k: int, i: int, num_local: int, s_split: int) -> dict:
    """name -> (shape, dtype) of every tensor of ``DecodeBuffers`` (its docstring's table) for C tokens, H, top-k K,
    I, E_l local experts and S' split scratch rows."""
    s = c * k
    w = min(num_local, s)
    f32, i32 = torch.float32, torch.int32
    return {
        "x_q": ((c, h), torch.float8_e4m3fn), "x_sf": ((c, h // 128), f32), "topk_idx": ((c, k), torch.int64),
        "topk_weights": ((c, k), f32), "x32": ((c, h), f32), "num_touched": ((1,), i32), "touched": ((w,), i32),
        "seg_start": ((w,), i32), "seg_count": ((w,), i32), "row_token": ((s,), i32), "row_weight": ((s,), f32),
        "slot_row": ((s,), i32), "l1_out": ((s, 2 * i), f32), "l2_q": ((s, i), torch.uint8), "l2_x": ((s, i), f32),
        "l2_sf": ((s, i // DOWN_GROUP), f32), "slot_out": ((s, h), torch.int16), "y": ((c, h), torch.bfloat16),
        "split_terms": ((s_split, h // 128, 2 * i), f32),
        "split_counts": ((min(num_local, s_split) * (i // 32),), i32),
        "step_sync": ((cuda_step.sync_words(h),), i32),
    }


_all_fields = operator.attrgetter(*(f.name for f in fields(DecodeBuffers)))  # every field's value, in one C call


def check_launch(dw, buf, num_tokens, clamp, cfg, who: str = "moe_decode") -> tuple[int, float]:
    """Everything a launch takes, on the host and without a sync (so a captured launch stays capturable; a graph
    replay runs none of it): the types; the buffers' and weights' structure (again only if a tensor of theirs was
    replaced since: ``DecodeBuffers.check``); num_tokens in [0, capacity] and no more than the last ``stage_into``
    staged into ``buf`` (rows past them hold an earlier step), with ids checked against the buffers' E; clamp
    (``validate.as_clamp``); the weights against the buffers (H, I, experts, device); the config against the
    weights. Returns (num_tokens, clamp)."""
    from ..staging.stage import staged_rows

    if not isinstance(dw, (DecodeWeights, TCWeights)):
        raise TypeError(f"{who}: dw must be DecodeWeights or TCWeights (prepare_decode_weights / prepare_tc_weights), "
                        f"got {type(dw).__name__}")
    if not isinstance(buf, DecodeBuffers):
        raise TypeError(f"{who}: buf must be DecodeBuffers (DecodeBuffers.allocate), got {type(buf).__name__}")
    if not isinstance(cfg, LaunchConfig):
        raise TypeError(f"{who}: cfg must be a LaunchConfig, got {type(cfg).__name__}")
    buf.check(who)
    m = as_int("num_tokens", num_tokens, lo=0, hi=buf.capacity, who=who)
    clamp = as_clamp(clamp, who)
    got = (dw.hidden, dw.intermediate, dw.num_experts)
    want = (buf.hidden, buf.intermediate, buf.num_local)
    if got != want:
        raise ValueError(f"{who}: the weights are (H, I, experts) = {got} but the buffers were allocated for {want} "
                         "(weights of one geometry on buffers of another)")
    w_dev = dw.l1_words.device if isinstance(dw, DecodeWeights) else dw.l1_codes.device
    if w_dev != buf.x_q.device:
        raise ValueError(f"{who}: the weights are on {w_dev} but the buffers on {buf.x_q.device}")
    staged = staged_rows(buf.topk_idx)
    if staged is not None:
        if m > staged.rows:
            raise ValueError(f"{who}: num_tokens={m} but only {staged.rows} token(s) are staged in these buffers (the "
                             f"last stage_into, or none since allocate; rows past them hold an earlier step or "
                             f"nothing); stage {m} (padding included) first")
        if staged.num_experts != buf.layer_experts:
            raise ValueError(f"{who}: the staged expert ids were given against num_experts={staged.num_experts} but "
                             f"the buffers route over a layer of {buf.layer_experts} experts")
    if isinstance(dw, TCWeights) and m:
        tc.launch_grids(dw, buf, m, cfg)  # tc_split and tc_route against the weights and buffers, before route runs
    return m, clamp


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
    """The Triton launches (four; three when the tensor-core gate/up routes for itself, ``LaunchConfig.tc_route``; one
    CUDA launch with ``LaunchConfig.tc_cuda_step1`` at 1 token where ``cuda_step`` can run, the same bits) on the
    first num_tokens staged tokens -> y [num_tokens, H] bf16 (a view of ``buf.y``). No host sync: the checks
    (``check_launch``) read only Python values."""
    num_tokens, clamp = check_launch(dw, buf, num_tokens, clamp, cfg)
    tensor_cores = isinstance(dw, TCWeights)  # the tensor-core GEMVs (recipe megamoe-decode-tc) read x_q itself
    if tensor_cores and one_cuda_launch(dw, buf, num_tokens, cfg):
        return cuda_step.step(dw, buf, clamp)  # the whole 1-token step in one launch, the same bits
    if not (tensor_cores and cfg.tc_route):  # (tc_route: gate/up routes for itself)
        routing.route(buf.topk_idx, buf.topk_weights, buf.x_q, num_tokens, buf.expert_lo, buf.num_local, buf,
                      cfg.pdl, full=not tensor_cores)
    if tensor_cores:
        tc.l1_tc(dw, buf, num_tokens, clamp, cfg)
        tc.l2_tc(dw, buf, num_tokens, cfg)
        gemv.combine(buf, num_tokens, buf.num_topk, cfg)
    else:
        gemv.l1(dw, buf, num_tokens, clamp, cfg)
        gemv.l2(dw, buf, num_tokens, cfg)
        gemv.combine(buf, num_tokens, buf.num_topk, cfg)
    return buf.y[:num_tokens]


def moe_decode_torch(dw: DecodeWeights | TCWeights, buf: DecodeBuffers, num_tokens: int, clamp: float,
                     cfg: LaunchConfig = LaunchConfig()) -> torch.Tensor:
    """``moe_decode`` through the four stages' torch twins (host syncs; for checking). Syncing anyway, it checks
    what it reads on the host too: the staged routing of the first num_tokens rows (``validate.check_topk``,
    whoever filled the buffers) and the scale bytes of the experts the step touches (``bad_scale``)."""
    who = "moe_decode_torch"
    num_tokens, clamp = check_launch(dw, buf, num_tokens, clamp, cfg, who)
    check_topk(buf.topk_idx[:num_tokens], buf.topk_weights[:num_tokens], buf.layer_experts, f"{who}: staged")
    routing.route_torch(buf.topk_idx, buf.topk_weights, buf.x_q, num_tokens, buf.expert_lo, buf.num_local, buf)
    bad = dw.bad_scale(buf.touched[: int(buf.num_touched[0])].tolist()) if num_tokens else None
    if bad is not None:
        raise ValueError(f"{who}: {bad}")
    if isinstance(dw, TCWeights):
        tc.l1_tc_torch(dw, buf, num_tokens, clamp, cfg)
        tc.l2_tc_torch(dw, buf, num_tokens, cfg)
    else:
        gemv.l1_torch(dw, buf, num_tokens, clamp, cfg)
        gemv.l2_torch(dw, buf, num_tokens, cfg)
    gemv.combine_torch(buf, num_tokens, buf.num_topk, cfg)
    return buf.y[:num_tokens]

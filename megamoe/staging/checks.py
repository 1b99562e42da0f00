"""One input generator and one checker for the staging kernel, shared by the tests and the device script.

    StagingCase      a readable test case: preset, T, padding to A = T + pad, capacity C = A + spare,
                     the x_sf view's layout (row-major, or column-major as a transposed buffer gives)
    make_case        -> (x bf16 [T, H], topk_idx int64 [T, K], topk_weights fp32 [T, K], Buffers)
    edge_x           x whose 128-groups hit every corner of the rule (zero groups, the amax floor,
                     exact RTNE ties, e4m3 subnormals, -0, huge and tiny binades)
    check_staged     bytes of rows [0, A) against the reference, rows [A, C) untouched
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..formats import E4M3_MAX
from ..geometry import Geometry, get_geometry
from ..inputs import make_routing
from ..testing import assert_bitwise_equal
from .stage import stage_reference

POISON = 0x7F  # byte written into every buffer before staging; rows [A, C) must keep it


@dataclass(frozen=True)
class StagingCase:
    preset: str
    tokens: int
    pad: int = 3  # A - T
    spare: int = 2  # C - A
    seed: int = 0
    edge: bool = False  # edge_x instead of Gaussian x with outlier channels
    sf_col_major: bool = False  # x_sf as a column-major [C, H/128] view (stride (1, C))
    idx_dtype: torch.dtype = torch.int64

    @property
    def id(self) -> str:
        parts = [self.preset, f"T{self.tokens}", f"A{self.tokens + self.pad}", f"C{self.tokens + self.pad + self.spare}"]
        if self.edge:
            parts.append("edge")
        if self.sf_col_major:
            parts.append("sfcol")
        if self.idx_dtype != torch.int64:
            parts.append(str(self.idx_dtype).removeprefix("torch."))
        return "-".join(parts)

    @property
    def agreed(self) -> int:
        return self.tokens + self.pad

    @property
    def capacity(self) -> int:
        return self.agreed + self.spare


@dataclass
class Buffers:
    """The buffer's views: x e4m3 [C, H], x_sf fp32 [C, H/128], topk_idx [C, K], topk_weights fp32 [C, K]."""

    x: torch.Tensor
    x_sf: torch.Tensor
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor

    def views(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.x, self.x_sf, self.topk_idx, self.topk_weights


def allocate_buffers(capacity: int, g: Geometry, device="cpu", *, sf_col_major: bool = False,
                     idx_dtype: torch.dtype = torch.int64) -> Buffers:
    """Poisoned buffers (every byte 0x7F: NaN-like floats, huge ints) so that an unwritten row shows."""
    h, k = g.hidden, g.num_topk
    x = torch.empty(capacity, h, dtype=torch.float8_e4m3fn, device=device)
    sf = torch.empty(h // 128, capacity, device=device) if sf_col_major else torch.empty(capacity, h // 128, device=device)
    b = Buffers(x, sf, torch.empty(capacity, k, dtype=idx_dtype, device=device), torch.empty(capacity, k, device=device))
    for t in b.views():
        t.view(torch.uint8).fill_(POISON)
    if sf_col_major:
        b.x_sf = sf.T  # [C, H/128] with strides (1, C), as a transposed (MN-major) buffer gives
    return b


def _e4m3_midpoints() -> torch.Tensor:
    """Every point halfway between two neighbouring positive e4m3 values up to 448 (exact in bf16)."""
    v = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # 0 .. 448, ascending
    return (v[:-1] + v[1:]) / 2


def edge_x(num_tokens: int, hidden: int, gen: torch.Generator) -> torch.Tensor:
    """bf16 [T, H]: Gaussian groups interleaved with special ones, group (t, j) of kind (t*NG + j) % 8.

    kinds: 0 Gaussian; 1 all zeros (amax floor); 2 amax 448 (sf = 1, inv = 1) with +-RTNE ties of
    e4m3, subnormal ones included; 3 amax 1 and the rest ~1e-6 (e4m3 subnormals and signed zeros);
    4 +-0.0 with a few values; 5 every |x| < 1e-4 (the floor, nonzero values); 6 x * 2^100; 7 x * 2^-100.
    """
    ng = hidden // 128
    x = torch.randn(num_tokens, ng, 128, generator=gen)
    mids = _e4m3_midpoints()
    kinds = (torch.arange(num_tokens * ng).view(num_tokens, ng)) % 8
    for t in range(num_tokens):
        for j in range(ng):
            kind = int(kinds[t, j])
            row = x[t, j]
            sign = torch.where(torch.rand(128, generator=gen) < 0.5, -1.0, 1.0)
            if kind == 1:
                row.zero_()
            elif kind == 2:
                row.copy_(sign * mids[torch.randint(0, mids.numel(), (128,), generator=gen)])
                row[int(torch.randint(0, 128, (1,), generator=gen))] = E4M3_MAX
            elif kind == 3:
                row.mul_(1e-6)
                row[int(torch.randint(0, 128, (1,), generator=gen))] = -1.0
            elif kind == 4:
                row.copy_(sign * 0.0)
                row[:4] = torch.randn(4, generator=gen)
            elif kind == 5:
                row.mul_(2e-5)
            elif kind == 6:
                row.mul_(2.0**100)
            elif kind == 7:
                row.mul_(2.0**-100)
    return x.view(num_tokens, hidden).to(torch.bfloat16)


def make_case(case: StagingCase, device="cpu"):
    """Fresh seeded inputs and poisoned buffers for one case: (x, topk_idx, topk_weights, Buffers)."""
    g = get_geometry(case.preset)
    gen = torch.Generator().manual_seed(1000 * case.seed + case.tokens)
    if case.edge:
        x = edge_x(case.tokens, g.hidden, gen)
    else:
        x = torch.randn(case.tokens, g.hidden, generator=gen)
        x[:, torch.randperm(g.hidden, generator=gen)[:4]] *= 100  # outlier channels: scales differ per group
        x = x.to(torch.bfloat16)
    idx, w = make_routing(case.tokens, g.num_experts, g.num_topk, gen=gen, mask_prob=0.1)
    bufs = allocate_buffers(case.capacity, g, device, sf_col_major=case.sf_col_major, idx_dtype=case.idx_dtype)
    return x.to(device), idx.to(case.idx_dtype).to(device), w.to(device), bufs


def check_staged(bufs: Buffers, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                 agreed: int, what: str = "") -> None:
    """Rows [0, A) bitwise equal to the reference (quantized on x's device), rows [A, C) still poisoned."""
    p = f"{what}: " if what else ""
    ref = stage_reference(x, topk_idx.to(torch.int64), topk_weights, agreed)
    names = ("x", "x_sf", "topk_idx", "topk_weights")
    for name, got, want in zip(names, bufs.views(), ref):
        assert_bitwise_equal(got[:agreed], want.to(got.dtype), f"{p}staged {name}, rows [0, {agreed})")
        if got.shape[0] == agreed:
            continue
        rest = got[agreed:].contiguous().view(torch.uint8)
        if not bool((rest == POISON).all()):
            raise AssertionError(f"{p}staged {name}: rows [{agreed}, {got.shape[0]}) were written (must stay untouched)")

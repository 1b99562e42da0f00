"""The tensor-core decode kernels' weight layout (``triton_tc.py``): checkpoint MXFP4 bytes, regrouped so that
each (tile, 32-K group) a program reads is one contiguous block. Bytes are the checkpoint's own (two e2m1 per
byte, K 2j in the low nibble of byte j); nothing is re-encoded, only permuted.

    L1 codes   uint8 [E, I/32, H/32, 64, 16]   tile t's 64 MMA rows: gate channels 32t..32t+31, then up's
    L1 scales  uint8 [E, I/32, H/32, 64]
    L2 codes   uint8 [E, H/64, I/32, 64, 16]   output rows 64t..64t+63
    L2 scales  uint8 [E, H/64, I/32, 64]

The kernel reads a byte of codes as two e4m3 values e2m1 * 2**-6 (exact: ``e4m3_from_nibbles``) and applies
2**(s - 121) to each group's tensor-core sum in FP32. That product stays exact, with no subnormal and no
overflow, for scale bytes 20..235 (``megamoe.formats``: the ``e4m3_group`` decode's window): a group with
nonzero codes and a byte outside it is refused. A group whose codes are all zero is worth zero under any
byte; its byte becomes 127, so that no 0xFF (NaN) or out-of-window byte reaches the FP32 scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..formats import MXFP4_BLOCK, scale_byte_window, unpack_e2m1
from ..weights import MXFP4Weights
from .layout import fold_global_scales

L1_ROWS = 64  # MMA rows per L1 tile: 32 gate channels + the same 32 up channels (one requant group of 32)
L2_ROWS = 64  # MMA rows per L2 tile
GROUP_BYTES = MXFP4_BLOCK // 2  # packed bytes of one row's 32-K group


@dataclass
class TCWeights:
    """Prepared experts (module docstring for the layouts), on one device."""

    l1_codes: torch.Tensor
    l1_scales: torch.Tensor
    l2_codes: torch.Tensor
    l2_scales: torch.Tensor
    hidden: int
    intermediate: int

    @property
    def num_experts(self) -> int:
        return self.l1_codes.shape[0]

    def nbytes_per_expert(self) -> int:
        return sum(t[0].numel() for t in (self.l1_codes, self.l1_scales, self.l2_codes, self.l2_scales))


def e4m3_from_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """What the kernel's decode computes: packed uint8 [..., K/2] -> e4m3 bytes [..., K] whose values are
    e2m1 * 2**-6: sign to bit 7, the three magnitude bits (e1 e0 m) to bits 4..2."""
    lo = ((packed & 7) << 2) | ((packed & 8) << 4)
    hi = ((packed >> 2) & 0x1C) | (packed & 0x80)
    return torch.stack((lo, hi), dim=-1).reshape(*packed.shape[:-1], -1)


def check_and_canonicalize_scales(packed: torch.Tensor, scale_bytes: torch.Tensor, what: str,
                                  first_expert: int = 0) -> torch.Tensor:
    """packed [E, N, K/2], bytes [E, N, K/32] -> bytes with all-zero groups set to 127; refuses a group with
    nonzero codes whose byte lies outside the window (0xFF, NaN, included)."""
    lo, hi = scale_byte_window("e4m3_group")
    codes = unpack_e2m1(packed)
    nonzero = ((codes & 7) != 0).reshape(*scale_bytes.shape, MXFP4_BLOCK).any(dim=-1)
    bad = nonzero & ((scale_bytes < lo) | (scale_bytes > hi))
    if bad.any():
        e, n, g = (int(v) for v in bad.nonzero()[0])
        raise ValueError(f"{what}: E8M0 scale byte {int(scale_bytes[e, n, g])} at [expert, row, group] = "
                         f"[{e + first_expert}, {n}, {g}] (a group with nonzero codes) is outside {lo}..{hi}, the bytes "
                         "the tensor-core decode kernel scales exactly; megamoe-decode (CUDA cores) takes 0..252")
    return torch.where(nonzero, scale_bytes, torch.full_like(scale_bytes, 127))


def _tiles(packed: torch.Tensor, scales: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """packed [E, N, K/2], scales [E, N, K/32] -> ([E, N/rows, K/32, rows, 16], [E, N/rows, K/32, rows])."""
    e, n, kb = packed.shape
    g = kb // GROUP_BYTES
    c = packed.view(e, n // rows, rows, g, GROUP_BYTES).permute(0, 1, 3, 2, 4)
    s = scales.view(e, n // rows, rows, g).permute(0, 1, 3, 2)
    return c.contiguous(), s.contiguous()


def _l1_rows(t: torch.Tensor, i: int) -> torch.Tensor:
    """[E, 2I, ...] (gate rows, then up rows) -> [E, 2I, ...] in tile order: per 32 channels, gate then up."""
    e = t.shape[0]
    return t.view(e, 2, i // 32, 32, *t.shape[2:]).transpose(1, 2).reshape(t.shape)


def prepare_tc_weights(weights: MXFP4Weights, experts_per_chunk: int = 16) -> TCWeights:
    """Checkpoint form (all experts) -> ``TCWeights`` on the same device; global scales folded (powers of two
    only), scale bytes checked (module docstring)."""
    w = fold_global_scales(weights)
    h, i = w.hidden, w.intermediate
    if i % 32 or h % L2_ROWS or h % 128 or i % 128:
        raise ValueError(f"the tensor-core decode kernel needs hidden % 128 == 0 and intermediate % 128 == 0, "
                         f"got hidden={h}, intermediate={i}")
    parts = []
    for lo in range(0, w.num_experts, experts_per_chunk):
        c = w.experts(lo, min(lo + experts_per_chunk, w.num_experts))
        s1 = check_and_canonicalize_scales(c.l1, c.l1_scale, "l1", lo)
        s2 = check_and_canonicalize_scales(c.l2, c.l2_scale, "l2", lo)
        parts.append((*_tiles(_l1_rows(c.l1, i), _l1_rows(s1, i), L1_ROWS), *_tiles(c.l2, s2, L2_ROWS)))
    l1c, l1s, l2c, l2s = (torch.cat(p) for p in zip(*parts))
    return TCWeights(l1c, l1s, l2c, l2s, h, i)


def expert_operands(tw: TCWeights, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expert e as the tensor cores read it, in checkpoint row order: (w1 [2I, H] e4m3 values e2m1 * 2**-6,
    sf1 [2I, H/32] fp32 2**(s - 121), w2 [H, I], sf2 [H, I/32])."""
    def back(codes, scales):
        nt, g, rows, gb = codes.shape
        c = codes.permute(0, 2, 1, 3).reshape(nt * rows, g * gb)
        s = scales.permute(0, 2, 1).reshape(nt * rows, g)
        vals = e4m3_from_nibbles(c).view(torch.float8_e4m3fn).float()
        return vals, torch.ldexp(torch.ones_like(s, dtype=torch.float32), s.to(torch.int32) - 121)

    i = tw.intermediate
    w1, sf1 = back(tw.l1_codes[e], tw.l1_scales[e])
    # tile order back to gate rows then up rows (the inverse of _l1_rows)
    w1 = w1.view(i // 32, 2, 32, -1).transpose(0, 1).reshape(2 * i, -1)
    sf1 = sf1.view(i // 32, 2, 32, -1).transpose(0, 1).reshape(2 * i, -1)
    w2, sf2 = back(tw.l2_codes[e], tw.l2_scales[e])
    return w1, sf1, w2, sf2

"""The tensor-core decode kernels' weight layout (``triton_tc.py``): the checkpoint's e2m1 codes and E8M0
bytes, regrouped so that each (tile, 32-K group) a program reads is one contiguous block and each thread's
share of it is 8 contiguous bytes, already in the order of the wgmma A-operand register fragment.

    l1_codes   uint8 [E, I/32, H/32, 1024]    gate/up tile t's 64 MMA rows: gate channels 32t..32t+31, then up's
    l1_scales  uint8 [E, I/32, H/128, 64, 4]  per 128-K block, row r's four group bytes in one 32-bit word
    l2_codes   uint8 [E, H/64, I/32, 1024]    down tile t's rows: output rows 64t..64t+63
    l2_scales  uint8 [E, H/64, I/128, 64, 4]

A scale byte is stored as s + 6 (``FACTOR_BIAS``): the FP32 exponent field of the group's factor 2**(s - 121),
so the kernel makes the factor with a shift and a mask.

A block holds the [64, 32] codes c[r, k] of one group, r = 16 w + 8 h + ri, k = 16 kh + 4 lq + i, as bytes in
the order (w, ri, lq, kh, i), one byte per (row ri, row ri + 8) pair (``pack_pair``): warp w's lane 4 ri + lq
then holds rows ri and ri + 8 of its 16 at K 4 lq + (0..3) and 16 + 4 lq + (0..3), which is what the wgmma
fragment asks of it.

The kernel reads a code as the e4m3 byte worth e2m1 * 2**-6 (``e4m3_bytes``: exact) and applies 2**(s - 121)
to each group's tensor-core sum in FP32. That product stays exact, with no subnormal and no overflow, for
scale bytes 20..236 (``megamoe.formats``: the ``e4m3_group`` decode's window): a group with nonzero codes
and a byte outside it is refused. A group whose codes are all zero is worth zero under any byte; its byte
becomes 127, so that no 0xFF (NaN) or out-of-window byte reaches the FP32 scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..formats import MXFP4_BLOCK, e8m0_to_float, scale_byte_window, unpack_e2m1
from ..validate import as_int, expect_tensor
from ..weights import MXFP4Weights
from .layout import fold_global_scales

GATE_UP_ROWS = 64  # MMA rows per gate/up tile: 32 gate channels + the same 32 up channels (one requant group of 32)
DOWN_ROWS = 64  # MMA rows per down tile
GROUP_BYTES = MXFP4_BLOCK // 2  # packed bytes of one row's 32-K group


def check_tc_geometry(hidden, intermediate, who: str) -> tuple[int, int]:
    """The tensor-core kernels' tiles divide the GEMMs: hidden and intermediate multiples of 128."""
    h = as_int("hidden", hidden, lo=128, who=who)
    i = as_int("intermediate", intermediate, lo=128, who=who)
    if h % 128 or i % 128:
        raise ValueError(f"{who}: the tensor-core decode kernel needs hidden % 128 == 0 and intermediate % 128 == 0, "
                         f"got hidden={h}, intermediate={i}")
    return h, i


@dataclass
class TCWeights:
    """Prepared experts (module docstring for the layouts), on one device; shapes, dtypes and contiguity checked
    at construction (the kernels index them as dense arrays, the scales as 32-bit words)."""

    l1_codes: torch.Tensor
    l1_scales: torch.Tensor
    l2_codes: torch.Tensor
    l2_scales: torch.Tensor
    hidden: int
    intermediate: int

    def __post_init__(self) -> None:
        who = "TCWeights"
        h, i = check_tc_geometry(self.hidden, self.intermediate, who)
        expect_tensor("l1_codes", self.l1_codes, who=who)
        e, dev = self.l1_codes.shape[0] if self.l1_codes.ndim else 0, self.l1_codes.device
        for name, shape in (("l1_codes", (e, i // 32, h // 32, 64 * GROUP_BYTES)),
                            ("l1_scales", (e, i // 32, h // 128, GATE_UP_ROWS, 4)),
                            ("l2_codes", (e, h // DOWN_ROWS, i // 32, 64 * GROUP_BYTES)),
                            ("l2_scales", (e, h // DOWN_ROWS, i // 128, DOWN_ROWS, 4))):
            expect_tensor(name, getattr(self, name), shape, torch.uint8, dev, who, contiguous=True)
        if e < 1:
            raise ValueError(f"{who}: needs at least one expert, got l1_codes of shape {tuple(self.l1_codes.shape)}")

    def bad_scale(self, experts=None) -> str | None:
        """The first stored scale byte of ``experts`` (all when None) outside the window ``prepare_tc_weights``
        keeps (bytes 20..236 stored as s + 6; all-zero groups stored as 127 + 6), named by tensor, expert,
        checkpoint row and 32-K group; None when there is none. Prepared weights hold none: one found was written
        in place after prepare (for a non-finite result's message)."""
        lo, hi = (b + FACTOR_BIAS for b in scale_byte_window("e4m3_group"))
        ids = list(range(self.num_experts)) if experts is None else sorted(set(int(e) for e in experts))
        idx = torch.tensor(ids, dtype=torch.int64, device=self.l1_scales.device)
        i = self.intermediate
        for name in ("l1_scales", "l2_scales"):
            s = getattr(self, name)[idx]  # [B, N/64, K/128, 64, 4]
            bad = (s < lo) | (s > hi)
            if bool(bad.any()):
                b, t, kb, r, j = bad.nonzero()[0].tolist()
                if name == "l1_scales":  # tile t's rows: gate 32t..32t+31, then up's (``_gate_up_rows``)
                    row = (32 * t + r) if r < 32 else (i + 32 * t + r - 32)
                    what = f"l1 row {row} ({'gate' if r < 32 else 'up'})"
                else:
                    what = f"l2 row {DOWN_ROWS * t + r}"
                byte = int(s[b, t, kb, r, j]) - FACTOR_BIAS
                return (f"TCWeights.{name}: expert {ids[b]}, {what}, 32-K group {4 * kb + j} holds scale byte "
                        f"{byte % 256} (stored {byte + FACTOR_BIAS}; outside {lo - FACTOR_BIAS}..{hi - FACTOR_BIAS}, "
                        "which prepare refuses: was it written in place?)")
        return None

    @property
    def num_experts(self) -> int:
        return self.l1_codes.shape[0]

    def nbytes_per_expert(self) -> int:
        return sum(t[0].numel() for t in (self.l1_codes, self.l1_scales, self.l2_codes, self.l2_scales))


def e4m3_bytes(codes: torch.Tensor) -> torch.Tensor:
    """What the kernel's decode computes: e2m1 codes uint8 -> e4m3 bytes worth e2m1 * 2**-6: sign to bit 7, the
    three magnitude bits (e1 e0 m) to bits 4..2."""
    return ((codes & 7) << 2) | ((codes & 8) << 4)


def pack_pair(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Codes of rows ri (lo) and ri + 8 (hi), uint8 -> the stored byte, placed so that the kernel's decode of a
    32-bit word (four bytes) is five operations (``unpack_pair`` is its torch twin):

        bit    7     6     5     4     3     2     1     0
              lo.s  hi.e1 hi.s  lo.e1 lo.e0 lo.m  hi.e0 hi.m

        lo = byte & 0x9C                                   (already sign at 7, magnitude at 4..2)
        hi = ((byte << 2) & 0x8C) | ((byte >> 2) & 0x10)   (hi.m, hi.e0, hi.s up 2; hi.e1 down 2)

    Across a word's four bytes the shifts carry bits only into positions the masks clear."""
    return e4m3_bytes(lo) | (hi & 3) | ((hi & 4) << 4) | ((hi & 8) << 2)


def unpack_pair(byte: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The stored byte -> (lo, hi) as e4m3 bytes worth e2m1 * 2**-6 (what the kernel's decode computes)."""
    return byte & 0x9C, ((byte << 2) & 0x8C) | ((byte >> 2) & 0x10)


def codes_from_e4m3(b: torch.Tensor) -> torch.Tensor:
    """Inverse of ``e4m3_bytes``: the e4m3 byte of a code -> the code."""
    return ((b >> 2) & 7) | ((b >> 4) & 8)


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


BLOCK_SHAPE = (4, 2, 8, 2, 4, 4)  # a block's rows and K as (w, h, ri) x (kh, lq, i)
BLOCK_ORDER = (0, 2, 4, 3, 5, 1)  # -> (w, ri, lq, kh, i, h): the byte order, h the row of the pair


def code_blocks(packed: torch.Tensor, rows: int) -> torch.Tensor:
    """packed [E, N, K/2] -> [E, N/64, K/32, 1024]: one block per (tile, group) (``rows`` = 64)."""
    e, n, kb = packed.shape
    g = kb // GROUP_BYTES
    c = unpack_e2m1(packed).view(e, n // rows, rows, g, 32).permute(0, 1, 3, 2, 4)  # [E, NT, G, 64, 32]
    c = c.reshape(e, n // rows, g, *BLOCK_SHAPE).permute(0, 1, 2, *(3 + d for d in BLOCK_ORDER))
    return pack_pair(c[..., 0], c[..., 1]).reshape(e, n // rows, g, rows * 16).contiguous()


FACTOR_BIAS = 6  # stored byte = s + 6 = the FP32 exponent field of 2**(s - 121), the group's factor


def scale_words(scales: torch.Tensor, rows: int) -> torch.Tensor:
    """scales [E, N, K/32] (checked bytes 20..236) -> [E, N/64, K/128, 64, 4] bytes s + 6: a tile's rows per
    128-K block, each row's four bytes adjacent (one 32-bit load per row and block)."""
    e, n, g = scales.shape
    return (scales + FACTOR_BIAS).view(e, n // rows, rows, g // 4, 4).permute(0, 1, 3, 2, 4).contiguous()


def _untile(blocks: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of ``code_blocks`` and ``scale_words`` for one expert: ([NT, G, 1024], [NT, G/4, 64, 4]) ->
    (codes [NT * 64, G * 32], bytes [NT * 64, G])."""
    nt, g, _ = blocks.shape
    lo, hi = unpack_pair(blocks.view(nt, g, 4, 8, 4, 2, 4))
    c = codes_from_e4m3(torch.stack((lo, hi), dim=-1))  # (w, ri, lq, kh, i, h)
    inv = [BLOCK_ORDER.index(d) for d in range(6)]
    c = c.permute(0, 1, *(2 + d for d in inv)).reshape(nt, g, 64, 32)
    return (c.permute(0, 2, 1, 3).reshape(nt * 64, g * 32),
            scales.permute(0, 2, 1, 3).reshape(nt * 64, g) - FACTOR_BIAS)


def _gate_up_rows(t: torch.Tensor, i: int) -> torch.Tensor:
    """[E, 2I, ...] (gate rows, then up rows) -> [E, 2I, ...] in tile order: per 32 channels, gate then up."""
    e = t.shape[0]
    return t.view(e, 2, i // 32, 32, *t.shape[2:]).transpose(1, 2).reshape(t.shape)


def prepare_tc_weights(weights: MXFP4Weights, experts_per_chunk: int = 16) -> TCWeights:
    """Checkpoint form (all experts) -> ``TCWeights`` on the same device; global scales folded (powers of two
    only), scale bytes checked (module docstring)."""
    if not isinstance(weights, MXFP4Weights):
        raise TypeError(f"prepare_tc_weights: weights must be MXFP4Weights, got {type(weights).__name__}")
    experts_per_chunk = as_int("experts_per_chunk", experts_per_chunk, lo=1, who="prepare_tc_weights")
    h, i = check_tc_geometry(weights.hidden, weights.intermediate, "prepare_tc_weights")
    w = fold_global_scales(weights)
    parts = []
    for lo in range(0, w.num_experts, experts_per_chunk):
        c = w.experts(lo, min(lo + experts_per_chunk, w.num_experts))
        s1 = check_and_canonicalize_scales(c.l1, c.l1_scale, "l1", lo)
        s2 = check_and_canonicalize_scales(c.l2, c.l2_scale, "l2", lo)
        parts.append((code_blocks(_gate_up_rows(c.l1, i), GATE_UP_ROWS),
                      scale_words(_gate_up_rows(s1, i), GATE_UP_ROWS),
                      code_blocks(c.l2, DOWN_ROWS), scale_words(s2, DOWN_ROWS)))
    codes1, scales1, codes2, scales2 = (torch.cat(p) for p in zip(*parts))
    return TCWeights(codes1, scales1, codes2, scales2, h, i)


def _expert_codes(tw: TCWeights, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expert e's codes and bytes in checkpoint order: (l1 codes [2I, H], bytes [2I, H/32], l2 codes [H, I],
    bytes [H, I/32]); the inverse of prepare's tiling (``_untile``) and row order (``_gate_up_rows``)."""
    i = tw.intermediate
    c1, s1 = _untile(tw.l1_codes[e], tw.l1_scales[e])
    c1, s1 = (t.view(i // 32, 2, 32, -1).transpose(0, 1).reshape(2 * i, -1) for t in (c1, s1))  # gate, then up
    return (c1, s1, *_untile(tw.l2_codes[e], tw.l2_scales[e]))


def expert_operands(tw: TCWeights, e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expert e as the tensor cores read it, in checkpoint row order: (w1 [2I, H] e4m3 values e2m1 * 2**-6,
    sf1 [2I, H/32] fp32 2**(s - 121), w2 [H, I], sf2 [H, I/32])."""
    c1, s1, c2, s2 = _expert_codes(tw, e)
    vals = lambda codes: e4m3_bytes(codes).view(torch.float8_e4m3fn).float()  # noqa: E731
    return vals(c1), e8m0_to_float(s1) * 2.0**6, vals(c2), e8m0_to_float(s2) * 2.0**6

"""The decode kernel's weight layout: MXFP4 checkpoint form -> tiles that each program streams once.

Bit layout of one 32-bit word (8 weights, K offsets 0..7 of the word). Weight pair p (0..3) holds K 2p
(``lo``) and K 2p+1 (``hi``); code = sign * 8 + c, c = (e1 e0 m) the magnitude index:

    lo: c at bits 9-3p .. 11-3p, sign at bit 15-p        hi: c at bits 25-3p .. 27-3p, sign at bit 31-p

so that ``h = ((w << 3p) & 0x0E000E00) | ((w << p) & 0x80008000)`` is two fp16 numbers whose bits are
(sign, 000 e1 e0, m 000000000): exactly e2m1 * 2**-14 each (fp16 subnormals for c = 0, 1). Decoding a
pair costs two shifts and two masks (pair 0: one mask), and the fp16 -> fp32 conversion. No nibble
layout does it with one shift per pair (an exhaustive search over the 4-bit placements finds none).

Tile order (groups fastest: the lanes of a warp take consecutive groups of the same row, so that each
lane keeps one group's x values for the several rows it owns):

    l1_words   int32 [E, I/BN, H/BK, 2, 4, BN, G]     gate/up: half 0 gate, 1 up; then word-in-group, row, group
    l1_scales  uint8 [E, I/BN, H/BK, 2, BN, G]
    l2_words   int32 [E, H/BN2, I/BK2, 4, BN2, G2]    down
    l2_scales  uint8 [E, H/BN2, I/BK2, BN2, G2]

with BK = 32 G (G groups of 32 K per K-iteration). Word (half, wig, r, g) of tile (t, i) holds row
half * I + t * BN + r (gate/up), K = i * BK + g * 32 + wig * 8 + (0..7).

``prepare_decode_weights`` refuses what the kernel cannot compute exactly: an E8M0 byte 0xFF (NaN) in a
group with nonzero codes, and a 128-K block of one row whose nonzero groups' scale bytes span more than
``MAX_SCALE_SPREAD`` binades (the block sum would need more than float64's 53 bits), and bytes above
``MAX_SCALE_BYTE`` (values beyond float32). Global scales that
are powers of two are folded into the scale bytes exactly; others are refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..formats import E8M0_NAN, MXFP4_BLOCK, pack_e2m1, unpack_e2m1
from ..recipe import MEGAMOE_DECODE
from ..validate import as_int, expect_tensor
from ..weights import MXFP4Weights

# A 128-K block sum of e4m3 x (e2m1 * 2**(s - 127)) is an integer multiple of 2**(-10 + s_min - 127)
# below 2**(28.4 + s_max - s_min) of those units: exact in float64 iff s_max - s_min <= 53 - 29 = 24.
MAX_SCALE_SPREAD = 24
MAX_SCALE_BYTE = 252  # 6 * 2**(253 - 127) = 1.5 * 2**128 overflows float32 (the reference's dequantized weights)
WORD_K = 8  # K values per 32-bit word
WIG = 4  # words per 32-K scale group
GATE_UP_BN = MEGAMOE_DECODE.l2_group  # gate/up rows per program: one down requant group (the kernel requantizes it)
MAGNITUDE_BITS = 0x0FFF0FFF  # the e2m1 magnitude bits of a word's 8 weights (a group is zero iff none is set)


def _lo_bits(p: int) -> tuple[int, int]:
    """(bit of c's lowest bit, bit of the sign) of the lo weight of pair p."""
    return 9 - 3 * p, 15 - p


def pack_words(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes uint8 [..., K] (K % 8 == 0) -> int32 words [..., K/8] in the decode bit layout."""
    c = codes.to(torch.int64).reshape(*codes.shape[:-1], -1, WORD_K)
    w = torch.zeros(c.shape[:-1], dtype=torch.int64, device=codes.device)
    for p in range(4):
        mag, sign = _lo_bits(p)
        for half in range(2):
            v = c[..., 2 * p + half]
            w |= (v & 7) << (mag + 16 * half)
            w |= ((v >> 3) & 1) << (sign + 16 * half)
    return (w - ((w >> 31) << 32)).to(torch.int32)  # two's complement into int32


def unpack_words(words: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_words``: int32 [..., K/8] -> e2m1 codes uint8 [..., K]."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    out = []
    for p in range(4):
        mag, sign = _lo_bits(p)
        for half in range(2):
            c = ((w >> (mag + 16 * half)) & 7) | (((w >> (sign + 16 * half)) & 1) << 3)
            out.append(c)
    return torch.stack(out, dim=-1).reshape(*words.shape[:-1], -1).to(torch.uint8)


@dataclass(frozen=True)
class TileShape:
    """Rows per program (``bn``) and 32-K groups per K-iteration (``groups``) of one GEMM: powers of two (a
    Triton block's sizes), checked here; what each GEMM takes on top is ``check_tiles``'."""

    bn: int
    groups: int

    def __post_init__(self) -> None:
        for name in ("bn", "groups"):
            v = as_int(name, getattr(self, name), lo=1, who="TileShape")
            if v & (v - 1):
                raise ValueError(f"TileShape: {name} must be a power of two (a Triton block size), got {v}")

    @property
    def bk(self) -> int:
        return 32 * self.groups


def check_tiles(hidden: int, intermediate: int, l1_tile: TileShape, l2_tile: TileShape, who: str) -> None:
    """What the kernels take (``triton_gemv``): gate/up rows per program = the down requant group (32), gate/up's groups
    a whole number of 128-K promotion blocks, 1..16 of them, down's groups 1..16 (its promotion block is one
    group); each tile dividing its GEMM (gate/up: I rows of H; down: H rows of I)."""
    for name, t in (("l1_tile", l1_tile), ("l2_tile", l2_tile)):
        if not isinstance(t, TileShape):
            raise TypeError(f"{who}: {name} must be a TileShape, got {type(t).__name__}")
    if l1_tile.bn != GATE_UP_BN:
        raise ValueError(f"{who}: l1_tile.bn must be {GATE_UP_BN} (gate/up's rows per program are one down requant "
                         f"group), got {l1_tile.bn}")
    if not 4 <= l1_tile.groups <= 64:
        raise ValueError(f"{who}: l1_tile.groups must be 4..64 (1 to 16 promotion blocks of 128 K), got "
                         f"{l1_tile.groups}")
    if l2_tile.groups > 16:
        raise ValueError(f"{who}: l2_tile.groups must be 1..16, got {l2_tile.groups}")
    for name, t, rows, k in (("l1_tile", l1_tile, intermediate, hidden), ("l2_tile", l2_tile, hidden, intermediate)):
        if rows % t.bn or k % t.bk:
            raise ValueError(f"{who}: {name} {t} must divide its GEMM: {rows} rows by bn={t.bn} and K={k} by "
                             f"bk={t.bk}")


@dataclass
class DecodeWeights:
    """The prepared experts (module docstring for the layouts), on one device; their shapes, dtypes,
    tiles and contiguity are checked at construction (the kernels index them as dense arrays).

    l1_words int32 [E, I/bn1, H/bk1, 2, 4, bn1, g1]; l1_scales uint8 [E, I/bn1, H/bk1, 2, bn1, g1];
    l2_words int32 [E, H/bn2, I/bk2, 4, bn2, g2]; l2_scales uint8 [E, H/bn2, I/bk2, bn2, g2]."""

    l1_words: torch.Tensor
    l1_scales: torch.Tensor
    l2_words: torch.Tensor
    l2_scales: torch.Tensor
    l1_tile: TileShape
    l2_tile: TileShape
    hidden: int
    intermediate: int

    def __post_init__(self) -> None:
        who = "DecodeWeights"
        h = as_int("hidden", self.hidden, lo=128, who=who)
        i = as_int("intermediate", self.intermediate, lo=32, who=who)
        check_tiles(h, i, self.l1_tile, self.l2_tile, who)
        expect_tensor("l1_words", self.l1_words, who=who)
        e, dev = self.l1_words.shape[0] if self.l1_words.ndim else 0, self.l1_words.device
        t1, t2 = self.l1_tile, self.l2_tile
        for name, shape, dtype in (
                ("l1_words", (e, i // t1.bn, h // t1.bk, 2, WIG, t1.bn, t1.groups), torch.int32),
                ("l1_scales", (e, i // t1.bn, h // t1.bk, 2, t1.bn, t1.groups), torch.uint8),
                ("l2_words", (e, h // t2.bn, i // t2.bk, WIG, t2.bn, t2.groups), torch.int32),
                ("l2_scales", (e, h // t2.bn, i // t2.bk, t2.bn, t2.groups), torch.uint8)):
            expect_tensor(name, getattr(self, name), shape, dtype, dev, who, contiguous=True)
        if e < 1:
            raise ValueError(f"{who}: needs at least one expert, got l1_words of shape {tuple(self.l1_words.shape)}")

    def bad_scale(self, experts=None) -> str | None:
        """The first scale byte of ``experts`` (all when None) that ``prepare_decode_weights`` would refuse in a
        group with nonzero codes (0xFF, NaN, or above MAX_SCALE_BYTE: 2**(s - 127) * 6 overflows), named by
        tensor, expert, checkpoint row and 32-K group; None when there is none. Prepared weights hold none: one
        found was written in place after prepare (for a non-finite result's message: ``validate.check_output``)."""
        ids = list(range(self.num_experts)) if experts is None else sorted(set(int(e) for e in experts))
        idx = torch.tensor(ids, dtype=torch.int64, device=self.l1_scales.device)
        i = self.intermediate
        for name, words, scales, wig_dim in (("l1_scales", self.l1_words, self.l1_scales, 4),
                                             ("l2_scales", self.l2_words, self.l2_scales, 3)):
            nonzero = ((words[idx] & MAGNITUDE_BITS) != 0).any(dim=wig_dim)
            s = scales[idx]
            bad = nonzero & ((s == E8M0_NAN) | (s > MAX_SCALE_BYTE))
            if bool(bad.any()):
                at = bad.nonzero()[0].tolist()
                byte = int(s[tuple(at)])
                if name == "l1_scales":  # [E, I/bn, H/bk, half, bn, g]
                    b, t, kb, half, r, g = at
                    row, group = half * i + t * self.l1_tile.bn + r, kb * self.l1_tile.groups + g
                    what = f"l1 row {row} ({'up' if half else 'gate'})"
                else:  # [E, H/bn2, I/bk2, bn2, g2]
                    b, t, kb, r, g = at
                    row, group = t * self.l2_tile.bn + r, kb * self.l2_tile.groups + g
                    what = f"l2 row {row}"
                return (f"DecodeWeights.{name}: expert {ids[b]}, {what}, 32-K group {group} holds scale byte "
                        f"{'0xFF (NaN)' if byte == E8M0_NAN else byte} (prepare refuses it: was it written in place?)")
        return None

    @property
    def num_experts(self) -> int:
        return self.l1_words.shape[0]

    def nbytes_per_expert(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in (self.l1_words, self.l1_scales, self.l2_words, self.l2_scales))


def check_exact_scales(codes: torch.Tensor, scale_bytes: torch.Tensor, what: str, first_expert: int = 0) -> None:
    """Refuse scale bytes the kernel cannot use exactly (module docstring). codes [E, N, K], bytes [E, N, K/32]
    of experts first_expert.. (error messages name experts by their absolute index)."""
    nonzero = ((codes & 7) != 0).reshape(*scale_bytes.shape, MXFP4_BLOCK).any(dim=-1)  # [E, N, K/32]
    nan = (scale_bytes == E8M0_NAN) & nonzero
    if nan.any():
        e, n, g = (int(v) for v in nan.nonzero()[0])
        e += first_expert
        raise ValueError(f"{what}: E8M0 scale byte 0xFF (NaN) at [expert, row, group] = [{e}, {n}, {g}], "
                         "a group with nonzero codes; the decode kernel refuses it")
    big = (scale_bytes > MAX_SCALE_BYTE) & (scale_bytes != E8M0_NAN) & nonzero
    if big.any():
        e, n, g = (int(v) for v in big.nonzero()[0])
        raise ValueError(f"{what}: E8M0 scale byte {int(scale_bytes[e, n, g])} > {MAX_SCALE_BYTE} at [expert, row, group] "
                         f"= [{e + first_expert}, {n}, {g}]: 6 * 2**(byte - 127) overflows float32")
    b = scale_bytes.to(torch.int32)
    hi = torch.where(nonzero, b, torch.full_like(b, -1)).reshape(*b.shape[:-1], -1, 4).amax(-1)
    lo = torch.where(nonzero, b, torch.full_like(b, 1 << 10)).reshape(*b.shape[:-1], -1, 4).amin(-1)
    spread = torch.where(hi >= 0, hi - lo, torch.zeros_like(hi))
    if (spread > MAX_SCALE_SPREAD).any():
        e, n, kb = (int(v) for v in (spread > MAX_SCALE_SPREAD).nonzero()[0])
        raise ValueError(f"{what}: scale bytes of expert {e + first_expert}, row {n}, 128-K block {kb} span {int(spread[e, n, kb])} "
                         f"binades; the decode kernel's float64 block sum is exact up to {MAX_SCALE_SPREAD}")


def fold_global_scales(weights: MXFP4Weights) -> MXFP4Weights:
    """Fold power-of-two per-expert global scales into the E8M0 bytes exactly (None stays None)."""
    out = {}
    for name, sc in (("l1", weights.l1_global_scale), ("l2", weights.l2_global_scale)):
        b = getattr(weights, f"{name}_scale")
        if sc is None:
            out[f"{name}_scale"] = b
            continue
        m, ex = torch.frexp(sc.double())
        if not bool((m == 0.5).all()):
            raise ValueError(f"{name}_global_scale must be powers of two for the decode kernel, got {sc.tolist()}")
        shifted = b.to(torch.int32) + (ex - 1).to(torch.int32).view(-1, 1, 1)
        if (shifted < 0).any() or (shifted > 254).any():
            raise ValueError(f"{name}_global_scale moves scale bytes outside E8M0's range [0, 254]")
        out[f"{name}_scale"] = torch.where(b == E8M0_NAN, b.to(torch.int32), shifted).to(torch.uint8)
    return MXFP4Weights(weights.l1, out["l1_scale"], weights.l2, out["l2_scale"])


def _tile(codes: torch.Tensor, scales: torch.Tensor, halves: int, tile: TileShape):
    """codes uint8 [E, halves * N, K], scales [E, halves * N, K/32] -> (words, scale tiles)."""
    e, rows, k = codes.shape
    n = rows // halves
    bn, g = tile.bn, tile.groups
    if n % bn or k % tile.bk:
        raise ValueError(f"rows {n} must be a multiple of bn={bn} and K={k} of bk={tile.bk}")
    words = pack_words(codes)  # [E, rows, K/8]
    # [E, H, T, BN, I, G, WIG] -> [E, T, I, H, WIG, BN, G]
    w = words.view(e, halves, n // bn, bn, k // tile.bk, g, WIG).permute(0, 2, 4, 1, 6, 3, 5)
    s = scales.view(e, halves, n // bn, bn, k // tile.bk, g).permute(0, 2, 4, 1, 3, 5)
    if halves == 1:
        w, s = w.squeeze(3), s.squeeze(3)
    return w.contiguous(), s.contiguous()


def _untile(words: torch.Tensor, scales: torch.Tensor, halves: int) -> tuple[torch.Tensor, torch.Tensor]:
    if halves == 1:
        words, scales = words.unsqueeze(3), scales.unsqueeze(3)
    e, nt, ni, h, wig, bn, g = words.shape
    w = words.permute(0, 3, 1, 5, 2, 6, 4).reshape(e, h * nt * bn, ni * g * wig)
    s = scales.permute(0, 3, 1, 4, 2, 5).reshape(e, h * nt * bn, ni * g)
    return unpack_words(w), s.contiguous()


def default_tiles(hidden: int, intermediate: int, bn1: int = 32, bn2: int = 64, groups: int = 16) -> tuple[TileShape, TileShape]:
    """Tiles that fit the geometry: ``groups`` capped by the K of each GEMM (H for gate/up, I for down). bn1 is the
    down requant group (32); 64 down rows per program let each x value a thread loads serve 8 rows (5.05
    instructions per weight in the down K loop for sm_90, against 5.76 with 32: scripts/decode_sass.py)."""
    return (TileShape(bn1, min(groups, hidden // 32)), TileShape(bn2, min(groups, intermediate // 32)))


def prepare_decode_weights(weights: MXFP4Weights, l1_tile: TileShape | None = None,
                           l2_tile: TileShape | None = None, experts_per_chunk: int = 8) -> DecodeWeights:
    """Checkpoint form (all experts given) -> ``DecodeWeights`` on the same device, checked exact.
    Experts go through in chunks (the int64 bit packing of DeepSeek-V4-Flash at once would take 34 GB)."""
    if not isinstance(weights, MXFP4Weights):
        raise TypeError(f"prepare_decode_weights: weights must be MXFP4Weights, got {type(weights).__name__}")
    experts_per_chunk = as_int("experts_per_chunk", experts_per_chunk, lo=1, who="prepare_decode_weights")
    h, i = weights.hidden, weights.intermediate
    d1, d2 = default_tiles(h, i)
    l1_tile, l2_tile = l1_tile or d1, l2_tile or d2
    check_tiles(h, i, l1_tile, l2_tile, "prepare_decode_weights")  # before the (long) packing
    w = fold_global_scales(weights)
    parts = []
    for lo in range(0, w.num_experts, experts_per_chunk):
        c = w.experts(lo, min(lo + experts_per_chunk, w.num_experts))
        c1, c2 = unpack_e2m1(c.l1), unpack_e2m1(c.l2)
        check_exact_scales(c1, c.l1_scale, "l1", lo)
        check_exact_scales(c2, c.l2_scale, "l2", lo)
        parts.append((*_tile(c1, c.l1_scale, 2, l1_tile), *_tile(c2, c.l2_scale, 1, l2_tile)))
    words1, scales1, words2, scales2 = (torch.cat(p) for p in zip(*parts))
    return DecodeWeights(words1, scales1, words2, scales2, l1_tile, l2_tile, h, i)


def checkpoint_from_decode(d: DecodeWeights) -> MXFP4Weights:
    """Inverse of ``prepare_decode_weights`` (after its global-scale fold): the checkpoint bytes back."""
    c1, s1 = _untile(d.l1_words, d.l1_scales, 2)
    c2, s2 = _untile(d.l2_words, d.l2_scales, 1)
    return MXFP4Weights(pack_e2m1(c1), s1, pack_e2m1(c2), s2)

"""FlashInfer SM90 MXFP4 weight layout (``flashinfer.megamoe.mxfp4_mega_moe``), with its exact inverse.

From the canonical ``MXFP4Weights`` (checkpoint nibble order, L1 = [gate; up]) to the kernel's bytes:

1. **Marlin byte order** (``to_marlin_order``): in each 4-byte word holding K[8w .. 8w+7],
   byte b = K[8w+b] << 4 | K[8w+b+4]  (high nibble K[b], low nibble K[b+4]).
2. **gate/up interleave by 8** on L1 rows (``interleave_gate_up``), scales with their rows.
3. **Rows of 80 bytes** per (row n, 128-wide K block kb): 64 packed bytes, then the 4 E8M0 bytes of
   the block's four 32-groups, then 12 zero bytes (dropped again by step 5).
4. **Sign braid** in each 4-byte word: with c[j] = the word's codes K[8w+j] (Marlin order read
   back), the braided nibble j = (c[j] & 7) | (c[P[j]] & 8), P = (4, 0, 5, 1, 6, 2, 7, 3), and the
   word is stored back with nibble 2b in the low and 2b+1 in the high half of byte b.
5. **Chunk-major tiles** of 128 rows x 128 K, 8704 bytes, tile t = n_tile * (K/128) + kb:

       tile[t][c*2048 + r*16 + x] = braided row (n_tile*128 + r, kb), data byte c*16 + x   (c < 4, x < 16)
       tile[t][8192 + r*4 + s]    = E8M0 byte of row n_tile*128 + r, group kb*4 + s

   L1: [E, (2I/128) * (H/128), 8704] uint8; L2: [E, (H/128) * (I/128), 8704] uint8.

Bytes agree with ``flashinfer.megamoe.transform_mxfp4_weights_for_mega_moe`` (FlashInfer 0.7.4) fed the
Marlin-ordered weights (tested bitwise). Global scales are not part of the layout: FlashInfer takes
``l1_global_scales`` / ``l2_global_scales`` fp32 [E_l] at run time (``flashinfer_global_scales``).
The kernel decodes only scale bytes 122..133 correctly (``megamoe.recipe.FLASHINFER_MXFP4``), so
``to_flashinfer_sm90`` checks the range first; ``prepare_flashinfer_sm90`` rebases, then converts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from einops import rearrange

from ..formats import MXFP4_BLOCK, pack_e2m1
from ..validate import check_mxfp4_values
from ..weights import MXFP4Weights
from ._common import deinterleave_gate_up, expect_multiple, expect_tensor, interleave_gate_up

TILE_ROWS = 128
TILE_K = 128
TILE_DATA_BYTES = TILE_ROWS * TILE_K // 2  # 8192
TILE_SCALE_BYTES = TILE_ROWS * TILE_K // MXFP4_BLOCK  # 512
TILE_BYTES = TILE_DATA_BYTES + TILE_SCALE_BYTES  # 8704
CHUNKS = 4  # 16-byte chunks of one row's 64 data bytes
SIGN_SOURCE = (4, 0, 5, 1, 6, 2, 7, 3)  # braided nibble j takes the sign of code SIGN_SOURCE[j]


@dataclass(frozen=True)
class FlashInferSM90Layout:
    """Geometry of one GEMM's chunk-major tiles: weight [N, K] -> [N/128 * K/128, 8704] bytes per expert.

    tile = (n // 128) * (K // 128) + k // 128; data byte of (n, k-pair kp = k//2 within the block) at
    ((kp // 16) * 128 + n % 128) * 16 + kp % 16; scale of (n, group g) at 8192 + (n % 128) * 4 + g % 4.
    """

    rows: int  # N
    k: int  # K

    @property
    def num_tiles(self) -> int:
        return self.rows // TILE_ROWS * (self.k // TILE_K)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.num_tiles, TILE_BYTES)


# ------------------------------------------------------------------------------------ nibble moves
# The codecs below work on little-endian 32-bit words (byte b at bits 8b): one word holds 8 codes.
# In checkpoint order code K[8w + j] sits at bits 4j.
def _words(packed: torch.Tensor, name: str) -> torch.Tensor:
    expect_tensor(name, packed, dtype=(torch.uint8, torch.int8))
    if packed.shape[-1] % 4:
        raise ValueError(f"{name} last dim must be a multiple of 4 bytes (8 values per word), got {packed.shape[-1]}")
    return packed.contiguous().view(torch.int32)


def _move_nibbles(words: torch.Tensor, moves: tuple[tuple[int, int], ...], mask: int = 0xF) -> torch.Tensor:
    """OR of ((words >> src) & mask) << dst over the (src, dst) bit positions."""
    out = torch.zeros_like(words)
    for src, dst in moves:
        moved = words >> src  # arithmetic shift: the mask drops the copied sign bits
        moved &= mask
        moved <<= dst
        out |= moved
    return out


_MARLIN_MOVES = tuple((4 * b, 8 * b + 4) for b in range(4)) + tuple((4 * (b + 4), 8 * b) for b in range(4))
_MARLIN_INV_MOVES = tuple((dst, src) for src, dst in _MARLIN_MOVES)


def to_marlin_order(packed: torch.Tensor) -> torch.Tensor:
    """Checkpoint nibble order (K[2i] low of byte i) -> Marlin order. uint8 [..., K/2] -> uint8 [..., K/2].

    Per 4-byte word: byte b = K[b] << 4 | K[b + 4].
    """
    return _move_nibbles(_words(packed, "packed"), _MARLIN_MOVES).view(torch.uint8).reshape(packed.shape)


def from_marlin_order(packed: torch.Tensor) -> torch.Tensor:
    """Marlin order -> checkpoint nibble order (inverse of ``to_marlin_order``)."""
    return _move_nibbles(_words(packed, "packed"), _MARLIN_INV_MOVES).view(torch.uint8).reshape(packed.shape)


# ------------------------------------------------------------------------------------ sign braid
def _braid_signs(marlin: torch.Tensor) -> torch.Tensor:
    """Marlin-order bytes [..., K/2] -> braided bytes, nibble by nibble (step 4 of the module docstring).

    The readable statement of the braid; ``_braid_from_checkpoint`` is the fast equivalent."""
    w = marlin.reshape(*marlin.shape[:-1], -1, 4)
    codes = torch.cat((w >> 4, w & 0xF), dim=-1)  # c[j] = K[8w + j]
    out = (codes & 7) | (codes[..., list(SIGN_SOURCE)] & 8)
    return pack_e2m1(out.reshape(*marlin.shape[:-1], -1))


# braid(marlin(x)) leaves every magnitude where the checkpoint order has it (nibble j at bits 4j)
# and moves the sign of code SIGN_SOURCE[j] to bit 4j + 3: on words, 8 single-bit moves.
_SIGN_MOVES = tuple((4 * SIGN_SOURCE[j] + 3, 4 * j + 3) for j in range(8))
_SIGN_INV_MOVES = tuple((dst, src) for src, dst in _SIGN_MOVES)
_MAGNITUDES = 0x77777777


def _braid_from_checkpoint(packed: torch.Tensor) -> torch.Tensor:
    """Checkpoint-order bytes [..., K/2] -> braided bytes (= _braid_signs(to_marlin_order(packed)))."""
    w = _words(packed, "packed")
    return ((w & _MAGNITUDES) | _move_nibbles(w, _SIGN_MOVES, mask=1)).view(torch.uint8).reshape(packed.shape)


def _unbraid_to_checkpoint(braided: torch.Tensor) -> torch.Tensor:
    """Inverse of ``_braid_from_checkpoint``."""
    w = _words(braided, "braided")
    return ((w & _MAGNITUDES) | _move_nibbles(w, _SIGN_INV_MOVES, mask=1)).view(torch.uint8).reshape(braided.shape)


# ------------------------------------------------------------------------------------ tiles
def _to_tiles(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Braided bytes [E, N, K/2] + E8M0 [E, N, K/32] -> chunk-major tiles [E, N/128 * K/128, 8704]."""
    data = rearrange(packed, "e (nt r) (kb c x) -> e (nt kb) (c r x)", r=TILE_ROWS, c=CHUNKS, x=16)
    sf = rearrange(scale, "e (nt r) (kb s) -> e (nt kb) (r s)", r=TILE_ROWS, s=TILE_K // MXFP4_BLOCK)
    return torch.cat((data, sf), dim=-1).contiguous()


def _from_tiles(tiles: torch.Tensor, rows: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    nt, kb = rows // TILE_ROWS, k // TILE_K
    data = rearrange(tiles[..., :TILE_DATA_BYTES], "e (nt kb) (c r x) -> e (nt r) (kb c x)", nt=nt, kb=kb, r=TILE_ROWS, c=CHUNKS)
    sf = rearrange(tiles[..., TILE_DATA_BYTES:], "e (nt kb) (r s) -> e (nt r) (kb s)", nt=nt, kb=kb, r=TILE_ROWS)
    return data.contiguous(), sf.contiguous()


def _check_dims(hidden: int, intermediate: int) -> None:
    expect_multiple("hidden", hidden, TILE_K, "whole 128 x 128 tiles")
    expect_multiple("intermediate", intermediate, TILE_K, "whole 128 x 128 tiles")


# ------------------------------------------------------------------------------------ public API
def to_flashinfer_sm90(weights: MXFP4Weights, *, check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4Weights -> (l1 uint8 [E, (2I/128)*(H/128), 8704], l2 uint8 [E, (H/128)*(I/128), 8704]).

    ``check`` (default) raises ValueError when a scale group with nonzero codes falls outside the
    decoder's bytes 122..133 (``ranges.check_ranges``); call ``ranges.repair_ranges`` first, or use
    ``prepare_flashinfer_sm90``. Byte 0xFF (NaN) is refused even with ``check=False``. Global scales
    travel separately (``flashinfer_global_scales``).
    """
    from ..recipe import FLASHINFER_MXFP4
    from .ranges import check_ranges

    if not isinstance(weights, MXFP4Weights):
        raise TypeError(f"weights must be MXFP4Weights, got {type(weights).__name__}")
    _check_dims(weights.hidden, weights.intermediate)
    check_mxfp4_values(weights, "to_flashinfer_sm90")
    if check:
        check_ranges(weights, FLASHINFER_MXFP4)
    l1 = _braid_from_checkpoint(interleave_gate_up(weights.l1))  # steps 1, 2, 4
    l1_sf = interleave_gate_up(weights.l1_scale)
    l2 = _braid_from_checkpoint(weights.l2)
    return _to_tiles(l1, l1_sf), _to_tiles(l2, weights.l2_scale)


def from_flashinfer_sm90(
    l1: torch.Tensor,
    l2: torch.Tensor,
    *,
    hidden: int,
    intermediate: int,
    l1_global_scale: torch.Tensor | None = None,
    l2_global_scale: torch.Tensor | None = None,
) -> MXFP4Weights:
    """Inverse of ``to_flashinfer_sm90``, bitwise: tiles -> MXFP4Weights (checkpoint order, [gate; up])."""
    _check_dims(hidden, intermediate)
    expect_tensor("l1", l1, dtype=torch.uint8)
    if l1.ndim != 3:
        raise ValueError(f"l1 must be 3-D [E, tiles, {TILE_BYTES}], got shape {tuple(l1.shape)}")
    e = l1.shape[0]
    lay1, lay2 = FlashInferSM90Layout(2 * intermediate, hidden), FlashInferSM90Layout(hidden, intermediate)
    expect_tensor("l1", l1, shape=(e, *lay1.shape))
    expect_tensor("l2", l2, shape=(e, *lay2.shape), dtype=torch.uint8, device=l1.device)
    p1, s1 = _from_tiles(l1, lay1.rows, lay1.k)
    p2, s2 = _from_tiles(l2, lay2.rows, lay2.k)
    p1 = deinterleave_gate_up(_unbraid_to_checkpoint(p1))
    p2 = _unbraid_to_checkpoint(p2)
    return MXFP4Weights(p1, deinterleave_gate_up(s1), p2, s2, l1_global_scale, l2_global_scale)


def flashinfer_global_scales(weights: MXFP4Weights) -> tuple[torch.Tensor, torch.Tensor]:
    """(l1_global_scales, l2_global_scales) fp32 [E] for ``mxfp4_mega_moe`` (ones where absent)."""
    ones = torch.ones(weights.num_experts, dtype=torch.float32, device=weights.device)
    gs1 = weights.l1_global_scale if weights.l1_global_scale is not None else ones
    gs2 = weights.l2_global_scale if weights.l2_global_scale is not None else ones
    return gs1.contiguous(), gs2.contiguous()


@dataclass
class FlashInferSM90Weights:
    """Everything ``mxfp4_mega_moe`` takes for one rank: tiles + per-expert fp32 global scales [E_l]."""

    l1: torch.Tensor  # uint8 [E_l, (2I/128)*(H/128), 8704]
    l2: torch.Tensor  # uint8 [E_l, (H/128)*(I/128), 8704]
    l1_global_scales: torch.Tensor  # fp32 [E_l]
    l2_global_scales: torch.Tensor  # fp32 [E_l]


def prepare_flashinfer_sm90(weights: MXFP4Weights) -> FlashInferSM90Weights:
    """Rebase scales into the legal window (exact, or a clear ValueError), then convert."""
    from ..recipe import FLASHINFER_MXFP4
    from .ranges import repair_ranges

    repaired = repair_ranges(weights, FLASHINFER_MXFP4)
    l1, l2 = to_flashinfer_sm90(repaired)
    return FlashInferSM90Weights(l1, l2, *flashinfer_global_scales(repaired))

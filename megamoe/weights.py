"""Expert weights in the library's canonical (checkpoint-like) form, and random generators.

``MXFP4Weights`` is the DeepSeek-V4 checkpoint layout stacked over experts, with L1 = [gate; up]:

    l1        uint8 [E, 2I, H/2]   packed e2m1, K[2i] in the low nibble of byte i; rows 0..I-1 gate, I..2I-1 up
    l1_scale  uint8 [E, 2I, H/32]  E8M0 bytes, one per 32 K values
    l2        uint8 [E, H, I/2]
    l2_scale  uint8 [E, H, I/32]
    l1_global_scale, l2_global_scale  fp32 [E] or None: per-expert multipliers (powers of two after a
              range repair), value = decode(l1) * l1_global_scale[e]

``FP8BlockWeights`` is the DeepGEMM SM90 FP8 input: e4m3 [E, N, K] + FP32 [E, N/128, K/128].
Every kernel layout is produced from these by ``megamoe.layouts``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from .formats import MXFP4_BLOCK, dequantize_mxfp4, quantize_mxfp4
from .geometry import Geometry
from .validate import check_fp8_block_values, check_mxfp4_values
from .validate import expect_tensor as _expect


@dataclass
class MXFP4Weights:
    l1: torch.Tensor
    l1_scale: torch.Tensor
    l2: torch.Tensor
    l2_scale: torch.Tensor
    l1_global_scale: torch.Tensor | None = None
    l2_global_scale: torch.Tensor | None = None
    format = "mxfp4"

    def __post_init__(self) -> None:
        """Shapes, dtypes, one device, and values that no decoder reads as a number: E8M0 byte 0xFF (NaN)
        anywhere, non-finite or non-positive global scales (``validate.check_mxfp4_values``)."""
        _expect("l1", self.l1)
        if self.l1.ndim != 3:
            raise ValueError(f"l1 must be 3-D [E, 2I, H/2], got shape {tuple(self.l1.shape)}")
        e, two_i, half_h = self.l1.shape
        i, h = two_i // 2, half_h * 2
        _expect("l1", self.l1, (e, 2 * i, h // 2), torch.uint8)
        _expect("l1_scale", self.l1_scale, (e, 2 * i, h // MXFP4_BLOCK), torch.uint8)
        _expect("l2", self.l2, (e, h, i // 2), torch.uint8)
        _expect("l2_scale", self.l2_scale, (e, h, i // MXFP4_BLOCK), torch.uint8)
        for name in ("l1_global_scale", "l2_global_scale"):
            gs = getattr(self, name)
            if gs is not None:
                _expect(name, gs, (e,), torch.float32)
        devices = {t.device for t in self.tensors()}
        if len(devices) != 1:
            raise ValueError(f"all weight tensors must be on one device, got {sorted(map(str, devices))}")
        if self.l1.device.type != "meta":
            check_mxfp4_values(self, "MXFP4Weights")

    # Shapes ------------------------------------------------------------------------------------
    @property
    def num_experts(self) -> int:
        return self.l1.shape[0]

    @property
    def hidden(self) -> int:
        return self.l1.shape[2] * 2

    @property
    def intermediate(self) -> int:
        return self.l1.shape[1] // 2

    @property
    def device(self) -> torch.device:
        return self.l1.device

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None]

    def to(self, device) -> "MXFP4Weights":
        return replace(self, **{f.name: (None if getattr(self, f.name) is None else getattr(self, f.name).to(device)) for f in fields(self)})

    def experts(self, lo: int, hi: int) -> "MXFP4Weights":
        """The weights of experts [lo, hi) (what one EP rank owns)."""
        return replace(self, **{f.name: (None if getattr(self, f.name) is None else getattr(self, f.name)[lo:hi]) for f in fields(self)})

    def check_geometry(self, g: Geometry) -> None:
        got = (self.num_experts, self.hidden, self.intermediate)
        want = (g.num_experts, g.hidden, g.intermediate)
        if got != want:
            raise ValueError(f"weights are (E, H, I) = {got} but geometry {g.name!r} expects {want}")

    def dequantize_expert(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Exact float32 values of expert e, global scales folded in: (w1 [2I, H], w2 [H, I])."""
        w1 = dequantize_mxfp4(self.l1[e], self.l1_scale[e])
        w2 = dequantize_mxfp4(self.l2[e], self.l2_scale[e])
        if self.l1_global_scale is not None:
            w1 = w1 * self.l1_global_scale[e]
        if self.l2_global_scale is not None:
            w2 = w2 * self.l2_global_scale[e]
        return w1, w2


@dataclass
class FP8BlockWeights:
    l1: torch.Tensor  # e4m3 [E, 2I, H], gate rows then up rows
    l1_scale: torch.Tensor  # fp32 [E, 2I/128, H/128]
    l2: torch.Tensor  # e4m3 [E, H, I]
    l2_scale: torch.Tensor  # fp32 [E, H/128, I/128]
    format = "fp8_block"

    def __post_init__(self) -> None:
        """Shapes, dtypes, one device; finite e4m3 values and block scales finite and > 0."""
        _expect("l1", self.l1)
        if self.l1.ndim != 3:
            raise ValueError(f"l1 must be 3-D [E, 2I, H], got shape {tuple(self.l1.shape)}")
        e, two_i, h = self.l1.shape
        i = two_i // 2
        _expect("l1", self.l1, (e, 2 * i, h), torch.float8_e4m3fn)
        _expect("l1_scale", self.l1_scale, (e, 2 * i // 128, h // 128), torch.float32)
        _expect("l2", self.l2, (e, h, i), torch.float8_e4m3fn)
        _expect("l2_scale", self.l2_scale, (e, h // 128, i // 128), torch.float32)
        devices = {t.device for t in self.tensors()}
        if len(devices) != 1:
            raise ValueError(f"all weight tensors must be on one device, got {sorted(map(str, devices))}")
        if self.l1.device.type != "meta":
            check_fp8_block_values(self, "FP8BlockWeights")

    num_experts = MXFP4Weights.num_experts
    device = MXFP4Weights.device
    tensors = MXFP4Weights.tensors
    to = MXFP4Weights.to
    experts = MXFP4Weights.experts
    check_geometry = MXFP4Weights.check_geometry

    @property
    def hidden(self) -> int:
        return self.l1.shape[2]

    @property
    def intermediate(self) -> int:
        return self.l1.shape[1] // 2

    def dequantize_expert(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        def deq(q, s):
            n, k = q.shape
            return (q.float().view(n // 128, 128, k // 128, 128) * s[:, None, :, None]).view(n, k)

        return deq(self.l1[e], self.l1_scale[e]), deq(self.l2[e], self.l2_scale[e])


# ------------------------------------------------------------------------------------ generators
def random_dense_expert(
    g: Geometry, *, gen: torch.Generator, device="cpu", row_spread: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert's Gaussian float32 weights (w1 [2I, H], w2 [H, I]) with std 1/sqrt(K_in).

    ``row_spread`` > 0 multiplies each row by 2**U(-spread, spread), so per-32 scales vary over
    several exponents inside one expert, as in real checkpoints.
    """
    h, i = g.hidden, g.intermediate
    w1 = torch.randn(2 * i, h, generator=gen, device=device) / h**0.5
    w2 = torch.randn(h, i, generator=gen, device=device) / i**0.5
    if row_spread:
        w1 = w1 * torch.exp2((torch.rand(2 * i, 1, generator=gen, device=device) * 2 - 1) * row_spread)
        w2 = w2 * torch.exp2((torch.rand(h, 1, generator=gen, device=device) * 2 - 1) * row_spread)
    return w1, w2


def quantize_experts_mxfp4(w1: torch.Tensor, w2: torch.Tensor) -> MXFP4Weights:
    """Dense float experts (w1 [E, 2I, H], w2 [E, H, I]) -> MXFP4Weights (no global scales)."""
    l1, l1_scale = quantize_mxfp4(w1)
    l2, l2_scale = quantize_mxfp4(w2)
    return MXFP4Weights(l1, l1_scale, l2, l2_scale)


def random_mxfp4_weights(g: Geometry, *, seed: int, device="cpu", row_spread: float = 1.0,
                         progress=None) -> MXFP4Weights:
    """Random MXFP4 experts with real-like magnitudes (std 1/sqrt(K_in)) and scale spread.

    Generated one expert at a time on ``device`` (DeepSeek-V4-Flash is 1.7 GB as MXFP4 but 26 GB
    as float32). Like real checkpoints, the raw scales sit below FlashInfer's legal range (about
    2**-9 .. 2**-5): repair them with ``megamoe.layouts.ranges`` before a kernel reads them.
    ``progress(e)`` is called after expert e (a CPU makes DeepSeek-V4-Flash's 256 in minutes).
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    parts = []
    for e in range(g.num_experts):
        w1, w2 = random_dense_expert(g, gen=gen, device=device, row_spread=row_spread)
        parts.append(quantize_experts_mxfp4(w1[None], w2[None]))
        if progress is not None:
            progress(e)
    return MXFP4Weights(*(torch.cat([getattr(p, name) for p in parts]) for name in ("l1", "l1_scale", "l2", "l2_scale")))

"""FP8 activation staging: bf16 x [T, H] -> e4m3 [T, H] + one scale per token per ``gran`` channels.

SM90 (FlashInfer, DeepGEMM SM90): FP32 scales [T, H/128], bit-exact with DeepGEMM's
``per_token_cast_to_fp8`` *as it runs on CUDA*:

    amax = max(|x| over the group, in FP32).clamp(min=1e-4)
    sf   = amax * fl32(1/448)        # a multiply by the rounded reciprocal, NOT amax / 448
    q    = e4m3_rn(x * (1 / sf))     # IEEE reciprocal, FP32 product, round-to-nearest-even

PyTorch's CUDA kernel divides by a scalar through its reciprocal, so the source's ``amax / 448.0``
is a multiply on the GPU; a true division on a CPU tensor differs in the scale's last bit on many
inputs (measured on the H200, see docs/kernel-contract.md). Here the multiply is spelled out, so
the result is the same on every device.

Humming (``per_token_cast_to_fp8_div448``): the same FP32 scales by another rule, its ``process_input``
compiled without fast math: ``sf = max(fl32(amax / 448), fl32(1e-30))``, a true IEEE division.

SM100 (not used by SM90 kernels): UE8M0 scales per 32 channels, 4 packed per int32 [T, H/128].
"""

from __future__ import annotations

import torch

from ..formats import E4M3_MAX, e4m3_satfinite, float_to_e8m0, pack_ue8m0_x4

AMAX_FLOOR = 1e-4
# fl32(1/448): the float32 nearest 1/448, as a tensor so no device or dtype promotion changes it.
_INV_448_FP32 = torch.tensor(1.0 / E4M3_MAX, dtype=torch.float32)


def _check_x(x: torch.Tensor, gran: int) -> None:
    if x.ndim != 2:
        raise ValueError(f"x must be 2-D [T, H], got shape {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"x must be bfloat16, float16 or float32, got {x.dtype}")
    if gran <= 0 or x.shape[1] % gran:
        raise ValueError(
            f"x hidden size must be a multiple of gran={gran}, got H={x.shape[1]} "
            "(the kernels take whole scale groups; pad the model, not the activations)"
        )
    if x.numel() and not torch.isfinite(x).all():
        bad = (~torch.isfinite(x)).nonzero()[0].tolist()
        raise ValueError(f"x contains NaN or Inf (first at [token, channel] = {bad}); FP8 staging would corrupt it")


def per_token_cast_to_fp8(x: torch.Tensor, gran: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] -> (e4m3 [T, H], fp32 scales [T, H/gran]); bit-exact with DeepGEMM on CUDA."""
    _check_x(x, gran)
    t, h = x.shape
    v = x.float()
    q = torch.empty(t, h, dtype=torch.float8_e4m3fn, device=x.device)
    sf = torch.empty(t, h // gran, dtype=torch.float32, device=x.device)
    per_token_cast_to_fp8_into(v, q, sf, torch.empty_like(sf), torch.empty_like(v), _INV_448_FP32.to(x.device), gran)
    return q, sf


def per_token_cast_to_fp8_into(v: torch.Tensor, q: torch.Tensor, sf: torch.Tensor, inv: torch.Tensor,
                               ws: torch.Tensor, inv448: torch.Tensor, gran: int = 128) -> None:
    """The arithmetic of ``per_token_cast_to_fp8`` into preallocated tensors, with no input check (a
    host sync) and no host-to-device copy, so it may run under a CUDA graph: v fp32 [M, C] ->
    q e4m3 [M, C], sf fp32 [M, C/gran]. ``inv`` [M, C/gran] and ``ws`` [M, C] are workspaces,
    ``inv448`` is fl32(1/448) on v's device; ``v`` is not changed."""
    m, c = v.shape
    torch.abs(v, out=ws)
    torch.amax(ws.view(m, c // gran, gran), dim=2, out=sf)
    sf.clamp_(min=AMAX_FLOOR).mul_(inv448)  # sf = max(amax, 1e-4) * fl32(1/448)
    torch.reciprocal(sf, out=inv)
    torch.mul(v.view(m, c // gran, gran), inv.unsqueeze(2), out=ws.view(m, c // gran, gran))
    q.copy_(ws.clamp_(-E4M3_MAX, E4M3_MAX))  # e4m3_satfinite: clamp, then RNE to e4m3


# fl32(1e-30): the floor Humming's process_input puts under each scale (``fmaxf(amax / 448.f, 1e-30f)``).
_SCALE_FLOOR_DIV448 = torch.tensor(1e-30, dtype=torch.float32)


def fp8_scale_div448(amax: torch.Tensor) -> torch.Tensor:
    """fp32 amax -> fp32 sf = max(fl32(amax / 448), fl32(1e-30)), the IEEE quotient on every device: a float64
    division of a float32 by 448, rounded once to float32, is the correctly rounded float32 quotient (53 >= 2 x 24
    + 2 bits, so the double rounding is innocuous); torch's own float32 division by a scalar is a multiply by the
    reciprocal on CUDA."""
    q = (amax.double() / 448.0).float()
    return torch.maximum(q, _SCALE_FLOOR_DIV448.to(amax.device))


def reciprocal_rn(sf: torch.Tensor) -> torch.Tensor:
    """fp32 1 / sf correctly rounded on every device (through float64, as ``fp8_scale_div448``)."""
    return (1.0 / sf.double()).float()


def per_token_cast_to_fp8_div448(x: torch.Tensor, gran: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Humming's staging: x [T, H] -> (e4m3 [T, H], fp32 scales [T, H/gran]) with sf = ``fp8_scale_div448``(amax)
    and q = e4m3 RTNE satfinite of x * fl32(1 / sf) (an FP32 product)."""
    _check_x(x, gran)
    t, h = x.shape
    xv = x.float().view(t, h // gran, gran)
    sf = fp8_scale_div448(xv.abs().amax(dim=2))
    q = e4m3_satfinite(xv * reciprocal_rn(sf).unsqueeze(2)).view(t, h)
    return q, sf


def per_token_cast_to_fp8_ue8m0_packed(x: torch.Tensor, gran: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """SM100 staging: x [T, H] -> (e4m3 [T, H], int32 [T, H/(4*gran)]) with power-of-two scales
    ``2**ceil(log2(amax * fl32(1/448)))`` per ``gran`` channels, packed four per int32."""
    _check_x(x, gran)
    t, h = x.shape
    if (h // gran) % 4:
        raise ValueError(f"H / gran must be a multiple of 4 for packing, got {h // gran}")
    xv = x.view(t, h // gran, gran)
    amax = xv.abs().float().amax(dim=2).clamp(min=AMAX_FLOOR)
    sf_bytes = float_to_e8m0(amax * _INV_448_FP32.to(x.device), rounding="ceil")  # [T, H/gran]
    inv = torch.reciprocal((sf_bytes.to(torch.int32) << 23).view(torch.float32))  # exact: powers of two
    q = e4m3_satfinite(xv.float() * inv.unsqueeze(2)).view(t, h)
    return q, pack_ue8m0_x4(sf_bytes)


def dequantize_per_token_fp8(q: torch.Tensor, sf: torch.Tensor) -> torch.Tensor:
    """(e4m3 [T, H], fp32 [T, H/g]) -> fp32 [T, H]: the value the kernels see."""
    t, h = q.shape
    g = h // sf.shape[1]
    return (q.float().view(t, -1, g) * sf.unsqueeze(2)).view(t, h)

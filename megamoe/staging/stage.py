"""Staging into the symmetric buffer: quantize x, copy the routes, pad to the agreed token count.

    x                bf16  [T, H]          ->  out_x             e4m3  [C, H]     rows [0, A)
    (scale)                                ->  out_x_sf          fp32  [C, H/128] rows [0, A)
    topk_idx         int64 [T, K]          ->  out_topk_idx      int   [C, K]     rows [0, A)
    topk_weights     fp32  [T, K]          ->  out_topk_weights  fp32  [C, K]     rows [0, A)

T tokens of this rank, A = ``num_tokens_agreed`` (the count every rank of the launch passes,
T <= A <= C), C = the buffer's capacity. Rows [T, A) are padding: x zeros, the scale of a zero
row (amax floor 1e-4 -> sf = fl32(1e-4) * fl32(1/448), as the reference gives), topk_idx -1,
topk_weights 0. Rows [A, C) are not touched.

The bytes of rows [0, T) equal ``megamoe.layouts.staging.per_token_cast_to_fp8`` (DeepGEMM's
``per_token_cast_to_fp8`` as it runs on CUDA). The routing weights are copied as they are: the
router applied ``routed_scaling`` once, so staging never scales them again (and a kernel entry
that takes a ``routed_scaling_factor``, e.g. ``deep_gemm.mega_moe_pre_dispatch_sm90``, must get 1.0).

Backends: ``"triton"`` (one fused kernel; on a CPU tensor it runs under Triton's interpreter),
``"torch"`` (the reference function plus copies: several kernels), ``"auto"`` (triton on CUDA when
importable, else torch).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from ..layouts.staging import AMAX_FLOOR, _INV_448_FP32, per_token_cast_to_fp8
from ..validate import as_int, check_topk, expect_tensor, routing_error_bits

WHO = "stage_into"
IDX_DTYPES = (torch.int64, torch.int32)
GROUP = 128
BACKENDS = ("auto", "triton", "torch")
CASTS = ("auto", "hw", "bits")
# The value a kernel entry's own routing-weight multiplier must have after staging (see module doc).
ROUTED_SCALING_AFTER_STAGING = 1.0


def triton_available() -> bool:
    """Whether the Triton kernel can be imported here."""
    try:
        from . import triton_stage  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means: use the torch path
        return False
    return True


def padding_scale(device="cpu") -> torch.Tensor:
    """fp32 [] scale of a padding (all-zero) row: fl32(1e-4) * fl32(1/448), as the reference gives."""
    return torch.tensor(AMAX_FLOOR, dtype=torch.float32, device=device) * _INV_448_FP32.to(device)


def _expect(name: str, t, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...], device: torch.device) -> None:
    expect_tensor(name, t, shape, dtypes, who=WHO)
    if t.device != device:
        raise ValueError(f"{WHO}: {name} is on {t.device} but x is on {device}")


def validate_stage_args(x, topk_idx, topk_weights, out_x, out_x_sf, out_topk_idx, out_topk_weights,
                        num_tokens_agreed: int | None, num_experts: int) -> int:
    """Check every shape, dtype, device, the capacity and the expert count before anything runs; returns A.
    (The routing's values are checked by ``stage_into`` itself: ``megamoe.validate.check_topk``.)"""
    expect_tensor("x", x, who=WHO)
    if x.ndim != 2:
        raise ValueError(f"{WHO}: x must be 2-D [T, H], got shape {tuple(x.shape)}")
    if x.dtype != torch.bfloat16:
        raise TypeError(f"{WHO}: x must have dtype torch.bfloat16, got {x.dtype}")
    t, h = x.shape
    if h % GROUP:
        raise ValueError(f"{WHO}: x hidden size must be a multiple of {GROUP}, got H={h}")
    if not isinstance(out_x, torch.Tensor) or out_x.ndim != 2:
        raise ValueError(f"{WHO}: out_x must be a 2-D tensor [C, {h}], got "
                         f"{tuple(out_x.shape) if isinstance(out_x, torch.Tensor) else type(out_x).__name__}")
    if not isinstance(topk_idx, torch.Tensor) or topk_idx.ndim != 2:
        raise ValueError(f"{WHO}: topk_idx must be a 2-D tensor [T, K]")
    c, k = out_x.shape[0], topk_idx.shape[1]
    dev = x.device
    _expect("topk_idx", topk_idx, (t, k), IDX_DTYPES, dev)
    _expect("topk_weights", topk_weights, (t, k), (torch.float32,), dev)
    _expect("out_x", out_x, (c, h), (torch.float8_e4m3fn,), dev)
    _expect("out_x_sf", out_x_sf, (c, h // GROUP), (torch.float32,), dev)
    _expect("out_topk_idx", out_topk_idx, (c, k), IDX_DTYPES, dev)
    _expect("out_topk_weights", out_topk_weights, (c, k), (torch.float32,), dev)
    # The Triton kernel reads x and writes out_x at row * stride(0) + channel: unit stride along H whatever the
    # row count (one row included; an empty tensor has nothing to read), any row stride. The other tensors go in
    # with both their strides.
    for name, ten in (("x", x), ("out_x", out_x)):
        if ten.numel() and ten.stride(1) != 1:
            raise ValueError(f"{WHO}: {name} must be contiguous along H (stride(1) == 1; any row stride), got "
                             f"strides {ten.stride()} for shape {tuple(ten.shape)}")
    as_int("num_experts", num_experts, lo=1, who=WHO)
    if num_tokens_agreed is not None and (isinstance(num_tokens_agreed, (bool, float)) or
                                          not isinstance(num_tokens_agreed, int)):
        raise TypeError(f"{WHO}: num_tokens_agreed must be an int or None, got {type(num_tokens_agreed).__name__} "
                        f"{num_tokens_agreed!r}")
    a = t if num_tokens_agreed is None else num_tokens_agreed
    if not t <= a <= c:
        raise ValueError(
            f"{WHO}: need T <= num_tokens_agreed <= capacity, got T={t}, num_tokens_agreed={a}, "
            f"capacity C={c} (the buffer's rows)"
        )
    return a


# ------------------------------------------------------------------------------------ what was staged where
@dataclass(frozen=True)
class StagedRows:
    """What the last ``stage_into`` wrote into a buffer, recorded on its ``out_topk_idx`` tensor: rows [0, rows)
    hold this step (real tokens, then padding), the ids were given against [-1, num_experts) and checked on the
    way in (``checked``; False: by the caller, ``check=False``). A launch reads it on the host, without a sync,
    to refuse more tokens than were staged (rows past them hold an earlier step)."""

    rows: int
    num_experts: int
    checked: bool
    version: int | None  # out_topk_idx._version right after staging (None: an inference-mode tensor)


_STAGED: dict[int, tuple[weakref.ref, StagedRows]] = {}


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # inference-mode tensors track no version
        return None


def record_staged(out_topk_idx: torch.Tensor, rows: int, num_experts: int, checked: bool) -> None:
    """Remember that ``rows`` rows were staged into ``out_topk_idx`` (``stage_into`` and ``DecodeBuffers.allocate``
    call it)."""
    key = id(out_topk_idx)
    _STAGED[key] = (weakref.ref(out_topk_idx, lambda _, key=key: _STAGED.pop(key, None)),
                    StagedRows(rows, num_experts, checked, _version(out_topk_idx)))


def staged_rows(out_topk_idx: torch.Tensor) -> StagedRows | None:
    """The record of the last ``stage_into`` into this very tensor, or None when there is none or the tensor was
    written since by something else (its version moved: a hand-filled buffer, whose staged count is unknown)."""
    entry = _STAGED.get(id(out_topk_idx))
    if entry is None or entry[0]() is not out_topk_idx:
        return None
    rec = entry[1]
    return rec if rec.version == _version(out_topk_idx) else None


def _raise_nonfinite(x: torch.Tensor) -> None:
    bad = (~torch.isfinite(x)).nonzero()
    where = bad[0].tolist() if bad.numel() else "?"
    raise ValueError(f"{WHO}: x contains NaN or Inf (first at [token, channel] = {where}); "
                     "FP8 staging would corrupt it (the buffer rows were written)")


def _stage_torch(x, topk_idx, topk_weights, out_x, out_x_sf, out_topk_idx, out_topk_weights, a: int) -> None:
    """The eager path: the reference quantizer (which checks finiteness itself), then copies."""
    t = x.shape[0]
    if t:
        q, sf = per_token_cast_to_fp8(x)
        out_x[:t].copy_(q)
        out_x_sf[:t].copy_(sf)
        out_topk_idx[:t].copy_(topk_idx)
        out_topk_weights[:t].copy_(topk_weights)
    if a > t:
        out_x[t:a].view(torch.uint8).zero_()
        out_x_sf[t:a].copy_(padding_scale(x.device).expand(a - t, out_x_sf.shape[1]))
        out_topk_idx[t:a].fill_(-1)
        out_topk_weights[t:a].zero_()


def default_blocks(num_tokens: int, num_groups: int) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_G, num_warps): 8 groups (1024 channels, 2 KB of bf16) per token per program,
    more tokens per program once there are enough programs to fill the GPU."""
    block_g = min(8, triton_next_pow2(num_groups))
    block_t = 4 if num_tokens >= 1024 else 2 if num_tokens >= 256 else 1
    return block_t, block_g, 4


def triton_next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def _stage_triton(x, topk_idx, topk_weights, out_x, out_x_sf, out_topk_idx, out_topk_weights, a: int, *,
                  cast: str, check: bool, error_flag, blocks) -> None:
    from . import triton_stage

    t, h = x.shape
    ng = h // GROUP
    k = topk_idx.shape[1]
    if a == 0:
        return
    interpret = triton_stage.is_interpreted()
    if x.device.type != "cuda" and not interpret:
        raise RuntimeError(
            f"stage_into: backend='triton' on a {x.device.type} tensor needs Triton's interpreter: set "
            "TRITON_INTERPRET=1 before triton is first imported (or use backend='torch')"
        )
    hw_cast = (not interpret) if cast == "auto" else cast == "hw"
    # Under the interpreter every program is a Python call: take the biggest tiles (same code, masks included).
    interp_blocks = (16, triton_next_pow2(ng), 4) if interpret else None
    block_t, block_g, num_warps = blocks or interp_blocks or default_blocks(a, ng)
    flag = error_flag
    if check and flag is None:
        flag = torch.zeros(1, dtype=torch.int32, device=x.device)
    x_in = x
    if t == 0:  # nothing to read, but the kernel still wants valid pointers (every load is masked off)
        x = torch.zeros(1, h, dtype=x.dtype, device=x.device)
        topk_idx = torch.zeros(1, k, dtype=topk_idx.dtype, device=x.device)
        topk_weights = torch.zeros(1, k, dtype=torch.float32, device=x.device)
    # The kernel writes e4m3 codes as bytes; the views share storage with out_x.
    qx = out_x.view(torch.uint8)
    # A 1-token tensor may carry any stride for its only row; give the kernel a valid one.
    sx = x.stride(0) if x.shape[0] > 1 else h
    sq = qx.stride(0) if qx.shape[0] > 1 else h
    dummy_flag = flag if flag is not None else out_x_sf  # never written when CHECK_FINITE is off
    kernel = triton_stage.stage_kernel
    grid = (-(-a // block_t), -(-ng // block_g))
    kwargs = {} if interpret else {"num_warps": num_warps}
    kernel[grid](
        x, topk_idx, topk_weights, qx, out_x_sf, out_topk_idx, out_topk_weights, dummy_flag,
        t, a, sx, sq, out_x_sf.stride(0), out_x_sf.stride(1),
        topk_idx.stride(0), topk_idx.stride(1), topk_weights.stride(0), topk_weights.stride(1),
        out_topk_idx.stride(0), out_topk_idx.stride(1), out_topk_weights.stride(0), out_topk_weights.stride(1),
        NG=ng, K=k, K_PAD=triton_next_pow2(k), BLOCK_T=block_t, BLOCK_G=block_g,
        HW_CAST=hw_cast, CHECK_FINITE=flag is not None, **kwargs,
    )
    if check and error_flag is None and int(flag.item()):
        _raise_nonfinite(x_in)


def resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"{WHO}: backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if backend == "triton" and not triton_available():
        raise RuntimeError("stage_into: backend='triton' but triton cannot be imported here")
    return backend


def stage_into(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    out_x: torch.Tensor,
    out_x_sf: torch.Tensor,
    out_topk_idx: torch.Tensor,
    out_topk_weights: torch.Tensor,
    num_tokens_agreed: int | None = None,
    *,
    num_experts: int,
    backend: str = "auto",
    check: bool = True,
    error_flag: torch.Tensor | None = None,
    cast: str = "auto",
    blocks: tuple[int, int, int] | None = None,
) -> int:
    """Stage one rank's step into the buffer's views in place; returns the agreed count A.

    x bf16 [T, H]; topk_idx int64 (or int32) [T, K], -1 = masked; topk_weights fp32 [T, K] (routed
    scaling already in); out_x e4m3 [C, H]; out_x_sf fp32 [C, H/128] (any strides);
    out_topk_idx int64 (or int32) [C, K]; out_topk_weights fp32 [C, K]; ``num_experts`` E, the layer's
    expert count (the ids must lie in [-1, E)). See the module docstring for what rows [0, T), [T, A)
    and [A, C) receive.

    Every argument is checked with the backends' own check (``megamoe.validate``) before anything is
    launched: shapes, dtypes, devices, capacity, and with ``check`` (default) the routing's values too
    (ids in [-1, E), no expert twice in a token, finite weights: one host sync) and NaN / Inf in x. The
    torch path raises on NaN / Inf in x before writing; the triton path finds it in the kernel (a flag,
    read back after the rows were written: one more sync). With a caller's ``error_flag`` (int32 [1],
    zeroed) the triton path neither syncs nor raises: the routing checks and the kernel set bits of the
    flag (``validate.X_NONFINITE``, ``ROUTE_ID_OUT_OF_RANGE``, ``ROUTE_ID_DUPLICATED``,
    ``ROUTE_WEIGHT_NONFINITE``), the way to check under a CUDA graph; read it before the launch. (The
    eager torch path syncs anyway: it checks on the host and raises, flag or not.)
    ``check=False`` skips the value checks (the backends' ``stage``, after ``check_inputs`` did them).
    ``cast``: ``"hw"`` (Triton's fp8 conversion), ``"bits"`` (integer RTNE), ``"auto"`` (hw on CUDA,
    bits under the interpreter). ``blocks`` = (BLOCK_T, BLOCK_G, num_warps) overrides the launch heuristic.
    """
    a = validate_stage_args(x, topk_idx, topk_weights, out_x, out_x_sf, out_topk_idx, out_topk_weights,
                            num_tokens_agreed, num_experts)
    if cast not in CASTS:
        raise ValueError(f"{WHO}: cast must be one of {CASTS}, got {cast!r}")
    which = resolve_backend(backend, x.device)
    if error_flag is not None:
        _expect("error_flag", error_flag, (1,), (torch.int32,), x.device)
    graph = x.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if check and error_flag is None:
        if graph:
            raise RuntimeError(f"{WHO}: check=True reads the routing and a flag on the host, which a CUDA graph "
                               "capture cannot do; pass an error_flag tensor (or check=False for inputs "
                               "already checked)")
        check_topk(topk_idx, topk_weights, num_experts, WHO, IDX_DTYPES)  # before anything is written
    if which == "torch":
        if error_flag is not None and check:
            check_topk(topk_idx, topk_weights, num_experts, WHO, IDX_DTYPES)  # the eager path syncs anyway
        _stage_torch(x, topk_idx, topk_weights, out_x, out_x_sf, out_topk_idx, out_topk_weights, a)
    else:
        _stage_triton(x, topk_idx, topk_weights, out_x, out_x_sf, out_topk_idx, out_topk_weights, a,
                      cast=cast, check=check, error_flag=error_flag if check else None, blocks=blocks)
        if check and error_flag is not None and topk_idx.numel():
            error_flag.bitwise_or_(routing_error_bits(topk_idx, topk_weights, num_experts))  # no sync
    record_staged(out_topk_idx, a, num_experts, check)
    return a


def stage_reference(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                    num_tokens_agreed: int | None = None):
    """The expected buffer contents, rows [0, A), from the reference alone (fresh tensors):
    (x e4m3 [A, H], x_sf fp32 [A, H/128], topk_idx [A, K], topk_weights fp32 [A, K])."""
    t, h = x.shape
    a = t if num_tokens_agreed is None else num_tokens_agreed
    k = topk_idx.shape[1]
    pad = torch.zeros(a - t, h, dtype=x.dtype, device=x.device)
    q, sf = per_token_cast_to_fp8(torch.cat([x, pad]))  # padding rows quantized as the zero rows they are
    idx = torch.cat([topk_idx, torch.full((a - t, k), -1, dtype=topk_idx.dtype, device=x.device)])
    w = torch.cat([topk_weights, torch.zeros(a - t, k, dtype=torch.float32, device=x.device)])
    return q, sf, idx, w

"""One validation layer: what every entry point checks before anything runs.

The reference, the layout converters, the range check and repair, staging, the fused backends, the
distributed reference and launcher, the checkpoint loader, ``Geometry`` and ``MoEInputs`` all check
their arguments with these functions, so that a check cannot exist on one path and be missing on its
twin. Each raises TypeError (wrong type or dtype) or ValueError (wrong shape, value or device); the
message starts with the entry point (``who``) and names the argument, the expected and the actual value.

    as_int, as_float        Python scalars: nothing truncated (6.9 is not 6), no NaN, bounds named
    as_clamp                the SwiGLU clamp: > 0, finite or +inf (the rule ``Geometry`` applies)
    expect_tensor           type, dtype, shape, device (and, for a kernel's raw pointer, contiguity) of one tensor
    check_finite            NaN / Inf, with the index of the first bad element
    check_scale_bytes       E8M0 byte 0xFF is NaN: refused anywhere, all-zero groups included
    routing_error_bits      bad routing as bit flags in a device tensor, without a host sync
    check_topk              the same on the host, naming the token and its values
    check_step              one rank's step (x, topk_idx, topk_weights) against the layer's shape
    check_weights           MXFP4 scale bytes, global scales; FP8 block values and scales
    check_expert_scales     the scale bytes of the experts one call reads, checked where it reads them
    content_checksum        a cheap digest of a tensor's bytes that every write changes, seen or not by torch
    memo_per_content        a result computed once per tensor content (version and checksum)
    check_output            NaN / Inf in a result computed from accepted, finite inputs (``diagnose``: what
                            in the weights caused it, named instead of the activations)

What the library promises about weights: they are frozen once a call has them, and a write torch's version
counter sees (``w.l1_scale[5] = 255``, an in-place op under ``torch.no_grad``) is treated like one it does not
(``param.data.copy_(...)``, a numpy view, the storage). Checks cheap next to the work re-run each call on what it
reads (``check_expert_scales``); dear results (the setup agreement's sha256) are kept per content
(``memo_per_content``: version and ``content_checksum``). A kernel's prepared weights are its own copy, not
checked per launch (the launch stays sync-free); a non-finite result then names the weight that caused it
(``check_output``'s ``diagnose``).
"""

from __future__ import annotations

import math
import operator
import weakref

import torch

from .formats import E8M0_NAN

# Bits of a routing / staging error flag (int32). The staging kernel sets X_NONFINITE itself.
X_NONFINITE = 1
ROUTE_ID_OUT_OF_RANGE = 2
ROUTE_ID_DUPLICATED = 4
ROUTE_WEIGHT_NONFINITE = 8


class NonFiniteOutputError(ValueError):
    """A result holds NaN / Inf although every input was accepted and finite (an overflow, say)."""


def _p(who: str) -> str:
    return f"{who}: " if who else ""


def as_clamp(value, who: str = "") -> float:
    """The SwiGLU clamp as ``Geometry`` takes it: a real number > 0, finite or +inf ("no clamp"); NaN,
    zero and negatives refused (a NaN clamp makes every output row NaN)."""
    return as_float("clamp", value, lo=0.0, lo_open=True, allow_inf=True, who=who)


# ------------------------------------------------------------------------------------ scalars
def as_int(name: str, value, *, lo: int | None = None, hi: int | None = None, who: str = "") -> int:
    """``value`` as an int, or TypeError for anything that is not an integer (a bool, a float such as
    6.9 or even 6.0: nothing is truncated), ValueError outside [lo, hi]."""
    if isinstance(value, bool) or isinstance(value, float):
        raise TypeError(f"{_p(who)}{name} must be an int, got {type(value).__name__} {value!r}")
    try:
        v = operator.index(value)  # int, numpy integers, integer 0-d tensors
    except TypeError:
        raise TypeError(f"{_p(who)}{name} must be an int, got {type(value).__name__} {value!r}") from None
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        want = f"in [{lo}, {hi}]" if lo is not None and hi is not None else f">= {lo}" if lo is not None else f"<= {hi}"
        raise ValueError(f"{_p(who)}{name} must be {want}, got {v}")
    return v


def as_float(name: str, value, *, lo: float | None = None, lo_open: bool = False, allow_inf: bool = False,
             who: str = "") -> float:
    """``value`` as a finite float (ints allowed, bools not), ValueError for NaN / Inf or below ``lo``
    (``lo_open``: strictly above it). ``allow_inf``: +inf is a value too (e.g. "no clamp"); NaN never is."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{_p(who)}{name} must be a real number, got {type(value).__name__} {value!r}")
    v = float(value)
    if not math.isfinite(v) and not (allow_inf and v == math.inf):
        raise ValueError(f"{_p(who)}{name} must be finite{' or +inf' if allow_inf else ''}, got {v!r}")
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise ValueError(f"{_p(who)}{name} must be {'>' if lo_open else '>='} {lo:g}, got {v!r}")
    return v


# ------------------------------------------------------------------------------------ tensors
def expect_tensor(name: str, t, shape: tuple[int, ...] | None = None,
                  dtype: torch.dtype | tuple[torch.dtype, ...] | None = None,
                  device: torch.device | str | None = None, who: str = "", contiguous: bool = False) -> None:
    """Raise TypeError / ValueError naming ``name``, the expected and the actual type, dtype, shape, device;
    ``contiguous``: a kernel indexes it as a dense row-major array from its first element (any shape, one
    row and zero rows included: torch ignores the strides of size-1 dimensions, and so does such a kernel)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{_p(who)}{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtype is not None:
        dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
        if t.dtype not in dtypes:
            raise TypeError(f"{_p(who)}{name} must have dtype {' or '.join(str(d) for d in dtypes)}, got {t.dtype}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{_p(who)}{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if device is not None and t.device != torch.device(device):
        raise ValueError(f"{_p(who)}{name} must be on device {torch.device(device)}, got {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{_p(who)}{name} must be contiguous (a kernel reads it as a dense row-major array), got "
                         f"strides {t.stride()} for shape {tuple(t.shape)}")


def check_finite(name: str, t: torch.Tensor, who: str = "", index: str = "index") -> None:
    """NaN / Inf in ``t`` -> ValueError with the count and the first bad element's ``index`` (a label
    such as "[token, channel]"). One host sync when ``t`` is on a GPU."""
    if not t.numel():
        return
    bad = ~torch.isfinite(t)
    if bool(bad.any()):
        first = bad.nonzero()[0].tolist()
        raise ValueError(f"{_p(who)}{name} contains NaN or Inf (first at {index} = {first}; "
                         f"{int(bad.sum())} of {t.numel()} elements)")


def check_scale_bytes(name: str, scale: torch.Tensor, who: str = "") -> None:
    """E8M0 bytes (uint8 [..., G]): byte 0xFF is NaN, not 2**128. Refused wherever it is, an all-zero
    group included (no decoder agrees on what NaN times zero is), and never repaired. 0xFF is the largest byte,
    so one max says whether there is any (a CPU's max reads bytes ~10x faster than ``==`` then ``any``)."""
    if not scale.numel() or int(scale.max()) != E8M0_NAN:
        return
    bad = scale == E8M0_NAN
    if bool(bad.any()):
        first = bad.nonzero()[0].tolist()
        raise ValueError(f"{_p(who)}{name} holds {int(bad.sum())} E8M0 byte(s) 0xFF, which is NaN, not a scale "
                         f"(first at {first}); 0xFF is refused even on all-zero groups")


# ------------------------------------------------------------------------------------ routing
def routing_error_bits(topk_idx: torch.Tensor, topk_weights: torch.Tensor | None, num_experts: int) -> torch.Tensor:
    """int32 [1] on topk_idx's device, no host sync (CUDA-graph safe): ROUTE_ID_OUT_OF_RANGE when an id
    is outside [-1, E), ROUTE_ID_DUPLICATED when a token names one expert twice (-1 may repeat),
    ROUTE_WEIGHT_NONFINITE when a routing weight is NaN / Inf. topk_idx [T, K] (any int dtype)."""
    idx = topk_idx.to(torch.int64)
    k = idx.shape[1]
    out_of_range = ((idx < -1) | (idx >= num_experts)).any()
    # Masked slots become distinct negatives, so only real experts can collide.
    keyed = torch.where(idx >= 0, idx, -2 - torch.arange(k, device=idx.device))
    dup = (keyed.sort(dim=1).values.diff(dim=1) == 0).any() if k > 1 else torch.zeros((), dtype=torch.bool, device=idx.device)
    bits = out_of_range.to(torch.int32) * ROUTE_ID_OUT_OF_RANGE + dup.to(torch.int32) * ROUTE_ID_DUPLICATED
    if topk_weights is not None:
        bits = bits + (~torch.isfinite(topk_weights)).any().to(torch.int32) * ROUTE_WEIGHT_NONFINITE
    return bits.reshape(1)


def check_topk(topk_idx, topk_weights, num_experts: int, who: str = "",
               idx_dtypes: tuple[torch.dtype, ...] = (torch.int64,)) -> None:
    """topk_idx [T, K] (dtype in ``idx_dtypes``; -1 = masked slot), topk_weights fp32 [T, K] or None:
    dtypes, shapes, ids in [-1, E), no expert twice in one token, finite weights. One host sync."""
    expect_tensor("topk_idx", topk_idx, who=who)
    if topk_idx.dtype not in idx_dtypes:
        want = " or ".join(str(d).removeprefix("torch.") for d in idx_dtypes)
        raise TypeError(f"{_p(who)}topk_idx must be {want}, got {topk_idx.dtype}")
    if topk_idx.ndim != 2:
        raise ValueError(f"{_p(who)}topk_idx must be [T, K], got shape {tuple(topk_idx.shape)}")
    if topk_weights is not None:
        expect_tensor("topk_weights", topk_weights, who=who)
        if topk_weights.dtype != torch.float32:
            raise TypeError(f"{_p(who)}topk_weights must be float32, got {topk_weights.dtype}")
        if topk_weights.shape != topk_idx.shape:
            raise ValueError(f"{_p(who)}topk_weights must have shape {tuple(topk_idx.shape)}, "
                             f"got {tuple(topk_weights.shape)}")
    if not topk_idx.numel():
        return
    bits = int(routing_error_bits(topk_idx, topk_weights, num_experts))
    if bits:
        raise_routing_error(bits, topk_idx, topk_weights, num_experts, who)


def raise_routing_error(bits: int, topk_idx, topk_weights, num_experts: int, who: str = "") -> None:
    """The message for error ``bits`` of ``routing_error_bits``, naming the token and its values."""
    idx = topk_idx.to(torch.int64).cpu()
    if bits & ROUTE_ID_OUT_OF_RANGE:
        lo, hi = int(idx.min()), int(idx.max())
        t = int(((idx < -1) | (idx >= num_experts)).any(dim=1).nonzero()[0])
        raise ValueError(f"{_p(who)}topk_idx must be in [-1, {num_experts - 1}] (-1 = masked), got values in "
                         f"[{lo}, {hi}] (first bad token {t}: {idx[t].tolist()})")
    if bits & ROUTE_ID_DUPLICATED:
        for t, row in enumerate(idx.tolist()):
            real = [e for e in row if e >= 0]
            if len(set(real)) != len(real):
                raise ValueError(f"{_p(who)}topk_idx: token {t} routes to the same expert twice: {row}")
    if bits & ROUTE_WEIGHT_NONFINITE:
        check_finite("topk_weights", topk_weights, who, "[token, slot]")
    raise ValueError(f"{_p(who)}routing error flag {bits} set, but the routing checks pass on the host")


# ------------------------------------------------------------------------------------ one step
def check_step_structure(x, topk_idx, topk_weights, who: str = "MoEInputs") -> None:
    """What a step is, whatever the layer: three tensors, x [T, H], topk_idx and topk_weights [T, K],
    on one device. Values, dtypes and the layer's H / K / E are the consumer's (``check_step``)."""
    for name, t in (("x", x), ("topk_idx", topk_idx), ("topk_weights", topk_weights)):
        expect_tensor(name, t, who=who)
        if t.ndim != 2:
            raise ValueError(f"{_p(who)}{name} must be 2-D, got shape {tuple(t.shape)}")
    if topk_idx.shape[0] != x.shape[0] or topk_weights.shape != topk_idx.shape:
        raise ValueError(f"{_p(who)}x, topk_idx and topk_weights must be [T, H], [T, K], [T, K], got "
                         f"{tuple(x.shape)}, {tuple(topk_idx.shape)}, {tuple(topk_weights.shape)}")
    for name, t in (("topk_idx", topk_idx), ("topk_weights", topk_weights)):
        if t.device != x.device:
            raise ValueError(f"{_p(who)}{name} is on {t.device} but x is on {x.device}")


def check_step(x, topk_idx, topk_weights, *, hidden: int, num_topk: int, num_experts: int, device,
               who: str = "", device_label: str = "the launch runs on", idx_dtypes: tuple[torch.dtype, ...] = (torch.int64,),
               num_tokens=None, capacity: int | None = None, allow_zero: bool = True) -> int:
    """One rank's step, before anything runs: x bf16 [T, H] finite, on ``device``; topk_idx [T, K],
    topk_weights fp32 [T, K] on x's device (``check_topk``); the launch count m = ``num_tokens`` (an int,
    T <= m <= capacity; 0 only with ``allow_zero``) or T. Returns m. ``device_label`` says whose device
    it is ("the weights are on"); errors start with ``who``."""
    expect_tensor("x", x, who=who)
    if x.ndim != 2 or x.shape[1] != hidden:
        raise ValueError(f"{_p(who)}x must be [T, {hidden}], got {tuple(x.shape)}")
    if x.dtype != torch.bfloat16:
        raise TypeError(f"{_p(who)}x must be bfloat16, got {x.dtype}")
    if x.device != torch.device(device):
        raise ValueError(f"{_p(who)}x is on {x.device} but {device_label} {torch.device(device)}")
    t = x.shape[0]
    for name, ten in (("topk_idx", topk_idx), ("topk_weights", topk_weights)):
        expect_tensor(name, ten, who=who)
        if tuple(ten.shape) != (t, num_topk):
            raise ValueError(f"{_p(who)}{name} must be [{t}, {num_topk}], got {tuple(ten.shape)}")
        if ten.device != x.device:
            raise ValueError(f"{_p(who)}{name} is on {ten.device} but x is on {x.device}")
    m = t if num_tokens is None else as_int("num_tokens", num_tokens, lo=0, who=who)
    if m < t:
        raise ValueError(f"{_p(who)}num_tokens={m} is below the staged token count T={t}")
    if capacity is not None and m > capacity:
        raise ValueError(f"{_p(who)}token count {m} exceeds the buffer capacity {capacity}")
    if m == 0 and not allow_zero:
        raise ValueError(f"{_p(who)}the kernel needs at least one token (got 0)")
    check_topk(topk_idx, topk_weights, num_experts, who, idx_dtypes)
    check_finite("x", x, who, "[token, channel]")
    return m


# ------------------------------------------------------------------------------------ weights
def content_checksum(t: torch.Tensor, row_words: int = 4096) -> tuple[int, ...]:
    """A cheap digest of ``t``'s bytes on its device (one host sync): its 32-bit words as rows of ``row_words``,
    (sum, row sums weighted by row, column sums weighted by column) in int64, with dtype, shape and data pointer.
    A changed word changes the sum, a moved one a weighted sum: a guard against writes made behind torch's
    version counter, not a cryptographic digest. Two reads of the data."""
    flat = t.detach().reshape(-1) if t.is_contiguous() else t.detach().contiguous().reshape(-1)
    raw = flat.view(torch.uint8)
    words = raw.view(torch.int32) if raw.numel() % 4 == 0 and raw.data_ptr() % 4 == 0 else raw
    n = words.numel()
    rows = n // row_words
    main, tail = words[: rows * row_words].view(rows, row_words), words[rows * row_words:]
    row_sums = main.sum(dim=1, dtype=torch.int64)
    col_sums = main.sum(dim=0, dtype=torch.int64)
    r = torch.arange(1, rows + 1, dtype=torch.int64, device=t.device)
    c = torch.arange(1, row_words + 1, dtype=torch.int64, device=t.device)
    tail_w = torch.arange(1, tail.numel() + 1, dtype=torch.int64, device=t.device)
    parts = torch.stack([row_sums.sum() + tail.sum(dtype=torch.int64), (row_sums * r).sum(), (col_sums * c).sum(),
                         (tail.to(torch.int64) * tail_w).sum()])
    return (str(t.dtype), tuple(t.shape), t.data_ptr(), *parts.tolist())


# Per tensor id: (weak reference, (version, content_checksum), value): a write seen by torch or not recomputes it.
_MEMO: dict[tuple[int, str], tuple[weakref.ref, object, object]] = {}


def memo_per_content(t: torch.Tensor, key: str, fn):
    """fn() for tensor ``t``, once per (tensor, content, key): for results dearer than a ``content_checksum`` (a
    sha256 over host copies). Inference-mode tensors have no version: keyed on the checksum alone."""
    try:
        version = t._version
    except RuntimeError:
        version = None
    content = (version, content_checksum(t))
    slot = (id(t), key)
    entry = _MEMO.get(slot)
    if entry is not None and entry[0]() is t and entry[1] == content:
        return entry[2]
    value = fn()
    _MEMO[slot] = (weakref.ref(t, lambda _, slot=slot: _MEMO.pop(slot, None)), content, value)
    return value


memo_per_version = memo_per_content  # the earlier name (it keyed on the version alone, which misses .data writes)


def _e4m3_nan_check(name: str, t: torch.Tensor, who: str, ids) -> None:
    """e4m3fn has no Inf; NaN is S.1111.111. Read as bytes, one expert at a time (no float copy); t [B, N, K]
    holds experts ``ids``."""
    for b, e in enumerate(ids):
        nan = (t[b].view(torch.uint8) & 0x7F) == 0x7F
        if bool(nan.any()):
            raise ValueError(f"{_p(who)}FP8 block weights {name} contains NaN or Inf (first at [expert, row, "
                             f"column] = {[e, *nan.nonzero()[0].tolist()]}; {int(nan.sum())} in expert {e})")


def check_mxfp4_values(weights, who: str = "") -> None:
    """MXFP4Weights: no E8M0 byte 0xFF in l1_scale / l2_scale; global scales finite and positive. Scans the
    scale bytes every call (1/16 of the weights' bytes: no memo, so no write can hide from it)."""
    for name in ("l1_scale", "l2_scale"):
        check_scale_bytes(f"weights.{name}", getattr(weights, name), who)
    check_global_scales(weights, who)


def check_global_scales(weights, who: str = "") -> None:
    """MXFP4Weights' per-expert global scales (E floats each): finite and positive, or None."""
    for name in ("l1_global_scale", "l2_global_scale"):
        gs = getattr(weights, name)
        if gs is not None and not bool((torch.isfinite(gs) & (gs > 0)).all()):
            e = int((~(torch.isfinite(gs) & (gs > 0))).nonzero()[0])
            raise ValueError(f"{_p(who)}weights.{name} must be finite and positive, got {gs[e].item()!r} at expert {e}")


def check_fp8_block_values(weights, who: str = "", experts=None) -> None:
    """FP8BlockWeights: e4m3 values finite (e4m3fn's NaN byte refused); block scales finite and > 0
    (a zero or negative scale silently zeroes or flips a 128 x 128 block). ``experts``: only these (a call
    that reads a few), else all; errors name the expert id."""
    ids = list(range(weights.l1.shape[0])) if experts is None else list(experts)

    def of(t):
        return t if experts is None else t[torch.tensor(ids, dtype=torch.int64, device=t.device)]

    for name in ("l1", "l2"):
        _e4m3_nan_check(name, of(getattr(weights, name)), who, ids)
    for name in ("l1_scale", "l2_scale"):
        s = of(getattr(weights, name))
        bad = ~torch.isfinite(s) | (s <= 0)
        if bool(bad.any()):
            b, *blk = bad.nonzero()[0].tolist()
            v, where = s[(b, *blk)].item(), f"[expert, block row, block column] = {[ids[b], *blk]}"
            if v != v or abs(v) == float("inf"):
                raise ValueError(f"{_p(who)}FP8 block weights {name} contains NaN or Inf (first at {where}; "
                                 f"{int((~torch.isfinite(s)).sum())} of {s.numel()} elements)")
            raise ValueError(f"{_p(who)}FP8 block weights {name} must be > 0, got {v!r} at {where}")


def check_expert_scales(name: str, scale: torch.Tensor, experts, who: str = "",
                        ok_bytes: tuple[int, int] | None = None, nonzero: torch.Tensor | None = None) -> None:
    """The scale bytes of the experts one call reads, where it reads them (every call, no memo: a write made
    behind torch's version counter is seen too). scale uint8 [B, N, G] of experts ``experts`` (B ids);
    refused: E8M0 byte 0xFF (NaN), and with ``ok_bytes`` = (lo, hi) a byte outside lo..hi in a group whose
    codes are nonzero (``nonzero`` bool [B, N, G]; all groups when None). The error names the tensor, the
    expert, the [row, group] and the byte. The bytes' min and max decide the common case (nothing wrong)."""
    if not scale.numel():
        return
    lo_hi = torch.aminmax(scale)
    lo, hi = int(lo_hi.min), int(lo_hi.max)
    if hi != E8M0_NAN and (ok_bytes is None or ok_bytes[0] <= lo and hi <= ok_bytes[1]):
        return
    bad = scale == E8M0_NAN
    if ok_bytes is not None:
        bad = bad | (scale < ok_bytes[0]) | (scale > ok_bytes[1])
    if nonzero is not None and ok_bytes is not None:
        bad = bad & (nonzero | (scale == E8M0_NAN))
    if bool(bad.any()):
        b, row, grp = bad.nonzero()[0].tolist()
        byte = int(scale[b, row, grp])
        where = f"first at expert {list(experts)[b]}, [row, group] = [{row}, {grp}], of the experts this call reads"
        if byte == E8M0_NAN:
            what = f"holds {int((scale == E8M0_NAN).sum())} E8M0 byte(s) 0xFF, which is NaN, not a scale ({where})"
        else:
            what = (f"holds {int(bad.sum())} E8M0 byte(s) outside {ok_bytes[0]}..{ok_bytes[1]} in groups with nonzero "
                    f"codes ({where}: byte {byte})")
        raise ValueError(f"{_p(who)}{name} {what}; weights are frozen once prepared: was the tensor written in place?")


def check_weights(weights, who: str = "") -> None:
    """Dispatch on the weight format: ``check_mxfp4_values`` or ``check_fp8_block_values``."""
    fmt = getattr(weights, "format", None)
    if fmt == "mxfp4":
        check_mxfp4_values(weights, who)
    elif fmt == "fp8_block":
        check_fp8_block_values(weights, who)
    else:
        raise TypeError(f"{_p(who)}weights must be MXFP4Weights or FP8BlockWeights, got {type(weights).__name__}")


# ------------------------------------------------------------------------------------ results
def check_output(name: str, y: torch.Tensor, who: str = "", why: str = "", diagnose=None) -> None:
    """A result with NaN / Inf computed from accepted, finite inputs -> NonFiniteOutputError naming the
    rows and the cause: ``diagnose(rows)`` (called on this error path only) returns the weight that made
    it (tensor, expert, byte) or None, in which case ``why`` says where an overflow can come from."""
    if not y.numel():
        return
    bad = ~torch.isfinite(y.float() if y.dtype in (torch.bfloat16, torch.float16) else y)
    if bool(bad.any()):
        rows = bad.reshape(bad.shape[0], -1).any(dim=1).nonzero().flatten().tolist()
        cause = diagnose(rows) if diagnose is not None else None
        because = f"; caused by the weights: {cause}" if cause else (f"; {why}" if why else "")
        raise NonFiniteOutputError(
            f"{_p(who)}{name} holds {int(bad.sum())} NaN / Inf value(s) in {len(rows)} row(s) (first rows "
            f"{rows[:8]}) although every input was finite{because}")

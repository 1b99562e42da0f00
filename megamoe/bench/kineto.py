"""The second clock: each call's device time summed from the GPU activity of a torch.profiler (kineto / CUPTI)
trace, as DeepGEMM's bench_kineto sums kernel rows. Reviewers trust it because nothing of the harness (events,
spin kernels, launch gaps) is in it; ``megamoe bench`` puts it beside the CUDA-event figure of every device-bound
row (``kineto_us`` and ``events_over_kineto`` in the row).

    kineto_us(fn, args=None, calls=10, flush_l2=True)  -> {"kineto_us", "kineto_calls", "kernels"}   (CUDA only)
    split_calls(events, calls, flush_names)            -> per-call sums, from [(name, us)] in launch order
"""

from __future__ import annotations

import statistics
from typing import Any, Callable, Sequence

import torch

from .timing import L2Flusher, _caller, _warm, gc_paused, resolve_device


def split_calls(events: Sequence[tuple[str, float]], calls: int, flush_names: Sequence[str]) -> list[float]:
    """Per-call device time from a trace's GPU activity in launch order, [(name, duration us)]: ``calls``
    chunks of equal length, each starting with the flush's own kernels (``flush_names``), which are dropped.
    Raises ValueError when the trace does not have that shape (a call that launches a varying number of
    kernels, or activity from elsewhere): the cross-check then has nothing it can trust."""
    if calls < 1 or not events or len(events) % calls:
        raise ValueError(f"{len(events)} GPU activities do not split into {calls} calls of equal length")
    k, kf = len(events) // calls, len(flush_names)
    out = []
    for c in range(calls):
        chunk = events[c * k:(c + 1) * k]
        if [n for n, _ in chunk[:kf]] != list(flush_names) or k <= kf:
            raise ValueError(f"call {c}: the trace chunk does not start with the flush {list(flush_names)}: "
                             f"{[n for n, _ in chunk[:kf + 1]]}")
        out.append(sum(d for _, d in chunk[kf:]))
    return out


GPU_WORK = ("kernel", "gpu_memcpy", "gpu_memset")  # kineto's activity types of device work (not syncs, markers)


def _gpu_activity(prof) -> list[tuple[str, float]]:
    from torch.autograd import DeviceType

    evs = [e for e in prof.events() if e.device_type == DeviceType.CUDA
           and getattr(e, "activity_type", None) in (None, *GPU_WORK)]
    return [(e.name, e.time_range.elapsed_us()) for e in sorted(evs, key=lambda e: e.time_range.start)]


def kineto_us(fn: Callable, *, args: Sequence[Any] | None = None, calls: int = 10, flush_l2: bool = True,
              device=None) -> dict:
    """The second clock (CUDA only): ``calls`` calls, each after an L2 flush, under torch.profiler; each call's
    device time is the sum of its GPU activities (kernels, copies) in the CUPTI trace (``split_calls``), with
    no launch gap and no event in it. For a one-kernel call it should match the event figure within a few
    percent; for a pipeline of kernels it is the busy time, below the event figure by the gaps.
    Returns {"kineto_us": median per call, "kineto_calls": [...], "kernels": names of one call}."""
    from torch.profiler import ProfilerActivity, profile

    call, dev = _caller(fn, args), resolve_device(device)
    if dev.type != "cuda":
        raise ValueError("kineto_us needs a CUDA device (the CUPTI trace is the clock)")
    flush = L2Flusher(dev) if flush_l2 else (lambda: None)
    _warm(call, 1, 1 if args is None else len(args), 0.0)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p0:
        flush()
        torch.cuda.synchronize()
    flush_names = [n for n, _ in _gpu_activity(p0)]
    with gc_paused(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        for c in range(calls):
            flush()
            call(c)
        torch.cuda.synchronize()
    events = _gpu_activity(prof)
    per_call = split_calls(events, calls, flush_names)
    k = len(events) // calls
    return {"kineto_us": float(statistics.median(per_call)), "kineto_calls": [round(x, 3) for x in per_call],
            "kernels": [n for n, _ in events[len(flush_names):k]]}

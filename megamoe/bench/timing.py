"""Device timing: CUDA events (or CUDA-graph replays) with warm-up, cache defeat, median + spread.

    time_fn(fn, ...)       -> Timing     the harness figure: one event pair per call, L2 flushed (or the
                                         inputs rotated) between calls, median of ``repeats`` calls
    time_graph(fn, ...)    -> Timing     for small calls: ``calls_per_graph`` calls captured in one CUDA
                                         graph, the replay timed with events, divided by the calls
    bare_loop_us(fn, ...)  -> float      a bare timed loop: one event pair around ``iters`` back-to-back
                                         calls, no flush, no per-call events
    overhead_check(...)    -> dict       the harness figure against the bare loop for the same case

On a CPU tensor (or ``device="cpu"``) everything falls back to ``time.perf_counter`` around each call,
so the harness is testable without a GPU; ``Timing.method`` says which clock produced the numbers.
All times are microseconds.

``fn`` is called as ``fn(arg)`` where ``arg`` cycles through ``args`` (one entry per input set: rotating
among several sets keeps a small call from timing the cache), or as ``fn()`` when ``args`` is None.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import torch

L2_FLUSH_BYTES = 256 * 2**20  # > 5x the H200's 50 MB L2


@dataclass
class Timing:
    """Per-call device times of one case, in microseconds."""

    samples_us: list[float]
    method: str  # "cuda-events", "cuda-graph", "perf_counter"
    warmup: int = 0
    flushed: bool = False
    rotated: int = 1  # input sets cycled through
    extra: dict = field(default_factory=dict)

    @property
    def median_us(self) -> float:
        return float(statistics.median(self.samples_us)) if self.samples_us else float("nan")

    @property
    def min_us(self) -> float:
        return float(min(self.samples_us)) if self.samples_us else float("nan")

    @property
    def max_us(self) -> float:
        return float(max(self.samples_us)) if self.samples_us else float("nan")

    @property
    def mean_us(self) -> float:
        return float(statistics.fmean(self.samples_us)) if self.samples_us else float("nan")

    @property
    def spread(self) -> float:
        """(p90 - p10) / median: the relative width of the middle 80% of the samples."""
        s = sorted(self.samples_us)
        if len(s) < 2 or self.median_us == 0:
            return 0.0
        lo, hi = _quantile(s, 0.1), _quantile(s, 0.9)
        return (hi - lo) / self.median_us

    def summary(self) -> dict:
        d = asdict(self)
        d.pop("samples_us")
        d.update(median_us=self.median_us, min_us=self.min_us, max_us=self.max_us, mean_us=self.mean_us,
                 spread=self.spread, repeats=len(self.samples_us), samples_us=[round(x, 3) for x in self.samples_us])
        return d


def _quantile(sorted_vals: Sequence[float], q: float) -> float:
    pos = q * (len(sorted_vals) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (pos - lo)


def resolve_device(device=None) -> torch.device:
    if device is not None:
        return torch.device(device)
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _is_cuda(device) -> bool:
    return resolve_device(device).type == "cuda"


def _caller(fn: Callable, args: Sequence[Any] | None) -> Callable[[int], Any]:
    if args is None:
        return lambda i: fn()
    if len(args) == 0:
        raise ValueError("args must hold at least one input set (or be None)")
    return lambda i: fn(args[i % len(args)])


class L2Flusher:
    """Writes a buffer larger than the L2 between timed calls (outside the event pair)."""

    def __init__(self, device, nbytes: int = L2_FLUSH_BYTES):
        self.buf = torch.empty(nbytes // 4, dtype=torch.int32, device=device)

    def __call__(self) -> None:
        self.buf.zero_()


def _sleep_ahead(us: float) -> None:
    """Queue a spin kernel so the host runs ahead of the device: launch latency of the Python wrapper
    then hides behind queued device work instead of landing between an event pair."""
    try:
        torch.cuda._sleep(int(us * 2000))  # about 2 cycles per ns on Hopper
    except Exception:  # noqa: BLE001 - a private helper; timing stays valid without it
        pass


def time_fn(
    fn: Callable,
    *,
    args: Sequence[Any] | None = None,
    warmup: int = 5,
    repeats: int = 20,
    flush_l2: bool = True,
    device=None,
    batch: int = 10,
    min_warmup_s: float = 0.0,
) -> Timing:
    """Median-of-``repeats`` device time of one call of ``fn`` (see the module docstring).

    Warm-up calls run first (JIT plans, allocator, handles), at least ``warmup`` of them and for at least
    ``min_warmup_s`` seconds. Per-call CUDA events bracket ``fn`` only; the L2 flush runs before the start
    event. Calls are queued in batches of ``batch`` behind a short spin kernel, so host-side launch cost
    does not show as device time.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    call = _caller(fn, args)
    rotated = 1 if args is None else len(args)
    cuda = _is_cuda(device)
    t_end = time.perf_counter() + min_warmup_s
    i = 0
    while i < warmup or time.perf_counter() < t_end:
        call(i)
        i += 1
    if not cuda:
        samples = []
        for r in range(repeats):
            t0 = time.perf_counter()
            call(i + r)
            samples.append((time.perf_counter() - t0) * 1e6)
        return Timing(samples, "perf_counter", warmup=i, flushed=False, rotated=rotated)
    torch.cuda.synchronize()
    flush = L2Flusher(resolve_device(device)) if flush_l2 else None
    samples: list[float] = []
    r = 0
    while r < repeats:
        n = min(batch, repeats - r)
        evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        _sleep_ahead(200.0 * n)
        for j, (a, b) in enumerate(evs):
            if flush is not None:
                flush()
            a.record()
            call(i + r + j)
            b.record()
        torch.cuda.synchronize()
        samples += [a.elapsed_time(b) * 1e3 for a, b in evs]
        r += n
    return Timing(samples, "cuda-events", warmup=i, flushed=flush is not None, rotated=rotated)


def time_graph(
    fn: Callable,
    *,
    args: Sequence[Any] | None = None,
    warmup: int = 3,
    repeats: int = 10,
    calls_per_graph: int = 20,
    device=None,
) -> Timing:
    """Per-call time from CUDA-graph replays: ``calls_per_graph`` calls (cycling ``args``) captured once,
    each replay timed with one event pair; sample = replay time / calls. Falls back to ``time_fn`` on CPU.
    The calls in one graph run back to back, so this is the throughput of a warm stream of calls."""
    if not _is_cuda(device):
        t = time_fn(fn, args=args, warmup=warmup, repeats=repeats, flush_l2=False, device=device)
        return t
    call = _caller(fn, args)
    rotated = 1 if args is None else len(args)
    for i in range(warmup):
        call(i)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        call(0)  # one eager call on the capture stream (lazy inits), as torch's docs advise
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            for j in range(calls_per_graph):
                call(j)
    torch.cuda.synchronize()
    graph.replay()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        samples.append(a.elapsed_time(b) * 1e3 / calls_per_graph)
    return Timing(samples, "cuda-graph", warmup=warmup, flushed=False, rotated=rotated,
                  extra={"calls_per_graph": calls_per_graph})


def bare_loop_us(fn: Callable, *, iters: int = 50, warmup: int = 5, device=None, repeats: int = 3) -> float:
    """The plainest measurement: events (or perf_counter + sync) around ``iters`` back-to-back calls of
    ``fn()``; no flush, no per-call events, no rotation. Median over ``repeats`` loops, per call, in us."""
    cuda = _is_cuda(device)
    for _ in range(warmup):
        fn()
    per_call = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(iters):
                fn()
            b.record()
            torch.cuda.synchronize()
            per_call.append(a.elapsed_time(b) * 1e3 / iters)
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            per_call.append((time.perf_counter() - t0) * 1e6 / iters)
    return float(statistics.median(per_call))


def overhead_check(fn: Callable, *, iters: int = 50, repeats: int = 20, device=None, tolerance: float = 0.02) -> dict:
    """The harness's figure for ``fn()`` (same case: no flush, no rotation, so both see the same caches)
    against a bare timed loop. ``ratio`` = harness / bare; ``ok`` when |ratio - 1| <= tolerance.
    Also reports the default harness figure (L2 flushed) for reference."""
    bare = bare_loop_us(fn, iters=iters, device=device)
    harness = time_fn(fn, repeats=repeats, flush_l2=False, device=device)
    flushed = time_fn(fn, repeats=repeats, flush_l2=True, device=device)
    ratio = harness.median_us / bare if bare > 0 else float("nan")
    return {
        "bare_loop_us": bare,
        "harness_us": harness.median_us,
        "harness_spread": harness.spread,
        "harness_flushed_us": flushed.median_us,
        "ratio": ratio,
        "tolerance": tolerance,
        "ok": bool(abs(ratio - 1) <= tolerance),
        "method": harness.method,
        "iters": iters,
    }

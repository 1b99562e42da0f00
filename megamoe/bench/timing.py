"""Device timing: the clock behind every figure megamoe reports, and a second clock to check it.

    time_fn(fn, ...)        -> Timing  one CUDA event pair per call, the L2 flushed (or the input sets rotated)
                                       between calls, calls queued in batches behind a spin kernel; at least
                                       ``repeats`` calls and ``min_time_s`` (of wall time on a GPU, of samples on a
                                       CPU) after ``warmup`` calls and ``min_warmup_s`` of warm-up
    time_graph(fn, ...)     -> Timing  the same from CUDA-graph replays (one graph per input set)
    overhead_check(fn, ...) -> dict    the harness's per-call figure against a bare timed loop of the same calls

The second clock, kineto / CUPTI kernel time, is in ``megamoe.bench.kineto``.

On a CPU (``device="cpu"``) everything falls back to ``time.perf_counter`` around each call, so the harness is
testable without a GPU; ``Timing.method`` names the clock ("cuda-events", "cuda-graph", "perf_counter"). All
times are microseconds. ``fn`` is called as ``fn(arg)`` with ``arg`` cycling through ``args`` (one entry per
input set), or as ``fn()`` when ``args`` is None. Python's garbage collector is off while timing.
"""

from __future__ import annotations

import contextlib
import gc
import math
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import torch

from ..provenance import resolve_device

L2_FLUSH_BYTES = 256 * 2**20  # > 5x the H200's 50 MB L2
SPIN_PER_CALL_US = 200.0  # the lead queued ahead of a batch whose calls may be shorter than their launch


@dataclass
class Timing:
    """Per-call times of one case, in microseconds (``set_index``: the input set of each sample)."""

    samples_us: list[float]
    method: str
    warmup: int = 0
    flushed: bool = False
    rotated: int = 1
    extra: dict = field(default_factory=dict)
    set_index: list[int] = field(default_factory=list)

    @property
    def median_us(self) -> float:
        return float(statistics.median(self.samples_us)) if self.samples_us else float("nan")

    @property
    def min_us(self) -> float:
        return float(min(self.samples_us)) if self.samples_us else float("nan")

    @property
    def mean_us(self) -> float:
        return float(statistics.fmean(self.samples_us)) if self.samples_us else float("nan")

    @property
    def stderr_us(self) -> float:
        """Standard error of the mean (nan below two samples): the figure of a host-bound row is its mean."""
        n = len(self.samples_us)
        return statistics.stdev(self.samples_us) / math.sqrt(n) if n >= 2 else float("nan")

    @property
    def spread(self) -> float:
        """(p90 - p10) / median: the relative width of the middle 80% of the samples."""
        s = sorted(self.samples_us)
        if len(s) < 2 or self.median_us == 0:
            return 0.0
        return (_quantile(s, 0.9) - _quantile(s, 0.1)) / self.median_us

    @property
    def per_set_median_us(self) -> list[float]:
        """Median of each input set's samples, in set order ([] with fewer than two sets): different
        routings are different amounts of work, reported as such rather than as noise."""
        if self.rotated < 2 or len(self.set_index) != len(self.samples_us):
            return []
        by: dict[int, list[float]] = {}
        for k, s in zip(self.set_index, self.samples_us):
            by.setdefault(k, []).append(s)
        return [float(statistics.median(by[k])) for k in sorted(by)]

    @property
    def rotation_spread(self) -> float | None:
        """(max - min) / min of the per-set medians (None with one set)."""
        m = self.per_set_median_us
        return (max(m) - min(m)) / min(m) if len(m) >= 2 and min(m) > 0 else None

    def summary(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k not in ("samples_us", "set_index")}
        d.update(median_us=self.median_us, min_us=self.min_us, mean_us=self.mean_us, stderr_us=self.stderr_us,
                 spread=self.spread, repeats=len(self.samples_us), samples_us=[round(x, 3) for x in self.samples_us],
                 per_set_median_us=self.per_set_median_us, rotation_spread=self.rotation_spread)
        return d


def _quantile(sorted_vals: Sequence[float], q: float) -> float:
    pos = q * (len(sorted_vals) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (pos - lo)


def _caller(fn: Callable, args: Sequence[Any] | None) -> Callable[[int], Any]:
    if args is None:
        return lambda i: fn()
    if len(args) == 0:
        raise ValueError("args must hold at least one input set (or be None)")
    return lambda i: fn(args[i % len(args)])


def round_to_sets(n: int, sets: int) -> int:
    """``n`` rounded up to whole rotations through ``sets`` input sets (each set equally often)."""
    sets = max(1, sets)
    return max(sets, int(math.ceil(n / sets)) * sets)


@contextlib.contextmanager
def gc_paused(enabled: bool = True):
    """Python's cyclic GC off inside the block (when ``enabled``), the previous state restored after. Yields a
    dict whose ``collections`` (filled on exit) counts collections that ran inside anyway."""
    info = {"gc_disabled": bool(enabled), "collections": 0}
    before = sum(s["collections"] for s in gc.get_stats())
    was = gc.isenabled()
    if enabled and was:
        gc.disable()
    try:
        yield info
    finally:
        if enabled and was:
            gc.enable()
        info["collections"] = sum(s["collections"] for s in gc.get_stats()) - before


class L2Flusher:
    """Writes a buffer larger than the L2 between timed calls (outside the event pair)."""

    def __init__(self, device, nbytes: int = L2_FLUSH_BYTES):
        self.buf = torch.empty(nbytes // 4, dtype=torch.int32, device=device)

    def __call__(self) -> None:
        self.buf.zero_()


def _sleep_ahead(us: float) -> None:
    """Queue a spin kernel so the host runs ahead of the device: the Python launch of the next call then hides
    behind queued work instead of landing between an event pair."""
    try:
        torch.cuda._sleep(int(us * 2000))  # about 2 cycles per ns on Hopper
    except Exception:  # noqa: BLE001 - a private helper; the timing stays valid without it
        pass


class SpinAhead:
    """How long a spin to queue before each batch: ``SPIN_PER_CALL_US`` per call while calls are short next to
    their launch (or nothing is known yet); once a batch shows device time per call above twice the host's
    enqueue time, the queue's lead grows by itself and three enqueue times + 50 us are enough. A 2 ms idle spin
    before every ten 5 ms launches idles the card ~4% of the time, which under the H200's power cap buys clock
    the kernel does not get when run back to back."""

    def __init__(self) -> None:
        self.host_us: float | None = None  # enqueue time per call, last batch
        self.device_us: float | None = None  # median device time per call, last batch

    def spin_us(self, n: int) -> float:
        if self.host_us is not None and self.device_us is not None and self.device_us > 2 * self.host_us:
            return 3 * self.host_us + 50.0
        return SPIN_PER_CALL_US * n

    def observe(self, n: int, host_s: float, samples_us: Sequence[float]) -> None:
        self.host_us = host_s * 1e6 / max(1, n)
        self.device_us = float(statistics.median(samples_us)) if samples_us else None


def _timed_batch(call, idx: Sequence[int], spin: SpinAhead | None, flush: L2Flusher | None) -> list[float]:
    """One batch on CUDA: a spin first, then [flush, event, call, event] per call, one sync at the end."""
    evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in idx]
    if spin is not None:
        _sleep_ahead(spin.spin_us(len(idx)))
    t0 = time.perf_counter()
    for i, (a, b) in zip(idx, evs):
        if flush is not None:
            flush()
        a.record()
        call(i)
        b.record()
    host_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    out = [a.elapsed_time(b) * 1e3 for a, b in evs]
    if spin is not None:
        spin.observe(len(idx), host_s, out)
    return out


def _warm(call, warmup: int, sets: int, min_warmup_s: float, cuda: bool = False) -> int:
    """At least ``warmup`` calls, one per input set, for at least ``min_warmup_s``. On CUDA that is device
    time: each call is waited for, else the host queues seconds of launches in the warm-up (seen on the
    H200: 1345 calls of 1.5 ms queued in a 0.5 s warm-up)."""
    n, t_end, i = max(warmup, sets), time.perf_counter() + min_warmup_s, 0
    while i < n or time.perf_counter() < t_end:
        call(i)
        i += 1
        if cuda and min_warmup_s > 0:
            torch.cuda.synchronize()
    return i


def time_fn(fn: Callable, *, args: Sequence[Any] | None = None, warmup: int = 5, repeats: int = 20,
            flush_l2: bool = True, device=None, batch: int = 10, min_warmup_s: float = 0.0, min_time_s: float = 0.0,
            max_repeats: int | None = None, gc_off: bool = True) -> Timing:
    """Per-call device times of ``fn`` (see the module docstring). Past ``repeats`` calls the pass keeps timing
    until ``min_time_s`` has passed, at most ``max_repeats`` calls, growing by the rotations the remaining time
    needs at the mean call so far (at most a batch), so a 200 ms call does not overshoot by a whole batch.
    With several input sets every count is whole rotations: each set is timed equally often."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    call, sets = _caller(fn, args), 1 if args is None else len(args)
    cuda = resolve_device(device).type == "cuda"
    with gc_paused(gc_off) as gci:
        i = _warm(call, warmup, sets, min_warmup_s, cuda)
        if cuda:
            torch.cuda.synchronize()
        flush = L2Flusher(resolve_device(device)) if (cuda and flush_l2) else None
        samples: list[float] = []
        target = round_to_sets(repeats, sets)
        ceiling = max(target, ((max_repeats or 10_000) // sets) * sets)
        step, spin, t_start = round_to_sets(batch, sets), SpinAhead(), time.perf_counter()
        while len(samples) < target:
            n, done = min(step, target - len(samples)), i + len(samples)
            if cuda:
                samples += _timed_batch(call, range(done, done + n), spin, flush)
            else:
                for j in range(done, done + n):
                    t0 = time.perf_counter()
                    call(j)
                    samples.append((time.perf_counter() - t0) * 1e6)
            # On a GPU the pass runs for min_time_s of wall time; on a CPU, where a sample is the call's whole wall
            # time, for min_time_s of samples (the loop's own microseconds between calls do not count towards it)
            elapsed = time.perf_counter() - t_start if cuda else sum(samples) / 1e6
            if len(samples) >= target and target < ceiling and elapsed < min_time_s:
                need = math.ceil((min_time_s - elapsed) / (elapsed / len(samples))) if elapsed > 0 else step
                target = min(target + min(step, round_to_sets(need, sets)), ceiling)
    return Timing(samples, "cuda-events" if cuda else "perf_counter", warmup=i, flushed=flush is not None,
                  rotated=sets, extra={"gc_collections": gci["collections"]},
                  set_index=[(i + k) % sets for k in range(len(samples))])


class GraphSet:
    """One CUDA graph per input set, captured after warm-up: ``calls_per_graph`` calls each; ``replay(k)``
    replays set k's graph. CUDA only."""

    def __init__(self, fn: Callable, args: Sequence[Any] | None, *, calls_per_graph: int = 1, warmup: int = 3):
        call = _caller(fn, args)
        self.sets, self.calls_per_graph = 1 if args is None else len(args), calls_per_graph
        self.warmup = _warm(call, warmup, self.sets, 0.0)
        torch.cuda.synchronize()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        self.graphs = []
        with torch.cuda.stream(stream):
            for k in range(self.sets):
                call(k)  # one eager call on the capture stream (lazy inits), as torch's docs advise
            torch.cuda.synchronize()
            for k in range(self.sets):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, stream=stream):
                    for _ in range(calls_per_graph):
                        call(k)
                self.graphs.append(g)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        for g in self.graphs:  # first replays outside any timing (graph upload)
            g.replay()
        torch.cuda.synchronize()

    def replay(self, k: int = 0) -> None:
        self.graphs[k % self.sets].replay()


def time_graph(fn: Callable, *, args: Sequence[Any] | None = None, warmup: int = 3, repeats: int = 10,
               calls_per_graph: int = 1, flush_l2: bool = False, device=None, gc_off: bool = True,
               min_time_s: float = 0.0, max_repeats: int | None = None) -> Timing:
    """Per-call time from CUDA-graph replays (``GraphSet``), timed by ``time_fn`` over ``replay`` (batches,
    spin, flush between replays); sample = replay time / ``calls_per_graph``. Only what was captured is timed:
    staging done before capture is not in it. On a CPU it falls back to ``time_fn`` on ``fn`` itself
    (``extra['requested'] = 'cuda-graph'``)."""
    if resolve_device(device).type != "cuda":
        t = time_fn(fn, args=args, warmup=warmup, repeats=repeats, flush_l2=False, device=device, gc_off=gc_off)
        t.extra["requested"] = "cuda-graph"
        return t
    gs = GraphSet(fn, args, calls_per_graph=calls_per_graph, warmup=warmup)
    t = time_fn(gs.replay, args=list(range(gs.sets)), warmup=0, repeats=repeats, flush_l2=flush_l2, device=device,
                gc_off=gc_off, min_time_s=min_time_s, max_repeats=max_repeats)
    return Timing([s / calls_per_graph for s in t.samples_us], "cuda-graph", warmup=gs.warmup, flushed=t.flushed,
                  rotated=gs.sets, extra={**t.extra, "calls_per_graph": calls_per_graph}, set_index=t.set_index)


def _bare_once(call, seq: Sequence[int], cuda: bool) -> float:
    """Per-call mean of one bare loop over ``seq``: one event pair (or perf_counter) around it. On CUDA the loop
    is queued behind a spin covering its enqueue, so the first call's Python launch is not inside the pair
    (without it a 10-call loop carried one launch latency, 2% of a DeepGEMM call at 128 tokens: H200)."""
    if not cuda:
        t0 = time.perf_counter()
        for i in seq:
            call(i)
        return (time.perf_counter() - t0) * 1e6 / len(seq)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    _sleep_ahead(SPIN_PER_CALL_US * len(seq))
    a.record()
    for i in seq:
        call(i)
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / len(seq)


def _harness_once(call, seq: Sequence[int], cuda: bool, batch: int) -> list[float]:
    """Per-call samples over ``seq`` as ``time_fn`` takes them (events, batches, spin; no flush)."""
    if not cuda:
        out = []
        for i in seq:
            t0 = time.perf_counter()
            call(i)
            out.append((time.perf_counter() - t0) * 1e6)
        return out
    torch.cuda.synchronize()
    spin, out = SpinAhead(), []
    for s in range(0, len(seq), batch):
        out += _timed_batch(call, seq[s:s + batch], spin, None)
    return out


def overhead_check(fn: Callable, *, args: Sequence[Any] | None = None, iters: int = 10, rounds: int = 8,
                   warmup: int = 5, device=None, tolerance: float = 0.02, batch: int = 10, settle_s: float = 0.0,
                   min_warmup_s: float = 0.0) -> dict:
    """The harness's per-call instrument against a bare timed loop over exactly the same calls: ``iters`` calls
    (whole rotations) cycling ``args`` in order, no flush on either side. The sides alternate ABBA over
    ``rounds``, so a drift of the card (the H200's power cap at 8192 tokens) falls on both. Each round gives
    each side's per-call mean (the bare loop can only give a mean); ``ratio`` is the median over rounds of
    harness / bare, ``ok`` when within ``tolerance``. ``settle_s``: idle first; ``min_warmup_s``: warm-up time."""
    call, sets = _caller(fn, args), 1 if args is None else len(args)
    cuda = resolve_device(device).type == "cuda"
    seq = list(range(round_to_sets(iters, sets)))
    bare, harness, samples, order = [], [], [], []
    if settle_s > 0:
        if cuda:
            torch.cuda.synchronize()
        time.sleep(settle_s)
    with gc_paused():
        _warm(call, warmup, sets, min_warmup_s, cuda)
        for r in range(rounds):
            for side in (("bare", "harness") if r % 4 in (0, 3) else ("harness", "bare")):
                order.append(side)
                if side == "bare":
                    bare.append(_bare_once(call, seq, cuda))
                else:
                    s = _harness_once(call, seq, cuda, batch)
                    samples += s
                    harness.append(statistics.fmean(s))
    tm = Timing(samples, "cuda-events" if cuda else "perf_counter", rotated=sets,
                set_index=[i % sets for _ in range(rounds) for i in seq])
    pairs = [h / b for h, b in zip(harness, bare) if b > 0]
    ratio = float(statistics.median(pairs)) if pairs else float("nan")
    return {"bare_loop_us": float(statistics.median(bare)), "harness_us": float(statistics.median(harness)),
            "harness_median_us": tm.median_us, "ratio": ratio, "pair_ratios": pairs, "tolerance": tolerance,
            "ok": bool(abs(ratio - 1) <= tolerance), "method": tm.method, "iters": len(seq), "rounds": rounds,
            "order": order, "sets": sets, "sequence": [i % sets for i in seq],
            "per_set_median_us": tm.per_set_median_us, "rotation_spread": tm.rotation_spread,
            "compared": "harness mean / bare-loop mean over the same call sequence, per ABBA round, median; no flush"}


def host_quiet(dev) -> None:
    """Before a host-bound case: collect garbage and return the allocator's unused blocks, so the warm-up
    allocates what the timed calls reuse (an allocation retry frees the whole cache and syncs the device)."""
    gc.collect()
    if torch.device(dev).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()

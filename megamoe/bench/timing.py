"""Device timing: CUDA events (or CUDA-graph replays) with warm-up, cache defeat, median + spread.

    time_fn(fn, ...)        -> Timing    the harness figure: one event pair per call, L2 flushed (or the
                                         inputs rotated) between calls, median of ``repeats`` calls
    time_graph(fn, ...)     -> Timing    ``fn`` captured in CUDA graphs after warm-up (one graph per input
                                         set), each replay timed with one event pair, L2 flushed between
                                         replays when asked; sample = replay time / calls per graph
    bare_loop_us(fn, ...)   -> float     a bare timed loop: one event pair around back-to-back calls, no
                                         flush, no per-call events (cycling the input sets in order)
    overhead_check(...)     -> dict      the harness against the bare loop over the SAME calls

On a CPU tensor (or ``device="cpu"``) everything falls back to ``time.perf_counter`` around each call,
so the harness is testable without a GPU; ``Timing.method`` says which clock produced the numbers
("cuda-events", "cuda-graph" or "perf_counter"). All times are microseconds.

``fn`` is called as ``fn(arg)`` where ``arg`` cycles through ``args`` (one entry per input set: rotating
among several sets keeps a small call from timing the cache), or as ``fn()`` when ``args`` is None.
``Timing.set_index`` records which input set each sample ran on, so the variation *between* input sets
(different routings are different amounts of work) is reported on its own (``per_set_median_us``,
``rotation_spread``) instead of being mistaken for noise or for harness overhead.

Host-side hygiene, on by default (``gc_off``): Python's cyclic garbage collector is disabled for the
warm-up and the timed calls (and restored after), so a collection never lands inside a sample of a
host-bound call. On CUDA the caching allocator's counters are read around the timed calls: a
``cudaMalloc`` or an allocation retry (the allocator freeing its whole cache to satisfy a request)
inside the timed region is recorded in ``Timing.extra`` (``device_mallocs``, ``alloc_retries``),
never hidden. Every input set runs at least once in the warm-up, so the allocator and any JIT cache
have seen each set's shapes before the first sample.
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
    set_index: list[int] = field(default_factory=list)  # input set of each sample (empty: all set 0)

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

    @property
    def per_set_median_us(self) -> list[float]:
        """Median of the samples of each input set, in set order ([] when fewer than two sets)."""
        if self.rotated < 2 or len(self.set_index) != len(self.samples_us):
            return []
        by: dict[int, list[float]] = {}
        for k, s in zip(self.set_index, self.samples_us):
            by.setdefault(k, []).append(s)
        return [float(statistics.median(by[k])) for k in sorted(by)]

    @property
    def rotation_spread(self) -> float | None:
        """(max - min) / min of the per-set medians: how much the input sets differ in work (None: one set)."""
        m = self.per_set_median_us
        if len(m) < 2 or min(m) <= 0:
            return None
        return (max(m) - min(m)) / min(m)

    def summary(self) -> dict:
        d = asdict(self)
        d.pop("samples_us")
        d.pop("set_index")
        d.update(median_us=self.median_us, min_us=self.min_us, max_us=self.max_us, mean_us=self.mean_us,
                 spread=self.spread, repeats=len(self.samples_us), samples_us=[round(x, 3) for x in self.samples_us],
                 per_set_median_us=self.per_set_median_us, rotation_spread=self.rotation_spread)
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


def _nsets(args) -> int:
    return 1 if args is None else len(args)


def round_to_sets(n: int, sets: int) -> int:
    """``n`` rounded up to a whole number of rotations through ``sets`` input sets (each set equally often)."""
    sets = max(1, sets)
    return max(sets, int(math.ceil(n / sets)) * sets)


@contextlib.contextmanager
def gc_paused(enabled: bool = True):
    """Disable Python's cyclic GC inside the block (when ``enabled``), restoring the previous state.
    Yields a dict whose ``collections`` (filled on exit) counts collections that ran inside anyway."""
    info = {"gc_disabled": False, "collections": 0}
    before = sum(s["collections"] for s in gc.get_stats())
    was = gc.isenabled()
    if enabled and was:
        gc.disable()
        info["gc_disabled"] = True
    elif enabled:
        info["gc_disabled"] = True  # already off: stays off
    try:
        yield info
    finally:
        if enabled and was:
            gc.enable()
        info["collections"] = sum(s["collections"] for s in gc.get_stats()) - before


_ALLOC_KEYS = {"num_alloc_retries": "alloc_retries", "num_device_alloc": "device_mallocs"}


def _alloc_counters(cuda: bool) -> dict:
    if not cuda:
        return {}
    try:
        s = torch.cuda.memory_stats()
    except Exception:  # noqa: BLE001 - diagnostics only
        return {}
    return {v: int(s[k]) for k, v in _ALLOC_KEYS.items() if k in s}


def _alloc_delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in before if k in after}


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


SPIN_PER_CALL_US = 200.0  # the lead queued ahead of a batch whose calls may be shorter than their launch


class SpinAhead:
    """How long a spin to queue before each batch of timed calls.

    The spin must cover the host's lead: while it runs, the host enqueues the batch, so no event pair
    waits on a Python launch. While calls are short next to their launch (or before anything is known)
    that takes ``SPIN_PER_CALL_US`` per call. Once a batch shows device time per call above twice the
    host's enqueue time per call, the queue's lead grows by itself after the first call, and a spin of
    a few launches is enough. That matters for long calls: a 2 ms idle spin before every ten 5 ms
    launches idles the card ~4% of the time, which under the H200's power cap can buy clock the kernel
    does not get when run back to back. (The 1-3% by which the harness once sat under a bare loop at
    8192 tokens came mostly from the bare loop's first launch latency, fixed in ``_bare_once``; with both
    fixes the six H200 checks read 0.9996-1.0036.)"""

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


def host_speed_probe_us() -> float:
    """A fixed piece of pure-Python work, timed (us): the speed of the CPU this thread runs on.

    On the H200's VM (2026-12-03, bench/results/2026-12-03_nvidia-h200_levels/) this took ~925 us on the
    pinned core most of the time and 1,300-1,700 us in episodes of 1-10 s, with no steal time reported;
    the eager reference's per-call time followed it (correlation 0.93-1.00 over 0.5-4 s windows). A
    host-bound row timed during such an episode measures the episode, so the sweep reads this probe
    between the timed batches of host-bound rows (``time_fn(probe=...)``)."""
    t0 = time.perf_counter_ns()
    acc = 0
    for i in range(20_000):
        acc += i * i
    return (time.perf_counter_ns() - t0) / 1e3


def _timed_batch(call: Callable[[int], Any], idx: Sequence[int], spin: SpinAhead | None,
                 flush: "L2Flusher | None") -> list[float]:
    """One batch on CUDA: a spin queued first, then per call [flush, event, call, event]; one sync at
    the end. Returns the per-call event times (us). ``spin`` None: no spin queued."""
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


def _warm(call: Callable[[int], Any], warmup: int, sets: int, min_warmup_s: float, cuda: bool = False) -> int:
    """Warm-up calls: at least ``warmup``, at least one per input set, for at least ``min_warmup_s``.
    On CUDA the time is device time: the device is synchronized after each call of the timed part,
    else the host would queue seconds of launches in ``min_warmup_s`` (seen on the H200: 1345 calls
    of 1.5 ms queued in a 0.5 s warm-up)."""
    n = max(warmup, sets)
    t_end = time.perf_counter() + min_warmup_s
    i = 0
    while i < n or time.perf_counter() < t_end:
        call(i)
        i += 1
        if cuda and min_warmup_s > 0:
            torch.cuda.synchronize()
    return i


def _extension(step: int, sets: int, kept: int, kept_s: float, min_time_s: float, host_bound: bool) -> int:
    """Calls to add when ``kept`` calls have taken ``kept_s`` < ``min_time_s``: one batch (``step``) for
    device-bound calls; for host-bound calls (a probe), the whole rotations the remaining time needs at the
    mean call so far, at most one batch. A host-bound call of 200 ms extended by whole 12-call batches
    timed 16 calls, 3 s, for a 1 s minimum (H200, run 0f79c20d8f, 256-2048 tokens), and a batch set aside
    for a slow probe cost as much again."""
    if not host_bound or kept <= 0 or kept_s <= 0:
        return step
    need = math.ceil((min_time_s - kept_s) / (kept_s / kept))
    return min(step, round_to_sets(need, sets))


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
    min_time_s: float = 0.0,
    max_repeats: int | None = None,
    gc_off: bool = True,
    probe: Callable[[], float] | None = None,
    probes_per_batch: int = 2,
    probe_slow_above: float | None = None,
    max_time_s: float = 10.0,
) -> Timing:
    """Median-of-``repeats`` device time of one call of ``fn`` (see the module docstring).

    Warm-up calls run first (JIT plans, allocator, handles): at least ``warmup`` of them, at least one per
    input set, and for at least ``min_warmup_s`` seconds. Per-call CUDA events bracket ``fn`` only; the L2
    flush runs before the start event. Calls are queued in batches of ``batch`` behind a short spin
    kernel, so host-side launch cost does not show as device time.

    ``min_time_s`` (host-bound calls): keep timing past ``repeats`` until the timed calls have taken that
    long, up to ``max_repeats``. With several input sets the count is rounded up to whole rotations, so
    every set contributes the same number of samples. With a ``probe`` (host-bound), the count grows by
    the rotations the remaining time needs at the mean call so far, at most a batch (``_extension``).

    ``probe`` (host-bound calls): called ``probes_per_batch`` times after each batch, outside every timed
    call (e.g. ``host_speed_probe_us``); its values go to ``extra['host_probe_us']`` and their median to
    ``extra['host_probe_median_us']``, so the host's speed during the samples is on record.

    ``probe_slow_above`` (with ``probe``; host-bound calls on a host whose speed comes and goes): the host
    is also probed before the first batch, batches are whole rotations of the input sets, and a batch
    with a probe on either side of it over this value is set aside: its samples are not in the figure,
    and ``repeats`` / ``min_time_s`` count only the batches kept (the wall time of their calls). On the
    H200's VM a slow episode can cover part of a pass and leave the pass's probe median at the usual speed
    (run 18db317, 16 tokens: probes up to 1.9x the usual in both passes, medians within 6%, passes 3.45%
    apart). Timing stops after ``max_time_s``; if the batches kept by then hold fewer than ``repeats``
    calls, every sample is used instead (``extra['host_clean']`` False) and ``host_probe_median_us`` is
    over every probe, so a caller that retakes slow passes sees it. ``extra['host_short']`` is True when
    ``max_time_s`` ran out before the kept batches reached the target (``repeats``, grown for
    ``min_time_s``): the figure then rests on a few calls caught in gaps of an unsteady host (H200, run
    0e3c5a09b5, 1 token: 97 batches set aside, 16 calls kept of ~130, 5.4% slower than the next pass,
    with a probe median at the usual speed). Set-aside counts go to
    ``extra['host_batches_aside']`` / ``['host_calls_aside']``; with a clean figure,
    ``host_probe_median_us`` is over the probes after the kept batches. ``extra['host_batch_log']`` (one
    ``[calls, slowest probe beside it, wall s, kept]`` per batch, in order), ``['host_every_us']`` (every
    sample, set-aside ones included) and ``['host_min_calls']`` let ``refilter_host_pass`` re-select the
    batches later against a lower limit.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if probe_slow_above is not None and not max_time_s > 0:
        raise ValueError(f"max_time_s must be > 0 when probe_slow_above is set, got {max_time_s}")
    call = _caller(fn, args)
    sets = _nsets(args)
    cap = max_repeats if max_repeats is not None else max(repeats, 10_000)
    cuda = _is_cuda(device)
    with gc_paused(gc_off) as gci:
        i = _warm(call, warmup, sets, min_warmup_s, cuda)
        if cuda:
            torch.cuda.synchronize()
        flush = L2Flusher(resolve_device(device)) if (cuda and flush_l2) else None
        a0 = _alloc_counters(cuda)
        samples: list[float] = []  # the kept batches' samples (every batch when not filtering)
        idx: list[int] = []
        every: list[float] = []  # filtering: every batch's samples, set-aside ones included
        every_idx: list[int] = []
        t_start = time.perf_counter()
        r = 0  # calls kept
        done = 0  # calls timed, set-aside ones included (the next call's index)
        kept_wall = 0.0  # wall time of the kept batches' calls
        target = round_to_sets(repeats, sets)
        ceiling = max(target, (cap // sets) * sets)  # max_repeats, in whole rotations, never below repeats
        step = round_to_sets(batch, sets)
        filtering = probe is not None and probe_slow_above is not None
        size = step if filtering else batch  # a set-aside batch takes whole rotations with it
        spin = SpinAhead()
        probed: list[float] = []
        kept_probes: list[float] = []
        aside = [0, 0]  # batches, calls
        batch_log: list[list] = []  # filtering: [calls, slowest probe beside, wall s, kept] per batch
        before = [float(probe()) for _ in range(probes_per_batch)] if filtering else []
        short = False  # filtering: max_time_s ran out before the kept batches held the target
        while r < target:
            if filtering and time.perf_counter() - t_start >= max_time_s:
                short = True
                break
            n = min(size, target - r)
            tb = time.perf_counter()
            if cuda:
                got = _timed_batch(call, range(i + done, i + done + n), spin, flush)
            else:
                got = []
                for j in range(n):
                    t0 = time.perf_counter()
                    call(i + done + j)
                    got.append((time.perf_counter() - t0) * 1e6)
            wall = time.perf_counter() - tb
            got_idx = [(i + done + j) % sets for j in range(n)]
            done += n
            after = [float(probe()) for _ in range(probes_per_batch)] if probe is not None else []
            probed += after
            slow_batch = False
            if filtering:
                every += got
                every_idx += got_idx
                slowest = max(before + after)
                slow_batch = slowest > probe_slow_above
                batch_log.append([n, round(slowest, 1), round(wall, 5), not slow_batch])
            if slow_batch:
                aside[0] += 1
                aside[1] += n
            else:
                samples += got
                idx += got_idx
                kept_probes += after
                r += n
                kept_wall += wall
            before = after
            progress = kept_wall if filtering else time.perf_counter() - t_start
            if r >= target and target < ceiling and progress < min_time_s:
                target = min(target + _extension(step, sets, r, progress, min_time_s, probe is not None), ceiling)
        a1 = _alloc_counters(cuda)
    extra = {"gc_disabled": gci["gc_disabled"], "gc_collections": gci["collections"], **_alloc_delta(a0, a1)}
    if filtering:
        clean = r >= round_to_sets(repeats, sets)
        if not clean:  # the host never stayed fast for long enough: every sample, and say so
            samples, idx, kept_probes = every, every_idx, probed
        extra.update(host_clean=clean, host_batches_aside=aside[0], host_calls_aside=aside[1], host_short=short,
                     host_batch_log=batch_log, host_every_us=[round(x, 3) for x in every],
                     host_min_calls=round_to_sets(repeats, sets))
    if probed:
        extra["host_probe_us"] = [round(x, 1) for x in probed]
        extra["host_probe_median_us"] = float(statistics.median(kept_probes or probed))
    return Timing(samples, "cuda-events" if cuda else "perf_counter", warmup=i, flushed=flush is not None,
                  rotated=sets, extra=extra, set_index=idx)


def pass_spread(medians: Sequence[float]) -> float:
    """The repeatability spread of one case's pass medians: (max - min) / min (nan when min <= 0)."""
    return (max(medians) - min(medians)) / min(medians) if min(medians) > 0 else float("nan")


def refilter_host_pass(extra: dict, slow_above: float) -> dict | None:
    """A filtered host-bound pass (``time_fn`` with ``probe_slow_above``) re-selected against a lower
    limit, from its ``host_batch_log`` and ``host_every_us``, without re-timing: the batches with a probe
    beside them over ``slow_above`` are set aside. For a limit learnt after the pass: the filter judges
    against the run's fastest probe so far, and a run that calibrates in a slow spell keeps slow batches
    at first (H200, 304635d966, 1 token: probes flipping 1,110 <-> 2,110 us, none set aside against a
    1,799 us calibration, the pass 12% slower than the next). Returns None without a batch log, else
    {"median_us", "calls", "batches", "wall_s", "enough"}: what the batches under the limit hold, and
    whether they hold the pass's minimum calls (``host_min_calls``)."""
    log, every = extra.get("host_batch_log"), extra.get("host_every_us")
    if not log or every is None:
        return None
    if sum(int(b[0]) for b in log) != len(every):
        raise ValueError(f"host_batch_log covers {sum(int(b[0]) for b in log)} calls, host_every_us has {len(every)}")
    kept: list[float] = []
    batches, wall, start = 0, 0.0, 0
    for n, slowest, w, _ in log:
        n = int(n)
        if slowest <= slow_above:
            kept += every[start:start + n]
            batches += 1
            wall += w
        start += n
    return {"median_us": statistics.median(kept) if kept else None, "calls": len(kept), "batches": batches,
            "wall_s": round(wall, 4), "enough": len(kept) >= int(extra.get("host_min_calls", 1))}


class GraphSet:
    """One CUDA graph per input set, captured after warm-up: ``calls_per_graph`` calls of ``fn(arg)``
    (or ``fn()``) each. ``replay(k)`` replays set k's graph. Built only on CUDA."""

    def __init__(self, fn: Callable, args: Sequence[Any] | None, *, calls_per_graph: int = 1, warmup: int = 3):
        call = _caller(fn, args)
        self.sets = _nsets(args)
        self.calls_per_graph = calls_per_graph
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


def time_graph(
    fn: Callable,
    *,
    args: Sequence[Any] | None = None,
    warmup: int = 3,
    repeats: int = 10,
    calls_per_graph: int = 1,
    flush_l2: bool = False,
    device=None,
    gc_off: bool = True,
    graphs: GraphSet | None = None,
) -> Timing:
    """Per-call time from CUDA-graph replays (see ``GraphSet``): one event pair per replay, replays cycle
    through the input sets' graphs, the L2 flush (when ``flush_l2``) runs between replays outside the
    event pair; sample = replay time / ``calls_per_graph``. With ``calls_per_graph`` > 1 the calls in one
    graph run back to back: the throughput of a warm stream of calls.

    What is timed is only what was captured: staging or copies done before capture are not in it (the
    caller labels that). On CPU it falls back to ``time_fn`` (``method`` "perf_counter", with
    ``extra['requested'] = 'cuda-graph'``)."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if not _is_cuda(device):
        t = time_fn(fn, args=args, warmup=warmup, repeats=repeats, flush_l2=False, device=device, gc_off=gc_off)
        t.extra["requested"] = "cuda-graph"
        return t
    sets = _nsets(args)
    with gc_paused(gc_off) as gci:
        gs = graphs if graphs is not None else GraphSet(fn, args, calls_per_graph=calls_per_graph, warmup=warmup)
        flush = L2Flusher(resolve_device(device)) if flush_l2 else None
        a0 = _alloc_counters(True)
        samples, idx = [], []
        n = round_to_sets(repeats, sets)
        for r in range(n):
            if flush is not None:
                flush()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            gs.replay(r)
            b.record()
            torch.cuda.synchronize()
            samples.append(a.elapsed_time(b) * 1e3 / gs.calls_per_graph)
            idx.append(r % sets)
        a1 = _alloc_counters(True)
    extra = {"calls_per_graph": gs.calls_per_graph, "graphs": gs.sets, "gc_disabled": gci["gc_disabled"],
             "gc_collections": gci["collections"], **_alloc_delta(a0, a1)}
    return Timing(samples, "cuda-graph", warmup=gs.warmup, flushed=flush is not None, rotated=sets, extra=extra,
                  set_index=idx)


def _bare_once(call: Callable[[int], Any], seq: Sequence[int], cuda: bool) -> float:
    """Per-call mean of one bare loop over the call indices ``seq``: one event pair (or perf_counter).
    On CUDA the loop is queued behind a spin that covers its whole enqueue (``SPIN_PER_CALL_US`` per
    call), so the first call's Python launch does not sit inside the pair: without it a 10-call loop
    carried one launch latency (~30 us per call for a DeepGEMM launch at 128 tokens, 2% of the call;
    seen on the H200 2026-12-02) that the harness, spinning ahead, never sees."""
    if cuda:
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        _sleep_ahead(SPIN_PER_CALL_US * len(seq))
        a.record()
        for i in seq:
            call(i)
        b.record()
        torch.cuda.synchronize()
        return a.elapsed_time(b) * 1e3 / len(seq)
    t0 = time.perf_counter()
    for i in seq:
        call(i)
    return (time.perf_counter() - t0) * 1e6 / len(seq)


def bare_loop_us(fn: Callable, *, args: Sequence[Any] | None = None, iters: int = 50, warmup: int = 5, device=None,
                 repeats: int = 3, gc_off: bool = True) -> float:
    """The plainest measurement: events (or perf_counter + sync) around ``iters`` back-to-back calls
    (cycling ``args`` in order, rounded up to whole rotations); no flush, no per-call events. Median over
    ``repeats`` loops, per call, in us."""
    call = _caller(fn, args)
    sets = _nsets(args)
    cuda = _is_cuda(device)
    seq = list(range(round_to_sets(iters, sets)))
    with gc_paused(gc_off):
        _warm(call, warmup, sets, 0.0)
        per_call = [_bare_once(call, seq, cuda) for _ in range(repeats)]
    return float(statistics.median(per_call))


def _harness_once(call: Callable[[int], Any], seq: Sequence[int], cuda: bool, batch: int) -> list[float]:
    """Per-call samples over ``seq`` exactly as ``time_fn`` takes them (events, batches, spin ahead; no flush)."""
    out: list[float] = []
    if not cuda:
        for i in seq:
            t0 = time.perf_counter()
            call(i)
            out.append((time.perf_counter() - t0) * 1e6)
        return out
    torch.cuda.synchronize()
    spin = SpinAhead()
    for s in range(0, len(seq), batch):
        out += _timed_batch(call, seq[s:s + batch], spin, None)
    return out


def overhead_check(fn: Callable, *, args: Sequence[Any] | None = None, iters: int = 10, rounds: int = 8,
                   warmup: int = 5, device=None, tolerance: float = 0.02, batch: int = 10, gc_off: bool = True,
                   repeats: int | None = None, with_flushed: bool = True, settle_s: float = 0.0,
                   min_warmup_s: float = 0.0) -> dict:
    """The harness's per-call instrument against a bare timed loop, over exactly the same calls.

    One call sequence is fixed first: ``iters`` calls (rounded up to whole rotations) cycling ``args`` in
    order (or ``fn()`` ``iters`` times). Both sides run that sequence: the bare loop with one event pair
    around it, the harness with one event pair per call in ``time_fn``'s batches (no flush on either
    side, so both see the same caches). The sides alternate in ``rounds`` short rounds, ABBA, so a drift
    of the card (on the H200 a long enough run of 8192-token launches reaches the power cap and the SM
    clock steps down by 1-3%) falls on both equally. Each round gives each side's per-call mean over
    the whole sequence: the mean, not the median, because the bare loop can only give a mean, and over
    identical calls the two means differ only by what the instrument adds.

    ``ratio`` = median over rounds of (harness mean / bare mean) of the same round, the two sides of a
    round being adjacent in time; ``ok`` when |ratio - 1| <= tolerance. ``settle_s``: an idle pause
    first, so the check does not start on a card still at its power cap from the work before it;
    ``min_warmup_s``: then warm up at least this long, so both sides run in the card's steady state.
    Reported separately, for what they are: ``harness_median_us`` (the statistic the sweep reports; it
    differs from the mean when the sets differ or samples have outliers), ``per_set_median_us`` and
    ``rotation_spread`` (different input sets really are different work, e.g. routings that load
    different experts), and ``harness_flushed_us`` (``time_fn`` as the sweep runs it, L2 flushed).
    ``repeats`` is accepted for the old signature and ignored (``iters`` fixes the sequence)."""
    del repeats
    call = _caller(fn, args)
    sets = _nsets(args)
    cuda = _is_cuda(device)
    seq = list(range(round_to_sets(iters, sets)))
    bare, harness, samples, order = [], [], [], []
    if settle_s > 0:
        if cuda:
            torch.cuda.synchronize()
        time.sleep(settle_s)
    with gc_paused(gc_off) as gci:
        _warm(call, warmup, sets, min_warmup_s, cuda)
        for r in range(rounds):
            sides = ("bare", "harness") if r % 4 in (0, 3) else ("harness", "bare")
            for side in sides:
                order.append(side)
                if side == "bare":
                    bare.append(_bare_once(call, seq, cuda))
                else:
                    s = _harness_once(call, seq, cuda, batch)
                    samples += s
                    harness.append(statistics.fmean(s))
    bare_us = float(statistics.median(bare))
    harness_us = float(statistics.median(harness))
    tm = Timing(samples, "cuda-events" if cuda else "perf_counter", rotated=sets,
                set_index=[i % sets for _ in range(rounds) for i in seq])
    pairs = [h / b for h, b in zip(harness, bare) if b > 0]
    ratio = float(statistics.median(pairs)) if pairs else float("nan")
    out = {
        "bare_loop_us": bare_us,
        "harness_us": harness_us,
        "harness_median_us": tm.median_us,
        "harness_spread": tm.spread,
        "ratio": ratio,
        "pair_ratios": pairs,
        "ratio_of_medians": harness_us / bare_us if bare_us > 0 else float("nan"),
        "ratio_median": tm.median_us / bare_us if bare_us > 0 else float("nan"),
        "tolerance": tolerance,
        "ok": bool(abs(ratio - 1) <= tolerance),
        "method": tm.method,
        "iters": len(seq),
        "rounds": rounds,
        "order": order,
        "sets": sets,
        "sequence": [i % sets for i in seq],
        "bare_rounds_us": bare,
        "harness_rounds_us": harness,
        "per_set_median_us": tm.per_set_median_us,
        "rotation_spread": tm.rotation_spread,
        "gc_disabled": gci["gc_disabled"],
        "compared": "harness mean / bare-loop mean over the same call sequence, per ABBA round, median; no flush",
    }
    if with_flushed:  # taken after the comparison (card warm); informational
        fl = time_fn(fn, args=args, warmup=1, repeats=len(seq), flush_l2=True, device=device, batch=batch, gc_off=gc_off)
        out["harness_flushed_us"] = fl.median_us
        out["harness_flushed_method"] = fl.method
    return out

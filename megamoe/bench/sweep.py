"""``megamoe bench``: token sweep x backends at one geometry, against ceilings measured in the same run.

Sections (each one in try/except, results written after each, so a failure leaves the rest):

    ceilings      copy bandwidth, FP8 and bf16 matmul rates (ceilings.py)
    sweep         every backend at every token count: correctness (calc_diff vs the backend's reference
                  recipe, on cloned inputs) of every case first, then device time, TFLOP/s, GB/s, fraction
                  of ceilings, roofline floor, BLOCK_M of the plan; each case timed ``passes`` times
                  (repeatability); the device-bound backends first, the eager reference's rows last
    drift         the first case of every backend timed again after the sweep (interleaved mode)
    speedup       fused / unfused time per token count
    overhead      the harness figure vs a bare timed loop of the same calls (within 2%)
    block_m       every forced BLOCK_M at every token count (backends that can force it)
    ragged        a ragged data-parallel step: each rank at its own count vs padded to the agreed count
    staging       per_token_cast_to_fp8 + copy into the buffer, as a fraction of the kernel

How a case is timed (``select_timing``, recorded per row as ``path``; ``method`` is the clock that
actually produced the numbers):

    cuda-graph    backends that promise ``graph_capturable`` (after build): launch() captured in a CUDA
                  graph (one graph per input set for rotated callables), each replay timed with one event
                  pair, the L2 flushed between replays when a single set is timed. Staging (``stage()``:
                  validation, the FP8 cast and the copy into the kernel's buffer) runs once, before
                  capture, and is not in the figure: the figure is the launch alone, as with events. A
                  capture that fails falls back to events and says so (``graph_error``).
    cuda-events   everything else: one event pair per call, L2 flushed between calls (fused) or the inputs
                  rotated (callables).
    perf_counter  no CUDA device: host wall time per call (the CPU fallback).

Host-bound rows (the eager reference; an unfused peer whose launch syncs the host): with events, the
figure is host time, so the host is kept quiet while they run. Python's GC is off during every timing
(``timing.gc_paused``), the caching allocator's cache is emptied and ``gc.collect()`` run before the case
(outside the timed region: the warm-up, at least one call per input set and ``host_min_warmup_s``
long, then re-populates the cache, so no timed call waits on a cudaMalloc or a cache flush; any that
still does is counted in the row, ``device_mallocs`` / ``alloc_retries``), and the case keeps timing past
``reference_repeats`` until ``host_min_time_s`` of samples (at most ``host_max_repeats``), in whole
rotations of the input sets. The card's clocks and P-state are read (nvidia-smi) before and after each
CUDA row (``gpu_before`` / ``gpu_after``). The progress bar never refreshes from a background thread
(it is redrawn between cases only), and the build thread pool is joined before the sweep starts, so
nothing the sweep started runs while a case is timed. On CUDA the timing thread is pinned to one CPU once
the builds are done (``pin_cpu``; ``meta['pinned']`` says which), so a host-bound row is not migrated
between cores mid-pass. Measured on the H200 (2026-12-02): no GC collection,
no cudaMalloc and no live Python thread besides the main one inside any timed region, and the card at
1980 / 3201 MHz, P0, no clock-event reason, around every reference pass; still, the eager reference's
per-call time moved between levels 10-20% apart that last seconds. The cause is the VM's host: a fixed
piece of pure-Python work on the pinned core (``timing.host_speed_probe_us``) took ~925 us most of the
time and 1,300-1,700 us in episodes of 1-10 s, with no steal time reported, and the reference followed it
(correlation 0.93-1.00; bench/results/2026-12-03_nvidia-h200_levels/). So on CUDA, host-bound rows read
that probe between their timed batches (``host_speed_check``): a pass whose probe median is ``host_slow_limit`` (25%)
or more over the fastest seen in the run is retaken, at most ``host_retakes`` times, each retake after
``wait_for_host`` (up to ``host_recover_s`` for ``host_recover_window_s`` of probes at the usual speed);
every retaken pass is kept in the row (``host_retaken``) and a pass still slow after the last retake is flagged
``host_slow``. Within a pass (``host_batch_filter``), a batch with a probe on either side of it over
that limit is set aside and the pass times on (at most ``host_max_time_s``) until the batches kept hold
its repeats: a slow episode can cover part of a pass and leave the pass's probe median at the usual
speed (run 18db317). A pass whose filter runs out of time before its kept batches reach its minimum
(``host_short``) is retaken like a slow one. The host-bound figure is thus the row's time at the host's
usual speed, and says so.

Device-bound rows time at least ``device_min_time_s`` (1 s) of samples after their warm-up. On the H200
under load the card sits at its power cap (~700 W) and the kernels at 1024 tokens slow by 5-15% for
~0.25 s once a second (the power controller's cycle); a pass of 50 ms caught that cycle or missed it,
and two such passes were up to 14-24% apart, while 1 s windows of the same traces were within 1.7%
(same folder). The BLOCK_M and ragged studies time ``study_min_time_s`` (0.5 s) per case.

Repeatability (``repeat_mode``). "interleaved" (the default): each case is timed ``passes`` times back
to back (pass A, then pass B of the same case, each with its own warm-up) before the next case. The spread
between A and B is then the reproducibility of that row's figure under one state of the process and the
card, which is what a per-row spread should measure; a slow change of state over the sweep (clocks,
allocator, something left running) would otherwise show up as a per-row spread that belongs to no row. Such
a change is not hidden: the ``drift`` section times the first case of every backend again at the end and
reports the change against its start. "sweeps" keeps the older protocol: ``passes`` whole sweeps back to
back, each row compared to itself one sweep later (per-row spread = reproducibility + drift). Both modes
report every row's spread and flag those at or over ``repeat_limit`` (3%); nothing is dropped or trimmed.
"""

from __future__ import annotations

import datetime as _dt
import gc
import os
import statistics
import subprocess
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field, fields
from typing import Callable, Sequence

import torch

from ..geometry import Geometry, get_geometry
from ..inputs import MoEInputs, make_inputs
from ..testing import calc_diff
from .backends import BenchBackend, block_m_of, make_backends
from .ceilings import Ceilings, device_name, measure_ceilings
from .roofline import achieved, step_floor
from .timing import (GraphSet, Timing, host_speed_probe_us, overhead_check, pass_spread, refilter_host_pass,
                     resolve_device, time_fn, time_graph)

DEFAULT_TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]


@dataclass
class SweepConfig:
    preset: str = "dsv4-flash"
    tokens: list[int] = field(default_factory=lambda: list(DEFAULT_TOKENS))
    backends: list[str] | None = None  # None: every registered backend that can run, plus "reference"
    repeats: int = 20
    warmup: int = 5
    rotate: int = 4  # input sets cycled through for rotatable (callable) backends
    flush_l2: bool = True
    graph: bool = False  # also time CUDA-graph replays of each launch (kept when it works)
    passes: int = 2  # sweeps run back to back, for the repeatability spread
    check: bool = True
    max_diff: float = 1e-3
    reference_max_tokens: int = 8192
    reference_repeats: int = 3
    host_min_time_s: float = 0.5  # host-bound rows: time at least this long (past reference_repeats / repeats)
    host_max_repeats: int = 64  # ... but never more calls than this
    host_min_warmup_s: float = 1.0  # host-bound rows: warm up for at least this long (and one call per set)
    device_min_warmup_s: float = 0.1  # CUDA, device-bound rows: warm up at least this much device time
    device_min_time_s: float = 1.0  # ... and time at least this long (past ``repeats``): one power-management cycle
    device_max_repeats: int = 2000
    study_min_time_s: float = 0.5  # device-bound cases of the BLOCK_M and ragged studies: time at least this long
    # host-bound rows: read host_speed_probe_us beside the samples and retake slow passes. None: on CUDA only.
    # On a CPU run the timed work itself loads the cores the probe runs on (torch's OpenMP threads spin on
    # after each op), so the probe reads the work, not the host: on a 2-core machine it read slow after
    # most CPU reference calls and the retakes' waits took a sweep test from 2 s to 100 s.
    host_speed_check: bool | None = None
    # A pass whose probe median is this much over the run's fastest is retaken. Slow episodes read 1.4-1.8x
    # (levels study); the usual speed itself wanders up to ~1.16x of the run's fastest probe median (run
    # 3ec44fd: 941-1,120 us), and an 8% limit spent the whole retake budget on passes at the usual speed.
    host_slow_limit: float = 0.25
    host_retakes: int = 3  # ... at most this many times (then kept, flagged host_slow)
    host_calibrate_s: float = 0.5  # probe the host this long once before the sweep (the first baseline)
    host_recover_s: float = 10.0  # before a retake, wait at most this long for the host's usual speed ...
    host_recover_window_s: float = 0.5  # ... held by every probe for this long
    # Within a pass: set aside every batch with a probe on either side of it over the slow limit
    # (time_fn's probe_slow_above), timing for at most host_max_time_s to collect the pass's samples.
    host_batch_filter: bool = True
    host_max_time_s: float = 5.0
    # Everything the host speed check adds, over the whole run: retaken passes, the waits before them and
    # the calls a pass's filter set aside. Once spent, passes are kept as first timed (a slow one flagged
    # host_slow). Without it a host that stays slow for minutes cost up to ~50 s per pass (a 5 s filtered
    # pass, then 3 x (10 s wait + 5 s retake)): run cf038b4ac2 timed out in its reference rows. 90 s, not
    # 60 s: run 0f79c20d8f (448 s in all, 62 s under the deadline) spent 60 s by 254 s, and its 2048-token
    # row then kept a pass half taken in a slow episode (248 vs 237 ms, 4.39% apart).
    host_extra_budget_s: float = 90.0
    overhead_rounds: int = 16  # ABBA rounds of the overhead check
    pin_cpu: bool = True  # CUDA: pin the timing thread to one CPU once the builds are done (pin_timing_thread)
    repeat_mode: str = "interleaved"  # "interleaved": passes of one case back to back; "sweeps": whole sweeps
    repeat_limit: float = 0.03  # rows whose pass-to-pass spread reaches this are flagged
    drift_check: bool = True  # interleaved mode: re-time each backend's first case after the sweep
    graph_capturable: bool = True  # time backends that promise graph_capturable by CUDA-graph replays
    settle_s: float = 2.0  # CUDA: idle seconds before each timed phase and before the overhead check
    block_m_study: bool = True
    block_m_tokens: list[int] | None = None  # None: the sweep's tokens
    ragged: bool = True
    ragged_means: list[int] = field(default_factory=lambda: [16, 256, 2048])
    staging: bool = True
    overhead: bool = True
    overhead_tokens: list[int] = field(default_factory=lambda: [128, 8192])
    seed: int = 0
    device: str | None = None
    out_dir: str | None = None  # results folder (named by date, card, commit under it); None: no files
    # optional studies, and sweep cases not yet begun, are skipped once this much wall time has passed
    deadline_s: float | None = None
    build_threads: int = 8
    progress: bool = True
    weights: object | None = None  # pre-made weights (tests); None: random MXFP4 at the geometry
    extra_backends: list = field(default_factory=list)  # BenchBackend objects timed too
    host_probe: Callable[[], float] | None = None  # None: timing.host_speed_probe_us (tests inject their own)
    ceilings: Ceilings | None = None  # pre-measured (tests, re-runs); None: measured in this run

    def device_pass(self, repeats: int, study: bool = False) -> dict:
        """``time_fn`` keywords of a device-bound pass on CUDA: ``device_min_warmup_s`` of warm-up and
        ``device_min_time_s`` of samples (``study_min_time_s`` for a BLOCK_M / ragged study case), at
        most ``device_max_repeats`` calls but never fewer than ``repeats``. The pytest suites time with
        the same (``megamoe.bench.suite.device_pass_kwargs``)."""
        return dict(min_warmup_s=self.device_min_warmup_s,
                    min_time_s=self.study_min_time_s if study else self.device_min_time_s,
                    max_repeats=max(repeats, self.device_max_repeats))


# ------------------------------------------------------------------------------------ metadata
def _git(*args) -> str:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        return subprocess.run(["git", *args], cwd=here, capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception:  # noqa: BLE001
        return ""


def package_versions() -> dict:
    import importlib.metadata as md
    import platform

    v = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    for dist in ("flashinfer-python", "sgl-deep-gemm", "deep-gemm", "triton", "apache-tvm-ffi", "megamoe"):
        try:
            v[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    return v


def run_metadata(device) -> dict:
    dev = resolve_device(device)
    meta = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "card": device_name(dev),
        "commit": os.environ.get("MEGAMOE_COMMIT") or _git("rev-parse", "--short=10", "HEAD") or "unknown",
        "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")) if not os.environ.get("MEGAMOE_COMMIT") else None,
        "versions": package_versions(),
    }
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        meta["sm_count"] = p.multi_processor_count
        meta["memory_gib"] = round(p.total_memory / 2**30, 1)
        meta["capability"] = f"{p.major}.{p.minor}"
        meta["gpu"] = card_identity(dev, getattr(p, "uuid", None))
    return meta


def card_identity(dev: torch.device, uuid=None) -> dict:
    """Which physical card ran: its UUID (torch), and serial, PCI bus, power limit and VBIOS where
    nvidia-smi answers. Figures from two device calls can differ by more than one call's two passes
    (810b815d80: up to 7.9% between calls, 1.68% within one), and a call may land on another H200, so a
    comparison across runs needs to know whether the card was the same."""
    ident = {"uuid": None if uuid is None else str(uuid)}
    fields_ = ("serial", "pci.bus_id", "power.limit", "clocks.max.sm", "vbios_version")
    try:
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields_)}", "--format=csv,noheader",
                              "-i", str(idx)], capture_output=True, text=True, timeout=20, check=True).stdout
        ident.update(zip(fields_, (x.strip() for x in out.strip().split(","))))
    except (OSError, subprocess.SubprocessError, ValueError):
        pass  # no nvidia-smi: the UUID alone
    return ident


def results_dir_name(meta: dict) -> str:
    card = "".join(c if c.isalnum() else "-" for c in meta["card"]).strip("-").lower()
    while "--" in card:
        card = card.replace("--", "-")
    return f"{meta['date'][:10]}_{card}_{meta['commit']}"


# ------------------------------------------------------------------------------------ progress
class _Progress:
    def __init__(self, enabled: bool, total: int):
        self.p = None
        if enabled:
            try:
                from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

                # auto_refresh=False: no refresh thread runs beside a timed call; redrawn in step()
                self.p = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                  auto_refresh=False)
                self.p.start()
                self.task = self.p.add_task("bench", total=total)
            except Exception:  # noqa: BLE001
                self.p = None

    def step(self, desc: str) -> None:
        if self.p is not None:
            self.p.update(self.task, advance=1, description=desc)
            self.p.refresh()

    def describe(self, desc: str) -> None:
        if self.p is not None:
            self.p.update(self.task, description=desc)
            self.p.refresh()

    def add(self, n: int) -> None:
        if self.p is not None:
            self.p.update(self.task, total=(self.p.tasks[0].total or 0) + n)

    def stop(self) -> None:
        if self.p is not None:
            self.p.stop()


# ------------------------------------------------------------------------------------ the sweep
class Sweep:
    """Runs the sections of one ``megamoe bench`` call; ``results`` is the JSON document."""

    def __init__(self, cfg: SweepConfig, log: Callable[[str], None] = print):
        self.cfg, self.log = cfg, log
        self.g: Geometry = get_geometry(cfg.preset)
        self.dev = resolve_device(cfg.device)
        self.t0 = time.perf_counter()
        self.meta = run_metadata(self.dev)
        # not asdict(cfg): it would deep-copy the weights it may hold
        self.meta.update(geometry=asdict(self.g), config={f.name: getattr(cfg, f.name) for f in fields(cfg)
                                                           if f.name not in ("weights", "extra_backends", "ceilings",
                                                                             "host_probe")})
        self.meta["timing_protocol"] = timing_protocol(cfg, self.host_speed_check)
        self.results: dict = {"meta": self.meta, "ceilings": None, "rows": [], "speedup": [], "repeatability": [],
                              "drift": [], "block_m": [], "ragged": [], "staging": [], "overhead": [], "errors": [],
                              "skipped": {}}
        self.backends: list[BenchBackend] = []
        self.out_dir: str | None = None
        self._inputs_cache: dict = {}
        self._ref_cache: dict = {}

    # --- helpers ----------------------------------------------------------------------------
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def time_left(self) -> bool:
        return self.cfg.deadline_s is None or self.elapsed() < self.cfg.deadline_s

    def error(self, where: str, exc: BaseException) -> None:
        tb = traceback.format_exc()
        self.log(f"[bench] ERROR in {where}: {type(exc).__name__}: {exc}\n{tb}")
        self.results["errors"].append({"where": where, "error": f"{type(exc).__name__}: {exc}", "traceback": tb})

    def inputs(self, t: int, k: int = 0) -> MoEInputs:
        """Input set k at t tokens: fresh random (distinct seed per (t, k)), the same in every pass."""
        key = (t, k)
        if key not in self._inputs_cache:
            self._inputs_cache[key] = make_inputs(self.g, t, seed=self.cfg.seed * 1_000_003 + t * 101 + k, device=self.dev)
        return self._inputs_cache[key]

    def _sync(self) -> None:
        if self.dev.type == "cuda":
            torch.cuda.synchronize()

    def _host_probe(self) -> Callable[[], float]:
        return self.cfg.host_probe or host_speed_probe_us

    @property
    def host_speed_check(self) -> bool:
        c = self.cfg.host_speed_check
        return self.dev.type == "cuda" if c is None else bool(c)

    def calibrate_host(self) -> None:
        """The host's speed before anything is timed: the median of ``host_calibrate_s`` of probes is the
        first baseline; every host-bound pass then lowers it when it saw a faster host."""
        if not self.host_speed_check:
            return
        probe, vals = self._host_probe(), []
        t_end = time.perf_counter() + self.cfg.host_calibrate_s
        while time.perf_counter() < t_end or len(vals) < 3:
            vals.append(float(probe()))
        self._host_best = statistics.median(vals)
        self.meta["host_probe_calibration_us"] = round(self._host_best, 1)

    def host_slow_above(self) -> float | None:
        """The probe reading over which the host counts as slow: the run's fastest probe median so far,
        plus ``host_slow_limit``. None before calibration or without the host speed check."""
        best = getattr(self, "_host_best", None)
        if best is None or not self.host_speed_check:
            return None
        return best * (1 + self.cfg.host_slow_limit)

    def host_budget_left(self) -> float:
        """Seconds left of ``host_extra_budget_s`` (retakes, their waits, calls set aside by the filter)."""
        return self.cfg.host_extra_budget_s - self.meta.get("host_extra_s", 0.0)

    def _spend_host(self, seconds: float) -> None:
        before = self.host_budget_left()
        self.meta["host_extra_s"] = round(self.meta.get("host_extra_s", 0.0) + max(seconds, 0.0), 3)
        if before > 0 >= self.host_budget_left():
            self.log(f"[bench] host speed check: its {self.cfg.host_extra_budget_s:g} s budget is spent at "
                     f"{self.elapsed():.0f} s; later host-bound passes are kept as first timed (slow ones flagged)")

    def wait_for_host(self) -> float:
        """Before a retake: probe the host until every probe of the last ``host_recover_window_s`` read
        within ``host_slow_limit`` of the run's fastest, for at most ``host_recover_s``. A slow episode
        lasts 1-10 s, and at its edges the host flips between speeds from one probe to the next (seen on
        the H200, run cb8a2c1d34: a wait that ended on the first fast probe started retakes that read
        slow again), so one fast probe is not a recovery. Returns the seconds waited."""
        cfg = self.cfg
        limit = self.host_slow_above()
        if limit is None or cfg.host_recover_s <= 0:
            return 0.0
        probe = self._host_probe()
        t0 = time.perf_counter()
        fast_since = None
        while time.perf_counter() - t0 < cfg.host_recover_s:
            fast = probe() <= limit
            now = time.perf_counter()
            if not fast:
                fast_since = None
            elif fast_since is None:
                fast_since = now
            if fast_since is not None and now - fast_since >= cfg.host_recover_window_s:
                break
        return time.perf_counter() - t0

    def _time_host(self, run: Callable[[bool], Timing]) -> Timing:
        """A host-bound pass, with the host's speed on record: ``run()`` is retaken (at most
        ``host_retakes`` times) while its probe median is over the fastest probe median seen in this run by
        ``host_slow_limit`` or more, or while its in-pass filter ran out of time short of its minimum
        (``host_short``). Every retaken pass stays in the row (``host_retaken``); a pass still slow or short
        after the last retake is kept and flagged ``host_slow``. The figure is the host-bound row's
        time at the host's usual speed, not during one of the VM's slow episodes (bench/results/
        2026-12-03_nvidia-h200_levels/: the pinned core ran 1.4-1.8x slower for 1-10 s at a time).
        Before each retake the host is given up to ``host_recover_s`` to come back (``wait_for_host``);
        ``run(retake)`` is told whether it is a retake (it may then skip the long warm-up: the case
        was just warmed)."""
        cfg = self.cfg
        retaken: list[dict] = []
        while True:
            t_run = time.perf_counter()
            tm = run(bool(retaken))
            run_s = time.perf_counter() - t_run
            if retaken:
                self._spend_host(run_s)  # the whole retake is extra
            elif tm.extra.get("host_calls_aside"):
                self._spend_host(tm.extra["host_calls_aside"] * tm.median_us * 1e-6)
            pm = tm.extra.get("host_probe_median_us")
            if pm is None:
                return tm
            best = getattr(self, "_host_best", None)
            best = pm if best is None else min(best, pm)
            self._host_best = best
            # A pass whose filter ran out of time short of its minimum is no steadier a figure than a slow
            # one, even when its kept batches' probes read the usual speed (host_short).
            short = bool(tm.extra.get("host_short"))
            slow = pm > self.host_slow_above() or short
            if not slow or len(retaken) >= cfg.host_retakes:
                break
            if self.host_budget_left() <= 0:
                tm.extra["host_budget_spent"] = True
                break
            waited = self.wait_for_host()
            self._spend_host(waited)
            retaken.append({"median_us": tm.median_us, "host_probe_median_us": round(pm, 1),
                            "samples": len(tm.samples_us), "host_clean": tm.extra.get("host_clean"),
                            "host_short": short,
                            "then_waited_s": round(waited, 2)})
        tm.extra.update(host_retaken=retaken, host_slow=bool(slow), host_probe_best_us=round(best, 1))
        return tm

    def _time(self, b: BenchBackend, t: int, sets: Sequence[MoEInputs], study: bool = False) -> Timing:
        """Time one case by the path ``select_timing`` picks; ``Timing.extra['path']`` records the pick.
        ``study``: a case of the BLOCK_M / ragged studies (device-bound cases time ``study_min_time_s``)."""
        cfg = self.cfg
        path = select_timing(b, self.dev.type, cfg.graph_capturable)
        fn, args = b.timer(sets)
        is_ref = b.name.startswith("reference")
        reps = cfg.reference_repeats if is_ref else cfg.repeats
        warm = 1 if is_ref else cfg.warmup
        flush = cfg.flush_l2 and args is None
        host = b.host_bound and path != "cuda-graph"
        tm = None
        graph_error = None
        if path == "cuda-graph":
            try:
                tm = time_graph(fn, args=args, warmup=warm, repeats=reps, flush_l2=flush, device=self.dev)
                tm.extra["staging"] = "outside the figure: staged once before capture" if not b.rotatable else \
                    "none (one graph per input set)"
            except Exception as exc:  # noqa: BLE001 - a broken promise keeps the event figure, labelled
                graph_error = f"{type(exc).__name__}: {exc}"
                self._sync()
                fn, args = b.timer(sets)  # re-stage: a failed capture may have left the stream dirty
        if tm is None:
            kw = {}
            if host:
                kw = dict(min_time_s=cfg.host_min_time_s, max_repeats=max(reps, cfg.host_max_repeats),
                          min_warmup_s=cfg.host_min_warmup_s,
                          probe=self._host_probe() if self.host_speed_check else None)
            elif self.dev.type == "cuda":
                # Warm-up: past the first power step (at 4096 tokens DeepGEMM FP8 slowed 2460 -> 2730 us
                # ~45 ms into a pass after a 5-call warm-up; H200, 2026-12-02), not seconds (after 2 s of
                # load the card sits at its power cap and steps its clock by ~5% every few calls, which
                # put 1024-2048-token rows 4-6% apart: run 939e95829a). Time: short calls keep timing for
                # ``device_min_time_s``, so a 75 us kernel's median is not taken from 1.5 ms of samples.
                kw = cfg.device_pass(reps, study)
            # The card's clocks, power and P-state around every CUDA row (outside the timing): a row
            # whose passes disagree shows whether the card changed state between them.
            before = gpu_state(self.dev)
            if host:
                def one_pass(retake: bool) -> Timing:
                    host_quiet(self.dev)
                    # a retake follows a full pass of the same case: one call per input set re-warms it
                    kw_pass = {**kw, "min_warmup_s": 0.0} if retake else dict(kw)
                    limit = self.host_slow_above()
                    if limit is not None and cfg.host_batch_filter and self.host_budget_left() > 0:
                        kw_pass.update(probe_slow_above=limit, max_time_s=cfg.host_max_time_s)
                    return time_fn(fn, args=args, warmup=warm, repeats=reps, flush_l2=flush, device=self.dev, **kw_pass)

                tm = self._time_host(one_pass)
            else:
                tm = time_fn(fn, args=args, warmup=warm, repeats=reps, flush_l2=flush, device=self.dev, **kw)
            after = gpu_state(self.dev)
            if before or after:
                tm.extra["gpu_before"], tm.extra["gpu_after"] = before, after
        tm.extra["path"] = path if graph_error is None else "cuda-events (graph capture failed)"
        tm.extra["host_bound"] = host
        if graph_error is not None:
            tm.extra["graph_error"] = graph_error
        if cfg.graph and path != "cuda-graph" and not is_ref and self.dev.type == "cuda":
            try:  # the optional extra figure for backends that made no promise
                gt = time_graph(fn, args=args, repeats=max(5, reps // 2), calls_per_graph=20, device=self.dev)
                tm.extra["graph_us"] = gt.median_us  # 20 calls back to back per replay: warm-stream throughput
                tm.extra["graph_spread"] = gt.spread
            except Exception as exc:  # noqa: BLE001 - a kernel that cannot be captured keeps its event time
                tm.extra["graph_try_error"] = f"{type(exc).__name__}: {exc}"
                self._sync()
        return tm

    def check(self, b: BenchBackend, t: int) -> dict:
        """calc_diff of the backend's output vs its reference recipe, on cloned inputs."""
        if not self.cfg.check:
            return {"checked": False}
        if b.name.startswith("reference"):
            return {"checked": False, "note": "is the reference"}
        inp = self.inputs(t)
        y = b.run(inp.clone())
        self._sync()
        key = (b.reference_key(), t)
        if key not in self._ref_cache:
            ref = b.reference(inp.clone(), self.weights)
            self._ref_cache[key] = None if ref is None else ref.float()
        ref = self._ref_cache[key]
        if ref is None:
            return {"checked": False, "note": "backend names no reference"}
        d = calc_diff(y.float(), ref)
        nan = bool(torch.isnan(y.float()).any())
        return {"checked": True, "calc_diff": d, "nan": nan, "correct": (not nan) and d <= self.cfg.max_diff}

    # --- sections ---------------------------------------------------------------------------
    def run(self) -> dict:
        cfg = self.cfg
        if cfg.out_dir:
            self.out_dir = os.path.join(cfg.out_dir, results_dir_name(self.meta))
            os.makedirs(self.out_dir, exist_ok=True)
        self.log(f"[bench] {self.meta['card']} commit {self.meta['commit']} geometry {self.g.name}; tokens {cfg.tokens}")
        # The overhead check right after the sweep: it is what the sweep's figures rest on, so a deadline
        # cuts the studies first (at a831744d81 the 460 s deadline cut ragged, staging and overhead).
        for name, fn in (("ceilings", self.section_ceilings), ("setup", self.section_setup), ("sweep", self.section_sweep),
                         ("overhead", self.section_overhead), ("block_m", self.section_block_m),
                         ("ragged", self.section_ragged), ("staging", self.section_staging)):
            if name in ("block_m", "ragged", "staging", "overhead") and not getattr(cfg, {"block_m": "block_m_study"}.get(name, name)):
                continue
            if name not in ("ceilings", "setup", "sweep") and not self.time_left():
                self.results["skipped"][f"section {name}"] = f"deadline {cfg.deadline_s} s reached"
                continue
            t1 = time.perf_counter()
            try:
                fn()
            except Exception as exc:  # noqa: BLE001
                self.error(name, exc)
            self.results.setdefault("section_seconds", {})[name] = round(time.perf_counter() - t1, 2)
            if name == "setup" and cfg.pin_cpu and self.dev.type == "cuda":
                # The JIT builds (compiler subprocesses inherit the mask) are done; from here on the
                # host-bound rows' figure is this thread's speed, so it stays on one core.
                self.meta["pinned"] = self._unpin = pin_timing_thread()
            if name == "setup" and any(b.host_bound for b in self.backends):
                self.calibrate_host()  # on the core the host-bound rows will run on
            self.write(final=name in ("sweep", "block_m"))
        if getattr(self, "_unpin", None):
            restore_affinity(self._unpin)
        self.results["wall_seconds"] = round(self.elapsed(), 2)
        self.results["out_dir"] = self.out_dir
        self.write(final=True)
        for b in self.backends:
            try:
                b.close()
            except Exception:  # noqa: BLE001
                pass
        return self.results

    def section_ceilings(self) -> None:
        c = self.cfg.ceilings or measure_ceilings(self.dev)
        self.ceilings = c
        self.results["ceilings"] = c.as_dict()
        self.log(f"[bench] ceilings: copy {c.copy_gbps:.0f} GB/s, FP8 {c.fp8_tflops:.0f} TFLOP/s, bf16 {c.bf16_tflops:.0f} TFLOP/s")

    def section_setup(self) -> None:
        cfg = self.cfg
        if not hasattr(self, "ceilings"):
            self.ceilings = Ceilings(device_name(self.dev), float("nan"), float("nan"), float("nan"), notes=["not measured"])
        t1 = time.perf_counter()
        if cfg.weights is not None:
            self.weights = cfg.weights
        else:
            from ..weights import random_mxfp4_weights

            self.weights = random_mxfp4_weights(self.g, seed=cfg.seed, device=self.dev)
        self._sync()
        self.log(f"[bench] weights ready in {time.perf_counter() - t1:.1f} s")
        names = cfg.backends
        include_ref = names is None or "reference" in names
        bks, skipped = make_backends(self.g, self.weights, max(cfg.tokens), names, include_reference=include_ref, log=self.log)
        self.backends = [*bks, *cfg.extra_backends]
        self.results["skipped"].update({f"backend {k}": v for k, v in skipped.items()})
        for k, v in skipped.items():
            self.log(f"[bench] skipping backend {k}: {v}")
        self.results["backends"] = [{"name": b.name, "fused": b.fused, "weight_format": b.weight_format,
                                     "graph_capturable": bool(b.graph_capturable), "host_bound": bool(b.host_bound),
                                     "jit_group": b.jit_group} for b in self.backends]
        jobs: dict = {}
        groups: dict = {}
        for b in self.backends:
            bms: list = [None]
            if cfg.block_m_study and b.fused:
                try:
                    bms += list(b.legal_block_ms())
                except Exception as exc:  # noqa: BLE001
                    self.error(f"legal_block_ms {b.name}", exc)
            toks = set(cfg.tokens) | set(cfg.block_m_tokens or [])
            if cfg.ragged and b.fused:  # the ragged study's own and agreed counts need their plans too
                for mean in cfg.ragged_means:
                    counts = ragged_counts(mean, max(cfg.tokens))
                    toks |= set(counts)
            toks = sorted(toks)
            try:
                for key, fn in b.build_jobs(toks, tuple(bms)):
                    jobs.setdefault(key, fn)
                    groups.setdefault(key, b.jit_group)
            except Exception as exc:  # noqa: BLE001
                self.error(f"build_jobs {b.name}", exc)
        self.build_all(jobs, groups)

    def build_all(self, jobs: dict, groups: dict | None = None) -> None:
        """Build every JIT plan first, in parallel threads (each plan is a ~15 s compile). Jobs of one
        ``groups[key]`` (the backend's ``jit_group``) run one after another in one worker; the pool is
        joined before this returns, so no build thread is alive while anything is timed."""
        from concurrent.futures import ThreadPoolExecutor

        t1 = time.perf_counter()

        def work(item):
            key, fn = item
            try:
                fn()
                return None
            except Exception as exc:  # noqa: BLE001
                return key, exc, traceback.format_exc()

        # deep_gemm's JIT include parser is process-global and not thread-safe (seen on the H200: "Circular
        # include may occur" when two of its builds overlap, and every later deep_gemm JIT in the process
        # then fails the same way). Every job of a backend in the "deep_gemm" group (the fused DeepGEMM
        # kernel AND the unfused peer's grouped GEMMs) runs in one serial worker. The old rule matched
        # keys starting with "dg", but keys start with the backend name, so nothing was serialized.
        groups = groups or {}
        items = list(jobs.items())
        by_group: dict = {}
        rest = []
        for it in items:
            grp = groups.get(it[0])
            if grp is None and isinstance(it[0], tuple) and "deepgemm" in str(it[0][0]).lower():
                grp = "deep_gemm"
            (by_group.setdefault(grp, []) if grp is not None else rest).append(it)

        def work_serial(group):
            return [e for e in map(work, group) if e is not None]

        with ThreadPoolExecutor(max_workers=max(1, self.cfg.build_threads)) as pool:
            serial = [pool.submit(work_serial, grp_items) for grp_items in by_group.values()]
            errs = [e for e in pool.map(work, rest) if e is not None]
            for f in serial:
                errs += f.result()
        self.results["build_groups"] = {str(k): len(v) for k, v in by_group.items()}
        for key, exc, tb in errs:
            self.log(f"[bench] build of {key} failed: {exc}\n{tb}")
            self.results["errors"].append({"where": f"build {key}", "error": f"{type(exc).__name__}: {exc}", "traceback": tb})
        self.results["plans_built"] = len(jobs)
        self.log(f"[bench] {len(jobs)} plans built in {time.perf_counter() - t1:.1f} s ({len(errs)} failed)")

    def _row(self, b: BenchBackend, t: int, tm: Timing, pass_idx: int, chk: dict, plan: dict) -> dict:
        inp = self.inputs(t)
        fl = step_floor(self.g, inp.topk_idx, self.ceilings, b.weight_format)
        fl4 = step_floor(self.g, inp.topk_idx, self.ceilings, "mxfp4")
        row = {"backend": b.name, "fused": b.fused, "tokens": t, "pass": pass_idx, "block_m": block_m_of(plan),
               "median_us": tm.median_us, "min_us": tm.min_us, "spread": tm.spread, "method": tm.method,
               "repeats": len(tm.samples_us), "warmup": tm.warmup, "flushed": tm.flushed, "rotated": tm.rotated,
               "per_set_median_us": tm.per_set_median_us, "rotation_spread": tm.rotation_spread,
               "graph_capturable": bool(b.graph_capturable),
               **achieved(fl, tm.median_us, self.ceilings), "floor_mxfp4_us": fl4.floor_us,
               "experts_touched": fl.experts_touched, "routed_rows": fl.routed_rows, "bytes": fl.bytes,
               "flops": fl.flops, "weight_format": b.weight_format, **{k: v for k, v in tm.extra.items()},
               "samples_us": [round(x, 3) for x in tm.samples_us], "plan": plan, **chk}
        return row

    def section_sweep(self) -> None:
        """Checks first (every case, before anything is timed), then the timed cases: the device-bound
        backends at every token count, then the eager reference's rows last. Both the checks and the
        reference are long runs of heavy GPU work that leave the card warm (the H200 then sits at its power
        cap for a while); a pass timed right after them was measured 3-7% slower than the pass after it.
        ``settle_s`` of idle time precede each timed phase."""
        cfg = self.cfg
        if cfg.repeat_mode not in ("interleaved", "sweeps"):
            raise ValueError(f"repeat_mode must be 'interleaved' or 'sweeps', got {cfg.repeat_mode!r}")
        keep = [(b, t) for t in cfg.tokens for b in self.backends
                if not (b.name.startswith("reference") and t > cfg.reference_max_tokens)]
        cases = [c for c in keep if not c[0].name.startswith("reference")] + \
                [c for c in keep if c[0].name.startswith("reference")]
        self.meta["threads_at_sweep"] = thread_report()
        prog = _Progress(cfg.progress, len(cases) * (cfg.passes + 1))
        first: dict = {}  # (backend, tokens) -> (check, plan)
        try:
            for b, t in cases:
                prog.step(f"check {b.name} T={t}")
                try:
                    first[(b.name, t)] = (self.check(b, t), b.plan(t))
                except Exception as exc:  # noqa: BLE001
                    self.error(f"check {b.name} T={t}", exc)
            if cfg.repeat_mode == "interleaved":
                order = [(b, t, p) for b, t in cases for p in range(cfg.passes)]
            else:
                order = [(b, t, p) for p in range(cfg.passes) for b, t in cases]
            phase = None
            cut: set = set()  # cases the deadline skipped
            for b, t, p in order:
                ph = (p if cfg.repeat_mode == "sweeps" else 0, b.name.startswith("reference"))
                if ph != phase:
                    if phase is not None:
                        self.write()  # what is done so far, before the next (long) phase
                    self._settle()
                    phase = ph
                prog.step(f"pass {p + 1}/{cfg.passes} {b.name} T={t}")
                # A case begins only before the deadline; once begun, its later passes run too (a case
                # without them has no repeatability figure). The python timeout then cuts nothing.
                if (b.name, t) in cut or (p == 0 and not self.time_left()):
                    cut.add((b.name, t))
                    self.results["skipped"][f"{b.name} T={t}"] = (f"deadline {cfg.deadline_s} s reached "
                                                                  f"before the case began")
                    continue
                try:
                    chk, plan = first.get((b.name, t), ({}, {})) if p == 0 else ({}, {})
                    tm = self._time(b, t, self._sets(b, t))
                    row = self._row(b, t, tm, p, chk, plan)
                    self.results["rows"].append(row)
                    self.log(row_log_line(row, cfg.passes, self.elapsed()))
                    if b.host_bound:
                        self._rejudge_host_rows(first)
                        self.write()  # a host-bound row takes seconds: keep it should the run be cut
                except Exception as exc:  # noqa: BLE001
                    self.error(f"sweep {b.name} T={t} pass {p}", exc)
                if cfg.repeat_mode == "sweeps" and p == 0 and (b, t) == cases[-1]:
                    self.write()
        finally:
            prog.stop()
        self._record_refilter()
        self._fill_from_first_pass()
        self.results["repeatability"] = repeatability(self.results["rows"], cfg.repeat_limit)
        self.results["speedup"] = speedups(self.results["rows"])
        if cfg.drift_check and cfg.repeat_mode == "interleaved":
            self._settle()
            self.section_drift()

    def _rejudge_host_rows(self, first: dict) -> None:
        """Host-bound passes kept as not slow against a baseline that later proved slow: the baseline is the
        fastest probe median so far, and a host in a slow episode at calibration sets it slow (run fdae4fd:
        calibration 1,768 us, the first pass kept at 1,775 us and 9.8 ms, the next at 1,023 us and 7.8 ms).
        Each such pass is re-timed once, now, within ``host_extra_budget_s`` and the deadline
        (``host_rejudged`` keeps the first take); without budget or time it is flagged ``host_slow``."""
        limit = self.host_slow_above()
        if limit is None:
            return
        rows = self.results["rows"]
        by_name = {b.name: b for b in self.backends}
        for i, r in enumerate(rows):
            pm = r.get("host_probe_median_us")
            if pm is None or pm <= limit or r.get("host_slow") or r.get("host_rejudged") or r["backend"] not in by_name:
                continue
            old = {"median_us": r["median_us"], "host_probe_median_us": round(pm, 1), "limit_us": round(limit, 1)}
            if self.host_budget_left() <= 0 or not self.time_left():
                r.update(host_slow=True, host_budget_spent=True, host_rejudged={**old, "re_timed": False})
                continue
            b, t, p = by_name[r["backend"]], r["tokens"], r["pass"]
            spent0, t0 = self.meta.get("host_extra_s", 0.0), time.perf_counter()
            tm = self._time(b, t, self._sets(b, t))
            inside = self.meta.get("host_extra_s", 0.0) - spent0  # what _time_host already counted
            self._spend_host(time.perf_counter() - t0 - inside)
            chk, plan = first.get((b.name, t), ({}, {})) if p == 0 else ({}, {})
            rows[i] = self._row(b, t, tm, p, chk, plan)
            rows[i]["host_rejudged"] = {**old, "re_timed": True}
            self.log(row_log_line(rows[i], self.cfg.passes, self.elapsed())
                     + f"; re-timed: first taken at probe {pm:,.0f} us, over the run's later limit {limit:,.0f} us")

    def _record_refilter(self) -> None:
        """Every filtered host-bound pass re-selected against the run's final limit from its recorded
        batches (``refilter_host_pass``), as ``host_refilter``: on record for analysis, not used in the
        figure. A pass filtered against an early, slow baseline keeps batches the final limit would set
        aside (304635d966, 1 token), and this shows what it would read without them."""
        limit = self.host_slow_above()
        if limit is None:
            return
        for r in self.results["rows"]:
            got = refilter_host_pass(r, limit)
            if got is not None:
                r["host_refilter"] = {**got, "limit_us": round(limit, 1)}

    def _settle(self) -> None:
        if self.dev.type == "cuda" and self.cfg.settle_s > 0:
            torch.cuda.synchronize()
            time.sleep(self.cfg.settle_s)

    def _sets(self, b: BenchBackend, t: int) -> list[MoEInputs]:
        return [self.inputs(t, k) for k in range(self.cfg.rotate if b.rotatable else 1)]

    def section_drift(self) -> None:
        """Each backend's first case (smallest token count) timed again now, against its first pass."""
        rows = {(r["backend"], r["tokens"]): r for r in self.results["rows"] if r["pass"] == 0}
        for b in self.backends:
            ts = [t for t in self.cfg.tokens if (b.name, t) in rows]
            if not ts:
                continue
            t = ts[0]
            try:
                tm = self._time(b, t, self._sets(b, t))
                start = rows[(b.name, t)]["median_us"]
                change = tm.median_us / start - 1 if start > 0 else float("nan")
                self.results["drift"].append({
                    "backend": b.name, "tokens": t, "start_us": start, "end_us": tm.median_us, "change": change,
                    "end_spread": tm.spread, "method": tm.method, "flag": bool(abs(change) >= self.cfg.repeat_limit)})
            except Exception as exc:  # noqa: BLE001
                self.error(f"drift {b.name} T={t}", exc)

    def _fill_from_first_pass(self) -> None:
        first = {(r["backend"], r["tokens"]): r for r in self.results["rows"] if r["pass"] == 0}
        for r in self.results["rows"]:
            if r["pass"] and (r["backend"], r["tokens"]) in first:
                f = first[(r["backend"], r["tokens"])]
                for k in ("block_m", "plan", "checked", "calc_diff", "nan", "correct", "note"):
                    if k in f:
                        r.setdefault(k, f[k])
                if r.get("block_m") is None:
                    r["block_m"] = f.get("block_m")

    def section_block_m(self) -> None:
        toks = self.cfg.block_m_tokens or self.cfg.tokens
        forced: list[tuple[BenchBackend, int]] = []
        for b in self.backends:
            if not b.fused:
                continue
            for bm in b.legal_block_ms():
                try:
                    forced.append((b.with_block_m(bm), bm))
                except Exception as exc:  # noqa: BLE001
                    self.error(f"block_m {b.name} force {bm}", exc)
        if not forced:
            self.results["skipped"]["section block_m"] = "no backend can force BLOCK_M"
            return
        prog = _Progress(self.cfg.progress, len(forced) * len(toks))
        try:
            for fb, bm in forced:
                for t in toks:
                    prog.step(f"BLOCK_M {bm} {fb.name} T={t}")
                    if not self.time_left():
                        self.results["skipped"][f"block_m {fb.name} {bm} T={t}"] = "deadline"
                        continue
                    try:
                        chk = self.check(fb, t)
                        tm = self._time(fb, t, [self.inputs(t)], study=True)
                        fl = step_floor(self.g, self.inputs(t).topk_idx, self.ceilings, fb.weight_format)
                        self.results["block_m"].append({"backend": fb.name, "tokens": t, "forced_block_m": bm,
                                                        "median_us": tm.median_us, "spread": tm.spread,
                                                        "floor_us": fl.floor_us, "plan": fb.plan(t), **chk})
                    except Exception as exc:  # noqa: BLE001
                        self.error(f"block_m {fb.name} bm={bm} T={t}", exc)
        finally:
            prog.stop()
            for fb, _ in forced:
                try:
                    fb.close()
                except Exception:  # noqa: BLE001
                    pass
        self.results["block_m_best"] = best_block_m(self.results["block_m"], self.results["rows"])

    def section_ragged(self) -> None:
        """One GPU stands in for each rank in turn: rank r's launch at its own count c_r (its own plan)
        against the same rows padded with -1 routes to the agreed count A (the plan every rank shares).
        The step time of a real EP launch is bounded below by its slowest rank."""
        try:
            from ..layouts.plans import agreed_token_count
        except ImportError:
            agreed_token_count = None
        for b in self.backends:
            if not b.fused:
                continue
            for mean in self.cfg.ragged_means:
                counts = ragged_counts(mean, max(self.cfg.tokens))
                if agreed_token_count is not None:
                    try:
                        agreed = int(agreed_token_count(counts))
                    except TypeError:
                        agreed = int(agreed_token_count(counts, self.g))
                else:
                    agreed = max(counts)
                agreed = min(agreed, max(self.cfg.tokens))
                ranks = []
                for r, c in enumerate(counts):
                    try:
                        own_in = make_inputs(self.g, c, seed=9000 + r, device=self.dev)
                        pad_in = pad_inputs(own_in, agreed)
                        own = self._time(b, c, [own_in], study=True)
                        pad = self._time(b, agreed, [pad_in], study=True)
                        ranks.append({"rank": r, "tokens": c, "own_us": own.median_us, "padded_us": pad.median_us,
                                      "own_block_m": block_m_of(b.plan(c)), "agreed_block_m": block_m_of(b.plan(agreed))})
                    except Exception as exc:  # noqa: BLE001
                        self.error(f"ragged {b.name} mean={mean} rank={r}", exc)
                if ranks:
                    self.results["ragged"].append({
                        "backend": b.name, "mean_tokens": mean, "counts": counts, "agreed": agreed, "ranks": ranks,
                        "step_own_us": max(x["own_us"] for x in ranks), "step_padded_us": max(x["padded_us"] for x in ranks),
                        "padding_cost": max(x["padded_us"] for x in ranks) / max(x["own_us"] for x in ranks) - 1,
                    })

    def section_staging(self) -> None:
        from ..layouts.staging import per_token_cast_to_fp8

        kern = {(r["backend"], r["tokens"]): r["median_us"] for r in self.results["rows"] if r["pass"] == 0}
        try:
            from deep_gemm.utils.math import per_token_cast_to_fp8 as _dg_cast  # type: ignore[import-not-found]
        except Exception:  # noqa: BLE001
            _dg_cast = None
        dg_cast = None if _dg_cast is None else (lambda x: _dg_cast(x, use_ue8m0=False))  # SM90: FP32 scales
        for t in self.cfg.tokens:
            x = [self.inputs(t, k).x for k in range(self.cfg.rotate)]
            cases: list[tuple[str, Callable, list | None, str | None]] = [
                ("megamoe per_token_cast_to_fp8", per_token_cast_to_fp8, x, None)]
            if dg_cast is not None:
                cases.append(("deep_gemm per_token_cast_to_fp8", dg_cast, x, None))
            for b in self.backends:
                for label, sf in b.stage_parts(self.inputs(t)).items():
                    cases.append((f"{b.name}: {label}", sf, None, b.name))
            for what, fn, args, bname in cases:
                try:
                    tm = time_fn(fn, args=args, warmup=self.cfg.warmup, repeats=self.cfg.repeats, flush_l2=args is None and self.cfg.flush_l2, device=self.dev)
                    row = {"what": what, "tokens": t, "median_us": tm.median_us, "spread": tm.spread}
                    for (kb, kt), us in kern.items():
                        if kt == t and (bname is None or kb == bname) and not kb.startswith("reference"):
                            row[f"frac_of {kb}"] = tm.median_us / us
                    self.results["staging"].append(row)
                except Exception as exc:  # noqa: BLE001
                    self.error(f"staging {what} T={t}", exc)

    def section_overhead(self) -> None:
        """The harness against a bare loop over the same calls: the row's own input set(s), in the same
        order, by the row's own path (graph replays for capturable backends, launches otherwise)."""
        for b in self.backends:
            if b.name.startswith("reference"):
                continue
            for t in self.cfg.overhead_tokens:
                if t not in self.cfg.tokens and t > max(self.cfg.tokens):
                    continue
                try:
                    path = select_timing(b, self.dev.type, self.cfg.graph_capturable)
                    fn, args = b.timer(self._sets(b, t))
                    if path == "cuda-graph":
                        gs = GraphSet(fn, args, warmup=self.cfg.warmup)
                        fn, args = gs.replay, list(range(gs.sets))
                    cuda = self.dev.type == "cuda"
                    oc = overhead_check(fn, args=args, device=self.dev, rounds=self.cfg.overhead_rounds,
                                        settle_s=self.cfg.settle_s if cuda else 0.0,
                                        min_warmup_s=self.cfg.device_min_warmup_s if cuda else 0.0)
                    self.results["overhead"].append({"backend": b.name, "tokens": t, "path": path, **oc})
                except Exception as exc:  # noqa: BLE001
                    self.error(f"overhead {b.name} T={t}", exc)

    # --- output -----------------------------------------------------------------------------
    def write(self, final: bool = False) -> None:
        if not self.out_dir:
            return
        from .report import write_all

        try:
            write_all(self.results, self.out_dir, plots=final)
        except Exception as exc:  # noqa: BLE001
            self.log(f"[bench] writing results failed: {exc}\n{traceback.format_exc()}")


# ------------------------------------------------------------------------------------ derived tables
def row_log_line(row: dict, passes: int, elapsed_s: float) -> str:
    """One log line per timed row: what was timed, its median and, for host-bound rows, the host's
    speed (probe median, batches set aside, retakes), so a cut or slow run's log says where time went."""
    line = (f"[bench] {elapsed_s:6.1f} s  pass {row['pass'] + 1}/{passes} {row['backend']} T={row['tokens']}: "
            f"{row['median_us']:,.1f} us ({row['repeats']} calls, {row.get('path', row.get('method'))})")
    if row.get("host_probe_median_us") is not None:
        line += (f"; host probe {row['host_probe_median_us']:,.0f} us (best {row.get('host_probe_best_us', '-')}), "
                 f"{row.get('host_batches_aside', 0)} batches aside, {len(row.get('host_retaken') or [])} retakes"
                 + (", host_slow" if row.get("host_slow") else "")
                 + (", not clean" if row.get("host_clean") is False else "")
                 + (", short" if row.get("host_short") else "")
                 + (", budget spent" if row.get("host_budget_spent") else ""))
    return line


def repeatability(rows: list[dict], limit: float = 0.03) -> list[dict]:
    """Per (backend, tokens): the medians of each pass (in pass order), their spread (max - min) / min,
    and ``flag`` when the spread reaches ``limit``."""
    by: dict = {}
    for r in rows:
        by.setdefault((r["backend"], r["tokens"]), []).append((r["pass"], r["median_us"]))
    out = []
    for (b, t), pm in by.items():
        meds = [m for _, m in sorted(pm, key=lambda x: x[0])]
        if len(meds) >= 2:
            spread = pass_spread(meds)
            out.append({"backend": b, "tokens": t, "medians_us": meds, "spread": spread,
                        "flag": bool(not spread < limit)})
    return out


def select_timing(b: BenchBackend, device_type: str, use_graphs: bool = True) -> str:
    """The path a case is timed by: "perf_counter" without CUDA; "cuda-graph" for a backend that
    promises ``graph_capturable`` (when ``use_graphs``); otherwise "cuda-events"."""
    if device_type != "cuda":
        return "perf_counter"
    if use_graphs and getattr(b, "graph_capturable", False) is True:
        return "cuda-graph"
    return "cuda-events"


def host_quiet(dev) -> None:
    """Before a host-bound case (outside any timing): collect garbage, and return the caching allocator's
    unused blocks, so the warm-up allocates what the timed calls reuse instead of a timed call finding the
    cache full of other cases' blocks (an allocation retry frees the whole cache and syncs the device)."""
    gc.collect()
    if torch.device(dev).type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def pin_timing_thread() -> dict:
    """Pin the calling thread (Linux: ``sched_setaffinity(0)`` is per thread) to the last CPU it may run
    on (CPU 0 usually takes the most interrupts), so a host-bound row is not migrated between cores in
    the middle of a pass. Threads already running (NCCL, the driver's) keep their masks; threads started
    later by this one inherit it. Returns {"cpu", "previous"} for ``restore_affinity`` ({} where the
    platform cannot pin)."""
    if not hasattr(os, "sched_setaffinity"):
        return {}
    try:
        prev = sorted(os.sched_getaffinity(0))
        cpu = prev[-1]
        os.sched_setaffinity(0, {cpu})
    except OSError:
        return {}
    return {"cpu": cpu, "previous": prev}


def restore_affinity(pinned: dict) -> None:
    if pinned.get("previous"):
        try:
            os.sched_setaffinity(0, set(pinned["previous"]))
        except OSError:
            pass


def gpu_state(dev) -> str:
    """SM / memory clock, power, P-state and throttle reasons from nvidia-smi ('' when unavailable or on
    CPU): recorded around every CUDA row, so a row whose passes disagree shows whether the card changed
    state between them."""
    if torch.device(dev).type != "cuda":
        return ""
    try:
        idx = torch.device(dev).index
        idx = torch.cuda.current_device() if idx is None else idx
        out = subprocess.run(["nvidia-smi", "-i", str(idx), "--query-gpu=clocks.sm,clocks.mem,power.draw,pstate,"
                              "clocks_event_reasons.active", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=5)
        return out.stdout.strip()
    except Exception:  # noqa: BLE001 - diagnostics only
        return ""


def thread_report() -> dict:
    """What runs beside the sweep: Python threads by name, native threads of the process, torch's pools."""
    d = {"python_threads": sorted(t.name for t in threading.enumerate()),
         "torch_intraop_threads": torch.get_num_threads()}
    try:
        d["native_threads"] = len(os.listdir("/proc/self/task"))
    except OSError:
        pass
    return d


def timing_protocol(cfg: SweepConfig, host_speed_check: bool) -> dict:
    """The protocol of this run, for the results' metadata (see the module docstring)."""
    return {
        "repeat_mode": cfg.repeat_mode,
        "repeat": ("each case timed `passes` times back to back (A then B), each with its own warm-up; "
                   "a drift section re-times each backend's first case after the sweep"
                   if cfg.repeat_mode == "interleaved" else
                   "`passes` whole sweeps back to back; each row compared with itself one sweep later"),
        "repeat_limit": cfg.repeat_limit,
        "statistic": "median of the timed calls; spread = (p90 - p10) / median; every sample kept",
        "paths": {"cuda-graph": "backends with graph_capturable = True: launch() replayed from a CUDA graph "
                                "captured after build, staging done once before capture (not in the figure)",
                  "cuda-events": "one event pair per call, L2 flushed between calls or inputs rotated",
                  "perf_counter": "no CUDA device: host wall time"},
        "device_bound": {"min_warmup_s": cfg.device_min_warmup_s, "min_time_s": cfg.device_min_time_s,
                         "study_min_time_s": cfg.study_min_time_s,
                         "max_repeats": cfg.device_max_repeats,
                         "spin": "a spin kernel queued before each batch of 10 calls: 200 us per call until a batch "
                                 "shows device time above twice the host's enqueue time, then 3 enqueue times + 50 us",
                         "overhead_rounds": cfg.overhead_rounds},
        "host_bound": {"gc": "disabled during every timing", "before_case": "gc.collect() + torch.cuda.empty_cache()",
                       "warmup": f"at least one call per input set and {cfg.host_min_warmup_s} s",
                       "min_time_s": cfg.host_min_time_s,
                       "pinned": "the timing thread pinned to one CPU after the builds" if cfg.pin_cpu else "no",
                       "max_repeats": cfg.host_max_repeats, "repeats": "whole rotations of the input sets",
                       "host_speed": (f"timing.host_speed_probe_us twice after every timed batch; a pass whose probe median "
                                      f"is {100 * cfg.host_slow_limit:.0f}% or more over the run's fastest is retaken, "
                                      f"at most {cfg.host_retakes} times, each after waiting up to {cfg.host_recover_s} s for "
                                      f"{cfg.host_recover_window_s} s of probes at the usual speed, with one warm-up call "
                                      f"per input set (retaken passes kept in the row, host_retaken; still slow: host_slow)"
                                      + (f"; within a pass, every batch (whole rotations) with a probe on either side over "
                                         f"that limit is set aside and the pass times on, for at most {cfg.host_max_time_s} s, "
                                         f"until its kept batches hold the repeats and min_time_s (too few: every sample, "
                                         f"host_clean false; out of time short of min_time_s: host_short, retaken like a "
                                         f"slow pass)" if cfg.host_batch_filter else "")
                                      + (f"; all of this (retakes, waits, calls set aside) spends at most "
                                         f"{cfg.host_extra_budget_s:g} s of the run (host_extra_budget_s), then passes are "
                                         f"kept as first timed" if host_speed_check else "")
                                      if host_speed_check else "not checked")},
        "progress": "redrawn between cases only (no refresh thread)",
        "overhead": "harness mean vs bare-loop mean over one fixed call sequence (the row's input sets, in "
                    "order), ABBA rounds; rotation-induced variation reported as per_set_median_us",
    }


def speedups(rows: list[dict]) -> list[dict]:
    """Per token count and fused backend: unfused time / fused time (first pass)."""
    first = [r for r in rows if r["pass"] == 0]
    out = []
    for t in sorted({r["tokens"] for r in first}):
        at = [r for r in first if r["tokens"] == t]
        unfused = [r for r in at if not r["fused"] and not r["backend"].startswith("reference")]
        ref = [r for r in at if r["backend"].startswith("reference")]
        for f in (r for r in at if r["fused"]):
            row = {"tokens": t, "fused": f["backend"], "fused_us": f["median_us"]}
            if unfused:
                row.update(unfused=unfused[0]["backend"], unfused_us=unfused[0]["median_us"],
                           speedup=unfused[0]["median_us"] / f["median_us"])
            if ref:
                row.update(speedup_vs_reference=ref[0]["median_us"] / f["median_us"])
            out.append(row)
    return out


def best_block_m(study: list[dict], rows: list[dict]) -> list[dict]:
    """Per (backend, tokens): the fastest forced BLOCK_M, against the plan's own choice. A token count
    where some BLOCK_M the backend was forced to elsewhere was not timed (a deadline, an error) has no
    best: ``missing`` lists those BLOCK_Ms, and ``best_block_m`` / ``plan_over_best`` are None (the best
    of an incomplete set would be a false comparison)."""
    plan = {(r["backend"], r["tokens"]): r for r in rows if r["pass"] == 0}
    by: dict = {}
    forced: dict = {}
    for s in study:
        by.setdefault((s["backend"], s["tokens"]), []).append(s)
        forced.setdefault(s["backend"], set()).add(s["forced_block_m"])
    out = []
    for (b, t), ss in sorted(by.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        missing = sorted(forced[b] - {s["forced_block_m"] for s in ss})
        best = None if missing else min(ss, key=lambda s: s["median_us"])
        p = plan.get((b, t))
        out.append({"backend": b, "tokens": t, "best_block_m": best and best["forced_block_m"],
                    "best_us": best and best["median_us"], "missing": missing,
                    "plan_block_m": p and p.get("block_m"), "plan_us": p and p["median_us"],
                    "plan_over_best": (p["median_us"] / best["median_us"]) if (p and best) else None,
                    "times_us": {s["forced_block_m"]: s["median_us"] for s in ss}})
    return out


def ragged_counts(mean: int, cap: int, ranks: int = 4) -> list[int]:
    """A ragged step of ``ranks`` ranks around ``mean`` tokens: (0.25, 0.75, 1.25, 1.75) x mean, capped."""
    fr = [0.25 + 1.5 * r / max(1, ranks - 1) for r in range(ranks)]
    return [max(1, min(cap, round(mean * f))) for f in fr]


def pad_inputs(inp: MoEInputs, num_tokens: int) -> MoEInputs:
    """Pad a step to ``num_tokens`` rows with every slot routed to -1 (rows the kernel must skip)."""
    t = inp.num_tokens
    if num_tokens < t:
        raise ValueError(f"cannot pad {t} tokens down to {num_tokens}")
    n = num_tokens - t
    gen = torch.Generator().manual_seed(num_tokens)  # padding rows are skipped, but never time on zeros
    pad_x = torch.randn(n, inp.x.shape[1], generator=gen).to(device=inp.x.device, dtype=inp.x.dtype)
    x = torch.cat([inp.x, pad_x])
    idx = torch.cat([inp.topk_idx, torch.full((n, inp.topk_idx.shape[1]), -1, dtype=inp.topk_idx.dtype, device=inp.x.device)])
    w = torch.cat([inp.topk_weights, torch.zeros(n, inp.topk_weights.shape[1], dtype=inp.topk_weights.dtype, device=inp.x.device)])
    return MoEInputs(x, idx, w)


def run_sweep(cfg: SweepConfig, log: Callable[[str], None] = print) -> dict:
    return Sweep(cfg, log).run()

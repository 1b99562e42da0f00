"""``megamoe bench``: every backend at every token count at one geometry, against ceilings measured in the run.

Sections, each in its own try/except, the results written after each (a failure or a timeout leaves the rest):

    ceilings   copy bandwidth, FP8 and bf16 matmul rates; the read ceiling (a plain read of N bytes) per size
    setup      weights, backends (each gets ``cls.synthetic_weights(w)``), every JIT plan built first
               (megamoe.fused.build), the read ceiling of every row's bytes
    sweep      every case checked (calc_diff against the backend's own recipe, on cloned inputs), then timed:
               device-bound rows ``passes`` times back to back (each pass with its own warm-up), host-bound rows
               once, last; the kineto clock beside every device-bound row's first pass on CUDA
    studies    overhead, staging, block_m, ragged (megamoe.bench.studies), in that order

How a case is timed (``select_timing``; ``path`` in the row, ``method`` the clock that produced it):

    cuda-graph    backends that promise ``graph_capturable``: launch() replayed from a CUDA graph captured after
                  build, staging done once before capture (not in the figure). A failed capture falls back to
                  events and says so (``graph_error``).
    cuda-events   one event pair per call, the L2 flushed between calls (fused) or the input sets rotated;
    perf_counter  no CUDA device: host wall time per call.

Device-bound rows: warm-up of at least ``warmup_ms`` of device time, then samples for at least ``rep_ms`` (on
the H200 under load the card sits at its power cap and the kernels slow by 5-15% for ~0.25 s once a second;
a 1 s pass covers that cycle, docs/measurement.md), the median reported; the repeatability bar (passes within
3%) applies to them. Host-bound rows (the eager reference, a peer whose launch syncs the host): GC off, the
allocator's cache emptied first, one warm-up call per input set, then whole rotations of the input sets for
``rep_ms``; reported as mean +- standard error, one pass, never retaken (their figure is 100x the kernels' and
moves with the host's CPU, which no repeatability bar can fix).
"""

from __future__ import annotations

import time
import traceback
from dataclasses import asdict, dataclass, field, fields
from typing import Callable, Sequence

import torch

from ..geometry import get_geometry
from ..inputs import MoEInputs, make_inputs, ragged_counts
from ..progress import Progress
from ..provenance import imported_kernel_modules
from ..testing import calc_diff
from ..weights import random_mxfp4_weights
from .backends import BenchBackend, make_backends, select_timing
from .ceilings import Ceilings, ReadCeiling, device_name, measure_ceilings
from ..provenance import gpu_state, new_results_dir, run_metadata, versions
from .report import ceilings_text, write_all
from .roofline import achieved, step_floor
from .tables import check_appendable, derive, load_results, merge_results
from .timing import Timing, host_quiet, resolve_device, time_fn, time_graph

DEFAULT_TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
STUDIES = ("overhead", "staging", "block_m", "ragged")  # in the order they run: cheap and essential first


@dataclass
class SweepConfig:
    preset: str = "small"
    tokens: list[int] = field(default_factory=lambda: [1, 16, 128])  # tokens per rank
    backends: list[str] | None = None  # None: every registered backend that runs here, and "reference"
    device: str | None = None
    seed: int = 0
    passes: int = 2  # device-bound rows: timed passes per case, back to back (repeatability)
    warmup_ms: float = 100.0  # CUDA, device-bound rows: at least this much device time of warm-up
    rep_ms: float = 1000.0  # CUDA, device-bound rows: samples for at least this long; host-bound rows: their budget
    study_rep_ms: float = 500.0  # the BLOCK_M and ragged studies' device-bound cases
    flush_l2: bool = True
    graph: bool = False  # also time CUDA-graph replays of backends that make no graph promise
    studies: tuple[str, ...] = STUDIES
    ref_max_tokens: int = 8192  # the reference rows are timed up to this many tokens
    repeats: int = 20  # device-bound rows: at least this many calls
    warmup: int = 5  # ... after at least this many warm-up calls
    max_repeats: int = 2000
    rotate: int = 4  # input sets cycled through for rotatable (callable) backends
    host_max_calls: int = 256
    check: bool = True
    max_diff: float = 1e-3
    kineto_calls: int = 10  # CUDA: the second clock beside each device-bound row's first pass (0: off)
    read_ceiling: bool = True
    repeat_mode: str = "interleaved"  # "interleaved": a case's passes back to back; "sweeps": whole sweeps
    repeat_limit: float = 0.03
    drift_check: bool = True  # interleaved: each backend's first case timed again after the sweep
    graph_capturable: bool = True  # time backends that promise graph_capturable by graph replays
    settle_s: float = 2.0  # CUDA: idle seconds before each timed phase
    block_m_tokens: list[int] | None = None
    ragged_means: list[int] = field(default_factory=lambda: [16, 256, 2048])
    overhead_tokens: list[int] = field(default_factory=lambda: [128, 8192])
    overhead_rounds: int = 16
    deadline_s: float | None = None  # studies and sweep cases not begun by then are skipped
    out_dir: str | None = None  # parent folder: results go to a new <date>_<card>_<commit> under it
    append_dir: str | None = None  # an earlier process's results folder: this process's rows are added to it
    build_threads: int = 8
    progress: bool = True
    weights: object | None = None  # pre-made weights (tests); None: random MXFP4 at the geometry
    extra_backends: list = field(default_factory=list)  # BenchBackend objects timed too
    ceilings: Ceilings | None = None  # pre-measured (tests); None: measured in this run

    def device_pass(self, repeats: int, study: bool = False) -> dict:
        """``time_fn`` keywords of a device-bound pass on CUDA (the pytest suites time with the same)."""
        return dict(min_warmup_s=self.warmup_ms / 1e3, min_time_s=(self.study_rep_ms if study else self.rep_ms) / 1e3,
                    max_repeats=max(repeats, self.max_repeats))


class Sweep:
    """Runs the sections of one ``megamoe bench`` call; ``results`` is the JSON document."""

    def __init__(self, cfg: SweepConfig, log: Callable[[str], None] = print):
        self.cfg, self.log = cfg, log
        self.g = get_geometry(cfg.preset)
        self.dev = resolve_device(cfg.device)
        self.t0 = time.perf_counter()
        self.meta = run_metadata(self.dev)
        self.prev = load_results(cfg.append_dir) if cfg.append_dir else None
        if self.prev is not None:
            check_appendable(self.prev, cfg, self.meta)
        self.meta["process"] = 1 if self.prev is None else len(self.prev.get("processes") or [0]) + 1
        self.meta.update(geometry=asdict(self.g), config={f.name: getattr(cfg, f.name) for f in fields(cfg)
                                                           if f.name not in ("weights", "extra_backends", "ceilings")})
        self.meta["config"]["tokens"] = sorted(cfg.tokens)
        self.results: dict = {"meta": self.meta, "ceilings": None, "rows": [], "drift": [], "block_m": [],
                              "ragged": [], "staging": [], "overhead": [], "errors": [], "skipped": {},
                              "section_seconds": {}}
        self.meta["section_seconds"] = self.results["section_seconds"]  # kept per process when appended
        self.backends: list[BenchBackend] = []
        self.out_dir: str | None = None
        self.read: ReadCeiling | None = None
        self.ceilings = cfg.ceilings
        self._inputs, self._refs = {}, {}

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
        """Input set k at t tokens: fresh random (a seed per (t, k)), the same in every pass."""
        if (t, k) not in self._inputs:
            self._inputs[(t, k)] = make_inputs(self.g, t, seed=self.cfg.seed * 1_000_003 + t * 101 + k, device=self.dev)
        return self._inputs[(t, k)]

    def sets(self, b: BenchBackend, t: int) -> list[MoEInputs]:
        return [self.inputs(t, k) for k in range(self.cfg.rotate if b.rotatable else 1)]

    def settle(self) -> None:
        if self.dev.type == "cuda" and self.cfg.settle_s > 0:
            torch.cuda.synchronize()
            time.sleep(self.cfg.settle_s)

    def sync(self) -> None:
        if self.dev.type == "cuda":
            torch.cuda.synchronize()

    def studied(self, study: str, backend: str) -> bool:
        """Append mode: whether an earlier process already ran ``study`` for ``backend`` (not run twice)."""
        return self.prev is not None and any(e.get("backend") == backend for e in self.prev.get(study, []))

    def time_case(self, b: BenchBackend, t: int, sets: Sequence[MoEInputs], study: bool = False) -> Timing:
        """One pass of one case by the path ``select_timing`` picks (``extra['path']``)."""
        cfg, cuda = self.cfg, self.dev.type == "cuda"
        path = select_timing(b, self.dev.type, cfg.graph_capturable)
        fn, args = b.timer(sets)
        flush = cfg.flush_l2 and args is None
        device_kw = cfg.device_pass(cfg.repeats, study) if cuda else {}
        before, tm, graph_error = gpu_state(self.dev), None, None
        if b.host_bound and path != "cuda-graph":
            host_quiet(self.dev)
            tm = time_fn(fn, args=args, warmup=1, repeats=1, flush_l2=flush, device=self.dev,
                         min_time_s=cfg.rep_ms / 1e3, max_repeats=cfg.host_max_calls)
        elif path == "cuda-graph":
            try:
                tm = time_graph(fn, args=args, warmup=cfg.warmup, repeats=cfg.repeats, flush_l2=flush, device=self.dev,
                                **{k: v for k, v in device_kw.items() if k != "min_warmup_s"})
                tm.extra["staging"] = "outside the figure: staged once before capture"
            except Exception as exc:  # noqa: BLE001 - a broken promise keeps an event figure, labelled
                graph_error = f"{type(exc).__name__}: {exc}"
                self.sync()
                fn, args = b.timer(sets)  # re-stage: a failed capture may have left the stream dirty
        if tm is None:
            tm = time_fn(fn, args=args, warmup=cfg.warmup, repeats=cfg.repeats, flush_l2=flush, device=self.dev,
                         **device_kw)
        if cuda:
            tm.extra.update(gpu_before=before, gpu_after=gpu_state(self.dev))
        tm.extra.update(path=path if graph_error is None else "cuda-events (graph capture failed)",
                        host_bound=bool(b.host_bound and path != "cuda-graph"))
        if graph_error is not None:
            tm.extra["graph_error"] = graph_error
        if cfg.graph and cuda and path == "cuda-events" and not b.host_bound:
            try:  # the optional extra figure for a backend that made no promise: 20 calls back to back per replay
                gt = time_graph(fn, args=args, repeats=10, calls_per_graph=20, device=self.dev)
                tm.extra.update(graph_us=gt.median_us, graph_spread=gt.spread)
            except Exception as exc:  # noqa: BLE001 - a kernel that cannot be captured keeps its event time
                tm.extra["graph_try_error"] = f"{type(exc).__name__}: {exc}"
                self.sync()
        return tm

    def check(self, b: BenchBackend, t: int) -> dict:
        """calc_diff of the backend's output against its own recipe's reference, on cloned inputs."""
        if not self.cfg.check:
            return {"checked": False}
        if b.name.startswith("reference"):
            return {"checked": False, "note": "is the reference"}
        inp = self.inputs(t)
        y = b.run(inp.clone()).float()
        self.sync()
        # Above 256 tokens, 256 of them (a token's reference rows do not depend on the others): minutes saved.
        sel = torch.randperm(t, generator=torch.Generator().manual_seed(t))[:256].sort().values.to(inp.x.device)
        key = (b.reference_key(t), t)
        if key not in self._refs:
            sub = inp if t <= 256 else inp.select(sel)
            ref = b.reference(sub.clone(), self.weights)
            self._refs[key] = None if ref is None else ref.float()
        if self._refs[key] is None:
            return {"checked": False, "note": "backend names no reference"}
        y = y if t <= 256 else y[sel]
        d, nan = calc_diff(y, self._refs[key]), bool(torch.isnan(y).any())
        return {"checked": True, "calc_diff": d, "nan": nan, "correct": (not nan) and d <= self.cfg.max_diff}

    def floor_kw(self, b: BenchBackend, t: int) -> dict:
        idx = self.inputs(t).topk_idx
        fl = step_floor(self.g, idx, self.ceilings, b.weight_format, read=self.read)
        return {"floor_mxfp4_us": step_floor(self.g, idx, self.ceilings, "mxfp4").floor_us,
                "experts_touched": fl.experts_touched, "routed_rows": fl.routed_rows, "bytes": fl.bytes,
                "flops": fl.flops, "_floor": fl}

    def row(self, b: BenchBackend, t: int, tm: Timing, pass_idx: int, chk: dict, plan: dict) -> dict:
        fk = self.floor_kw(b, t)
        host = tm.extra.get("host_bound", False)
        us = tm.mean_us if host else tm.median_us
        return {"backend": b.name, "process": self.meta["process"], "fused": b.fused, "tokens": t, "pass": pass_idx,
                "block_m": plan.get("block_m"), "us": us, "statistic": "mean" if host else "median",
                "median_us": tm.median_us, "mean_us": tm.mean_us, "stderr_us": tm.stderr_us, "min_us": tm.min_us,
                "spread": tm.spread, "method": tm.method, "repeats": len(tm.samples_us), "warmup": tm.warmup,
                "flushed": tm.flushed, "rotated": tm.rotated, "per_set_median_us": tm.per_set_median_us,
                "rotation_spread": tm.rotation_spread, "graph_capturable": bool(b.graph_capturable),
                **achieved(fk.pop("_floor"), us, self.ceilings), **fk, "weight_format": b.weight_format,
                **tm.extra, "samples_us": [round(x, 3) for x in tm.samples_us], "plan": plan, **chk}

    # --- the run ----------------------------------------------------------------------------
    def run(self) -> dict:
        from . import studies

        cfg = self.cfg
        if cfg.append_dir:
            self.out_dir = cfg.append_dir
        elif cfg.out_dir:
            self.out_dir = new_results_dir(cfg.out_dir, self.meta)
        self.log(f"[bench] {self.meta['card']} commit {self.meta['commit']} geometry {self.g.name}; tokens per rank "
                 f"{sorted(cfg.tokens)}" + (f"; results in {self.out_dir}" if self.out_dir else ""))
        sections = [("ceilings", self.section_ceilings), ("setup", self.section_setup), ("sweep", self.section_sweep)]
        sections += [(s, getattr(studies, s)) for s in STUDIES if s in cfg.studies]
        for name, fn in sections:
            if name in STUDIES and not self.time_left():
                self.results["skipped"][f"study {name}"] = f"deadline {cfg.deadline_s} s reached"
                continue
            t1 = time.perf_counter()
            try:
                fn(self) if name in STUDIES else fn()
            except Exception as exc:  # noqa: BLE001
                self.error(name, exc)
            self.results["section_seconds"][name] = round(time.perf_counter() - t1, 2)
            self.write(final=name in ("sweep", "block_m"))
        self.results["wall_seconds"] = self.meta["wall_seconds"] = round(self.elapsed(), 2)
        self.results["out_dir"] = self.out_dir
        self.write(final=True)
        for b in self.backends:
            try:
                b.close()
            except Exception:  # noqa: BLE001
                pass
        return self.document()

    def document(self) -> dict:
        """This process's results, merged into the earlier process's document in append mode."""
        derive(self.results, self.cfg.repeat_limit)
        return self.results if self.prev is None else merge_results(self.prev, self.results)

    def write(self, final: bool = False) -> None:
        if not self.out_dir:
            return
        try:
            write_all(self.document(), self.out_dir, plots=final)
        except Exception as exc:  # noqa: BLE001
            self.log(f"[bench] writing results failed: {exc}\n{traceback.format_exc()}")

    def section_ceilings(self) -> None:
        c = self.ceilings = self.cfg.ceilings or measure_ceilings(self.dev)
        self.read = ReadCeiling(self.dev) if self.cfg.read_ceiling else None
        self.results["ceilings"] = {**c.as_dict(), **(self.read.summary() if self.read else {"read": None})}
        self.meta["ceilings"] = self.results["ceilings"]
        self.log(f"[bench] ceilings: {ceilings_text(c.as_dict(), self.dev.type == 'cuda')}")

    def section_setup(self) -> None:
        from ..fused.build import build_plans

        cfg = self.cfg
        if self.ceilings is None:
            self.ceilings = Ceilings(device_name(self.dev), float("nan"), float("nan"), float("nan"), notes=["not measured"])
        if cfg.weights is not None:
            self.weights = cfg.weights
        else:
            big = self.g.num_experts * self.g.hidden * self.g.intermediate >= 3 * 10**7  # minutes on a CPU: a bar
            with Progress(cfg.progress and big, self.g.num_experts, "making the experts") as prog:
                self.weights = random_mxfp4_weights(self.g, seed=cfg.seed, device=self.dev,
                                                    progress=lambda e: prog.step(f"expert {e + 1}"))
        bks, skipped = make_backends(self.g, self.weights, max(cfg.tokens), cfg.backends, log=self.log)
        self.backends = [*bks, *cfg.extra_backends]
        self.results["skipped"].update({f"backend {k}": v for k, v in skipped.items()})
        self.meta.update(versions=versions(), kernel_modules=imported_kernel_modules())  # now that they are imported
        self.results["backends"] = [{"name": b.name, "fused": b.fused, "weight_format": b.weight_format,
                                     "graph_capturable": bool(b.graph_capturable), "host_bound": bool(b.host_bound),
                                     "build_lane": b.build_lane, "provenance": b.provenance()} for b in self.backends]
        toks = set(cfg.tokens) | set(cfg.block_m_tokens or [])
        if "ragged" in cfg.studies:
            toks |= {c for m in cfg.ragged_means for c in ragged_counts(m, cap=max(cfg.tokens))}
        jobs, lanes = {}, {}
        for b in self.backends:
            forced = list(b.legal_block_ms()) if ("block_m" in cfg.studies and b.fused) else []
            for bm in [None, *forced]:
                try:
                    for k, fn in b.build_jobs(sorted(toks), bm).items():
                        jobs.setdefault(k, fn)
                        lanes[k] = b.build_lane
                except Exception as exc:  # noqa: BLE001
                    self.error(f"build_jobs {b.name} BLOCK_M {bm}", exc)
        t1 = time.perf_counter()
        with Progress(cfg.progress and len(jobs) > 1, len(jobs), "building plans") as prog:
            errors = build_plans(jobs, lanes, cfg.build_threads, done=lambda k: prog.step(f"built {k[0]}"))
        for key, exc, tb in errors:
            self.results["errors"].append({"where": f"build {key}", "error": f"{type(exc).__name__}: {exc}", "traceback": tb})
        self.results["plans_built"] = len(jobs)
        self.log(f"[bench] {len(jobs)} plans built in {time.perf_counter() - t1:.1f} s ({len(errors)} failed)")
        if self.read is not None:  # the read ceiling of every row's bytes, now, not between timed rows
            for t in cfg.tokens:
                for fmt in {b.weight_format for b in self.backends}:
                    step_floor(self.g, self.inputs(t).topk_idx, self.ceilings, fmt, read=self.read)
            self.results["ceilings"].update(self.read.summary())  # every size's reads: each candidate's time

    def section_sweep(self) -> None:
        """Checks first (every case, before anything is timed), then the device-bound rows, ``passes`` each, then
        the host-bound rows once; ``settle_s`` of idle before each timed phase (a pass right after a long run
        of heavy work was measured 3-7% slower than the next)."""
        from . import studies

        cfg = self.cfg
        if cfg.repeat_mode not in ("interleaved", "sweeps"):
            raise ValueError(f"repeat_mode must be 'interleaved' or 'sweeps', got {cfg.repeat_mode!r}")
        keep = [(b, t) for t in sorted(cfg.tokens) for b in self.backends
                if not (b.name.startswith("reference") and t > cfg.ref_max_tokens) and t <= b.max_tokens]
        dev_cases = [c for c in keep if not c[0].host_bound]
        host_cases = [c for c in keep if c[0].host_bound]
        if cfg.repeat_mode == "interleaved":
            order = [(b, t, p) for b, t in dev_cases for p in range(cfg.passes)]
        else:
            order = [(b, t, p) for p in range(cfg.passes) for b, t in dev_cases]
        order += [(b, t, 0) for b, t in host_cases]
        first: dict = {}
        with Progress(cfg.progress, len(keep) + len(order), "checks") as prog:
            for b, t in keep:
                prog.step(f"check {b.name} T={t}")
                try:
                    first[(b.name, t)] = (self.check(b, t), b.plan(t))
                except Exception as exc:  # noqa: BLE001
                    self.error(f"check {b.name} T={t}", exc)
            phase, cut = None, set()
            for b, t, p in order:
                ph = (p if cfg.repeat_mode == "sweeps" else 0, b.host_bound)
                if ph != phase:
                    if phase is not None:
                        self.write()
                    self.settle()
                    phase = ph
                prog.step(f"pass {p + 1} {b.name} T={t}")
                if (b.name, t) in cut or (p == 0 and not self.time_left()):  # begun cases finish their passes
                    cut.add((b.name, t))
                    self.results["skipped"][f"{b.name} T={t}"] = f"deadline {cfg.deadline_s} s reached before the case began"
                    continue
                try:
                    tm = self.time_case(b, t, self.sets(b, t))
                    chk, plan = first.get((b.name, t), ({}, {}))
                    row = self.row(b, t, tm, p, chk, plan)
                    if p == 0 and cfg.kineto_calls and self.dev.type == "cuda" and not b.host_bound:
                        studies.second_clock(self, b, t, row)
                    self.results["rows"].append(row)
                    self.log(f"[bench] {self.elapsed():6.1f} s  pass {p + 1} {b.name} T={t}: {row['us']:,.1f} us "
                             f"({row['statistic']} of {row['repeats']} calls, {row['path']})")
                    if b.host_bound:
                        self.write()  # a host-bound row takes seconds: keep it should the run be cut
                except Exception as exc:  # noqa: BLE001
                    self.error(f"sweep {b.name} T={t} pass {p}", exc)
        if cfg.drift_check and cfg.repeat_mode == "interleaved":
            self.settle()
            studies.drift(self)


def run_sweep(cfg: SweepConfig, log: Callable[[str], None] = print) -> dict:
    return Sweep(cfg, log).run()

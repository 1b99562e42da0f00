"""CPU tests of the timing protocol of megamoe.bench (issue #5): the overhead check times the same calls
on both sides, graph-path selection for backends that promise ``graph_capturable``, GC handling, the
host-bound repeat rule, interleaved repeatability bookkeeping and the drift check, serialized JIT groups.

Most tests drive the harness with a virtual clock (``FakeClock`` replaces ``timing.time``): a timed call
advances it by a cost the test drew at random, so every figure the harness reports is known exactly and
an assertion on it can only fail for a reason in the harness."""

from __future__ import annotations

import gc
import random
import threading
import time

import pytest

from megamoe.bench import backends as bk
from megamoe.bench import sweep as sw
from megamoe.bench import timing
from megamoe.bench.ceilings import Ceilings
from megamoe.bench.sweep import Sweep, SweepConfig, repeatability, run_sweep, select_timing
from megamoe.bench.timing import Timing, bare_loop_us, gc_paused, overhead_check, round_to_sets, time_fn, time_graph
from megamoe.inputs import make_inputs

CPU_CEIL = Ceilings("cpu (test)", copy_gbps=10.0, fp8_tflops=0.5, bf16_tflops=0.5)


class FakeClock:
    """time.perf_counter / time.sleep for megamoe.bench.timing: only ``advance_us`` moves it."""

    def __init__(self):
        self.t = 1000.0

    def perf_counter(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s

    def advance_us(self, us: float) -> None:
        self.t += us * 1e-6


@pytest.fixture
def clock(monkeypatch):
    c = FakeClock()
    monkeypatch.setattr(timing, "time", c)
    return c


def _costs(n: int) -> list[float]:
    """n distinct per-set costs in us, drawn fresh: at least 2x apart end to end."""
    while True:
        c = [random.uniform(200.0, 5000.0) for _ in range(n)]
        if n == 1 or max(c) > 2 * min(c):
            return c


# ------------------------------------------------------------------------------------ overhead check
def test_overhead_check_times_the_same_calls_on_both_sides(clock):
    """Sets of really different cost (different routings): with the same call sequence on both sides
    the harness and the bare loop agree exactly, and the rotation shows up as per-set medians, not as
    overhead. (The old check timed the first set in the bare loop against a rotating harness, or could
    not take the sets at all.)"""
    n = random.randint(2, 5)
    cost = _costs(n)
    log: list[int] = []

    def fn(k):
        log.append(k)
        clock.advance_us(cost[k])

    oc = overhead_check(fn, args=list(range(n)), iters=random.randint(5, 12), rounds=4, warmup=1, device="cpu",
                        with_flushed=False)
    seq = oc["sequence"]
    assert oc["sets"] == n and len(seq) % n == 0 and seq == [i % n for i in range(len(seq))]
    # warm-up (one call per set), then 2 sides x 4 rounds, each exactly the sequence, in order
    body = log[n:]
    assert len(body) == 8 * len(seq) and all(body[j * len(seq):(j + 1) * len(seq)] == seq for j in range(8))
    mean = sum(cost[k] for k in seq) / len(seq)
    assert oc["bare_loop_us"] == pytest.approx(mean) and oc["harness_us"] == pytest.approx(mean)
    assert oc["ratio"] == pytest.approx(1.0) and oc["ok"]
    assert oc["per_set_median_us"] == pytest.approx(cost)
    assert oc["rotation_spread"] == pytest.approx((max(cost) - min(cost)) / min(cost))
    assert oc["order"] == ["bare", "harness", "harness", "bare", "harness", "bare", "bare", "harness"]  # ABBA


def test_overhead_check_catches_a_harness_that_adds_time(clock, monkeypatch):
    """The check can fail: per-call instrument cost (here 5% of the call, added inside the harness's
    per-call timing only) is what it must see."""
    c = random.uniform(500.0, 3000.0)
    real = timing._harness_once

    def slow_harness(call, seq, cuda, batch):
        return [s + 0.05 * c for s in real(call, seq, cuda, batch)]

    monkeypatch.setattr(timing, "_harness_once", slow_harness)
    oc = overhead_check(lambda: clock.advance_us(c), device="cpu", with_flushed=False)
    assert oc["ratio"] == pytest.approx(1.05) and not oc["ok"] and oc["sets"] == 1


def test_sweep_overhead_section_uses_the_rows_input_sets(tiny, clock):
    g, w = tiny
    rotate = random.randint(2, 4)
    cost = _costs(rotate)
    seen: dict[int, int] = {}

    def fn(inp):  # set k costs cost[k]: sets are numbered in the order the warm-up first calls them
        k = seen.setdefault(id(inp), len(seen))
        clock.advance_us(cost[k % rotate])

    cb = bk.CallableBackend("routed", fn)
    cfg = SweepConfig(preset="tiny", tokens=[2], backends=[], repeats=4, warmup=1, rotate=rotate, passes=1,
                      block_m_study=False, ragged=False, staging=False, overhead=True, overhead_tokens=[2],
                      device="cpu", ceilings=CPU_CEIL, progress=False, weights=w, extra_backends=[cb],
                      seed=random.randrange(1 << 20), drift_check=False, check=False)
    res = run_sweep(cfg, log=lambda s: None)
    assert res["errors"] == [], res["errors"]
    (oc,) = res["overhead"]
    assert oc["sets"] == rotate and oc["path"] == "perf_counter"
    assert oc["ratio"] == pytest.approx(1.0) and oc["ok"]
    assert sorted(oc["per_set_median_us"]) == pytest.approx(sorted(cost))
    (row,) = res["rows"]
    assert row["rotated"] == rotate and sorted(row["per_set_median_us"]) == pytest.approx(sorted(cost))
    assert row["rotation_spread"] == pytest.approx((max(cost) - min(cost)) / min(cost))


# ------------------------------------------------------------------------------------ graph path
class FakeLaunch:
    """The megamoe.fused protocol, minimal: stage / launch, no reference."""

    fused = False
    weight_format = "fp8_block"

    def __init__(self, g, num_max_tokens_per_rank, block_m=None, group=None):
        self.g, self.staged, self.launches = g, None, 0

    @classmethod
    def available(cls):
        return True, ""

    def prepare_weights(self, weights):
        pass

    def stage(self, inputs, num_tokens):
        self.staged = num_tokens

    def launch(self, num_tokens):
        self.launches += 1

    def run(self, inputs):
        return inputs.x


class FakeCapturable(FakeLaunch):
    graph_capturable = True


class FakeFusedKernel(FakeLaunch):
    fused = True


class FakeTruthy(FakeLaunch):
    graph_capturable = 1  # not the promise (True)


def test_graph_path_selection(tiny):
    g, _ = tiny
    cap = bk.FusedAdapter("peer-cap", FakeCapturable, g, 8)
    plain = bk.FusedAdapter("peer", FakeLaunch, g, 8)
    fused = bk.FusedAdapter("kernel", FakeFusedKernel, g, 8)
    truthy = bk.FusedAdapter("truthy", FakeTruthy, g, 8)
    assert cap.graph_capturable and not plain.graph_capturable and not fused.graph_capturable
    assert not truthy.graph_capturable
    assert select_timing(cap, "cuda") == "cuda-graph"
    assert select_timing(cap, "cuda", use_graphs=False) == "cuda-events"
    assert select_timing(cap, "cpu") == "perf_counter"
    assert select_timing(plain, "cuda") == "cuda-events" and select_timing(fused, "cuda") == "cuda-events"
    assert select_timing(truthy, "cuda") == "cuda-events"
    # host-bound: the unfused peer that is not capturable; a capturable one is timed by graphs instead
    assert plain.host_bound and not cap.host_bound and not fused.host_bound
    ref = bk.reference_backend(g, tiny[1])
    assert ref.host_bound and not ref.graph_capturable and select_timing(ref, "cuda") == "cuda-events"
    assert bk.CallableBackend("c", lambda i: None, graph_capturable=True).graph_capturable
    assert not bk.CallableBackend("c", lambda i: None).graph_capturable


def test_sweep_times_capturable_backends_by_graph_replays(tiny, fake_graph_registry, monkeypatch):
    g, w = tiny
    calls = []
    real_select = sw.select_timing

    def as_if_cuda(b, device_type, use_graphs=True):
        return real_select(b, "cuda", use_graphs)

    def fake_time_graph(fn, *, args=None, warmup=3, repeats=10, flush_l2=False, device=None, **kw):
        calls.append((fn, args, flush_l2))
        if fake_graph_registry["fail"]:
            raise RuntimeError("operation not permitted when stream is capturing")
        for _ in range(warmup + repeats):
            fn()
        return Timing([10.0] * repeats, "cuda-graph", warmup=warmup, flushed=flush_l2)

    monkeypatch.setattr(sw, "select_timing", as_if_cuda)
    monkeypatch.setattr(sw, "time_graph", fake_time_graph)
    cfg = SweepConfig(preset="tiny", tokens=[2, 4], backends=["peer-cap", "peer"], repeats=3, warmup=1, passes=2,
                      block_m_study=False, ragged=False, staging=False, overhead=False, check=False, device="cpu",
                      ceilings=CPU_CEIL, progress=False, weights=w, drift_check=False, seed=random.randrange(1 << 20))
    res = run_sweep(cfg, log=lambda s: None)
    assert res["errors"] == [], res["errors"]
    by = {(r["backend"], r["tokens"], r["pass"]): r for r in res["rows"]}
    for t in (2, 4):
        for p in (0, 1):
            assert by[("peer-cap", t, p)]["path"] == "cuda-graph" and by[("peer-cap", t, p)]["method"] == "cuda-graph"
            assert by[("peer-cap", t, p)]["graph_capturable"] is True and by[("peer-cap", t, p)]["host_bound"] is False
            assert by[("peer-cap", t, p)]["staging"].startswith("outside the figure")
            assert by[("peer", t, p)]["path"] == "cuda-events" and by[("peer", t, p)]["method"] == "perf_counter"
            assert by[("peer", t, p)]["host_bound"] is True
    assert len(calls) == 4 and all(a is None and fl for _, a, fl in calls)  # one staged set, L2 flushed
    # a broken promise: the capture fails, the row keeps an event figure and says why
    fake_graph_registry["fail"] = True
    res = run_sweep(cfg, log=lambda s: None)
    cap_rows = [r for r in res["rows"] if r["backend"] == "peer-cap"]
    assert cap_rows and all(r["path"] == "cuda-events (graph capture failed)" and "capturing" in r["graph_error"]
                            and r["method"] == "perf_counter" for r in cap_rows)


@pytest.fixture
def fake_graph_registry(monkeypatch):
    state = {"fail": False}
    monkeypatch.setattr(bk, "fused_registry", lambda: {"peer-cap": FakeCapturable, "peer": FakeLaunch})
    return state


def test_time_graph_on_cpu_falls_back_and_says_so():
    n = random.randint(1, 3)
    seen = []
    tm = time_graph(seen.append, args=list(range(n)), warmup=1, repeats=2 * n, device="cpu")
    assert tm.method == "perf_counter" and tm.extra["requested"] == "cuda-graph" and tm.rotated == n
    assert len(tm.samples_us) == 2 * n and tm.set_index == [j % n for j in range(2 * n)]
    assert seen[:n] == list(range(n))


# ------------------------------------------------------------------------------------ gc handling
def test_timing_disables_gc_inside_and_restores_it():
    states = []
    fn = lambda: states.append(gc.isenabled())  # noqa: E731
    assert gc.isenabled()
    tm = time_fn(fn, warmup=2, repeats=3, device="cpu")
    assert states == [False] * 5 and gc.isenabled() and tm.extra["gc_disabled"] is True
    assert tm.extra["gc_collections"] == 0
    states.clear()
    tm = time_fn(fn, warmup=1, repeats=2, device="cpu", gc_off=False)
    assert states == [True] * 3 and tm.extra["gc_disabled"] is False
    states.clear()
    bare_loop_us(fn, iters=2, warmup=1, repeats=1, device="cpu")
    overhead_check(fn, iters=2, rounds=2, warmup=1, device="cpu", with_flushed=False)
    assert states and not any(states) and gc.isenabled()
    gc.disable()  # already off: stays off after
    try:
        time_fn(fn, warmup=1, repeats=1, device="cpu")
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_gc_paused_counts_collections_and_survives_errors():
    with pytest.raises(RuntimeError):
        with gc_paused(True):
            raise RuntimeError("boom")
    assert gc.isenabled()
    with gc_paused(True) as info:
        gc.collect()  # an explicit collection still runs and is counted
    assert info["collections"] >= 1 and info["gc_disabled"]


# ------------------------------------------------------------------------------------ host-bound repeats
def test_min_time_extends_repeats_in_whole_rotations(clock):
    n = random.randint(2, 4)
    c = random.uniform(50_000.0, 150_000.0)  # a slow host-bound call, in us
    fn = lambda k: clock.advance_us(c)  # noqa: E731
    tm = time_fn(fn, args=list(range(n)), warmup=1, repeats=3, device="cpu", min_time_s=1.0, max_repeats=1000)
    r = len(tm.samples_us)
    assert r % n == 0 and r * c * 1e-6 >= 1.0 and (r - round_to_sets(10, n)) * c * 1e-6 < 1.0
    assert tm.warmup == n  # at least one warm-up call per input set
    capped = time_fn(fn, args=list(range(n)), warmup=1, repeats=3, device="cpu", min_time_s=100.0, max_repeats=2 * n)
    assert len(capped.samples_us) == 2 * n
    plain = time_fn(fn, args=list(range(n)), warmup=1, repeats=3, device="cpu")
    assert len(plain.samples_us) == round_to_sets(3, n)


@pytest.mark.parametrize("filtered", [False, True])
def test_min_time_of_a_host_bound_pass_stops_within_a_rotation(clock, filtered):
    """With a probe (host-bound), the pass grows by the rotations the remaining time needs, not by whole
    batches: a 200 ms call must not time 3x min_time_s (run 0f79c20d8f timed 16 calls for a 1 s minimum)."""
    n = random.randint(2, 4)
    c = random.uniform(120_000.0, 300_000.0)
    min_time = random.uniform(0.8, 2.0)
    fn = lambda k: clock.advance_us(c)  # noqa: E731
    probe = lambda: 1000.0 + random.random()  # noqa: E731 - a host at its usual speed throughout
    kw = dict(probe_slow_above=2000.0, max_time_s=60.0) if filtered else {}
    tm = time_fn(fn, args=list(range(n)), warmup=1, repeats=3, device="cpu", min_time_s=min_time,
                 max_repeats=1000, probe=probe, **kw)
    r = len(tm.samples_us)
    assert r % n == 0 and r * c * 1e-6 >= min_time  # the minimum is met, in whole rotations ...
    assert (r - n) * c * 1e-6 < min_time  # ... and one rotation fewer would not have met it
    assert len(tm.extra["host_probe_us"]) >= 2
    # a cheap call still grows by at most one batch at a time and meets the minimum the same way
    fast = random.uniform(2_000.0, 9_000.0)
    tm2 = time_fn(lambda k: clock.advance_us(fast), args=list(range(n)), warmup=1, repeats=3, device="cpu",
                  min_time_s=min_time, max_repeats=100_000, probe=probe, **kw)
    r2 = len(tm2.samples_us)
    assert r2 % n == 0 and r2 * fast * 1e-6 >= min_time and (r2 - n) * fast * 1e-6 < min_time


def test_per_set_medians_and_rotation_spread():
    tm = Timing([1.0, 10.0, 2.0, 12.0, 3.0, 11.0], "perf_counter", rotated=2, set_index=[0, 1, 0, 1, 0, 1])
    assert tm.per_set_median_us == [2.0, 11.0] and tm.rotation_spread == pytest.approx(4.5)
    assert Timing([1.0, 2.0], "perf_counter").rotation_spread is None
    s = tm.summary()
    assert s["per_set_median_us"] == [2.0, 11.0] and "set_index" not in s


# ------------------------------------------------------------------------------------ interleaved passes
class OrderBackend(bk.CallableBackend):
    """A callable whose timings and checks are logged in order (the sweep's bookkeeping under test)."""

    def __init__(self, name, clock, log, cost, slow_pass_b=0.0):
        self.clock, self.log_, self.cost, self.slow = clock, log, cost, slow_pass_b
        self.timings = 0
        super().__init__(name, self._fn, reference_fn=lambda inp, w: inp.x.float())

    def _fn(self, inp):
        self.clock.advance_us(self.cost * (1 + (self.slow if self.timings % 2 == 0 else 0.0)))  # pass B
        return inp.x

    def run(self, inputs):
        self.log_.append(("check", self.name, inputs.num_tokens))
        return inputs.x

    def timer(self, input_sets):
        self.log_.append(("time", self.name, input_sets[0].num_tokens))
        self.timings += 1
        return super().timer(input_sets)


def _order_cfg(w, **kw):
    base = dict(preset="tiny", tokens=[1, 3], backends=[], repeats=3, warmup=1, rotate=1, passes=2,
                reference_repeats=2, block_m_study=False, ragged=False, staging=False, overhead=False, device="cpu",
                ceilings=CPU_CEIL, progress=False, weights=w, seed=random.randrange(1 << 20), host_min_time_s=0.0,
                host_speed_check=False)  # the host probe is tested in test_bench_harness (it reads the real clock)
    base.update(kw)
    return SweepConfig(**base)


def test_interleaved_passes_checks_first_reference_last(tiny, clock):
    g, w = tiny
    log: list = []
    a = OrderBackend("a", clock, log, random.uniform(100, 900))
    b = OrderBackend("b", clock, log, random.uniform(100, 900), slow_pass_b=0.10)  # pass B 10% slower
    ref = OrderBackend("reference", clock, log, random.uniform(1000, 3000))
    res = run_sweep(_order_cfg(w, extra_backends=[ref, a, b]), log=lambda s: None)
    assert res["errors"] == [], res["errors"]
    checks = [i for i, e in enumerate(log) if e[0] == "check"]
    times = [e for e in log if e[0] == "time"]
    assert max(checks) < min(i for i, e in enumerate(log) if e[0] == "time")  # every check before any timing
    assert {(e[1], e[2]) for e in log if e[0] == "check"} == {("a", 1), ("a", 3), ("b", 1), ("b", 3)}
    sweep_times = times[:12]  # then the drift re-times
    assert sweep_times == [("time", n, t) for n, t in [("a", 1), ("a", 1), ("b", 1), ("b", 1), ("a", 3), ("a", 3),
                                                     ("b", 3), ("b", 3), ("reference", 1), ("reference", 1),
                                                     ("reference", 3), ("reference", 3)]]
    rows = res["rows"]
    assert [(r["backend"], r["tokens"], r["pass"]) for r in rows] == [(e[1], e[2], p) for e, p in
                                                                      zip(sweep_times, [0, 1] * 6)]
    rep = {(r["backend"], r["tokens"]): r for r in res["repeatability"]}
    assert len(rep) == 6
    for t in (1, 3):
        assert rep[("a", t)]["spread"] == pytest.approx(0.0) and not rep[("a", t)]["flag"]
        assert rep[("b", t)]["spread"] == pytest.approx(0.10) and rep[("b", t)]["flag"]  # flagged, kept
        assert rep[("b", t)]["medians_us"][1] == pytest.approx(1.1 * rep[("b", t)]["medians_us"][0])
    assert {d["backend"]: d["tokens"] for d in res["drift"]} == {"a": 1, "b": 1, "reference": 1}
    assert res["meta"]["timing_protocol"]["repeat_mode"] == "interleaved"
    assert all(r["gc_disabled"] for r in rows) and all(r["checked"] for r in rows if r["backend"] != "reference")
    assert all(r["host_bound"] is False for r in rows)  # plain callables: not host-bound unless they say


def test_sweeps_mode_keeps_whole_sweeps(tiny, clock):
    g, w = tiny
    log: list = []
    a = OrderBackend("a", clock, log, 300.0)
    b = OrderBackend("b", clock, log, 500.0)
    res = run_sweep(_order_cfg(w, extra_backends=[a, b], repeat_mode="sweeps"), log=lambda s: None)
    assert res["errors"] == [], res["errors"]
    times = [(e[1], e[2]) for e in log if e[0] == "time"]
    one = [("a", 1), ("b", 1), ("a", 3), ("b", 3)]
    assert times == one + one and res["drift"] == []
    assert [r["pass"] for r in res["rows"]] == [0] * 4 + [1] * 4
    with pytest.raises(ValueError, match="repeat_mode"):
        Sweep(_order_cfg(w, extra_backends=[a], repeat_mode="twice")).section_sweep()


def test_drift_flags_a_backend_that_slows_over_the_sweep(tiny, clock):
    g, w = tiny
    log: list = []

    class Slowing(OrderBackend):
        def _fn(self, inp):
            self.clock.advance_us(self.cost * (1.25 if self.timings > 4 else 1.0))  # after the first cases
            return inp.x

    s = Slowing("s", clock, log, random.uniform(100, 900))
    res = run_sweep(_order_cfg(w, tokens=[1, 2, 3], extra_backends=[s]), log=lambda s_: None)
    (d,) = res["drift"]
    assert d["tokens"] == 1 and d["change"] == pytest.approx(0.25) and d["flag"]
    assert all(not r["flag"] for r in res["repeatability"])  # A and B of each case agree: the drift is separate


def test_host_bound_rows_get_the_host_hygiene(tiny, clock, monkeypatch):
    g, w = tiny
    quiet = []
    monkeypatch.setattr(sw, "host_quiet", lambda dev: quiet.append(str(dev)))
    c = random.uniform(20_000, 60_000)
    hb = bk.CallableBackend("reference", lambda inp: clock.advance_us(c), host_bound=True)
    res = run_sweep(_order_cfg(w, tokens=[2], extra_backends=[hb], rotate=4, reference_repeats=3, host_min_time_s=0.5,
                               drift_check=False), log=lambda s: None)
    assert res["errors"] == [], res["errors"]
    assert quiet == ["cpu", "cpu"]  # before each pass of the host-bound case
    for r in res["rows"]:
        assert r["host_bound"] and r["repeats"] % 4 == 0 and r["repeats"] * c * 1e-6 >= 0.5 and r["warmup"] >= 4


# ------------------------------------------------------------------------------------ JIT groups
def test_build_all_serializes_a_jit_group(tiny):
    g, w = tiny
    spans: dict = {}
    lock = threading.Lock()

    def job(key):
        def f():
            t0 = time.perf_counter()
            time.sleep(0.03)
            with lock:
                spans[key] = (t0, time.perf_counter())
        return f

    keys = [("deepgemm-sm90-fp8", f"('dg', {t})") for t in (1, 8)] + \
           [("deepgemm-staged-fp8", f"('pool-rows', {t})") for t in (128, 256)] + \
           [("flashinfer-mxfp4", f"plan{t}") for t in range(4)]
    jobs = {k: job(k) for k in keys}
    s = Sweep(_order_cfg(w, build_threads=8))
    s.build_all(jobs)  # no groups given: the backend names say deep_gemm
    dg = sorted(spans[k] for k in keys if k[0].startswith("deepgemm"))
    assert all(a[1] <= b[0] for a, b in zip(dg, dg[1:])), "deep_gemm builds overlapped"
    assert s.results["build_groups"] == {"deep_gemm": 4} and s.results["plans_built"] == len(keys)
    a = bk.FusedAdapter("deepgemm-staged-fp8", FakeCapturable, g, 8)
    assert a.jit_group == "deep_gemm" and bk.FusedAdapter("flashinfer-mxfp4", FakeLaunch, g, 8).jit_group is None


# ------------------------------------------------------------------------------------ host batch filter
def _host_with_spells(clock, fast_us: float, slow_us: float, slow_probes: set[int]):
    """A host whose speed changes at probe calls: probe call k (1-based) reads slow iff k is in
    ``slow_probes``, and every call timed after it costs ``slow_us`` until a probe reads fast again."""
    state = {"n": 0, "slow": False}

    def probe() -> float:
        state["n"] += 1
        state["slow"] = state["n"] in slow_probes
        return 1500.0 + random.random() if state["slow"] else 1000.0 + random.random()

    def fn(k=None):
        clock.advance_us(slow_us if state["slow"] else fast_us)

    return probe, fn, state


def test_time_fn_sets_aside_the_batches_a_slow_probe_stands_beside(clock):
    sets = random.randint(2, 4)
    fast, slow = random.uniform(5_000.0, 9_000.0), random.uniform(12_000.0, 20_000.0)
    start = random.randint(2, 6)
    spell = set(range(start, start + random.randint(2, 9)))  # one slow episode, a few probes long
    probe, fn, state = _host_with_spells(clock, fast, slow, spell)
    tm = time_fn(fn, args=list(range(sets)), warmup=1, repeats=20, device="cpu", min_time_s=0.3, max_repeats=1000,
                 probe=probe, probe_slow_above=1080.0, max_time_s=30.0)
    step = round_to_sets(10, sets)
    assert tm.extra["host_clean"] is True and tm.extra["host_batches_aside"] >= 1 and tm.extra["host_short"] is False
    assert tm.extra["host_calls_aside"] % sets == 0  # whole rotations set aside ...
    assert sets <= tm.extra["host_calls_aside"] <= tm.extra["host_batches_aside"] * step  # ... at most a batch each
    assert all(s == pytest.approx(fast) for s in tm.samples_us)  # no slow call in the figure
    assert len(tm.samples_us) * fast * 1e-6 >= 0.3  # min_time_s counts the kept calls only
    per_set = [tm.set_index.count(k) for k in range(sets)]
    assert len(set(per_set)) == 1  # every input set equally represented
    assert tm.extra["host_probe_median_us"] < 1080.0
    # the same host without the filter: the slow calls are in the samples
    probe2, fn2, _ = _host_with_spells(clock, fast, slow, spell)
    plain = time_fn(fn2, args=list(range(sets)), warmup=1, repeats=20, device="cpu", min_time_s=0.3, max_repeats=1000,
                    probe=probe2)
    assert any(s == pytest.approx(slow) for s in plain.samples_us) and "host_clean" not in plain.extra


def test_time_fn_says_when_a_flickering_host_left_a_pass_short_of_its_minimum(clock):
    """A host that flips speed every few probes: two batches in three have a slow probe beside them. The
    kept batches meet ``repeats`` but not ``min_time_s`` before ``max_time_s``: the pass is clean (every
    kept sample fast, probe median at the usual speed) and says it is short (run 0e3c5a09b5, 1 token)."""
    sets = random.randint(2, 4)
    fast, slow = random.uniform(5_000.0, 9_000.0), random.uniform(12_000.0, 20_000.0)
    flicker = {k for k in range(1, 10**5) if ((k - 1) // 2) % 3 == 0}  # probe pairs 0, 3, 6, ... read slow
    probe, fn, _ = _host_with_spells(clock, fast, slow, flicker)
    max_time = random.uniform(0.8, 1.5)
    tm = time_fn(fn, args=list(range(sets)), warmup=1, repeats=3, device="cpu", min_time_s=5.0, max_repeats=10_000,
                 probe=probe, probe_slow_above=1080.0, max_time_s=max_time)
    assert tm.extra["host_clean"] is True and tm.extra["host_short"] is True
    assert all(x == pytest.approx(fast) for x in tm.samples_us) and tm.extra["host_probe_median_us"] < 1080.0
    assert tm.extra["host_batches_aside"] >= 2 * (len(tm.samples_us) // round_to_sets(10, sets)) - 1
    assert len(tm.samples_us) * fast * 1e-6 < 5.0
    # the same host with time enough: not short
    probe2, fn2, _ = _host_with_spells(clock, fast, slow, flicker)
    tm2 = time_fn(fn2, args=list(range(sets)), warmup=1, repeats=3, device="cpu", min_time_s=0.3, max_repeats=10_000,
                  probe=probe2, probe_slow_above=1080.0, max_time_s=60.0)
    assert tm2.extra["host_short"] is False and len(tm2.samples_us) * fast * 1e-6 >= 0.3


def test_time_fn_keeps_every_sample_when_the_host_never_comes_back(clock):
    fast, slow = random.uniform(5_000.0, 9_000.0), random.uniform(12_000.0, 20_000.0)
    max_time = random.uniform(0.5, 1.5)
    probe, fn, _ = _host_with_spells(clock, fast, slow, set(range(1, 10**6)))
    t0 = clock.perf_counter()
    tm = time_fn(fn, warmup=1, repeats=20, device="cpu", probe=probe, probe_slow_above=1080.0, max_time_s=max_time)
    assert tm.extra["host_clean"] is False and len(tm.samples_us) == tm.extra["host_calls_aside"] > 0
    assert tm.extra["host_short"] is True
    assert all(s == pytest.approx(slow) for s in tm.samples_us)
    assert tm.extra["host_probe_median_us"] > 1400.0  # a retaking caller sees a slow pass
    assert max_time <= clock.perf_counter() - t0 <= max_time + 10 * slow * 1e-6 + 1.0  # stopped after max_time_s
    with pytest.raises(ValueError, match="max_time_s"):
        time_fn(fn, warmup=1, repeats=2, device="cpu", probe=probe, probe_slow_above=1080.0, max_time_s=0)


def test_a_pass_filtered_against_a_slow_baseline_can_be_re_selected_from_its_batch_log(clock):
    """A run that calibrates in a slow spell filters its first passes against a high limit, and keeps the
    slow batches (H200, 304635d966, 1 token: 12% between passes). The batch log lets the pass be
    re-selected against the run's later, lower limit without re-timing it."""
    sets = random.randint(2, 4)
    fast, slow = random.uniform(5_000.0, 9_000.0), random.uniform(12_000.0, 20_000.0)
    flicker = {k for k in range(1, 10**5) if ((k - 1) // 2) % 3 == 0}  # probe pairs 0, 3, 6, ... read slow
    probe, fn, _ = _host_with_spells(clock, fast, slow, flicker)
    tm = time_fn(fn, args=list(range(sets)), warmup=1, repeats=3, device="cpu", min_time_s=1.0, max_repeats=10_000,
                 probe=probe, probe_slow_above=2000.0, max_time_s=60.0)  # the slow calibration's limit
    log, every = tm.extra["host_batch_log"], tm.extra["host_every_us"]
    assert tm.extra["host_batches_aside"] == 0 and all(b[3] for b in log)  # nothing set aside at 2000 us
    assert sum(b[0] for b in log) == len(every) == len(tm.samples_us)
    assert any(s == pytest.approx(slow) for s in tm.samples_us)  # slow calls in the figure
    assert tm.extra["host_min_calls"] == round_to_sets(3, sets)
    same = timing.refilter_host_pass(tm.extra, 2000.0)  # the original limit gives back the original pass
    assert same["calls"] == len(tm.samples_us) and same["median_us"] == pytest.approx(tm.median_us, abs=1e-3)
    got = timing.refilter_host_pass(tm.extra, 1080.0)  # the limit the run learnt later
    fast_batches = [b for b in log if b[1] <= 1080.0]
    assert got["batches"] == len(fast_batches) > 0 and got["calls"] == sum(b[0] for b in fast_batches)
    assert got["median_us"] == pytest.approx(fast, abs=1e-3) and got["enough"] is True
    assert got["wall_s"] == pytest.approx(sum(b[2] for b in fast_batches), abs=1e-3)
    none = timing.refilter_host_pass(tm.extra, 500.0)  # every batch over: nothing kept, and it says so
    assert none["calls"] == 0 and none["median_us"] is None and none["enough"] is False
    assert timing.refilter_host_pass({}, 1080.0) is None  # a pass timed without the filter has no log
    with pytest.raises(ValueError, match="host_batch_log covers"):
        timing.refilter_host_pass({**tm.extra, "host_every_us": every[:-1]}, 1080.0)


def test_the_report_says_what_the_re_selection_would_change():
    from megamoe.bench.report import refilter_text

    limit = random.uniform(1_050.0, 1_400.0)
    a, b = random.uniform(8_000, 9_000), random.uniform(8_000, 9_000)
    slow_a = a * random.uniform(1.05, 1.2)
    rows = [{"backend": "reference", "tokens": 1, "pass": 0, "median_us": slow_a, "samples_us": [0.0] * 40,
             "host_refilter": {"median_us": a, "calls": 16, "enough": True, "limit_us": limit}},
            {"backend": "reference", "tokens": 1, "pass": 1, "median_us": b, "samples_us": [0.0] * 30,
             "host_refilter": {"median_us": b, "calls": 30, "enough": True, "limit_us": limit}},
            {"backend": "reference", "tokens": 2, "pass": 0, "median_us": b, "samples_us": [0.0] * 20,
             "host_refilter": {"median_us": None, "calls": 0, "enough": False, "limit_us": limit}}]
    text = refilter_text(rows)
    as_timed = (max(slow_a, b) - min(slow_a, b)) / min(slow_a, b)
    re_sel = (max(a, b) - min(a, b)) / min(a, b)
    assert "2 of 3 passes would keep fewer calls" in text and "over the 1 row whose" in text
    assert f"would be {100 * re_sel:.2f}% (as timed: {100 * as_timed:.2f}%)" in text
    assert refilter_text([{"backend": "x", "tokens": 1, "pass": 0, "median_us": 1.0}]) == ""

"""CPU tests of the timer (megamoe.bench.timing), the second clock's trace parsing (kineto), the read ceiling.

Most tests drive the timer with a virtual clock (``FakeClock`` replaces ``timing.time``): a timed call advances
it by a cost drawn at random, so every figure the harness reports is known exactly and an assertion on it can
only fail for a reason in the harness."""

from __future__ import annotations

import gc
import json
import os
import random
import statistics
import subprocess
import sys

import pytest
import torch

from megamoe.bench import timing
from megamoe.bench.kineto import split_calls
from megamoe.bench.timing import (SPIN_PER_CALL_US, SpinAhead, Timing, gc_paused, overhead_check, round_to_sets,
                                  time_fn, time_graph)


class FakeClock:
    """time.perf_counter / time.sleep for megamoe.bench.timing: only ``advance_us`` and ``sleep`` move it."""

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
    """n per-set costs in us, drawn fresh, at least 2x apart end to end."""
    while True:
        c = [random.uniform(200.0, 5000.0) for _ in range(n)]
        if n == 1 or max(c) > 2 * min(c):
            return c


def test_time_fn_rotates_input_sets_and_warms_up_each_one(clock):
    seen, cost = [], _costs(3)

    def fn(k):
        seen.append(k)
        clock.advance_us(cost[k])

    tm = time_fn(fn, args=[0, 1, 2], warmup=2, repeats=5, device="cpu")
    assert tm.rotated == 3 and tm.warmup == 3  # the warm-up covers every input set at least once
    assert seen == [0, 1, 2] * 3 and tm.set_index == [0, 1, 2, 0, 1, 2]  # 5 timed -> whole rotations
    assert tm.samples_us == pytest.approx(cost * 2) and tm.method == "perf_counter"
    assert tm.per_set_median_us == pytest.approx(cost)
    assert tm.rotation_spread == pytest.approx((max(cost) - min(cost)) / min(cost))
    with pytest.raises(ValueError, match="repeats"):
        time_fn(lambda: None, repeats=0, device="cpu")
    with pytest.raises(ValueError, match="at least one"):
        time_fn(lambda x: None, args=[], device="cpu")


def test_timing_statistics():
    xs = [random.uniform(1.0, 100.0) for _ in range(random.randint(5, 40))]
    tm = Timing(xs, "perf_counter")
    assert tm.median_us == pytest.approx(statistics.median(xs)) and tm.mean_us == pytest.approx(statistics.fmean(xs))
    assert tm.stderr_us == pytest.approx(statistics.stdev(xs) / len(xs) ** 0.5)  # a host-bound row's error bar
    assert Timing([3.0], "perf_counter").stderr_us != Timing([3.0], "perf_counter").stderr_us  # nan with one sample
    tm = Timing([float(x) for x in range(1, 12)], "perf_counter")  # 1..11, median 6
    assert tm.spread == pytest.approx((10 - 2) / 6)
    s = tm.summary()
    assert s["repeats"] == 11 and "set_index" not in s and s["stderr_us"] == pytest.approx(tm.stderr_us)


def test_min_time_grows_a_pass_in_whole_rotations_and_stops_within_one(clock):
    """Past ``repeats`` the pass grows by the rotations the remaining time needs at the mean call so far, at most
    a batch: a 200 ms call must not overshoot by a whole batch (16 calls for a 1 s minimum, once)."""
    n = random.randint(2, 4)
    for c in (random.uniform(120_000.0, 300_000.0), random.uniform(2_000.0, 9_000.0)):
        min_time = random.uniform(0.8, 2.0)
        tm = time_fn(lambda k: clock.advance_us(c), args=list(range(n)), warmup=1, repeats=3, device="cpu",
                     min_time_s=min_time, max_repeats=100_000)
        r = len(tm.samples_us)
        assert r % n == 0 and r * c * 1e-6 >= min_time and (r - n) * c * 1e-6 < min_time
    capped = time_fn(lambda k: clock.advance_us(1000.0), args=list(range(n)), warmup=1, repeats=3, device="cpu",
                     min_time_s=100.0, max_repeats=2 * n)
    assert len(capped.samples_us) == 2 * n
    assert len(time_fn(lambda k: None, args=list(range(n)), repeats=3, device="cpu").samples_us) == round_to_sets(3, n)


def test_spin_ahead_shrinks_only_once_calls_outlast_their_launch():
    spin, n = SpinAhead(), random.randint(2, 12)
    assert spin.spin_us(n) == SPIN_PER_CALL_US * n  # nothing known yet: the full lead
    host = random.uniform(20.0, 100.0)
    spin.observe(n, n * host * 1e-6, [random.uniform(1.0, 1.9) * host for _ in range(n)])
    assert spin.host_us == pytest.approx(host) and spin.spin_us(n) == SPIN_PER_CALL_US * n
    spin.observe(n, n * host * 1e-6, [random.uniform(2.5, 100.0) * host] * n)
    assert spin.spin_us(n) == pytest.approx(3 * host + 50.0)  # the queue's lead now grows by itself


def test_time_graph_on_a_cpu_falls_back_and_says_so():
    n, seen = random.randint(1, 3), []
    tm = time_graph(seen.append, args=list(range(n)), warmup=1, repeats=2 * n, device="cpu")
    assert tm.method == "perf_counter" and tm.extra["requested"] == "cuda-graph" and tm.rotated == n
    assert len(tm.samples_us) == 2 * n and seen[:n] == list(range(n))


def test_gc_is_off_while_timing_and_restored_after():
    states = []
    fn = lambda: states.append(gc.isenabled())  # noqa: E731
    assert gc.isenabled()
    tm = time_fn(fn, warmup=2, repeats=3, device="cpu")
    assert states == [False] * 5 and gc.isenabled() and tm.extra["gc_collections"] == 0
    states.clear()
    time_fn(fn, warmup=1, repeats=2, device="cpu", gc_off=False)
    assert states == [True] * 3
    with pytest.raises(RuntimeError):
        with gc_paused(True):
            raise RuntimeError("boom")
    assert gc.isenabled()
    with gc_paused(True) as info:
        gc.collect()  # an explicit collection still runs and is counted
    assert info["collections"] >= 1


def test_overhead_check_times_the_same_calls_on_both_sides(clock):
    """Sets of really different cost: with the same call sequence on both sides the harness and the bare loop
    agree exactly, and the rotation shows as per-set medians, not as overhead."""
    n = random.randint(2, 5)
    cost, log = _costs(n), []

    def fn(k):
        log.append(k)
        clock.advance_us(cost[k])

    oc = overhead_check(fn, args=list(range(n)), iters=random.randint(5, 12), rounds=4, warmup=1, device="cpu")
    seq = oc["sequence"]
    assert oc["sets"] == n and len(seq) % n == 0 and seq == [i % n for i in range(len(seq))]
    body = log[n:]  # warm-up (one call per set), then 2 sides x 4 rounds of exactly the sequence
    assert len(body) == 8 * len(seq) and all(body[j * len(seq):(j + 1) * len(seq)] == seq for j in range(8))
    mean = sum(cost[k] for k in seq) / len(seq)
    assert oc["bare_loop_us"] == pytest.approx(mean) and oc["harness_us"] == pytest.approx(mean)
    assert oc["ratio"] == pytest.approx(1.0) and oc["ok"] and oc["per_set_median_us"] == pytest.approx(cost)
    assert oc["order"] == ["bare", "harness", "harness", "bare", "harness", "bare", "bare", "harness"]  # ABBA


def test_overhead_check_catches_a_harness_that_adds_time(clock, monkeypatch):
    c, real = random.uniform(500.0, 3000.0), timing._harness_once
    monkeypatch.setattr(timing, "_harness_once", lambda call, seq, cuda, batch: [s + 0.05 * c for s in real(call, seq, cuda, batch)])
    oc = overhead_check(lambda: clock.advance_us(c), device="cpu")
    assert oc["ratio"] == pytest.approx(1.05) and not oc["ok"]


def test_the_kineto_trace_splits_into_calls_and_drops_the_flush():
    flush = ["fill"]
    calls = random.randint(2, 6)
    kernels = [f"k{i}" for i in range(random.randint(1, 3))]
    durs = [[random.uniform(1, 100) for _ in kernels] for _ in range(calls)]
    events = [e for c in range(calls) for e in [("fill", 9.0)] + list(zip(kernels, durs[c]))]
    assert split_calls(events, calls, flush) == pytest.approx([sum(d) for d in durs])
    with pytest.raises(ValueError, match="do not split"):
        split_calls(events[:-1], calls, flush)  # a call with a kernel fewer: no shape to trust
    with pytest.raises(ValueError, match="does not start with the flush"):
        split_calls(events, calls, ["memset"])
    assert split_calls([("k", 5.0), ("k", 7.0)], 2, []) == [5.0, 7.0]  # no flush: every activity counts


def test_the_read_ceiling_reads_each_size_once_and_feeds_the_floor():
    from megamoe.bench.ceilings import Ceilings, ReadCeiling
    from megamoe.bench.roofline import achieved, step_floor
    from megamoe.geometry import get_geometry

    read = ReadCeiling("cpu", repeats=3)
    nbytes = random.randint(1, 1 << 20)
    us = read.us(nbytes)
    assert us > 0 and read.us(nbytes) == us and list(read.cache) == [-(-nbytes // 16) * 16]  # measured once
    g = get_geometry("tiny")
    idx = torch.randint(0, g.num_experts, (3, g.num_topk))
    fl = step_floor(g, idx, Ceilings("cpu", 10.0, 1.0, 1.0), "mxfp4", read=read)
    rec = read.cache[-(-int(fl.bytes) // 16) * 16]
    assert fl.read_us == rec["us"] and fl.read_kernel == rec["best"] == "torch" and fl.read_us_stream is None
    a = achieved(fl, 4 * fl.read_us, Ceilings("cpu", 10.0, 1.0, 1.0))
    assert a["frac_of_read"] == pytest.approx(0.25) and a["read_us"] == fl.read_us and a["read_kernel"] == "torch"
    assert a["read_us_stream"] is None and a["frac_of_read_stream"] is None  # no streaming read off CUDA


@pytest.mark.skipif(not __import__("importlib").util.find_spec("triton"), reason="triton is not installed")
def test_the_triton_read_kernel_reads_every_word_once():
    """Under Triton's CPU interpreter: the xor of every program's output is the xor of the whole buffer."""
    code = ("import functools, operator, sys, torch\n"
            "from megamoe.bench.read_kernel import programs, read_all\n"
            "for n in map(int, sys.argv[1:]):\n"
            "    buf = torch.randint(-2**31, 2**31 - 1, (n,), dtype=torch.int32, generator=torch.Generator().manual_seed(n))\n"
            "    out = read_all(buf, torch.full((programs(buf),), 7, dtype=torch.int32))\n"
            "    print(functools.reduce(operator.xor, buf.tolist(), 0), functools.reduce(operator.xor, out.tolist(), 0))\n")
    sizes = [1, 4096, random.randint(4097, 5 * 4096), random.randint(5 * 4096, 9 * 4096)]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", code, *map(str, sizes)], env=env, capture_output=True, text=True,
                         timeout=300, check=True).stdout.split("\n")
    for line in out[:len(sizes)]:
        want, got = line.split()
        assert want == got


def test_pytest_benchmark_records_and_compares_the_device_time(tmp_path):
    """`pytest bench/ --benchmark-only --benchmark-json=F` runs (addopts no longer forces --benchmark-disable),
    the figure pytest-benchmark stores is each timed call's device time (its timer is device_clock), and
    `pytest-benchmark compare F` shows it."""
    toks = sorted(random.sample(range(1, 33), 2))
    out = tmp_path / "b.json"
    env = {**os.environ, "MEGAMOE_BENCH_PRESET": "tiny", "MEGAMOE_BENCH_TOKENS": ",".join(map(str, toks)),
           "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", "")}
    subprocess.run([sys.executable, "-m", "pytest", "bench/test_bench_reference.py", "-k", "staging_cast", "-q",
                    "-p", "no:cacheprovider", "--benchmark-only", f"--benchmark-json={out}"],
                   check=True, env=env, capture_output=True, timeout=300)
    bench = json.loads(out.read_text())
    assert len(bench["benchmarks"]) == len(toks) and bench["machine_info"]["megamoe"]["versions"]["megamoe"]
    for b in bench["benchmarks"]:
        assert b["options"]["timer"] == "device_clock" and b["stats"]["rounds"] == b["extra_info"]["repeats"]
        assert b["stats"]["median"] * 1e6 == pytest.approx(b["extra_info"]["device_us"], rel=1e-9)
    p = subprocess.run([sys.executable, "-c", "from pytest_benchmark.cli import main; main()", "compare", str(out)],
                       env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    for b in bench["benchmarks"]:
        assert b["name"] in p.stdout


def test_the_floor_matches_the_kernels_table():
    """The H200 floors at DeepSeek-V4-Flash from the kernels' contract: 19 us at 1 token (HBM), 1739 us at 8192 (FP8)."""
    from megamoe.bench.ceilings import Ceilings
    from megamoe.bench.roofline import achieved, bytes_per_weight, distinct_experts, step_floor
    from megamoe.geometry import get_geometry

    h200 = Ceilings("NVIDIA H200 (datasheet)", copy_gbps=4240.0, fp8_tflops=1422.0, bf16_tflops=815.0)
    g = get_geometry("dsv4-flash")
    one = torch.arange(6).view(1, 6)
    f1 = step_floor(g, one, h200, "mxfp4")
    assert f1.bound == "HBM" and f1.experts_touched == 6 and round(f1.floor_us) == 19 and f1.read_us is None
    full = torch.arange(8192 * 6).remainder(256).view(8192, 6)  # every expert touched
    f8k = step_floor(g, full, h200, "mxfp4")
    assert f8k.bound == "FP8" and abs(f8k.floor_us - 1739) < 2
    a = achieved(f8k, 2 * f8k.floor_us, h200)
    assert a["frac_of_floor"] == pytest.approx(0.5) and a["frac_fp8_peak"] == pytest.approx(0.5) and a["frac_of_read"] is None
    assert step_floor(g, one, h200, "fp8_block").hbm_us > 1.8 * f1.hbm_us  # FP8 weights move ~1.9x the bytes
    assert bytes_per_weight("mxfp4") == 0.53125 and bytes_per_weight("fp8_block") == pytest.approx(1 + 4 / 16384)
    with pytest.raises(ValueError, match="unknown weight format"):
        bytes_per_weight("int3")
    idx = torch.tensor([[0, 3], [3, -1], [-1, -1], [7, 0]])
    assert (distinct_experts(idx), distinct_experts(idx, 0, 4), distinct_experts(idx, 4, 8)) == (3, 2, 1)


def test_ceilings_and_ragged_counts():
    from megamoe.bench.ceilings import Ceilings, measure_ceilings
    from megamoe.inputs import ragged_counts

    c = measure_ceilings("cpu", copy_bytes=8 * 2**20, matmul_n=64, repeats=3)
    assert c.copy_gbps > 0 and c.fp8_tflops > 0 and c.bf16_tflops > 0 and Ceilings.from_dict(c.as_dict()) == c
    assert ragged_counts(256, cap=8192) == [64, 192, 320, 448] and ragged_counts(2, cap=8192) == [1, 2, 2, 4]
    assert max(ragged_counts(8192, cap=8192)) == 8192 and ragged_counts(8, ranks=1) == [8]

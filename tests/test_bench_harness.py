"""CPU tests of the benchmark harness (megamoe.bench): timing, floors, the adapter, the sweep, the CLI."""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time

import pytest
import torch

from megamoe.bench import backends as bk
from megamoe.bench.ceilings import Ceilings, measure_ceilings
from megamoe.bench.cli import add_arguments, config_from_args
from megamoe.bench.report import to_markdown
from megamoe.bench.roofline import achieved, bytes_per_weight, distinct_experts, step_floor
from megamoe.bench.sweep import (Sweep, SweepConfig, pad_inputs, pin_timing_thread, ragged_counts, repeatability,
                                 restore_affinity, run_sweep, speedups)
from megamoe.bench.timing import (SPIN_PER_CALL_US, SpinAhead, Timing, bare_loop_us, overhead_check, time_fn,
                                  time_graph)
from megamoe.geometry import get_geometry
from megamoe.inputs import make_inputs
from megamoe.reference import moe_forward

CPU_CEIL = Ceilings("cpu (test)", copy_gbps=10.0, fp8_tflops=0.5, bf16_tflops=0.5)
H200 = Ceilings("NVIDIA H200 (KERNELS.md)", copy_gbps=4240.0, fp8_tflops=1422.0, bf16_tflops=815.0)


def _busy(us: float) -> None:
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


# ------------------------------------------------------------------------------------ timing
def test_time_fn_cpu_fallback_measures_the_call():
    tm = time_fn(lambda: _busy(2000), warmup=1, repeats=5, device="cpu")
    assert tm.method == "perf_counter" and len(tm.samples_us) == 5
    assert 1900 < tm.median_us < 20000  # a loaded CI host stretches it, never shrinks it
    assert tm.min_us <= tm.median_us <= tm.max_us
    s = tm.summary()
    assert s["repeats"] == 5 and s["median_us"] == tm.median_us


def test_time_fn_rotates_input_sets_and_warms_up():
    seen = []
    tm = time_fn(seen.append, args=["a", "b", "c"], warmup=2, repeats=5, device="cpu")
    assert tm.rotated == 3 and tm.warmup == 3  # the warm-up covers every input set at least once
    # 3 warm-up + 5 timed rounded up to whole rotations (6), cycling in order
    assert seen == ["a", "b", "c"] * 3 and tm.set_index == [0, 1, 2, 0, 1, 2] and len(tm.samples_us) == 6


def test_time_fn_rejects_bad_arguments():
    with pytest.raises(ValueError, match="repeats"):
        time_fn(lambda: None, repeats=0, device="cpu")
    with pytest.raises(ValueError, match="at least one"):
        time_fn(lambda x: None, args=[], device="cpu")


def test_timing_spread_and_median():
    tm = Timing([10.0, 10.0, 10.0, 10.0], "perf_counter")
    assert tm.spread == 0.0 and tm.median_us == 10.0
    tm = Timing([float(x) for x in range(1, 12)], "perf_counter")  # 1..11, median 6
    assert tm.median_us == 6.0 and tm.spread == pytest.approx((10 - 2) / 6)


def test_spin_ahead_shrinks_only_once_calls_outlast_their_launch():
    spin = SpinAhead()
    n = random.randint(2, 12)
    assert spin.spin_us(n) == SPIN_PER_CALL_US * n  # nothing known yet: the full lead
    host = random.uniform(20.0, 100.0)
    spin.observe(n, n * host * 1e-6, [random.uniform(1.0, 1.9) * host for _ in range(n)])
    assert spin.host_us == pytest.approx(host)
    assert spin.spin_us(n) == SPIN_PER_CALL_US * n  # calls not clearly longer than their launch: keep it
    long_call = random.uniform(2.5, 100.0) * host
    spin.observe(n, n * host * 1e-6, [long_call] * n)
    assert spin.spin_us(n) == pytest.approx(3 * host + 50.0)  # the queue's lead now grows by itself


def test_time_graph_falls_back_on_cpu():
    tm = time_graph(lambda: _busy(500), repeats=3, device="cpu")
    assert tm.method == "perf_counter" and len(tm.samples_us) == 3


def test_bare_loop_and_harness_agree_on_a_steady_call():
    bare = bare_loop_us(lambda: _busy(3000), iters=5, device="cpu")
    assert 2900 < bare < 30000
    oc = overhead_check(lambda: _busy(3000), iters=5, repeats=5, device="cpu", tolerance=0.05)
    assert oc["method"] == "perf_counter" and set(oc) >= {"bare_loop_us", "harness_us", "ratio", "ok"}
    assert 0.5 < oc["ratio"] < 2  # a busy-wait: only host jitter differs (the 2% check is a GPU one)


# ------------------------------------------------------------------------------------ ceilings + floors
def test_ceilings_measure_on_cpu():
    c = measure_ceilings("cpu", copy_bytes=8 * 2**20, matmul_n=128, repeats=3)
    assert c.copy_gbps > 0 and c.fp8_tflops > 0 and c.bf16_tflops > 0
    assert Ceilings.from_dict(c.as_dict()) == c


def test_bytes_per_weight():
    assert bytes_per_weight("mxfp4") == 0.53125
    assert bytes_per_weight("fp8_block") == pytest.approx(1 + 4 / 16384)
    with pytest.raises(ValueError, match="unknown weight format"):
        bytes_per_weight("int3")


def test_distinct_experts_skips_masked_slots_and_ranges():
    idx = torch.tensor([[0, 3], [3, -1], [-1, -1], [7, 0]])
    assert distinct_experts(idx) == 3
    assert distinct_experts(idx, 0, 4) == 2
    assert distinct_experts(idx, 4, 8) == 1


def test_floor_matches_the_kernels_md_table():
    """KERNELS.md's H200 floors at DeepSeek-V4-Flash: 19 us at 1 token (HBM), 1739 us at 8192 (FP8)."""
    g = get_geometry("dsv4-flash")
    one = torch.arange(6).view(1, 6)
    f1 = step_floor(g, one, H200, "mxfp4")
    assert f1.bound == "HBM" and f1.experts_touched == 6 and round(f1.floor_us) == 19
    full = torch.arange(8192 * 6).remainder(256).view(8192, 6)  # every expert touched
    f8k = step_floor(g, full, H200, "mxfp4")
    assert f8k.bound == "FP8" and abs(f8k.floor_us - 1739) < 2  # the table rounds the ceilings
    a = achieved(f8k, 2 * f8k.floor_us, H200)
    assert a["frac_of_floor"] == pytest.approx(0.5) and a["frac_fp8_peak"] == pytest.approx(0.5)
    # FP8 weights move ~1.9x the bytes of MXFP4 ones: the HBM floor moves with the format
    assert step_floor(g, one, H200, "fp8_block").hbm_us > 1.8 * f1.hbm_us


# ------------------------------------------------------------------------------------ sweep helpers
def test_pad_inputs_routes_padding_to_minus_one(tiny):
    g, w = tiny
    inp = make_inputs(g, 5, seed=1)
    pad = pad_inputs(inp, 9)
    assert pad.num_tokens == 9 and (pad.topk_idx[5:] == -1).all() and torch.equal(pad.x[:5], inp.x)
    assert pad.x[5:].abs().sum() > 0  # never zeros
    y = moe_forward(pad, w, "flashinfer-mxfp4", g)
    assert torch.equal(y[:5], moe_forward(inp, w, "flashinfer-mxfp4", g)) and (y[5:] == 0).all()
    with pytest.raises(ValueError):
        pad_inputs(inp, 3)


def test_ragged_counts():
    assert ragged_counts(256, 8192) == [64, 192, 320, 448]
    assert ragged_counts(2, 8192) == [1, 2, 2, 4]
    assert max(ragged_counts(8192, 8192)) == 8192


def test_repeatability_and_speedup_tables():
    rows = [{"backend": "f", "fused": True, "tokens": 1, "pass": 0, "median_us": 100.0},
            {"backend": "u", "fused": False, "tokens": 1, "pass": 0, "median_us": 300.0},
            {"backend": "f", "fused": True, "tokens": 1, "pass": 1, "median_us": 102.0}]
    rep = repeatability(rows)
    assert rep == [{"backend": "f", "tokens": 1, "medians_us": [100.0, 102.0], "spread": pytest.approx(0.02), "flag": False}]
    rows.append({"backend": "u", "fused": False, "tokens": 1, "pass": 1, "median_us": 330.0})
    flagged = {r["backend"]: r["flag"] for r in repeatability(rows)}
    assert flagged == {"f": False, "u": True}  # 10% >= 3%: flagged, never dropped
    sp = speedups(rows)
    assert len(sp) == 1 and sp[0]["speedup"] == pytest.approx(3.0) and sp[0]["unfused"] == "u"


# ------------------------------------------------------------------------------------ a fake fused backend
class FakeFused:
    """Follows the megamoe.fused protocol over the eager reference (CPU)."""

    recipe = "flashinfer-mxfp4"
    weight_format = "mxfp4"
    fused = True
    wrong = False

    def __init__(self, g, num_max_tokens_per_rank, block_m=None, group=None):
        self.g, self.cap, self.block_m = g, num_max_tokens_per_rank, block_m
        self.built, self.launches, self.buf = [], 0, None

    @classmethod
    def available(cls):
        return True, ""

    def prepare_weights(self, weights):
        self.w = weights

    def build_plans(self, token_counts):
        self.built += list(token_counts)

    def stage(self, inputs, num_tokens):
        assert num_tokens <= self.cap
        self.buf = inputs.clone()

    def launch(self, num_tokens):  # cheap stand-in for the kernel: the timed region
        self.launches += 1
        self.y = self.buf.x[:num_tokens].float().sum()

    _cache: dict = {}

    def reference(self, inputs):  # memoised: the tests must stay quick on a loaded CPU
        key = (inputs.num_tokens, float(inputs.x.float().sum()), float(inputs.topk_idx.sum()))
        if key not in FakeFused._cache:
            FakeFused._cache[key] = moe_forward(inputs, self.w, self.recipe, self.g)
        return FakeFused._cache[key]

    def run(self, inputs):
        self.stage(inputs, inputs.num_tokens)
        self.launch(inputs.num_tokens)
        return self.reference(self.buf) * (2 if self.wrong else 1)

    def plan_report(self, num_tokens):
        return {"block_m": self.block_m or (8 if num_tokens <= 4 else 24), "num_tokens": num_tokens}

    def legal_block_ms(self, num_tokens=None):
        return [8, 24]


class FakeUnfused(FakeFused):
    fused = False


class FakeBroken(FakeFused):
    wrong = True


@pytest.fixture
def fake_registry(monkeypatch):
    reg = {"fake-fused": FakeFused, "fake-unfused": FakeUnfused, "fake-base": FakeBase}
    monkeypatch.setattr(bk, "fused_registry", lambda: dict(reg))
    return reg


def test_adapter_drives_the_protocol(tiny, fake_registry):
    g, w = tiny
    out, skipped = bk.make_backends(g, w, 16, ["fake-fused", "missing", "reference"])
    assert [b.name for b in out] == ["fake-fused", "reference"] and "missing" in skipped
    a = out[0]
    assert isinstance(a, bk.FusedAdapter) and a.fused and a.weight_format == "mxfp4" and not a.rotatable
    a.build([1, 8])
    assert a.obj.built == [1, 8]
    inp = make_inputs(g, 8, seed=3)
    fn, args = a.timer([inp])
    assert args is None
    fn()
    assert a.obj.launches == 1
    assert a.plan(8)["block_m"] == 24 and bk.block_m_of(a.plan(2)) == 8
    forced = a.with_block_m(8)
    assert forced.obj.block_m == 8 and forced.plan(100)["block_m"] == 8 and forced.plan(100)["forced_block_m"] == 8
    assert torch.equal(a.run(inp), a.reference(inp, w))
    assert torch.equal(a.reference(inp, w), moe_forward(inp, w, "flashinfer-mxfp4", g))


class FakeBase(FakeFused):
    """Like megamoe.fused.base.FusedBackend: set_force_block_m + _build_job + _stage."""

    def __init__(self, g, num_max_tokens_per_rank, block_m=None, group=None):
        super().__init__(g, num_max_tokens_per_rank)
        self.force_block_m = None
        self.set_force_block_m(block_m)

    def set_force_block_m(self, bm):
        if bm is not None and bm not in self.legal_block_ms():
            raise ValueError(f"illegal BLOCK_M {bm}")
        self.force_block_m = self.block_m = bm

    def _build_job(self, num_tokens):
        bm = self.plan_report(num_tokens)["block_m"]
        return bm, (lambda: self.built.append(bm))

    def _stage(self, inputs, m):
        self.buf = inputs


def test_forced_block_m_shares_the_backend_and_build_jobs_cover_every_plan(tiny):
    g, w = tiny
    a = bk.FusedAdapter("base", FakeBase, g, 64)
    a.prepare(w)
    jobs = dict(a.build_jobs([1, 2, 8, 64], (None, 8, 24)))
    assert len(jobs) == 2  # plans keyed by BLOCK_M: {8, 24} whatever the token count
    for fn in jobs.values():
        fn()
    assert sorted(a.obj.built) == [8, 24] and a.obj.force_block_m is None  # restored
    v = a.with_block_m(24)
    assert isinstance(v, bk.ForcedBlockM) and v.base is a
    assert v.plan(1)["block_m"] == 24 and a.obj.force_block_m == 24
    v.close()
    assert a.obj.force_block_m is None and a.plan(1)["block_m"] == 8
    with pytest.raises(ValueError, match="illegal"):
        a.with_block_m(7)
    parts = a.stage_parts(make_inputs(g, 4, seed=0))
    assert set(parts) == {"stage() incl. input validation", "cast + copy into the buffer"}


def test_adapter_forces_block_m_through_a_setter(tiny):
    g, w = tiny

    class Setter(FakeFused):
        def __init__(self, g, num_max_tokens_per_rank):
            super().__init__(g, num_max_tokens_per_rank)

        def force_block_m(self, bm):
            self.block_m = bm

    a = bk.FusedAdapter("setter", Setter, g, 8, block_m=24)
    assert a.obj.block_m == 24


def test_sweep_end_to_end_on_cpu(tiny, fake_registry, tmp_path):
    g, w = tiny
    cfg = SweepConfig(preset="tiny", tokens=[1, 8], backends=["fake-fused", "fake-unfused", "reference"], repeats=3,
                      warmup=1, rotate=2, passes=2, reference_repeats=2, reference_max_tokens=1, ragged_means=[4], overhead_tokens=[8],
                      device="cpu", ceilings=CPU_CEIL, out_dir=str(tmp_path), progress=False, weights=w, seed=5)
    res = run_sweep(cfg, log=lambda s: None)
    # the overhead check (what the figures rest on) runs before the studies a deadline may cut
    assert list(res["section_seconds"]) == ["ceilings", "setup", "sweep", "overhead", "block_m", "ragged", "staging"]
    assert res["errors"] == [], res["errors"]
    first = [r for r in res["rows"] if r["pass"] == 0]
    assert len(first) == 5 and len(res["rows"]) == 10
    for r in first:
        assert r["median_us"] > 0 and r["floor_us"] > 0 and 0 < r["frac_of_floor"]
        assert r["tflops"] > 0 and r["gbps"] > 0 and r["method"] == "perf_counter"
        if r["backend"] != "reference":
            assert r["checked"] and r["correct"] and r["calc_diff"] == 0.0
    assert {r["block_m"] for r in first if r["backend"] == "fake-fused"} == {8, 24}
    assert all(r["block_m"] is not None for r in res["rows"] if r["backend"] == "fake-fused")  # pass 2 too
    assert len(res["repeatability"]) == 5
    assert {s["fused"] for s in res["speedup"]} == {"fake-fused"} and all("speedup" in s for s in res["speedup"])
    assert len(res["block_m"]) == 2 * 2 and {r["backend"] for r in res["block_m"]} == {"fake-fused"}  # 2 BMs x 2 T
    assert res["block_m_best"] and all(b["best_block_m"] in (8, 24) for b in res["block_m_best"])
    assert res["ragged"] and res["ragged"][0]["counts"] == [1, 3, 5, 7] and res["ragged"][0]["agreed"] >= 7
    assert any(s["what"].startswith("megamoe per_token_cast") for s in res["staging"])
    assert any("fake-fused: stage()" in s["what"] and "frac_of fake-fused" in s for s in res["staging"])
    assert {o["backend"] for o in res["overhead"]} == {"fake-fused", "fake-unfused"}
    (folder,) = os.listdir(tmp_path)
    assert folder.endswith(res["meta"]["commit"]) and folder.startswith(res["meta"]["date"][:10])
    files = set(os.listdir(tmp_path / folder))
    assert {"results.json", "results.md", "sweep.png", "block_m.png"} <= files
    back = json.loads((tmp_path / folder / "results.json").read_text())
    assert back["meta"]["geometry"]["name"] == "tiny" and back["ceilings"]["copy_gbps"] == 10.0
    md = (tmp_path / folder / "results.md").read_text()
    assert "## Sweep" in md and "## BLOCK_M study" in md and "## Harness overhead" in md and "## Repeatability" in md


def test_sweep_flags_a_wrong_backend_and_survives_a_crashing_one(tiny, monkeypatch):
    g, w = tiny

    class Crash(FakeFused):
        def launch(self, num_tokens):
            raise RuntimeError("kernel exploded")

    monkeypatch.setattr(bk, "fused_registry", lambda: {"broken": FakeBroken, "crash": Crash})
    cfg = SweepConfig(preset="tiny", tokens=[4], backends=["broken", "crash"], repeats=2, warmup=1, passes=1,
                      block_m_study=False, ragged=False, staging=False, overhead=False, device="cpu", ceilings=CPU_CEIL,
                      progress=False, weights=w)
    res = run_sweep(cfg, log=lambda s: None)
    (row,) = res["rows"]
    assert row["backend"] == "broken" and row["correct"] is False and row["calc_diff"] > 0.1
    assert any("crash" in e["where"] and "kernel exploded" in e["error"] for e in res["errors"])
    assert "FAIL" in to_markdown(res)


def test_sweep_times_any_callable(tiny):
    g, w = tiny
    x = torch.randn(64, 64)
    cb = bk.CallableBackend("torch matmul", lambda inp: x @ x, fused=False)
    cfg = SweepConfig(preset="tiny", tokens=[2], backends=[], repeats=3, warmup=1, passes=1, block_m_study=False,
                      ragged=False, staging=False, overhead=True, overhead_tokens=[2], device="cpu", ceilings=CPU_CEIL, progress=False,
                      weights=w, extra_backends=[cb])
    res = run_sweep(cfg, log=lambda s: None)
    assert [r["backend"] for r in res["rows"]] == ["torch matmul"] and res["rows"][0]["rotated"] == 4
    assert res["overhead"][0]["backend"] == "torch matmul"


def test_cli_arguments_map_to_the_config():
    p = argparse.ArgumentParser()
    add_arguments(p)
    cfg = config_from_args(p.parse_args(["--preset", "small", "--tokens", "8", "1", "8", "--no-studies", "--passes", "1"]))
    assert cfg.preset == "small" and cfg.tokens == [1, 8] and cfg.passes == 1
    assert not (cfg.block_m_study or cfg.ragged or cfg.staging or cfg.overhead)
    default = config_from_args(p.parse_args([]))
    assert default.tokens[0] == 1 and default.tokens[-1] == 8192 and default.block_m_study and default.passes == 2
    assert default.pin_cpu and default.host_min_time_s == 0.5 and default.host_max_repeats == 64
    host = config_from_args(p.parse_args(["--host-min-time", "2.5", "--host-min-warmup", "1.5",
                                          "--host-max-repeats", "300", "--no-pin"]))
    assert (host.host_min_time_s, host.host_min_warmup_s, host.host_max_repeats, host.pin_cpu) == (2.5, 1.5, 300, False)
    filt = config_from_args(p.parse_args(["--no-host-filter", "--host-max-time", "7.5", "--host-extra-budget", "12"]))
    assert (filt.host_batch_filter, filt.host_max_time_s, default.host_batch_filter) == (False, 7.5, True)
    assert (filt.host_extra_budget_s, default.host_extra_budget_s) == (12.0, SweepConfig.host_extra_budget_s)
    dev = config_from_args(p.parse_args(["--device-min-warmup", "0.7", "--device-min-time", "0.3", "--device-max-repeats",
                                         "900", "--repeat-mode", "sweeps", "--settle", "0"]))
    assert (dev.device_min_warmup_s, dev.device_min_time_s, dev.device_max_repeats, dev.repeat_mode, dev.settle_s) == \
        (0.7, 0.3, 900, "sweeps", 0.0)
    assert (default.device_min_warmup_s, default.device_min_time_s, default.repeat_mode) == (0.1, 1.0, "interleaved")


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="needs Linux CPU affinity")
def test_pin_timing_thread_pins_this_thread_and_restores_it():
    before = os.sched_getaffinity(0)
    pinned = pin_timing_thread()
    try:
        assert pinned["cpu"] == max(before) and os.sched_getaffinity(0) == {pinned["cpu"]}
        assert set(pinned["previous"]) == before
        seen = []
        t = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
        t.start()
        t.join()
        assert seen == [{pinned["cpu"]}]  # a thread started after the pin inherits it: why the builds come first
    finally:
        restore_affinity(pinned)
    assert os.sched_getaffinity(0) == before


def test_block_m_study_through_the_shared_backend(tiny, fake_registry):
    g, w = tiny
    cfg = SweepConfig(preset="tiny", tokens=[2, 8], backends=["fake-base"], repeats=2, warmup=1, passes=1,
                      ragged=False, staging=False, overhead=False, device="cpu", ceilings=CPU_CEIL, progress=False, weights=w)
    res = run_sweep(cfg, log=lambda s: None)
    assert res["errors"] == [], res["errors"]
    assert res["plans_built"] == 2  # BLOCK_M 8 and 24, built once in setup
    assert sorted((r["forced_block_m"], r["tokens"]) for r in res["block_m"]) == [(8, 2), (8, 8), (24, 2), (24, 8)]
    assert all(r["plan"]["block_m"] == r["forced_block_m"] and r["correct"] for r in res["block_m"])
    assert {b["plan_block_m"] for b in res["block_m_best"]} == {8, 24}


def test_adapter_reference_uses_the_recipe_on_the_kernels_weights(tiny):
    """A backend without a reference method: moe_forward(recipe) on ``kernel_weights`` (what it reads)."""
    g, w = tiny
    from megamoe.weights import random_mxfp4_weights

    w2 = random_mxfp4_weights(g, seed=9)

    class NoRef(FakeFused):
        reference = None

        def prepare_weights(self, weights):
            self.w = weights
            self.kernel_weights = w2  # a stand-in for the repaired / converted copy

    a = bk.FusedAdapter("noref", NoRef, g, 8)
    a.prepare(w)
    inp = make_inputs(g, 3, seed=2)
    assert torch.equal(a.reference(inp, w), moe_forward(inp, w2, "flashinfer-mxfp4", g))


def test_time_fn_records_the_host_probe_beside_the_samples():
    seen = []

    def probe():
        seen.append(1)
        return 100.0 + len(seen)  # distinct values: the median is computed, not a constant

    tm = time_fn(lambda: sum(range(100)), repeats=20, warmup=1, batch=5, device="cpu", probe=probe, probes_per_batch=3)
    assert len(tm.extra["host_probe_us"]) == len(seen) == 4 * 3  # 20 calls in batches of 5, 3 probes each
    assert tm.extra["host_probe_median_us"] == pytest.approx(statistics.median(100.0 + k for k in range(1, 13)))
    assert "host_probe_us" not in time_fn(lambda: None, repeats=3, warmup=1, device="cpu").extra


def test_host_probe_tracks_the_cores_speed():
    from megamoe.bench.timing import host_speed_probe_us

    # A busy process on the same core takes half of it (the kernel's fair share): the probe must read
    # slower then. Rounds alternate alone (the spinner stopped) / shared (running), so both sides see the
    # same background. Each side sums 20 probes (~20-40 ms), several scheduler slices, so the share shows
    # whole. (The first version shared the GIL with a thread instead; that read 0.8-4.9x, ~1 run in 6 failing.)
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("needs os.sched_setaffinity (Linux)")
    before = os.sched_getaffinity(0)
    cpu = min(before)
    os.sched_setaffinity(0, {cpu})  # this thread; the spinner inherits it
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    ratios = []
    try:
        for _ in range(7):
            os.kill(spinner.pid, signal.SIGSTOP)
            time.sleep(5e-3)
            alone = sum(host_speed_probe_us() for _ in range(20))
            os.kill(spinner.pid, signal.SIGCONT)
            time.sleep(5e-3)
            shared = sum(host_speed_probe_us() for _ in range(20))
            assert alone > 0
            ratios.append(shared / alone)
    finally:
        spinner.kill()
        spinner.wait()
        os.sched_setaffinity(0, before)
    assert statistics.median(ratios) > 1.3, ratios  # ~2 on an idle core; 1.5 with one more busy task on it


def _slow_host_sweep(tiny, slow_probe_calls: int, retakes: int = 3, recover_s: float = 5.0, min_warmup_s: float = 0.0,
                     recover_window_s: float = 0.0, batch_filter: bool = False, max_time_s: float = 5.0,
                     tokens=(2,), extra_budget_s: float = 60.0, log=None, calibration_us: float = 100.0,
                     min_time_s: float = 0.0, call_s: float = 0.0):
    """A host-bound callable timed with a fake probe that reads 1.5x slow for its first ``slow_probe_calls``
    calls after calibration (an episode of the VM's host), 1.0x after. ``batch_filter``: the in-pass
    batch filter on (off here by default, so the retake tests see whole passes)."""
    g, w = tiny
    x = torch.randn(32, 32)
    state = {"calls": 0, "calibrated": False}

    def probe():
        state["calls"] += 1
        if not state["calibrated"]:
            return calibration_us
        return 150.0 if state["calls"] <= slow_probe_calls else 100.0 + random.random()

    def call(inp):
        if call_s:
            time.sleep(call_s)  # a host-bound step that takes time (the pass's min_time_s counts it)
        return x @ x

    cb = bk.CallableBackend("host-bound", call, host_bound=True)
    cfg = SweepConfig(preset="tiny", tokens=list(tokens), backends=[], repeats=10, reference_repeats=10, warmup=1, passes=2,
                      block_m_study=False, ragged=False, staging=False, overhead=False, device="cpu", ceilings=CPU_CEIL,
                      progress=False, weights=w, extra_backends=[cb], host_min_time_s=min_time_s,
                      host_min_warmup_s=min_warmup_s, host_calibrate_s=0.0, host_probe=probe, host_speed_check=True, host_retakes=retakes,
                      host_recover_s=recover_s, host_max_time_s=max_time_s,
                      host_recover_window_s=recover_window_s, drift_check=False, host_batch_filter=batch_filter,
                      host_extra_budget_s=extra_budget_s)
    sw = Sweep(cfg, log=log or (lambda s: None))
    orig = sw.calibrate_host

    def calibrate():
        orig()
        state.update(calibrated=True, calls=0)

    sw.calibrate_host = calibrate
    res = sw.run()
    res["probe_calls_after_calibration"] = state["calls"]
    return res


def test_sweep_retakes_a_host_bound_pass_taken_while_the_host_was_slow(tiny):
    # a pass: 12 calls (3 x 4 sets), 2 batches, 4 probes, all slow; the wait before the retake then reads
    # probes 5-8 (slow) and 9 (usual speed; a window of 0 s: one fast probe is enough here), so the one
    # retake runs on a host back at its usual speed
    res = _slow_host_sweep(tiny, slow_probe_calls=8, min_warmup_s=0.3)
    a, b = sorted(res["rows"], key=lambda r: r["pass"])
    assert res["meta"]["host_probe_calibration_us"] == 100.0
    (r,) = a["host_retaken"]
    assert r["host_probe_median_us"] == 150.0 and 0.0 <= r["then_waited_s"] < 5.0
    assert a["host_slow"] is False and a["host_probe_median_us"] < 101.0
    assert b["host_retaken"] == [] and b["host_slow"] is False
    assert res["probe_calls_after_calibration"] == 4 + 5 + 4 + 4  # pass A, the wait, the retake, pass B
    # the retake re-warms with one call per input set; a first pass warms for host_min_warmup_s
    assert a["warmup"] == 4 and b["warmup"] > 4


def test_sweep_keeps_and_flags_a_pass_still_slow_after_the_last_retake(tiny):
    res = _slow_host_sweep(tiny, slow_probe_calls=10**9, retakes=1, recover_s=0.2)
    for r in res["rows"]:
        assert r["host_slow"] is True and len(r["host_retaken"]) == 1 and r["host_probe_median_us"] == 150.0
        assert r["host_retaken"][0]["then_waited_s"] >= 0.2  # waited the whole recovery time, in vain
    assert "host_slow" in to_markdown(res)


def test_sweep_sets_aside_a_slow_spell_within_the_pass_instead_of_retaking_it(tiny):
    # the first probes after calibration read slow: with the in-pass filter, pass A sets aside the batches
    # beside them and times on, so no pass is retaken and every pass is clean
    slow = random.randint(3, 8)
    res = _slow_host_sweep(tiny, slow_probe_calls=slow, batch_filter=True)
    a, b = sorted(res["rows"], key=lambda r: r["pass"])
    assert a["host_retaken"] == [] and b["host_retaken"] == [] and not a["host_slow"] and not b["host_slow"]
    assert a["host_clean"] is True and a["host_batches_aside"] >= 1 and b["host_batches_aside"] == 0
    assert a["host_probe_median_us"] < 101.0
    md = to_markdown(res)
    assert f"{a['host_batches_aside']} batches ({a['host_calls_aside']} calls) of 1 passes were set aside" in md
    # each pass's batches are on record, and re-selected against the run's final limit (the same limit
    # these passes were filtered against: the same selection)
    for r in (a, b):
        assert sum(n for n, *_ in r["host_batch_log"]) == len(r["host_every_us"])
        assert r["host_refilter"]["limit_us"] == pytest.approx(100.0 * 1.25, abs=1.3)
        assert r["host_refilter"]["calls"] == len(r["samples_us"]) and r["host_refilter"]["enough"] is True
        assert r["host_refilter"]["median_us"] == pytest.approx(r["median_us"], abs=1e-3)
    assert "0 of 2 passes would keep fewer calls" in md
    # a host that never comes back within host_max_time_s: the pass keeps every sample, says so, is retaken
    res = _slow_host_sweep(tiny, slow_probe_calls=10**9, retakes=1, recover_s=0.1, batch_filter=True, max_time_s=0.2)
    for r in res["rows"]:
        assert r["host_clean"] is False and r["host_slow"] is True and r["host_retaken"][0]["host_clean"] is False
    assert "(not clean)" in to_markdown(res)


def test_a_pass_left_short_of_its_minimum_is_retaken_like_a_slow_one(tiny):
    # the host reads its usual speed throughout, but the pass cannot collect min_time_s of kept calls
    # within max_time_s: it is retaken, and still short after the last retake it is flagged host_slow
    logged: list[str] = []
    res = _slow_host_sweep(tiny, slow_probe_calls=0, retakes=1, recover_s=0.1, batch_filter=True, max_time_s=0.1,
                           min_time_s=30.0, call_s=0.005, log=logged.append)
    for r in res["rows"]:
        assert r["host_short"] is True and r["host_clean"] is True and r["host_probe_median_us"] < 101.0
        (first,) = r["host_retaken"]
        assert first["host_short"] is True and first["host_probe_median_us"] < 101.0
        assert r["host_slow"] is True
    assert any(", short" in line for line in logged)
    md = to_markdown(res)
    assert "(short)" in md and "2 kept passes ran out of time short of their minimum (host_short)" in md
    # time enough for the minimum: neither short nor retaken
    res = _slow_host_sweep(tiny, slow_probe_calls=0, batch_filter=True, max_time_s=30.0, min_time_s=0.05, call_s=0.005)
    for r in res["rows"]:
        assert r["host_short"] is False and r["host_retaken"] == [] and r["host_slow"] is False


def test_the_host_check_stops_retaking_once_its_budget_is_spent(tiny):
    # a host slow for good: every pass would be retaken (waiting recover_s before each retake); the
    # budget lets the first case spend it, and later passes are kept as first timed, flagged host_slow
    budget = random.uniform(0.25, 0.35)
    logged: list[str] = []
    t0 = time.perf_counter()
    res = _slow_host_sweep(tiny, slow_probe_calls=10**9, retakes=3, recover_s=0.2, batch_filter=True, max_time_s=0.1,
                           tokens=(1, 2, 4), extra_budget_s=budget, log=logged.append)
    rows = sorted(res["rows"], key=lambda r: (r["tokens"], r["pass"]))
    assert len(rows) == 6 and all(r["host_slow"] for r in rows)
    assert rows[0]["host_retaken"]  # the budget was there to spend
    spent = [r for r in rows if r.get("host_budget_spent")]
    assert spent and rows[-1].get("host_budget_spent") and all(r["host_retaken"] == [] for r in spent[1:])
    # once spent, passes are not filtered either (no max_time_s extension): no set-aside count on them
    assert "host_batches_aside" not in rows[-1]
    assert budget <= res["meta"]["host_extra_s"] < budget + 3 * (0.2 + 0.1) + 1.0  # overshoot: at most one retake
    assert any("budget is spent" in line for line in logged)
    assert f"of its {budget:g} s budget" in to_markdown(res)
    # every row left a log line with its median and the host's speed
    assert sum("host probe" in line and "pass " in line for line in logged) == 6
    assert time.perf_counter() - t0 < 30


def test_a_pass_kept_against_a_slow_calibration_is_re_timed_once_the_baseline_falls(tiny):
    # the host is slow (150) at calibration and through pass A (its 4 probes), back to 100 from pass B:
    # pass A read no slower than the baseline then, and is over the limit once pass B lowers it
    logged: list[str] = []
    res = _slow_host_sweep(tiny, slow_probe_calls=4, calibration_us=150.0, log=logged.append)
    a, b = sorted(res["rows"], key=lambda r: r["pass"])
    assert res["meta"]["host_probe_calibration_us"] == 150.0
    assert a["host_rejudged"]["re_timed"] is True and a["host_rejudged"]["host_probe_median_us"] == 150.0
    assert a["host_rejudged"]["limit_us"] < 150.0 and a["host_probe_median_us"] < 101.0 and not a["host_slow"]
    assert "host_rejudged" not in b and b["host_probe_median_us"] < 101.0
    assert any("re-timed: first taken at probe 150" in line for line in logged)
    md = to_markdown(res)
    assert "1 passes kept at first were over the limit" in md and "re-timed later" in md
    # no budget left: the pass is not re-timed but flagged, so no slow pass stands unmarked
    res = _slow_host_sweep(tiny, slow_probe_calls=4, calibration_us=150.0, extra_budget_s=0.0)
    a, b = sorted(res["rows"], key=lambda r: r["pass"])
    assert a["host_rejudged"]["re_timed"] is False and a["host_slow"] is True and a["host_probe_median_us"] == 150.0
    assert "not re-timed: no budget or time" in to_markdown(res)


def test_sweep_cases_not_begun_by_the_deadline_are_skipped_but_begun_cases_finish(tiny, tmp_path):
    g, w = tiny
    x = torch.randn(16, 16)
    seen_on_disk: list[int] = []
    sw_box: list = []

    def call(inp):
        if inp.num_tokens == 2 and sw_box[0].out_dir:  # what is on disk while T=2 runs
            with open(os.path.join(sw_box[0].out_dir, "results.json")) as f:
                seen_on_disk.append(len(json.load(f)["rows"]))
        return x @ x

    cb = bk.CallableBackend("host-bound", call, host_bound=True)
    cfg = SweepConfig(preset="tiny", tokens=[1, 2, 4], backends=[], repeats=3, reference_repeats=3, warmup=1,
                      passes=2, block_m_study=False, ragged=False, staging=False, overhead=False, device="cpu",
                      ceilings=CPU_CEIL, progress=False, weights=w, extra_backends=[cb], host_min_time_s=0.0,
                      host_min_warmup_s=0.0, drift_check=False, out_dir=str(tmp_path), deadline_s=1e9)
    sw = Sweep(cfg, log=lambda s: None)
    sw_box.append(sw)
    n_cases = random.choice([1, 2])
    sw.time_left = lambda: len(sw.results["rows"]) < 2 * n_cases  # the deadline falls after n_cases cases
    res = sw.run()
    assert sorted((r["tokens"], r["pass"]) for r in res["rows"]) == [(t, p) for t in (1, 2)[:n_cases] for p in (0, 1)]
    cut = {k: why for k, why in res["skipped"].items() if not k.startswith("backend ")}  # not: kernels absent on a CPU
    assert set(cut) == {f"host-bound T={t}" for t in (1, 2, 4)[n_cases:]}
    assert all("deadline" in why for why in cut.values())
    if n_cases == 2:
        assert {2, 3} <= set(seen_on_disk)  # timing T=2: each earlier host-bound row already on disk


def test_best_block_m_has_no_best_where_a_forced_block_m_was_not_timed():
    from megamoe.bench.sweep import best_block_m

    t1, t2 = random.uniform(50, 60), random.uniform(70, 80)
    study = [{"backend": "k", "tokens": 1, "forced_block_m": 8, "median_us": t1},
             {"backend": "k", "tokens": 1, "forced_block_m": 64, "median_us": t2},
             {"backend": "k", "tokens": 2, "forced_block_m": 8, "median_us": t2}]  # BM 64 at 2 tokens: deadline
    rows = [{"backend": "k", "tokens": t, "pass": 0, "median_us": t1, "block_m": 64} for t in (1, 2)]
    full, part = best_block_m(study, rows)
    assert (full["best_block_m"], full["missing"]) == (8, []) and full["plan_over_best"] == pytest.approx(1.0)
    assert part["missing"] == [64] and part["best_block_m"] is None and part["plan_over_best"] is None
    res = {"meta": {"card": "test", "date": "2026-12-03T00:00:00Z", "commit": "x", "versions": {}}, "rows": [],
           "block_m_best": [full, part]}
    md = to_markdown(res)
    assert "- (BM 64 not timed)" in md


def test_wait_for_host_needs_a_whole_window_of_fast_probes(tiny):
    g, w = tiny
    reads = iter([150.0, 100.0, 150.0, 100.0] + [100.0] * 1000)  # a host flipping, then back for good
    seen = []

    def probe():
        time.sleep(0.01)
        seen.append(1)
        return next(reads)

    cfg = SweepConfig(preset="tiny", device="cpu", weights=w, host_probe=probe, host_speed_check=True,
                      host_recover_s=5.0, host_recover_window_s=0.1, progress=False)
    sw = Sweep(cfg, log=lambda s: None)
    sw._host_best = 100.0
    waited = sw.wait_for_host()
    assert 0.1 <= waited < 1.0 and len(seen) >= 3 + 10  # not done at the first fast probe (the 2nd read)
    cfg.host_recover_s = 0.15
    reads = iter([150.0] * 1000)  # never recovers: the wait ends at host_recover_s
    t0 = time.perf_counter()
    assert 0.15 <= sw.wait_for_host() < 0.5 and time.perf_counter() - t0 < 0.5


def test_host_speed_check_is_on_for_cuda_runs_only_unless_asked(tiny):
    g, w = tiny
    assert Sweep(SweepConfig(preset="tiny", device="cpu", weights=w), log=lambda s: None).host_speed_check is False
    assert Sweep(SweepConfig(preset="tiny", device="cpu", weights=w, host_speed_check=True),
                 log=lambda s: None).host_speed_check is True
    if torch.cuda.is_available():
        assert Sweep(SweepConfig(preset="tiny", device="cuda", weights=w), log=lambda s: None).host_speed_check is True


def test_card_identity_reads_nvidia_smi_and_lands_in_the_report(tmp_path, monkeypatch):
    from megamoe.bench.sweep import card_identity

    serial, watts = str(random.randrange(10**12, 10**13)), f"{random.uniform(500, 700):.2f} W"
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\n"
                   "case \"$*\" in *'-i 3'*) ;; *) echo wrong index >&2; exit 2;; esac\n"
                   f"echo '{serial}, 00000000:19:00.0, {watts}, 1980 MHz, 96.00.99.00.01'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    ident = card_identity(torch.device("cuda", 3), uuid="GPU-abc")
    assert ident == {"uuid": "GPU-abc", "serial": serial, "pci.bus_id": "00000000:19:00.0",
                     "power.limit": watts, "clocks.max.sm": "1980 MHz", "vbios_version": "96.00.99.00.01"}
    res = {"meta": {"card": "test", "date": "2026-12-03T00:00:00Z", "commit": "x", "versions": {}, "gpu": ident},
           "rows": []}
    assert f"- card: uuid GPU-abc, serial {serial}, pci.bus_id 00000000:19:00.0, power.limit {watts}" in to_markdown(res)
    monkeypatch.setenv("PATH", str(tmp_path / "none"))  # no nvidia-smi at all: the UUID alone
    assert card_identity(torch.device("cuda", 0), uuid="GPU-x") == {"uuid": "GPU-x"}


def test_the_pytest_suites_time_a_device_pass_as_the_sweep_does():
    # bench/test_bench_fused.py times with these keywords: the sweep's device-bound pass (1 s of samples
    # over the card's power-cap cycle), so `pytest bench/` and `megamoe bench` report comparable figures
    import inspect

    from megamoe.bench.suite import device_pass_kwargs

    cfg = SweepConfig()
    reps = random.randint(1, 5000)
    kw = device_pass_kwargs("cuda", reps)
    assert kw == {"min_warmup_s": cfg.device_min_warmup_s, "min_time_s": cfg.device_min_time_s,
                  "max_repeats": max(reps, cfg.device_max_repeats)}
    assert set(kw) <= set(inspect.signature(time_fn).parameters)
    assert device_pass_kwargs("cpu", reps) == {}


def test_the_pytest_fused_suite_takes_the_path_the_sweep_takes(monkeypatch):
    # the unfused peer promises graph_capturable: the sweep times it from CUDA-graph replays, and an
    # event-timed pytest pass put its host-side launches in the figure (854 us against 235 us at 1 token,
    # H200 2026-12-03). time_fused_case must pick select_timing's path with the sweep's arguments.
    from megamoe.bench import timing
    from megamoe.bench.suite import device_pass_kwargs, time_fused_case
    from megamoe.bench.sweep import select_timing

    calls = []

    def fake(kind):
        def timer(fn, **kw):
            calls.append((kind, kw))
            return Timing(samples_us=[random.uniform(1, 9) for _ in range(3)], method=kind)
        return timer

    monkeypatch.setattr(timing, "time_graph", fake("cuda-graph"))
    monkeypatch.setattr(timing, "time_fn", fake("cuda-events"))
    reps = random.randint(2, 40)
    for promise in (True, False):
        b = bk.CallableBackend("x", lambda inp: inp, graph_capturable=promise)
        calls.clear()
        tm = time_fused_case(b, lambda: None, None, "cuda", warmup=3, repeats=reps)
        kind, kw = calls[0]
        assert len(calls) == 1 and kind == select_timing(b, "cuda") == tm.extra["path"] == tm.method
        assert kind == ("cuda-graph" if promise else "cuda-events")
        expected = {"args": None, "warmup": 3, "repeats": reps, "flush_l2": True, "device": "cuda"}
        if not promise:
            expected.update(device_pass_kwargs("cuda", reps))
        assert kw == expected
    sets = [object(), object()]  # rotated input sets: no L2 flush, as in the sweep
    time_fused_case(bk.CallableBackend("y", lambda inp: inp), lambda s: None, sets, "cuda")
    assert calls[-1][1]["flush_l2"] is False and calls[-1][1]["args"] is sets


def test_the_pytest_benchmark_json_becomes_a_table_of_its_extra_info(tmp_path):
    # a real pytest-benchmark run of one suite (staging cast, 2 token counts), then its JSON as markdown
    from megamoe.bench.report import benchmark_json_markdown

    toks = sorted(random.sample(range(1, 33), 2))
    out = tmp_path / "b.json"
    sha = f"{random.getrandbits(40):010x}"
    env = {**os.environ, "MEGAMOE_BENCH_PRESET": "tiny", "MEGAMOE_BENCH_TOKENS": ",".join(map(str, toks)),
           "PYTHONPATH": os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""), "MEGAMOE_COMMIT": sha}
    subprocess.run([sys.executable, "-m", "pytest", "bench/test_bench_reference.py", "-k", "staging_cast", "-q",
                    "-p", "no:cacheprovider", "--benchmark-enable", f"--benchmark-json={out}"],
                   check=True, env=env, capture_output=True, timeout=300)
    bench = json.loads(out.read_text())
    # the run's own record (bench/conftest.py): the commit it was told, the versions it ran with
    meta = bench["machine_info"]["megamoe"]
    assert meta["commit"] == sha and meta["versions"]["torch"] == torch.__version__
    own = benchmark_json_markdown(bench)
    assert f"commit {sha}," in own and f"- versions: python {meta['versions']['python']}, torch {torch.__version__}" in own
    md = benchmark_json_markdown(bench, commit="abc1234567")
    assert md.startswith("# pytest bench/") and "commit abc1234567" in md
    lines = [ln for ln in md.splitlines() if ln.startswith("| test_bench_staging_cast")]
    assert len(lines) == len(toks) == len(bench["benchmarks"])
    for b, ln in zip(bench["benchmarks"], lines):
        cells = [c.strip() for c in ln.strip("|").split("|")]
        e = b["extra_info"]
        assert cells[0] == b["name"] and cells[3] == e["method"] and cells[4] == str(e["repeats"])
        assert float(cells[1].replace(",", "")) == pytest.approx(e["device_us"], rel=0.01, abs=0.06)
        assert float(cells[5].replace(",", "")) == pytest.approx(b["stats"]["median"] * 1e6, rel=0.01, abs=0.06)

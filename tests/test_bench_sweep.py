"""CPU tests of ``megamoe bench``'s sweep: a fake fused kernel (a real ``FusedBackend`` subclass over the eager
reference) driven through its one spelling, the host-bound rule, the studies, the files, two processes merged."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
import torch

from megamoe.bench import backends as bk
from megamoe.bench import sweep as sw
from megamoe.bench.ceilings import Ceilings
from megamoe.provenance import card_identity, new_results_dir
from megamoe.bench.report import to_markdown
from megamoe.bench.sweep import SweepConfig, run_sweep, select_timing
from megamoe.bench.tables import best_block_m, repeatability, speedups
from megamoe.bench.timing import Timing
from megamoe.fused.base import FusedBackend, Plan
from megamoe.inputs import make_inputs, pad_inputs
from megamoe.recipe import FLASHINFER_MXFP4

CPU_CEIL = Ceilings("cpu (test)", copy_gbps=10.0, fp8_tflops=0.5, bf16_tflops=0.5)


class OneRank:
    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


class FakeKernel(FusedBackend):
    """The FusedBackend life cycle on a CPU: launch() returns the reference output computed at stage()."""

    name, recipe, weight_format, parallel_builds = "fake-kernel", FLASHINFER_MXFP4, "mxfp4", True
    wrong = 1.0

    def __init__(self, geometry, *, capacity, force_block_m=None, group=None):
        super().__init__(geometry, capacity=capacity, force_block_m=force_block_m, group=group or OneRank())
        self.built, self.launches, self.launched_block_ms, self.synthetic = [], 0, [], False

    @classmethod
    def availability(cls):
        return True, ""

    @classmethod
    def synthetic_weights(cls, weights):
        from megamoe.layouts.ranges import repair_ranges

        return repair_ranges(weights, cls.recipe)

    @property
    def device(self):
        return torch.device("cpu")

    def legal_block_ms(self):
        return (8, 24)

    def plan(self, num_tokens, block_m=None):
        return Plan(block_m or (8 if num_tokens <= 4 else 24), forced=block_m is not None)

    def _prepare(self, weights):
        self.kernel_weights = weights

    def _allocate(self):
        pass

    def _build_job(self, num_tokens, block_m=None):
        bm = self.plan(num_tokens, block_m).block_m
        return (bm,), (lambda: self.built.append(bm))

    _ys: dict = {}

    def _stage(self, inputs, m):  # the reference's output, once per (inputs, m): the tests stay quick
        from megamoe.reference import moe_forward

        key = (id(inputs), m, self.wrong)
        if key not in self._ys:
            self._ys[key] = (inputs, moe_forward(pad_inputs(inputs, m), self.kernel_weights, self.recipe, self.g) * self.wrong)
        self.y = self._ys[key][1]

    def launch(self, num_tokens, block_m=None):
        self.launches += 1
        self.launched_block_ms.append(block_m)
        return self.y[:num_tokens]


class FakePeer(FakeKernel):
    name, fused, graph_capturable = "fake-peer", False, True


class FakeSyncingPeer(FakeKernel):
    name, fused = "fake-syncing-peer", False  # not capturable and not fused: host-bound


class FakeOther(FakeKernel):
    name = "fake-other"


@pytest.fixture
def fakes(monkeypatch):
    reg = {c.name: c for c in (FakeKernel, FakePeer, FakeSyncingPeer, FakeOther)}
    monkeypatch.setattr(bk, "fused_registry", lambda: dict(reg))
    return reg


def _cfg(w, tmp_path=None, **kw):
    base = dict(preset="tiny", tokens=[1, 8], backends=["fake-kernel", "fake-peer", "reference"], repeats=3, warmup=1,
                rotate=2, rep_ms=30.0, ragged_means=[4], overhead_tokens=[8], overhead_rounds=4, device="cpu",
                ceilings=CPU_CEIL, out_dir=str(tmp_path) if tmp_path else None, progress=False, weights=w, seed=5)
    base.update(kw)
    return SweepConfig(**base)


def test_the_sweep_end_to_end_on_a_cpu(tiny, fakes, tmp_path):
    g, w = tiny
    res = run_sweep(_cfg(w, tmp_path), log=lambda s: None)
    assert res["errors"] == [], res["errors"]
    assert list(res["section_seconds"]) == ["ceilings", "setup", "sweep", "overhead", "staging", "block_m", "ragged"]
    rows = res["rows"]
    dev = [r for r in rows if r["backend"] != "reference"]
    ref = [r for r in rows if r["backend"] == "reference"]
    assert sorted((r["backend"], r["tokens"], r["pass"]) for r in dev) == sorted(
        (b, t, p) for b in ("fake-kernel", "fake-peer") for t in (1, 8) for p in (0, 1))
    # host-bound rows: one pass, never retaken, mean +- standard error over whole rotations for rep_ms
    assert [(r["tokens"], r["pass"]) for r in ref] == [(1, 0), (8, 0)]
    for r in ref:
        assert r["host_bound"] and r["statistic"] == "mean" and r["us"] == pytest.approx(r["mean_us"])
        assert r["stderr_us"] > 0 and r["repeats"] % 2 == 0 and sum(r["samples_us"]) >= 30e3
    for r in dev:
        assert r["statistic"] == "median" and r["us"] == r["median_us"] and not r["host_bound"]
        assert r["checked"] and r["correct"] and r["calc_diff"] == 0.0 and r["process"] == 1
        assert r["read_us"] > 0 and r["frac_of_read"] == pytest.approx(r["read_us"] / r["us"])
        assert r["read_kernel"] == "torch" and r["read_us_stream"] is None  # no streaming read off CUDA
    # every size's reads, once each, in the ceilings: the rows' figures are theirs
    sizes = {s["bytes"]: s for s in res["ceilings"]["read_sizes"]}
    assert res["ceilings"]["read_candidates"] == ["torch"] and len(sizes) == len(res["ceilings"]["read_sizes"])
    for r in dev:
        assert sizes[-(-int(r["bytes"]) // 16) * 16]["us"] == r["read_us"]
    assert {r["block_m"] for r in dev if r["backend"] == "fake-kernel"} == {8, 24}
    assert {(x["backend"], x["tokens"]) for x in res["repeatability"]} == {(r["backend"], r["tokens"]) for r in dev}
    assert len(res["block_m"]) == 2 * 2 and res["block_m_best"]  # 2 forced BMs x 2 token counts
    assert res["ragged"] and res["ragged"][0]["counts"] == [1, 3, 5, 7] and res["ragged"][0]["agreed"] == 7
    assert {o["backend"] for o in res["overhead"]} == {"fake-kernel", "fake-peer"}  # no host-bound row
    assert any("fake-kernel: stage()" in s["what"] and "frac_of fake-kernel" in s for s in res["staging"])
    assert res["plans_built"] >= 2 and {d["backend"] for d in res["drift"]} == {"fake-kernel", "fake-peer"}
    assert {b["name"]: b["host_bound"] for b in res["backends"]} == {"fake-kernel": False, "fake-peer": False,
                                                                     "reference": True}
    (folder,) = os.listdir(tmp_path)
    assert folder.startswith(res["meta"]["date"][:10]) and folder.endswith(res["meta"]["commit"])
    assert {"results.json", "results.md", "sweep.png", "block_m.png"} <= set(os.listdir(tmp_path / folder))
    back = json.loads((tmp_path / folder / "results.json").read_text())
    assert back["meta"]["versions"]["megamoe"] and back["meta"]["versions"]["torch"] == torch.__version__
    md = to_markdown(back)
    for needle in ("## Sweep", "+-", "read ", "## Repeatability (device-bound rows)", "## BLOCK_M study",
                   "## Ragged step", "## Staging cost", "## Harness overhead"):
        assert needle in md, needle


def test_a_wrong_kernel_is_marked_fail_but_still_timed(tiny, fakes):
    g, w = tiny

    class Broken(FakeKernel):
        name, wrong = "broken", 2.0

    fakes["broken"] = Broken
    res = run_sweep(_cfg(w, backends=["broken"], studies=()), log=lambda s: None)
    assert all(r["correct"] is False and r["calc_diff"] > 0.1 for r in res["rows"]) and len(res["rows"]) == 4
    assert "FAIL" in to_markdown(res)


def test_timing_paths(tiny, fakes, monkeypatch):
    g, w = tiny
    kernel, peer, syncing = (bk.FusedBench(c, g, 8) for c in (FakeKernel, FakePeer, FakeSyncingPeer))
    assert select_timing(peer, "cuda") == "cuda-graph" and select_timing(peer, "cuda", use_graphs=False) == "cuda-events"
    assert select_timing(kernel, "cuda") == "cuda-events" and select_timing(peer, "cpu") == "perf_counter"
    assert syncing.host_bound and not peer.host_bound and not kernel.host_bound
    assert bk.reference_backend(g, w).host_bound
    # a capturable backend is timed from graph replays; a failed capture keeps an event figure and says why
    calls, fail = [], []

    def fake_graph(fn, *, args=None, warmup=3, repeats=10, flush_l2=False, device=None, **kw):
        calls.append((args, flush_l2, kw))
        if fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        return Timing([10.0] * repeats, "cuda-graph", warmup=warmup, flushed=flush_l2)

    monkeypatch.setattr(sw, "select_timing", lambda b, d, g=True: bk.select_timing(b, "cuda", g))
    monkeypatch.setattr(sw, "time_graph", fake_graph)
    cfg = _cfg(w, backends=["fake-peer", "fake-kernel"], studies=(), drift_check=False, check=False)
    rows = run_sweep(cfg, log=lambda s: None)["rows"]
    assert {r["path"] for r in rows if r["backend"] == "fake-peer"} == {"cuda-graph"} and len(calls) == 4
    assert all(a is None and fl for a, fl, _ in calls)  # one staged set, the L2 flushed between replays
    assert {r["path"] for r in rows if r["backend"] == "fake-kernel"} == {"cuda-events"}
    fail.append(1)
    rows = run_sweep(cfg, log=lambda s: None)["rows"]
    peer_rows = [r for r in rows if r["backend"] == "fake-peer"]
    assert peer_rows and all(r["path"] == "cuda-events (graph capture failed)" and "capturing" in r["graph_error"]
                             for r in peer_rows)


def test_cases_not_begun_by_the_deadline_are_skipped_and_begun_ones_finish(tiny, fakes):
    g, w = tiny
    s = sw.Sweep(_cfg(w, backends=["fake-kernel"], tokens=[1, 2, 4], studies=(), drift_check=False, deadline_s=1e9),
                 log=lambda s_: None)
    n = random.choice([1, 2])
    s.time_left = lambda: len(s.results["rows"]) < 2 * n
    res = s.run()
    assert sorted((r["tokens"], r["pass"]) for r in res["rows"]) == [(t, p) for t in (1, 2, 4)[:n] for p in (0, 1)]
    assert {k for k in res["skipped"] if k.startswith("fake")} == {f"fake-kernel T={t}" for t in (1, 2, 4)[n:]}


def test_two_processes_on_one_card_make_one_document(tiny, fakes, tmp_path):
    """``--append``: the second process's rows join the first's folder; a backend timed in both keeps both
    readings ("name [p2]") and the cross-process table compares them."""
    g, w = tiny
    first = run_sweep(_cfg(w, tmp_path, backends=["fake-kernel", "reference"], studies=("ragged",)), log=lambda s: None)
    folder = first["out_dir"]
    second = run_sweep(_cfg(w, append_dir=folder, backends=["fake-other", "fake-kernel"], studies=("ragged",)),
                       log=lambda s: None)
    doc = json.loads(open(os.path.join(folder, "results.json")).read())
    assert second["out_dir"] == folder and os.listdir(tmp_path) == [os.path.basename(folder)]
    assert {(r["backend"], r["process"]) for r in doc["rows"]} == {
        ("fake-kernel", 1), ("reference", 1), ("fake-other", 2), ("fake-kernel [p2]", 2)}
    assert [p["process"] for p in doc["processes"]] == [1, 2]
    assert {(x["backend"], x["tokens"]) for x in doc["cross_process"]} == {("fake-kernel", 1), ("fake-kernel", 8)}
    assert sorted(r["backend"] for r in doc["ragged"]) == ["fake-kernel", "fake-other"]  # not studied twice
    md = open(os.path.join(folder, "results.md")).read()
    assert "process 2:" in md and "## One backend in two processes" in md and "fake-kernel [p2] us" in md
    assert "process 1: fake-kernel, reference; process 2: fake-other, fake-kernel [p2]." in md
    with pytest.raises(ValueError, match="tokens"):
        sw.Sweep(_cfg(w, append_dir=folder, tokens=[1, 2]), log=lambda s: None)
    with pytest.raises(ValueError, match="preset"):
        sw.Sweep(_cfg(w, append_dir=folder, preset="small"), log=lambda s: None)


def test_derived_tables():
    rows = [{"backend": "f", "fused": True, "tokens": 1, "pass": 0, "median_us": 100.0, "us": 100.0},
            {"backend": "u", "fused": False, "tokens": 1, "pass": 0, "median_us": 300.0, "us": 300.0},
            {"backend": "f", "fused": True, "tokens": 1, "pass": 1, "median_us": 102.0, "us": 102.0},
            {"backend": "u", "fused": False, "tokens": 1, "pass": 1, "median_us": 330.0, "us": 330.0},
            {"backend": "reference", "fused": False, "tokens": 1, "pass": 0, "median_us": 9e3, "us": 9e3,
             "host_bound": True}]
    assert {r["backend"]: r["flag"] for r in repeatability(rows)} == {"f": False, "u": True}  # 10%: flagged, kept
    (sp,) = speedups(rows)
    assert sp["speedup"] == pytest.approx(3.0) and sp["speedup_vs_reference"] == pytest.approx(90.0)
    t1, t2 = random.uniform(50, 60), random.uniform(70, 80)
    study = [{"backend": "k", "tokens": 1, "forced_block_m": 8, "median_us": t1},
             {"backend": "k", "tokens": 1, "forced_block_m": 64, "median_us": t2},
             {"backend": "k", "tokens": 2, "forced_block_m": 8, "median_us": t2}]  # BM 64 at 2 tokens: cut
    full, part = best_block_m(study, [{"backend": "k", "tokens": t, "pass": 0, "median_us": t1} for t in (1, 2)])
    assert (full["best_block_m"], full["plan_over_best"]) == (8, pytest.approx(1.0))
    assert part["missing"] == [64] and part["best_block_m"] is None and part["plan_over_best"] is None


def test_results_folders_are_never_overwritten(tmp_path):
    meta = {"date": "2026-12-03T00:00:00Z", "card": "NVIDIA H200", "commit": "abc"}
    made = [new_results_dir(str(tmp_path / "out"), meta) for _ in range(3)]
    assert [os.path.basename(m) for m in made] == ["2026-12-03_nvidia-h200_abc", "2026-12-03_nvidia-h200_abc-2",
                                                   "2026-12-03_nvidia-h200_abc-3"]


def test_card_identity_reads_nvidia_smi(tmp_path, monkeypatch):
    serial, watts = str(random.randrange(10**12, 10**13)), f"{random.uniform(500, 700):.2f} W"
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\ncase \"$*\" in *'-i 3'*) ;; *) exit 2;; esac\n"
                   f"echo '{serial}, 00000000:19:00.0, {watts}, 1980 MHz, 96.00.99.00.01'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    assert card_identity(torch.device("cuda", 3), uuid="GPU-abc") == {
        "uuid": "GPU-abc", "serial": serial, "pci.bus_id": "00000000:19:00.0", "power.limit": watts,
        "clocks.max.sm": "1980 MHz", "vbios_version": "96.00.99.00.01"}
    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    assert card_identity(torch.device("cuda", 0), uuid="GPU-x") == {"uuid": "GPU-x"}


def test_the_sweep_plot_uses_the_palette(tiny, fakes, tmp_path, monkeypatch):
    import matplotlib.colors as mc
    import matplotlib.pyplot as plt

    from megamoe.bench.plots import plot_sweep
    from megamoe.palette import backend_colour

    g, w = tiny
    res = run_sweep(_cfg(w, backends=["fake-kernel", "reference"], studies=()), log=lambda s: None)
    figs = []
    monkeypatch.setattr(plt, "close", figs.append)
    assert plot_sweep(res, str(tmp_path / "s.png"))
    lines = {ln.get_label(): ln.get_color() for ln in figs[0].axes[0].get_lines()}
    for name in ("fake-kernel", "reference"):
        assert mc.to_rgba(lines[name]) == mc.to_rgba(backend_colour(name))


def test_run_sweep_sh_dry_run_on_a_cpu(tmp_path):
    """bench/device/run_sweep.sh end to end on a CPU (tiny preset): both processes, the second appending."""
    env = {**os.environ, "OUT": str(tmp_path), "PRESET": "tiny", "TOKENS": "1 4", "DEVICE": "cpu",
           "BACKENDS1": "reference", "BACKENDS2": "reference", "DEEPGEMM_FP4_PATH": str(tmp_path),
           "EXTRA": "--rep-ms 20 --studies staging", "PYTHON": sys.executable}
    p = subprocess.run(["bash", "bench/device/run_sweep.sh"], env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (folder,) = [d for d in os.listdir(tmp_path) if os.path.isdir(tmp_path / d)]
    doc = json.loads((tmp_path / folder / "results.json").read_text())
    assert [m["process"] for m in doc["processes"]] == [1, 2] and {r["process"] for r in doc["rows"]} == {1, 2}
    assert {"log-1.txt", "log-2.txt", "nvidia-smi.txt"} <= set(os.listdir(tmp_path))


def test_the_pytest_suites_time_a_case_as_the_sweep_does(monkeypatch):
    """bench/test_bench_fused.py times each backend by the sweep's path (graph replays for a capturable backend:
    an event-timed pass once read 854 us against 235 us from graph replays for the unfused peer at 1 token) and
    with the sweep's device pass (1 s of samples over the H200's power-cap cycle)."""
    from megamoe.bench import timing
    from megamoe.bench.suite import device_pass_kwargs, time_fused_case

    reps = random.randint(1, 5000)
    cfg = SweepConfig()
    assert device_pass_kwargs("cuda", reps) == {"min_warmup_s": cfg.warmup_ms / 1e3, "min_time_s": cfg.rep_ms / 1e3,
                                                "max_repeats": max(reps, cfg.max_repeats)}
    assert device_pass_kwargs("cpu", reps) == {}
    calls = []
    for kind, name in (("cuda-graph", "time_graph"), ("cuda-events", "time_fn")):
        monkeypatch.setattr(timing, name, lambda fn, kind=kind, **kw: calls.append((kind, kw)) or Timing([1.0], kind))
    for promise in (True, False):
        b = bk.CallableBackend("x", lambda inp: inp, graph_capturable=promise)
        tm = time_fused_case(b, lambda: None, None, "cuda", warmup=3, repeats=7)
        kind, kw = calls[-1]
        assert kind == select_timing(b, "cuda") == tm.extra["path"] == ("cuda-graph" if promise else "cuda-events")
        assert kw["flush_l2"] is True and kw["min_time_s"] == cfg.rep_ms / 1e3 and kw["repeats"] == 7


def test_a_forced_block_m_is_a_view_of_the_prepared_backend(tiny, fakes):
    g, w = tiny
    b = bk.FusedBench(FakeKernel, g, 64)
    b.prepare(w)
    assert b.obj.kernel_weights is not w  # handed cls.synthetic_weights(w), not w
    jobs = b.build_jobs([1, 2, 8, 64], 24)
    assert {k[1] for k in jobs} == {(24,)} and b.obj.force_block_m is None  # built at the forced BM, nothing pinned
    v = b.with_block_m(8)
    assert v.obj is b.obj and v.plan(64)["block_m"] == 8 and v.plan(64)["forced"] is True
    assert b.plan(64)["block_m"] == 24 and b.plan(64)["forced"] is False  # the base asks for the plan's own choice
    with pytest.raises(ValueError, match=r"block_m must be one of \(8, 24\) \(or None\), got 7"):
        b.with_block_m(7)
    v.close()
    assert b.obj.launches == 0 and b.owner and not v.owner
    fn, args = v.timer([make_inputs(g, 3, seed=1)])
    fn()
    b.timer([make_inputs(g, 3, seed=1)])[0]()  # the base after the view: its own plan, whatever the view ran
    assert args is None and b.obj.launched_block_ms == [8, None] and b.obj.force_block_m is None

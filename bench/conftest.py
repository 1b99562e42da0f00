"""pytest-benchmark suites of megamoe: ``pytest bench/ --benchmark-only`` (a CPU: the reference and its stages;
an H200: every fused backend too), ``--benchmark-json=F`` to save, ``pytest-benchmark compare`` to compare.

The figure pytest-benchmark records is the device time of each timed call (``megamoe.bench.suite.device_clock``
is its timer: CUDA events, or CUDA-graph replays for a graph-capturable backend; perf_counter on a CPU), timed by
``megamoe.bench.timing`` the way ``megamoe bench`` times it. ``extra_info`` adds the rates, the fractions of the
ceilings measured in the session and of the roofline floor, BLOCK_M and calc_diff. Without --benchmark-only the
suites run once each as tests (CI).

Environment: MEGAMOE_BENCH_PRESET (default dsv4-flash on a GPU, small on a CPU), MEGAMOE_BENCH_TOKENS (comma
list; default 1,128,2048,8192 on a GPU, 1,16 on a CPU).
"""

from __future__ import annotations

import functools

import pytest
import torch

from megamoe.bench.ceilings import measure_ceilings
from megamoe.bench.roofline import achieved, step_floor
from megamoe.bench.suite import ON_GPU, bench_preset, device_clock, record_timing
from megamoe.geometry import get_geometry
from megamoe.weights import random_mxfp4_weights


def _gpu_skip_reason() -> str:
    if not torch.cuda.is_available():
        return "needs an SM90 (Hopper) GPU: torch.cuda.is_available() is False"
    if not ON_GPU:
        return f"needs an SM90 (Hopper) GPU: capability {torch.cuda.get_device_capability()}"
    return ""


def pytest_collection_modifyitems(config, items):
    reason = _gpu_skip_reason()
    for item in items:
        item.add_marker(pytest.mark.benchmark(timer=device_clock))  # pytest-benchmark reads the device clock
        if reason and "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))


def pytest_benchmark_update_machine_info(config, machine_info):
    """The run's commit (MEGAMOE_COMMIT where set), versions of what was imported, and the card's identity, as
    ``megamoe bench`` records them, into the benchmark JSON's machine_info."""
    from megamoe.provenance import run_metadata

    machine_info["megamoe"] = run_metadata("cuda" if ON_GPU else "cpu")


@functools.lru_cache(maxsize=None)
def _weights(preset: str, device: str):
    g = get_geometry(preset)
    return g, random_mxfp4_weights(g, seed=0, device=device)


@pytest.fixture(scope="session")
def device() -> str:
    return "cuda" if ON_GPU else "cpu"


@pytest.fixture(scope="session")
def geometry_and_weights(device):
    return _weights(bench_preset(), device)


@pytest.fixture(scope="session")
def ceilings(device):
    """Measured once per session on this device (a CPU: small sizes, so the suites stay quick)."""
    if device == "cuda":
        return measure_ceilings(device)
    return measure_ceilings(device, copy_bytes=16 * 2**20, matmul_n=128, repeats=3)


@pytest.fixture
def record(benchmark, ceilings):
    """record(timing, *, g=None, topk_idx=None, weight_format="mxfp4", **extra): the harness's device samples
    become pytest-benchmark's rounds (``record_timing``); rates, floor and ceilings go into extra_info."""

    def _record(timing, *, g=None, topk_idx=None, weight_format="mxfp4", **extra):
        info = {"device_us": timing.median_us, "spread": timing.spread, "method": timing.method,
                "path": timing.extra.get("path", timing.method), "repeats": len(timing.samples_us),
                "flushed": timing.flushed, "rotated": timing.rotated, "card": ceilings.device,
                "copy_gbps_ceiling": ceilings.copy_gbps, "fp8_tflops_ceiling": ceilings.fp8_tflops}
        if g is not None and topk_idx is not None:
            fl = step_floor(g, topk_idx, ceilings, weight_format)
            info.update(achieved(fl, timing.median_us, ceilings), experts_touched=fl.experts_touched)
        info.update(extra)
        benchmark.extra_info.update(info)
        record_timing(benchmark, timing)
        return info

    return _record

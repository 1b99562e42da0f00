"""pytest-benchmark suites of megamoe: ``pytest bench/ --benchmark-enable`` (CPU: the reference suites;
H200: every fused backend too).

pytest-benchmark's own clock is wall time; the numbers that matter come from megamoe.bench.timing
(CUDA events, L2 flushed or inputs rotated) and go into ``benchmark.extra_info``: device_us, TFLOP/s,
GB/s, the fraction of the measured ceilings and of the roofline floor, calc_diff of the checked output.

Environment: MEGAMOE_BENCH_PRESET (default dsv4-flash on a GPU, small on a CPU),
MEGAMOE_BENCH_TOKENS (comma list; default 1,128,2048,8192 on a GPU, 1,16 on a CPU).
"""

from __future__ import annotations

import functools

import pytest
import torch

from megamoe.bench.ceilings import measure_ceilings
from megamoe.bench.roofline import achieved, step_floor
from megamoe.bench.suite import ON_GPU, bench_preset
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
    if reason:
        skip = pytest.mark.skip(reason=reason)
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


def pytest_benchmark_update_machine_info(config, machine_info):
    """The run's commit (MEGAMOE_COMMIT where set: a device copy's git HEAD can be stale), package versions
    and card identity, as ``megamoe bench`` records them, into the benchmark JSON's machine_info."""
    from megamoe.bench.sweep import run_metadata

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
    """Measured once per session on this device (CPU: small sizes, so the suites stay quick)."""
    if device == "cuda":
        return measure_ceilings(device)
    return measure_ceilings(device, copy_bytes=16 * 2**20, matmul_n=256, repeats=3)


@pytest.fixture
def record(benchmark, ceilings):
    """record(fn, timing, *, g=None, topk_idx=None, weight_format="mxfp4", **extra): run ``fn`` under
    benchmark.pedantic (wall time, a few rounds) and put the harness's device time, the roofline floor
    and the achieved rates into benchmark.extra_info."""

    def _record(fn, timing, *, g=None, topk_idx=None, weight_format="mxfp4", rounds=3, **extra):
        info = {"device_us": timing.median_us, "device_min_us": timing.min_us, "spread": timing.spread,
                "method": timing.method, "repeats": len(timing.samples_us), "flushed": timing.flushed,
                "rotated": timing.rotated, "card": ceilings.device, "copy_gbps_ceiling": ceilings.copy_gbps,
                "fp8_tflops_ceiling": ceilings.fp8_tflops}
        if g is not None and topk_idx is not None:
            fl = step_floor(g, topk_idx, ceilings, weight_format)
            info.update(achieved(fl, timing.median_us, ceilings), experts_touched=fl.experts_touched)
        info.update(extra)
        benchmark.extra_info.update(info)
        benchmark.pedantic(fn, rounds=rounds, iterations=1, warmup_rounds=1)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return info

    return _record

"""The ceilings every floor divides by, recorded so a benchmark JSON carries them."""

from __future__ import annotations

import pytest

from megamoe.bench.ceilings import measure_copy_gbps
from megamoe.bench.timing import time_fn


def test_bench_ceilings(benchmark, ceilings, device):
    assert ceilings.copy_gbps > 0 and ceilings.fp8_tflops > 0 and ceilings.bf16_tflops > 0
    benchmark.extra_info.update(ceilings.as_dict())
    nbytes = 16 * 2**20 if device == "cpu" else 2 * 2**30
    benchmark.pedantic(lambda: measure_copy_gbps(device, nbytes, repeats=3), rounds=1, iterations=1)


@pytest.mark.gpu
def test_bench_timer_resolves_a_short_kernel(benchmark, device):
    """A 1 MiB copy (a few us): events must resolve it and the median must be stable."""
    import torch

    src = torch.randn(2**18, device=device)
    dst = torch.empty_like(src)
    tm = time_fn(lambda: dst.copy_(src), warmup=10, repeats=50, flush_l2=False, device=device)
    benchmark.extra_info.update(device_us=tm.median_us, spread=tm.spread)
    benchmark.pedantic(lambda: dst.copy_(src), rounds=10, iterations=1)
    assert 0 < tm.median_us < 100 and tm.spread < 0.5

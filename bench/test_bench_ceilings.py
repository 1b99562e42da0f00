"""The ceilings every floor divides by, recorded so a benchmark JSON carries them; and the timer on a short kernel."""

from __future__ import annotations

import pytest
import torch

from megamoe.bench.timing import time_fn


def test_bench_ceilings(record, ceilings, device):
    """The copy the copy-bandwidth ceiling is measured on, timed and recorded; the ceilings in extra_info."""
    assert ceilings.copy_gbps > 0 and ceilings.fp8_tflops > 0 and ceilings.bf16_tflops > 0
    nbytes = 16 * 2**20 if device == "cpu" else 2 * 2**30
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    tm = time_fn(lambda: dst.copy_(src), warmup=3, repeats=10, flush_l2=False, device=device)
    record(tm, **ceilings.as_dict(), copy_bytes_timed=nbytes, copy_gbps_timed=2 * nbytes / (tm.median_us * 1e-6) / 1e9)


@pytest.mark.gpu
def test_bench_timer_resolves_a_short_kernel(record, device):
    """A 1 MiB copy (a few us): events must resolve it and the median must be stable."""
    src = torch.randn(2**18, device=device)
    dst = torch.empty_like(src)
    tm = time_fn(lambda: dst.copy_(src), warmup=10, repeats=50, flush_l2=False, device=device)
    record(tm)
    assert 0 < tm.median_us < 100 and tm.spread < 0.5

"""Settings shared by the pytest-benchmark suites in bench/ (read from the environment)."""

from __future__ import annotations

import os

import torch

ON_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9


def bench_preset() -> str:
    """MEGAMOE_BENCH_PRESET, default dsv4-flash on an SM90 GPU, small elsewhere."""
    return os.environ.get("MEGAMOE_BENCH_PRESET", "dsv4-flash" if ON_GPU else "small")


def bench_tokens() -> list[int]:
    """MEGAMOE_BENCH_TOKENS (comma list), default 1,128,2048,8192 on a GPU, 1,16 elsewhere."""
    env = os.environ.get("MEGAMOE_BENCH_TOKENS")
    if env:
        return [int(t) for t in env.split(",") if t.strip()]
    return [1, 128, 2048, 8192] if ON_GPU else [1, 16]

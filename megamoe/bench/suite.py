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


def device_pass_kwargs(device: str, repeats: int = 20) -> dict:
    """``time_fn`` keywords for a device-bound pass on CUDA, timed as ``megamoe bench`` times it
    (``SweepConfig().device_pass``: at least 0.1 s of warm-up and 1 s of samples); none elsewhere. On the
    H200 under load the card steps its clock for ~0.25 s once a second at its power cap; a pass of 20
    calls (~2-100 ms) caught that cycle or missed it (bench/results/2026-12-03_nvidia-h200_levels/)."""
    from megamoe.bench.sweep import SweepConfig

    return SweepConfig().device_pass(repeats) if str(device).startswith("cuda") else {}


def time_fused_case(backend, fn, args, device: str, *, warmup: int = 5, repeats: int = 20):
    """Time one fused case by the path ``megamoe bench`` picks for it (``select_timing``): CUDA-graph
    replays for a backend that promises ``graph_capturable`` (the unfused peer: its host-side launches
    would otherwise be in the figure; at 1 token an event-timed pass read 854 us against 235 us from
    graph replays, H200 2026-12-03), else CUDA events over a device pass (``device_pass_kwargs``); the L2 is
    flushed between calls when there are no rotated input sets, as in the sweep. Returns the Timing with
    ``extra['path']``."""
    from megamoe.bench.sweep import select_timing
    from megamoe.bench.timing import time_fn, time_graph

    path = select_timing(backend, torch.device(device).type)
    flush = args is None
    if path == "cuda-graph":
        tm = time_graph(fn, args=args, warmup=warmup, repeats=repeats, flush_l2=flush, device=device)
    else:
        tm = time_fn(fn, args=args, warmup=warmup, repeats=repeats, flush_l2=flush, device=device,
                     **device_pass_kwargs(device, repeats))
    tm.extra["path"] = path
    return tm

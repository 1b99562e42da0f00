"""What the pytest-benchmark suites in bench/ share: their settings, and the clock pytest-benchmark reads.

pytest-benchmark times a target with a timer it calls before and after each round. The suites give it
``device_clock`` (``@pytest.mark.benchmark(timer=...)``) and a target that replays, one per round, the calls the
harness timed (``record_timing``): each round advances the clock by one call's device time, so the figures
pytest-benchmark records, prints, saves with ``--benchmark-json`` and compares with ``pytest-benchmark compare``
are the device times (CUDA events, CUDA-graph replays; perf_counter on a CPU), not the wall time of a Python
call that queues a kernel.

Environment: MEGAMOE_BENCH_PRESET (default dsv4-flash on an SM90 GPU, small elsewhere), MEGAMOE_BENCH_TOKENS
(comma list; default 1,128,2048,8192 on a GPU, 1,16 elsewhere).
"""

from __future__ import annotations

import os

import torch

ON_GPU = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
_CLOCK = [0.0]  # seconds of device time replayed so far


def device_clock() -> float:
    """pytest-benchmark's timer in the suites: seconds of device time of the calls replayed so far."""
    return _CLOCK[0]


def record_timing(benchmark, timing) -> None:
    """Hand the harness's per-call device times (a ``Timing``) to pytest-benchmark: one round per timed call,
    each advancing ``device_clock`` by that call's time. With ``--benchmark-disable`` nothing is recorded."""
    samples = iter(timing.samples_us)

    def replay() -> None:
        _CLOCK[0] += next(samples) * 1e-6

    benchmark.pedantic(replay, rounds=len(timing.samples_us), iterations=1, warmup_rounds=0)


def bench_preset() -> str:
    return os.environ.get("MEGAMOE_BENCH_PRESET", "dsv4-flash" if ON_GPU else "small")


def bench_tokens() -> list[int]:
    env = os.environ.get("MEGAMOE_BENCH_TOKENS")
    if env:
        return [int(t) for t in env.split(",") if t.strip()]
    return [1, 128, 2048, 8192] if ON_GPU else [1, 16]


def device_pass_kwargs(device: str, repeats: int = 20) -> dict:
    """``time_fn`` keywords of a device-bound pass as ``megamoe bench`` times it on CUDA (``SweepConfig().device_pass``:
    0.1 s of warm-up, 1 s of samples, over the H200's power-cap cycle); none elsewhere."""
    from .sweep import SweepConfig

    return SweepConfig().device_pass(repeats) if str(device).startswith("cuda") else {}


def time_fused_case(backend, fn, args, device: str, *, warmup: int = 5, repeats: int = 20):
    """One case by the path ``megamoe bench`` picks (``select_timing``): CUDA-graph replays for a backend that
    promises ``graph_capturable``, else CUDA events, both over a device pass; the L2 flushed between calls when
    there are no rotated input sets. Returns the Timing with ``extra['path']``."""
    from . import timing
    from .sweep import select_timing

    path = select_timing(backend, torch.device(device).type)
    kw = dict(args=args, warmup=warmup, repeats=repeats, flush_l2=args is None, device=device)
    if path == "cuda-graph":
        tm = timing.time_graph(fn, **kw, **{k: v for k, v in device_pass_kwargs(device, repeats).items() if k != "min_warmup_s"})
    else:
        tm = timing.time_fn(fn, **kw, **device_pass_kwargs(device, repeats))
    tm.extra["path"] = path
    return tm

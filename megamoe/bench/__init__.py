"""Benchmarks: device timing, measured ceilings, roofline floors, the token sweep (``megamoe bench``).

    timing.py     CUDA-event / CUDA-graph timing with warm-up, L2 flush or input rotation, bare-loop check
    ceilings.py   copy bandwidth, FP8 and bf16 matmul rates, measured on the card
    roofline.py   bytes of the experts touched + activations, FLOPs; the floor of one step
    backends.py   the one adapter between the harness and megamoe.fused backends (or any callable)
    sweep.py      token sweep x backends, repeatability, BLOCK_M study, ragged step, staging cost
    report.py     JSON, Markdown, PNG plots, rich tables
"""

from .backends import BenchBackend, CallableBackend, FusedAdapter, make_backends, reference_backend
from .ceilings import Ceilings, measure_ceilings
from .roofline import Floor, achieved, bytes_per_weight, distinct_experts, step_floor
from .sweep import DEFAULT_TOKENS, Sweep, SweepConfig, run_sweep
from .timing import Timing, bare_loop_us, overhead_check, time_fn, time_graph

__all__ = [
    "BenchBackend", "CallableBackend", "FusedAdapter", "make_backends", "reference_backend", "Ceilings",
    "measure_ceilings", "Floor", "achieved", "bytes_per_weight", "distinct_experts", "step_floor", "DEFAULT_TOKENS",
    "Sweep", "SweepConfig", "run_sweep", "Timing", "bare_loop_us", "overhead_check", "time_fn", "time_graph",
]

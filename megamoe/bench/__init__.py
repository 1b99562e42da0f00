"""Benchmarks: device timing, measured ceilings, roofline floors, the token sweep (``megamoe bench``).

    timing.py      CUDA-event / CUDA-graph timing, the harness-vs-bare-loop check; kineto.py: the second clock
    ceilings.py    copy bandwidth, FP8 and bf16 matmul rates, the read ceiling (read_kernel.py, read_cuda.py)
    roofline.py    bytes of the experts touched + activations, FLOPs: the floor of one step
    backends.py    the one adapter between the harness and megamoe.fused backends (or any callable)
    sweep.py       the sweep: checks, timed passes, the second clock; studies.py: overhead, BLOCK_M, ragged, staging
    tables.py      derived tables and the merge of two processes; report.py / plots.py: Markdown, PNG, screen
    cli.py         ``megamoe bench`` (a results file's run metadata: megamoe.provenance); suite.py: pytest-benchmark
"""

from .backends import BenchBackend, CallableBackend, FusedBench, make_backends, reference_backend
from .ceilings import Ceilings, ReadCeiling, measure_ceilings
from .roofline import Floor, achieved, bytes_per_weight, distinct_experts, step_floor
from .sweep import DEFAULT_TOKENS, Sweep, SweepConfig, run_sweep
from .kineto import kineto_us
from .timing import Timing, overhead_check, time_fn, time_graph

__all__ = [
    "BenchBackend", "CallableBackend", "FusedBench", "make_backends", "reference_backend", "Ceilings", "ReadCeiling",
    "measure_ceilings", "Floor", "achieved", "bytes_per_weight", "distinct_experts", "step_floor", "DEFAULT_TOKENS",
    "Sweep", "SweepConfig", "run_sweep", "Timing", "kineto_us", "overhead_check", "time_fn", "time_graph",
]

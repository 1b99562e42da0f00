"""The one thread pool that builds kernel plans before anything is checked or timed.

    errors = build_plans(jobs, lanes, max_workers=8)     # [(key, exception, traceback)], [] when all built

``jobs`` maps a plan key to a zero-argument callable that builds it (a JIT compile, or a launch that compiles
on first use). ``lanes`` maps a key to a lane name, or None. Jobs without a lane run in a pool of threads:
FlashInfer's plans are independent JIT compiles of ~15 s each. The jobs of one lane run one after another in
one worker, beside the pool: deep_gemm's JIT include parser is process-global and not thread-safe (seen on
the H200: "Circular include may occur" when two of its builds overlapped, and every later deep_gemm JIT in
the process then failed the same way), and a build that launches the kernel must not run beside another
launch of it. ``FusedBackend.build``, the differential matrix and ``megamoe bench`` all build through here.
The pool is joined before this returns, so no build thread is alive while anything is timed.
"""

from __future__ import annotations

import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Hashable, Mapping


def build_plans(jobs: Mapping[Hashable, Callable[[], object]], lanes: Mapping[Hashable, str | None] | None = None,
                max_workers: int = 8, done: Callable[[Hashable], None] | None = None) -> list[tuple[Hashable, BaseException, str]]:
    """Run every job once (see the module docstring); returns the failures, in no particular order. ``done(key)``
    is called after each job, from the thread that ran it (a progress bar)."""
    lanes = lanes or {}
    by_lane: dict[str, list] = {}
    free = []
    for key, fn in jobs.items():
        lane = lanes.get(key)
        (by_lane.setdefault(lane, []) if lane is not None else free).append((key, fn))

    def one(item) -> tuple | None:
        key, fn = item
        try:
            fn()
            return None
        except Exception as exc:  # noqa: BLE001 - every failure is returned to the caller, with its traceback
            return key, exc, traceback.format_exc()
        finally:
            if done is not None:
                done(key)

    def serial(items) -> list[tuple]:
        return [e for e in map(one, items) if e is not None]

    with ThreadPoolExecutor(max_workers=max(1, max_workers)) as pool:
        lanes_done = [pool.submit(serial, items) for items in by_lane.values()]
        errors = [e for e in pool.map(one, free) if e is not None]
        for f in lanes_done:
            errors += f.result()
    return errors

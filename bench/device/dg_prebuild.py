"""Compile DeepGEMM Mega MoE kernels ahead of a run, several processes at a time.

DeepGEMM compiles a kernel (nvcc, tens of seconds) the first time a launch needs its configuration, one
configuration at a time in the launching thread. This script launches the given token counts once each on
a backend whose weights are all zero (nothing else matters to the compiler), so several copies of it,
started side by side with different token counts, fill DG_JIT_CACHE_DIR in parallel; the run that follows
then finds every kernel in the cache.

    python3 bench/device/dg_prebuild.py --backend deepgemm-sm90-fp4 --preset dsv4-flash --capacity 8192 \
        --tokens 1 2 4 8
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def zero_weights(g, device):
    from megamoe.weights import MXFP4Weights

    e, h, i = g.num_experts, g.hidden, g.intermediate
    z = lambda *s: torch.zeros(*s, dtype=torch.uint8, device=device)  # noqa: E731
    return MXFP4Weights(z(e, 2 * i, h // 2), z(e, 2 * i, h // 32) + 127, z(e, h, i // 2), z(e, h, i // 32) + 127)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="deepgemm-sm90-fp4")
    p.add_argument("--preset", default="dsv4-flash")
    p.add_argument("--capacity", type=int, required=True)
    p.add_argument("--tokens", type=int, nargs="+", required=True)
    a = p.parse_args()
    from megamoe.fused.registry import make_backend
    from megamoe.geometry import get_geometry

    t0 = time.time()
    g = get_geometry(a.preset)
    be = make_backend(a.backend, g, capacity=a.capacity)
    w = zero_weights(g, "cuda")
    if be.weight_format == "fp8_block":
        from megamoe.layouts.deepgemm_sm90 import to_fp8_block

        w = to_fp8_block(w)
    be.prepare(w)
    be.allocate()
    be.build(a.tokens)
    plans = {t: be.plan(t).describe() for t in a.tokens}
    print("PREBUILD " + json.dumps({"backend": a.backend, "preset": a.preset, "capacity": a.capacity,
                                    "seconds": round(time.time() - t0, 1), "plans": plans}), flush=True)
    be.destroy()


if __name__ == "__main__":
    main()

"""Time the eager reference at DeepSeek-V4-Flash geometry on the GPU (issue 2: 8192 tokens in < 1 s).

Usage (H200): python3 bench/device/reference_speed.py --tokens 8192 --out $OUT/reference_speed.json
Weights are random MXFP4 with real-like scales, generated on the GPU expert by expert.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from megamoe import PRESETS, make_inputs, random_mxfp4_weights
from megamoe.recipe import get_recipe
from megamoe.reference import moe_forward


def sync(dev) -> None:
    if str(dev).startswith("cuda"):
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="dsv4-flash")
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 128, 2048, 8192])
    ap.add_argument("--recipes", nargs="+", default=["deepgemm-sm90-fp4", "exact"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    g = PRESETS[args.preset]
    dev = args.device
    t0 = time.perf_counter()
    w = random_mxfp4_weights(g, seed=0, device=dev)
    sync(dev)
    rows = [{"what": "random_mxfp4_weights", "seconds": time.perf_counter() - t0}]
    print(f"weights generated in {rows[0]['seconds']:.2f} s")
    for name in args.recipes:
        recipe = get_recipe(name)
        for t in args.tokens:
            inp = make_inputs(g, t, seed=t, device=dev)
            moe_forward(inp, w, recipe, g)  # warm-up (allocator, cuBLAS handles)
            sync(dev)
            times = []
            for _ in range(args.repeats):
                t1 = time.perf_counter()
                y = moe_forward(inp, w, recipe, g)
                sync(dev)
                times.append(time.perf_counter() - t1)
            times.sort()
            row = {"recipe": name, "tokens": t, "median_s": times[len(times) // 2], "min_s": times[0],
                   "finite": bool(torch.isfinite(y.float()).all())}
            rows.append(row)
            print(f"{name:>18} T={t:>5}: median {row['median_s']:.3f} s (min {row['min_s']:.3f})")
    meta = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "torch": torch.__version__, "preset": args.preset}
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

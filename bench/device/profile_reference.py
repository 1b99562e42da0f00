"""Where the eager reference's time goes on the GPU: wall per call, device kernel time, op counts.

    python bench/device/profile_reference.py OUT_DIR [tokens ...]
"""
import json, sys, time

import torch
from torch.profiler import ProfilerActivity, profile

from megamoe.bench.backends import reference_backend
from megamoe.geometry import PRESETS
from megamoe.inputs import make_inputs
from megamoe.weights import random_mxfp4_weights

out = sys.argv[1]
tokens = [int(t) for t in sys.argv[2:]] or [1, 8, 128]
g = PRESETS["dsv4-flash"]
w = random_mxfp4_weights(g, seed=0, device="cuda")
b = reference_backend(g, w)
res = {}
for t in tokens:
    inps = [make_inputs(g, t, seed=100 + k, device="cuda") for k in range(3)]
    for x in inps:
        b.fn(x)
    torch.cuda.synchronize()
    walls = []
    for rep in range(2):
        for x in inps:
            t0 = time.perf_counter(); b.fn(x); torch.cuda.synchronize(); walls.append(time.perf_counter() - t0)
    torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
    b.fn(inps[0]); torch.cuda.synchronize()
    peak_gib = (torch.cuda.max_memory_allocated() - base) / 2**30
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        t0 = time.perf_counter(); b.fn(inps[0]); torch.cuda.synchronize(); wall = time.perf_counter() - t0
    ev = p.key_averages()
    dev_us = sum(e.self_device_time_total for e in ev)
    nops = sum(e.count for e in ev if e.key.startswith("aten::"))
    res[t] = dict(walls_ms=[x * 1e3 for x in walls], peak_gib=peak_gib, prof_wall_ms=wall * 1e3, device_ms=dev_us / 1e3, aten_ops=nops)
    print(f"== tokens {t}: walls {[round(x*1e3,1) for x in walls]} ms; profiled wall {wall*1e3:.1f} ms, "
          f"device kernels {dev_us/1e3:.1f} ms, aten ops {nops}, peak {peak_gib:.2f} GiB above the weights", flush=True)
    print(ev.table(sort_by="self_device_time_total", row_limit=12, max_name_column_width=60), flush=True)
json.dump(res, open(f"{out}/profile_reference.json", "w"), indent=1)

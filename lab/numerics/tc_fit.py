"""H200: fit the FP8 tensor-core accumulation model on crafted and random test vectors.

    OUT=/tmp/tc python3 lab/numerics/tc_fit.py      (on an H200; writes tc_fit.json and tc_vectors.pt)

The vectors are ``fused_probe.tc_probe_inputs`` (built on the CPU from fixed seeds). cuBLAS's FP8 GEMM with
fast accumulation and unit scales does no promotion at K <= 128, so its output is the tensor cores' own
chained k32 sum. Every model of ``tensorcore.model_grid()`` is ranked at K = 32; the named models of
``tensorcore.MODELS`` are scored at K = 32, 64 and 128 (chained steps from a zero accumulator).
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))  # the repository root: megamoe and lab

from lab.numerics.fused_probe import tc_probe_inputs  # noqa: E402  (the vectors the earlier fit used)

from megamoe.reference.tensorcore import MODELS, fit_tensorcore_model, model_grid, tc_dot  # noqa: E402


def main() -> None:
    out = os.environ.get("OUT", "/tmp/tc")
    os.makedirs(out, exist_ok=True)
    t0 = time.time()
    res, vectors = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}, {}
    one = torch.tensor(1.0, device="cuda")
    for k in (32, 64, 128):
        a, b = tc_probe_inputs(k)
        y = torch._scaled_mm(a.to(torch.float8_e4m3fn).cuda(), b.to(torch.float8_e4m3fn).cuda().t(), scale_a=one,
                             scale_b=one, out_dtype=torch.float32, use_fast_accum=True).cpu()
        vectors[k] = {"a": a, "b": b, "y": y}
        ac, bc, yc = a.cuda(), b.cuda(), y.cuda()
        res[f"k{k}"] = {name: float((tc_dot(ac, bc, m).view(torch.int32) == yc.view(torch.int32)).float().mean())
                        for name, m in MODELS.items()}
        print(f"K={k}: bit-exact fraction per named model {res[f'k{k}']}", flush=True)
    v = vectors[32]
    ranked = fit_tensorcore_model(v["a"].cuda(), v["b"].cuda(), v["y"].cuda(), model_grid())
    res["grid_k32_top"] = [[round(f, 6), m.name] for f, m in ranked[:15]]
    print("K=32 grid, best first:", res["grid_k32_top"][:8], flush=True)
    res["wall_s"] = round(time.time() - t0, 1)
    json.dump(res, open(os.path.join(out, "tc_fit.json"), "w"), indent=1)
    torch.save(vectors, os.path.join(out, "tc_vectors.pt"))


if __name__ == "__main__":
    main()

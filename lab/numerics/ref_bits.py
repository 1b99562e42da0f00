"""Reference outputs on the GPU, saved for a bitwise comparison of two versions of megamoe.

    python lab/numerics/ref_bits.py OUT.pt      (the megamoe on PYTHONPATH is the one compared)
"""
import sys, time

import torch

from megamoe.geometry import PRESETS
from megamoe.inputs import make_inputs
from megamoe.layouts.deepgemm_sm90 import to_fp8_block
from megamoe.reference import moe_forward
from megamoe.weights import random_mxfp4_weights

g = PRESETS["dsv4-flash"]
w = random_mxfp4_weights(g, seed=0, device="cuda")
w8 = to_fp8_block(w)
out = {}
for recipe, ww in (("flashinfer-mxfp4", w), ("deepgemm-sm90-fp4", w), ("deepgemm-sm90-fp8", w8)):
    for t in (1, 128, 2048):
        inp = make_inputs(g, t, seed=7 + t, device="cuda")
        t0 = time.perf_counter()
        res = moe_forward(inp, ww, recipe, g, keep_stages=True)
        torch.cuda.synchronize()
        print(recipe, t, f"{time.perf_counter() - t0:.3f} s", flush=True)
        st = res.ranks[0]
        out[(recipe, t)] = [x.cpu() for x in (res.y[0], st.l1_out, st.l2_in, st.l2_out)]
torch.save(out, sys.argv[1])

"""The 1-token CUDA step (megamoe/decode/cuda_step.py, its probe modes: step.py) under Nsight Compute: where its warps stall, per SASS
instruction, for the step itself and its probe modes (issue 25: the step is ~40 us of kernel time where its
stream alone, in lab/cuda_step/pattern_bench.cu, is a plain read's). DeepSeek-V4-Flash, EP = 1, one token.

    ncu --section WarpStateStats --section SchedulerStats --section SourceCounters --section SpeedOfLight \
        -k regex:step1_kernel --launch-skip 1 -o step1 python3 lab/cuda_step/ncu.py
    ncu -i step1.ncu-rep --page source --csv --print-source sass > step1-source.csv

Launches, in order: one to build and warm (skip it), then one each of --modes (default: the step, no-load, bare).
Each launch's y is checked against the Triton launches' bit for bit where the mode leaves y right.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from lab.decode.decode_probe import staged_buffers  # noqa: E402
from lab.cuda_step import step as probe_step  # noqa: E402
from lab.cuda_step.selfcheck import Y_RIGHT_MODES  # noqa: E402
from megamoe.decode import cuda_step, moe_decode  # noqa: E402
from megamoe.decode.layout_tc import prepare_tc_weights  # noqa: E402
from megamoe.decode.tc import tc_launch_config  # noqa: E402
from megamoe.geometry import get_geometry  # noqa: E402
from megamoe.weights import random_mxfp4_weights  # noqa: E402

MODES = ("step", "no-load", "bare")  # the step, or a step.MODES name


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", nargs="*", default=list(MODES), choices=sorted(MODES))
    args = ap.parse_args()
    g = get_geometry("dsv4-flash")
    dev = torch.device("cuda")
    tw = prepare_tc_weights(random_mxfp4_weights(get_geometry("dsv4-flash"), seed=0, device="cuda"))
    inp, buf, touched, slots = staged_buffers(g, 1, dev, split_tokens=1, capacity=64)
    why = cuda_step.unsupported(tw, buf, 1)
    if why:
        raise SystemExit(f"the CUDA step cannot run here: {why}")
    y_triton = moe_decode(tw, buf, 1, g.clamp, tc_launch_config(1, g.num_topk)).clone()
    probe_step.step(tw, buf, g.clamp)  # builds with nvcc on first use; the launch to skip
    for name in args.modes:
        y = probe_step.step(tw, buf, g.clamp, mode=probe_step.MODES.get(name, 0)).clone()
        torch.cuda.synchronize()
        same = torch.equal(y.view(torch.int16), y_triton.view(torch.int16))
        print(f"[step1_ncu] {name}: y {'equals' if same else 'differs from'} the Triton launches' "
              f"({'expected' if same == (name == 'step' or name in Y_RIGHT_MODES) else 'UNEXPECTED'})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The tensor-core decode path's kernels under Nsight Compute: what stalls them (issue 25's diagnosis).

    ncu --section WarpStateStats --section SchedulerStats --section Occupancy --section SpeedOfLight \
        -k regex:'l[12]_tc_kernel|read_kernel' python3 lab/decode/decode_tc_ncu.py --tokens 1 8

Each count runs the backend's launch (``tc_launch_config``) twice (the first launch compiles) and a plain read of
the same bytes once.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from lab.decode.decode_probe import plain_read, staged_buffers  # noqa: E402
from megamoe.decode import moe_decode  # noqa: E402
from megamoe.decode.layout_tc import prepare_tc_weights  # noqa: E402
from megamoe.decode.tc import tc_launch_config  # noqa: E402
from megamoe.geometry import get_geometry  # noqa: E402
from megamoe.weights import random_mxfp4_weights  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="*", default=[1, 8])
    args = ap.parse_args()
    g = get_geometry("dsv4-flash")
    tw = prepare_tc_weights(random_mxfp4_weights(get_geometry("dsv4-flash"), seed=0, device="cuda"))
    sink = torch.empty(1 << 16, dtype=torch.int32, device="cuda")
    read_src = torch.empty(g.num_experts * tw.nbytes_per_expert() // 4, dtype=torch.int32, device="cuda")
    for t in args.tokens:
        inp, buf, touched, slots = staged_buffers(g, t, torch.device("cuda"), split_tokens=t)
        # the backend's own launch (until 2026-12-04 this took the CUDA-core path's)
        cfg = tc_launch_config(t, g.num_topk)
        for _ in range(2):
            moe_decode(tw, buf, t, g.clamp, cfg)
        plain_read(read_src, touched * tw.nbytes_per_expert(), sink)()
        torch.cuda.synchronize()
        print(f"T={t}: {touched} experts", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

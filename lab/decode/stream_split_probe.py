"""Issue 25 on one H200: what two dependent streams cost a 1-token step, read from plain reads alone.

    PYTHONPATH=$PWD python3 lab/decode/stream_split_probe.py --out $OUT

The tensor-core decode step at 1 token reads L1's weights (53.5 MB for six experts), then L2's (26.7 MB), in
two launches; the bar is 1.3x one plain read of all 80.2 MB. This times the roofline's plain read
(megamoe.bench.read_kernel) in launches shaped like that step, in
CUDA graphs with the L2 flushed before each replay (decode_probe.time_replays), kineto per kernel:
  one           all 80.2 MB in one launch
  l1, l2        each part alone
  chain         l1 then l2, two ordinary launches
  chain-pdl     l2 launched with PDL and waiting (griddepcontrol.wait) before its loads, l1 releasing it after
                its loads: the shape of the decode's dependent L2
  chain-free    the same, l2 not waiting: the two streams may overlap (what no dependence would allow)
  chain3-pdl    chain-pdl plus a third small launch that waits (the combine's place)
and, in the same run, the decode step itself (`tc_launch_config`), by this clock and by `megamoe bench`'s.
Results: $OUT/stream_split_probe.json and a table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import triton

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from lab.decode.decode_probe import L2Flusher, kineto_us, staged_buffers, time_replays  # noqa: E402
from lab.decode.decode_tc_probe import sweep_clock  # noqa: E402
from megamoe.provenance import tree_commit  # noqa: E402
from megamoe.bench.read_kernel import BLOCK, _read_kernel  # noqa: E402
from megamoe.geometry import get_geometry  # noqa: E402

KERNELS = ("_read_kernel", "l1_tc_kernel", "l2_tc_kernel", "combine_kernel", "route_kernel")


def reader(src: torch.Tensor, out: torch.Tensor, *, wait=False, release=False, pdl=False):
    """The roofline's read (megamoe.bench.read_kernel), optionally waiting on the launch before and releasing
    the next after its load."""
    n = src.numel()
    opts = {"num_warps": 8, **({"launch_pdl": True} if pdl else {})}
    return lambda: _read_kernel[(triton.cdiv(n, BLOCK),)](src, out, n, BLOCK=BLOCK, WAIT=wait, RELEASE=release,
                                                          **opts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "stream_split_out"))
    ap.add_argument("--min-s", type=float, default=0.4)
    ap.add_argument("--no-step", action="store_true", help="plain reads only")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    dev = torch.device("cuda")
    g = get_geometry("dsv4-flash")
    h, i, k = g.hidden, g.intermediate, g.num_topk
    l1_bytes = k * (2 * i * h // 2 + 2 * i * h // 32)  # codes and scale words of six experts (layout_tc)
    l2_bytes = k * (h * i // 2 + h * i // 32)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "commit": tree_commit(), "l1_mb": l1_bytes / 1e6, "l2_mb": l2_bytes / 1e6, "rows": {}}
    gen = torch.Generator(device=dev).manual_seed(25)
    words = torch.randint(-2**31, 2**31 - 1, ((l1_bytes + l2_bytes) // 4,), dtype=torch.int32, generator=gen,
                          device=dev)
    a, b = words[: l1_bytes // 4], words[l1_bytes // 4:]  # two views: the same bytes as `one`
    sink = [torch.empty(triton.cdiv(x.numel(), BLOCK), dtype=torch.int32, device=dev) for x in (words, a, b)]
    small = torch.empty(BLOCK * 4, dtype=torch.int32, device=dev)
    sink_small = torch.empty(4, dtype=torch.int32, device=dev)
    flush = L2Flusher(dev)

    def chain(*fns):
        return lambda: [f() for f in fns]

    cases = {
        "one": reader(words, sink[0]),
        "l1": reader(a, sink[1]),
        "l2": reader(b, sink[2]),
        "chain": chain(reader(a, sink[1]), reader(b, sink[2])),
        "chain-pdl": chain(reader(a, sink[1], release=True), reader(b, sink[2], wait=True, pdl=True)),
        "chain-free": chain(reader(a, sink[1], release=True), reader(b, sink[2], pdl=True)),
        "chain3-pdl": chain(reader(a, sink[1], release=True), reader(b, sink[2], wait=True, release=True, pdl=True),
                            reader(small, sink_small, wait=True, pdl=True)),
    }
    for name, fn in cases.items():
        tm = time_replays(fn, args.min_s, flush)
        tm["kineto_us"] = kineto_us(tm.pop("graph"), flush, 20, KERNELS)
        res["rows"][name] = tm
        print(f"[split] {name:11s} {tm['median_us']:7.1f} us (p10 {tm['p10_us']:.1f} p90 {tm['p90_us']:.1f}) "
              f"kineto {tm['kineto_us']}", flush=True)
    res["rows"]["one_sweep_clock"] = sweep_clock(cases["one"])
    res["rows"]["chain3-pdl_sweep_clock"] = sweep_clock(cases["chain3-pdl"])
    from megamoe.bench.ceilings import ReadCeiling
    res["rows"]["one_read_ceiling"] = {"median_us": ReadCeiling(dev).us(l1_bytes + l2_bytes)}
    if not args.no_step:
        from megamoe.decode import moe_decode
        from megamoe.decode.layout_tc import prepare_tc_weights
        from megamoe.weights import random_mxfp4_weights
        from megamoe.decode.tc import tc_launch_config

        tw = prepare_tc_weights(random_mxfp4_weights(get_geometry("dsv4-flash"), seed=0, device="cuda"))
        _, buf, touched, _ = staged_buffers(g, 1, dev, split_tokens=1, capacity=64)
        cfg = tc_launch_config(1, k)
        step = lambda: moe_decode(tw, buf, 1, g.clamp, cfg)  # noqa: E731
        tm = time_replays(step, args.min_s, flush)
        tm["kineto_us"] = kineto_us(tm.pop("graph"), flush, 20, KERNELS)
        res["rows"]["step"] = tm
        res["rows"]["step_sweep_clock"] = sweep_clock(step)
        res["touched"] = touched
    with open(os.path.join(args.out, "stream_split_probe.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)
    print("| case | us | kineto (us) |\n|---|---:|---|")
    for name, r in res["rows"].items():
        kin = ", ".join(f"{k2} {v:.1f}" for k2, v in r.get("kineto_us", {}).items())
        print(f"| {name} | {r['median_us']:.1f} | {kin} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

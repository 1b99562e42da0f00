"""The 1-token CUDA step (megamoe/decode/cuda_step.py; its probe modes: step.py) on one H200, DeepSeek-V4-Flash,
EP = 1: timed beside the Triton launches it replaces and a plain read of the same bytes, with ring-depth variants, a
bare streaming run of the same ring (no decode, no MMA: what the loads alone take), each CTA's timeline
(stamps-*.pt) and a per-stage trace of one flushed launch (trace-*.pt: when each stage was issued, when its
warpgroup found it landed).

    PYTHONPATH=$PWD python3 lab/cuda_step/probe.py --out $OUT

Each figure is the median of CUDA-graph replays, the L2 flushed before each (decode_probe.time_replays), with
kineto's kernel time. Results: $OUT/step1_probe.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from lab.decode.decode_probe import L2Flusher, kineto_us, plain_read, staged_buffers, time_replays  # noqa: E402
from lab.cuda_step.stamps import points  # noqa: E402
from megamoe.provenance import tree_commit  # noqa: E402
from lab.cuda_step import step as probe_step  # noqa: E402
from megamoe.decode import cuda_step, moe_decode  # noqa: E402
from megamoe.decode.layout_tc import prepare_tc_weights  # noqa: E402
from megamoe.decode.tc import tc_launch_config  # noqa: E402
from megamoe.geometry import get_geometry  # noqa: E402
from megamoe.weights import random_mxfp4_weights  # noqa: E402

KERNELS = ("step1_kernel", "l1_tc_kernel", "l2_tc_kernel", "combine_kernel", "read_kernel")


def timeline(fn, stamps: torch.Tensor, flush, replays: int = 5) -> dict:
    """Per stamp point (step.STAMP_POINTS): min / median / max over CTAs, us from the first CTA's set-up, of the
    replay with the median last point (stamps.points, as a saved timeline is read on any machine)."""
    reps = []
    for _ in range(replays):
        stamps.fill_(-1)
        flush()
        fn()
        torch.cuda.synchronize()
        reps.append(stamps.clone())
    ends = [int(r[:, 5].max()) - int(r[:, 0].min()) for r in reps]
    return points(reps[sorted(range(replays), key=ends.__getitem__)[replays // 2]].cpu())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "step1_out"))
    ap.add_argument("--stages", type=int, nargs="*", default=[8, 16, 32])
    ap.add_argument("--inflight", type=int, nargs="*", default=[8, 12, 16, 24])
    ap.add_argument("--lags", type=int, nargs="*", default=[0, 2])
    ap.add_argument("--modes", nargs="*", default=["bare", "bare_noscales"])
    ap.add_argument("--timelines", nargs="*", default=["cuda", "bare"])
    ap.add_argument("--traces", nargs="*", default=["cuda", "bare"])
    ap.add_argument("--min-s", type=float, default=0.4)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    import triton

    g = get_geometry("dsv4-flash")
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "commit": tree_commit(), "geometry": g.name, "rows": {}}
    dev = torch.device("cuda")
    tw = prepare_tc_weights(random_mxfp4_weights(get_geometry("dsv4-flash"), seed=0, device="cuda"))
    inp, buf, touched, slots = staged_buffers(g, 1, dev, split_tokens=1, capacity=64)
    cfg = tc_launch_config(1, g.num_topk)
    why = cuda_step.unsupported(tw, buf, 1)
    res["unsupported"] = why
    flush = L2Flusher(dev)
    ctas, most, smem = probe_step.launch_shape(cuda_step.device_index(dev), tw.hidden, tw.intermediate)
    sync = probe_step.sync_buffer(tw, dev)  # every mode's, the LL modes' words too
    probe = lambda **kw: probe_step.step(tw, buf, g.clamp, sync=sync, **kw)  # noqa: E731
    res.update(ctas=ctas, stages=most, smem=smem)

    def run(name, fn):
        tm = time_replays(fn, args.min_s, flush)
        tm["kineto_us"] = kineto_us(tm.pop("graph"), flush, 20, KERNELS)
        res["rows"][name] = tm
        print(f"[step1] {name}: {tm['median_us']:.1f} us (p10 {tm['p10_us']:.1f}, p90 {tm['p90_us']:.1f}) kineto "
              f"{ {k: round(v, 1) for k, v in tm['kineto_us'].items()} }", flush=True)
        save()

    def save():  # after every row: what ran is kept if a later variant never returns
        with open(os.path.join(args.out, "step1_probe.json"), "w") as f:
            json.dump(res, f, indent=1, default=str)

    y_triton = moe_decode(tw, buf, 1, g.clamp, cfg).clone()  # the backend's launch: the Triton kernels
    y_cuda = cuda_step.step(tw, buf, g.clamp).clone()  # the library's step
    res["same_y"] = bool(torch.equal(y_triton.view(torch.int16), y_cuda.view(torch.int16)))
    run("triton", lambda: moe_decode(tw, buf, 1, g.clamp, cfg))
    run("cuda", lambda: cuda_step.step(tw, buf, g.clamp))
    for st in args.stages:
        if st < most:
            run(f"cuda_stages{st}", lambda: probe(stages=st))
    for lim in args.inflight:
        run(f"cuda_inflight{lim}", lambda: probe(inflight=lim))
    for lag in args.lags:
        if lag != probe_step.LAG:
            run(f"cuda_lag{lag}", lambda: probe(lag=lag))
    M = probe_step.MODES  # the variants --modes times and --timelines / --traces record
    # "studied": the lab's instance 0, the step as its studies measured it (with the probe hooks), beside "cuda", the
    # library's step without them
    variants = {"cuda": {}, "studied": {}, "bare": {"mode": M["bare"]},
                "bare_noscales": {"mode": M["bare"] | M["no-scales"]},
                "prefetch": {"mode": M["prefetch"]}, "noload": {"mode": M["no-load"]}, "touch": {"mode": M["touch"]},
                "touch_bare": {"mode": M["touch"] | M["bare"]}, "empty": {"mode": M["empty"]},
                "plain": {"mode": M["plain"]}, "empty_plain": {"mode": M["empty"] | M["plain"]},
                "ahead": {"mode": M["ahead"]}, "ahead_bare": {"mode": M["ahead"] | M["bare"]},
                "noload_bare": {"mode": M["no-load"] | M["bare"]}, "nowait": {"mode": M["no-wait"]},
                "nowait_bare": {"mode": M["no-wait"] | M["bare"]}, "relaxed": {"mode": M["relaxed"]},
                "regs": {"mode": M["regs"]}, "regs_bare": {"mode": M["regs"] | M["bare"]},
                "regs_nowait": {"mode": M["regs"] | M["no-wait"]}, "regs_l1": {"mode": M["regs-l1"]},
                "ll": {"mode": M["ll"]}, "ll_regs_l1": {"mode": M["ll"] | M["regs-l1"]},
                "llc": {"mode": M["ll-combine"]}, "ll_all": {"mode": M["ll"] | M["ll-combine"]},
                "ll_all_regs_l1": {"mode": M["ll"] | M["ll-combine"] | M["regs-l1"]},
                **{f"inflight{lim}": {"inflight": lim} for lim in args.inflight},
                **{f"lag{lag}": {"lag": lag} for lag in args.lags},
                **{f"bare_lag{lag}": {"lag": lag, "mode": M["bare"]} for lag in args.lags}}
    nbytes = touched * tw.nbytes_per_expert()  # the read first, so that a variant that never returns leaves it
    src = torch.empty(nbytes // 4 + 1024, dtype=torch.int32, device=dev)
    run("read", plain_read(src, nbytes, torch.empty(1 << 16, dtype=torch.int32, device=dev)))
    for name in args.modes:
        run(name, lambda: probe(**variants[name]))
    print(f"[step1] same y as the Triton launches: {res['same_y']}", flush=True)
    stamps = torch.full((ctas, 8), -1, dtype=torch.int64, device=dev)
    for name, kw in ((n, variants[n]) for n in args.timelines):
        res[f"timeline_{name}"] = timeline(lambda: probe(stamps=stamps, **kw), stamps, flush)
        print(f"[step1] timeline {name}:", json.dumps(res[f"timeline_{name}"]), flush=True)
        torch.save(stamps.cpu(), os.path.join(args.out, f"stamps-{name}.pt"))
    tr = torch.full((ctas, 1 + cuda_step.PARTS, probe_step.TRACE_SLOTS), -1, dtype=torch.int64, device=dev)
    for name, kw in ((n, variants[n]) for n in args.traces):  # every block's landing, one flushed launch
        tr.fill_(-1)
        flush()
        probe(trace=tr, **kw)
        torch.cuda.synchronize()
        torch.save(tr.cpu(), os.path.join(args.out, f"trace-{name}.pt"))
    res.update(touched=touched, weight_mb=nbytes / 1e6)
    save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

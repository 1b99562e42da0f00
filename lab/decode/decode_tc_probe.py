"""Issue 25 on one H200: the tensor-core decode path (megamoe.decode.triton_tc, recipe megamoe-decode-tc)
beside the CUDA-core default, DeepSeek-V4-Flash geometry, EP = 1.

    PYTHONPATH=$PWD python3 lab/decode/decode_tc_probe.py --out $OUT

(a) correctness (tests/decode_tc_selfcheck.py's run_tc_case on the GPU): l1_tc / l2_tc against their twins bit for
    bit (the recipe's tensor-core model), the whole path against the eager reference: calc_diff and the bitwise
    agreement of y, poison kept, a second launch bit-identical.
(b) speed, side by side in one run: the four launches of each path captured in one CUDA graph, replayed with
    the L2 flushed before each (decode_probe.time_replays), kineto per kernel, and the plain read of the same
    bytes; --stages times the tensor-core path with other software-pipeline depths, --variants without register
    caps (same bits: checked against the default's y).
Results: $OUT/decode_tc_probe.json and a table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
import traceback

import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]  # megamoe and lab; the tests' decode checks (decode_selfcheck.py)

from lab.decode.decode_probe import FLASHINFER_US, L2Flusher, kineto_us, plain_read, staged_buffers, time_replays  # noqa: E402
from megamoe.decode import moe_decode  # noqa: E402
from megamoe.decode.layout_tc import prepare_tc_weights  # noqa: E402
from megamoe.decode.tc import tc_launch_config  # noqa: E402
from megamoe.fused.megamoe_decode import default_launch_config  # noqa: E402
from megamoe.provenance import tree_commit  # noqa: E402
from megamoe.geometry import get_geometry  # noqa: E402
from megamoe.testing import first_mismatch  # noqa: E402
from decode_selfcheck import DecodeCase, case_decode_weights, case_weights  # noqa: E402
from decode_tc_selfcheck import passed_tc, run_tc_case  # noqa: E402

VARIANTS = {
    "nocap": dict(tc_l1_maxnreg=None, tc_l2_maxnreg=None),
    # tighter register caps: more resident programs (no gain on the H200, run 12)
    "cap64": dict(tc_l1_maxnreg=64, tc_l2_maxnreg=80),
    "cap72": dict(tc_l1_maxnreg=72, tc_l2_maxnreg=88),
    # L2's cap alone (L1 at 80): more resident L2 programs (no spill inside its K loop down to 72: decode_sass.py)
    "l2cap88": dict(tc_l2_maxnreg=88),
    "l2cap80": dict(tc_l2_maxnreg=80),
    "l2cap72": dict(tc_l2_maxnreg=72),
    "l2cap64": dict(tc_l2_maxnreg=64),
    "l1cap72-l2cap72": dict(tc_l1_maxnreg=72, tc_l2_maxnreg=72),
    # programmatic dependent launch (megamoe/decode/triton_pdl.py): L1 / L2 let the next launch start after their
    # K loops (the early release at once was LaunchConfig.pdl_early_release, rejected and removed: the journal)
    "pdl": dict(pdl=True),
    "nopdl": dict(pdl=False),
    # experts with at most 4 rows: a 128-K block's four groups in one MMA (triton_tc_ops._packed_mma)
    "pack4": dict(tc_pack4=True),
    # L1's packed K loop in 1 / 2 / 4 parts, the promotion chain replayed by the last (triton_tc._replay); an L2
    # split (its terms per 32-K group) was slower at every count (run 20)
    "split1": dict(tc_split=1),
    "split2": dict(tc_split=2),
    "split4": dict(tc_split=4),
    # L1 routes for itself, no route launch
    "route": dict(tc_route=True),
    "noroute": dict(tc_route=False),
    "l2cap96": dict(tc_l2_maxnreg=96),
    # at 1 token: the whole step in one persistent CUDA launch (megamoe/decode/cuda_step.py), or the Triton launches
    "cuda1": dict(tc_cuda_step1=True),
    "nocuda1": dict(tc_cuda_step1=False),
}
KERNELS = ("route_kernel", "l1_kernel", "l2_kernel", "l1_tc_kernel", "l2_tc_kernel", "combine_kernel", "step1_kernel",
           "read_kernel")
T0 = time.time()


def timed(fn, s, flush) -> dict:
    tm = time_replays(fn, s, flush)
    tm["kineto_us"] = kineto_us(tm.pop("graph"), flush, 20, KERNELS)
    return tm


def sweep_clock(fn) -> dict:
    """fn timed as `megamoe bench` times a graph-capturable backend (``time_graph`` with the sweep's device pass),
    next to this probe's own clock (``time_replays``: one host sync per replay)."""
    from megamoe.bench.sweep import SweepConfig
    from megamoe.bench.timing import time_graph

    cfg = SweepConfig()
    kw = {k: v for k, v in cfg.device_pass(cfg.repeats).items() if k != "min_warmup_s"}
    tm = time_graph(fn, warmup=cfg.warmup, repeats=cfg.repeats, flush_l2=True, device="cuda", **kw)
    return {"median_us": tm.median_us, "replays": len(tm.samples_us)}


def timeline_of(tw, buf, t: int, g, cfg, flush, replays: int = 5, raw_out: str | None = None) -> dict:
    """The launch's timeline (lab.decode.timeline) over a few flushed graph replays with stamps on; the
    replay whose last L2 exit is the median one is printed. Its own clock too: stamping costs a few stores."""
    from megamoe.decode.tc import launch_grids
    from lab.decode.stamps import stamped_step
    from lab.decode.timeline import stamp_buffer, summarize, table

    stamps = stamp_buffer(buf, max(math.prod(grid) for grid in launch_grids(tw, buf, t, cfg)))
    tm = time_replays(lambda: stamped_step(tw, buf, t, g.clamp, cfg, stamps), 0.2, flush)
    gs, reps = tm.pop("graph"), []
    for _ in range(replays):
        stamps.fill_(-1)
        flush()
        gs.replay(0)
        torch.cuda.synchronize()
        reps.append((summarize(stamps), stamps.clone()))
    reps.sort(key=lambda r: r[0]["launches"]["l2"]["at_us"]["exit"]["max"])
    mid, raw = reps[len(reps) // 2]
    reps = [r[0] for r in reps]
    if raw_out:  # the median replay's stamps of the programs that ran, for offline reading
        ran = raw[:, :, 1] >= 0
        torch.save({"stamps": [raw[i][ran[i]] for i in range(2)], "tokens": t, "config": str(cfg)}, raw_out)
    print(f"[tc] timeline T={t} (stamped launch {tm['median_us']:.1f} us; timer step {mid['timer_step_ns']} ns, "
          f"{mid['clock_ghz']} GHz):\n{table(mid)}", flush=True)
    print("     ", {k: {x: d[x] for x in ("programs", "working", "sms", "max_resident_per_sm", "loop_us") if x in d}
                     for k, d in mid["launches"].items()}, flush=True)
    return {"stamped": tm, "replays": reps, "median_replay": mid}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "decode_tc_out"))
    ap.add_argument("--tokens", type=int, nargs="*", default=[1, 8, 32, 2, 4, 16, 64])
    ap.add_argument("--check", type=int, nargs="*", default=[1, 8, 32])
    ap.add_argument("--check-split", type=int, nargs="*", default=[], help="also check these K splits at each --check "
                    "count up to 4 tokens")
    ap.add_argument("--check-route", action="store_true", help="also check L1 routing for itself at each --check count")
    ap.add_argument("--stages", type=int, nargs="*", default=[])
    ap.add_argument("--variants", nargs="*", default=[], choices=sorted(VARIANTS),
                    help="nocap: no register caps (the compiler's choice); cap64 / cap72, l2capNN, l1cap72-l2cap72: "
                         "other caps; pdl, nopdl: launch overlap; pack4: four groups per MMA; split1 / 2 / "
                         "4: L1's K in parts; route / noroute: L1 routing for itself or not (VARIANTS)")
    ap.add_argument("--repeat", type=int, default=20, help="poisoned launches of each variant checked against the default")
    ap.add_argument("--no-cuda-core", action="store_true", help="time the tensor-core path only")
    ap.add_argument("--min-s", type=float, default=0.4)
    ap.add_argument("--capacity", type=int, default=0, help="buffers for this many tokens (the backend's: the sweep's "
                    "largest count; default: each count's own)")
    ap.add_argument("--sweep-clock", action="store_true", help="also time the backend's launch as `megamoe bench` "
                    "does (megamoe.bench.timing.time_graph: batches queued back to back, the L2 flushed between calls)")
    ap.add_argument("--timeline", action="store_true", help="also record the backend's launch's timeline "
                    "(lab/decode/timeline.py: when each L1 / L2 program started, waited, knew its item, finished "
                    "its K loop, exited)")
    ap.add_argument("--deadline", type=float, default=400.0)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    dev = torch.device("cuda")
    g = get_geometry("dsv4-flash")
    import triton
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "commit": tree_commit(),
           "geometry": g.name, "check": [], "rows": [], "errors": []}

    def save():
        with open(os.path.join(args.out, "decode_tc_probe.json"), "w") as f:
            json.dump(res, f, indent=1, default=str)

    w = case_weights("dsv4-flash", "cuda")
    tw = prepare_tc_weights(w)
    dw = case_decode_weights("dsv4-flash", "cuda", 64)
    print(f"[tc] weights ready {time.time() - T0:.0f} s", flush=True)
    for t in args.check:
        for routing in ("uniform", "masked") if t == 8 else ("uniform",):
            try:
                extra = [dict(split=s) for s in (args.check_split if t <= 4 else [])]
                for kw in [{}] + extra + ([dict(route=True)] if args.check_route else []):
                    r = run_tc_case(DecodeCase("dsv4-flash", t, routing=routing, seed=t), "cuda", **kw)
                    r["passed"] = passed_tc(r)
                    res["check"].append(r)
                    print(f"[tc] check {r['case']} {routing}: route '{r['route'][:200]}' l1 '{r['l1'][:200]}' "
                          f"l2 '{r['l2'][:200]}' calc_diff "
                          f"{r['calc_diff']:.2e} bitwise {r['bitwise_frac']:.6f} repeat {r['repeat_identical']} passed "
                          f"{r['passed']} ({time.time() - T0:.0f} s)", flush=True)
            except Exception:  # noqa: BLE001
                res["errors"].append(f"check T={t}: {traceback.format_exc()}")
                print(res["errors"][-1][-2000:], flush=True)
            save()
    flush = L2Flusher(dev)
    sink = torch.empty(1 << 16, dtype=torch.int32, device=dev)
    read_src = torch.empty(g.num_experts * tw.nbytes_per_expert() // 4, dtype=torch.int32, device=dev)
    for t in args.tokens:
        if time.time() - T0 > args.deadline:
            break
        row = {"tokens": t}
        res["rows"].append(row)
        try:
            inp, buf, touched, slots = staged_buffers(g, t, dev, split_tokens=t, capacity=max(t, args.capacity))
            cfg = default_launch_config(t)
            if not args.no_cuda_core:
                row["cuda_core"] = timed(lambda: moe_decode(dw, buf, t, g.clamp, cfg), args.min_s, flush)
            ctc = tc_launch_config(t, g.num_topk)  # the backend's own launch
            row["tc"] = timed(lambda: moe_decode(tw, buf, t, g.clamp, ctc), args.min_s, flush)
            if args.sweep_clock:
                row["tc_sweep_clock"] = sweep_clock(lambda: moe_decode(tw, buf, t, g.clamp, ctc))
            if args.timeline:
                row["timeline"] = timeline_of(tw, buf, t, g, ctc, flush,
                                              raw_out=os.path.join(args.out, f"stamps-T{t}.pt") if t <= 2 else None)
            for st in args.stages:
                c2 = dataclasses.replace(ctc, tc_stages=st)
                row[f"tc_stages{st}"] = timed(lambda: moe_decode(tw, buf, t, g.clamp, c2), 0.2, flush)
            y0 = moe_decode(tw, buf, t, g.clamp, ctc).clone()
            for name in args.variants:  # same bits, other schedules
                c3 = dataclasses.replace(ctc, **VARIANTS[name])
                differ = 0
                for _ in range(args.repeat):  # every intermediate poisoned first: a read before its write shows
                    buf.poison_()
                    differ += bool(first_mismatch(moe_decode(tw, buf, t, g.clamp, c3), y0))
                row[f"tc_{name}"] = {**timed(lambda: moe_decode(tw, buf, t, g.clamp, c3), 0.2, flush),
                                     "same_bits": differ == 0, "launches_differing": f"{differ} of {args.repeat}"}
                if args.sweep_clock:
                    row[f"tc_{name}_sweep_clock"] = sweep_clock(lambda: moe_decode(tw, buf, t, g.clamp, c3))
                if args.timeline and t <= 2:
                    print(f"[tc] variant {name}:", flush=True)
                    row[f"timeline_{name}"] = timeline_of(tw, buf, t, g, c3, flush,
                                                          raw_out=os.path.join(args.out, f"stamps-T{t}-{name}.pt"))
            nbytes = touched * tw.nbytes_per_expert()
            row.update(touched=touched, slots=slots, weight_mb=nbytes / 1e6)
            if nbytes // 4 <= read_src.numel():
                row["read"] = timed(plain_read(read_src, nbytes, sink), 0.2, flush)
            line = " ".join(f"{k} {v['median_us']:.1f}{'' if v.get('same_bits', True) else ' (OTHER BITS)'}"
                            for k, v in row.items() if isinstance(v, dict) and "median_us" in v)
            print(f"[tc] T={t} experts {touched}: {line} (FlashInfer {FLASHINFER_US.get(t, '-')}) "
                  f"({time.time() - T0:.0f} s)", flush=True)
            print("     kineto tc:", {k: round(v, 1) for k, v in row["tc"]["kineto_us"].items()}, flush=True)
        except Exception:  # noqa: BLE001
            res["errors"].append(f"T={t}: {traceback.format_exc()}")
            print(res["errors"][-1][-2000:], flush=True)
        save()
    res["total_s"] = round(time.time() - T0, 1)
    save()
    return 0 if all(r["passed"] for r in res["check"]) and not res["errors"] else 1


if __name__ == "__main__":
    raise SystemExit(main())

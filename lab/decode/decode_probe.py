"""Issue 25 on one H200: megamoe's decode kernel at DeepSeek-V4-Flash geometry, 1..64 tokens, EP = 1.

    PYTHONPATH=$PWD python3 lab/decode/decode_probe.py --out $OUT

(a) correctness per token count (tests/decode_selfcheck.py's run_case on the GPU): each Triton stage against
    its torch twin bit for bit, the whole path against the eager reference (recipe megamoe-decode):
    calc_diff and the bitwise agreement rate of y, rows past the step still poisoned, a second launch
    bit-identical. Every variant below must also give the default's y bit for bit.
(b) speed: the four launches captured in one CUDA graph, replayed for >= --min-s seconds with the L2 flushed
    (256 MB written) before each replay outside the event pair, median per replay; per-kernel device time
    from kineto (torch.profiler) over 30 replays; bytes each launch moves and its GB/s.
(c) the size-aware ceiling: a plain Triton kernel that reads exactly the bytes of the touched experts
    (contiguous, int32 x 4 per thread), timed the same way.
(d) variants (same numerics; each must give the default's y bit for bit), timed the same way for --var-s s
    (--variants NAME... picks some): no-prefetch / prefetch (each K-iteration of L1 and L2 loads the next
    one's tile first: neither / both; the default prefetches in L1, and in L2 up to 8 tokens), warps8 (8 warps
    per program), l2-bn32 (32 L2 rows per program instead of 64), bm-alt (the other tokens-per-pass choice);
    where one stops winning, bytes / GB/s / time per launch say why. (A fused variant, L1 + L2 + combine in one
    launch, was timed here until it was rejected: lab/decode/JOURNAL.md, "The CUDA-core path's fused launch".)
FlashInfer is not run here (its JIT build takes minutes): its times from issue 25 are printed beside.
Results: $OUT/decode_probe.json; a short table is printed last. Budget < 3 minutes (--deadline).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
import traceback

import torch
import triton
import triton.language as tl

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]  # megamoe and lab; the tests' decode checks (decode_selfcheck.py)

from megamoe.bench.timing import GraphSet, L2Flusher  # noqa: E402
from megamoe.decode import DecodeBuffers, moe_decode  # noqa: E402
from megamoe.fused.megamoe_decode import default_launch_config  # noqa: E402
from megamoe.geometry import get_geometry  # noqa: E402
from megamoe.staging import stage_into  # noqa: E402
from megamoe.testing import first_mismatch  # noqa: E402
from megamoe.inputs import make_inputs  # noqa: E402
from decode_selfcheck import DecodeCase, case_decode_weights, case_weights, passed, run_case  # noqa: E402

TOKENS = (1, 8, 32, 2, 4, 16, 64)  # the counts issue 25 sets targets for first, in case the deadline hits
FLASHINFER_US = {1: 73.5, 8: 225.0, 32: 537.0}  # issue 25's table (one H200, same geometry, megamoe bench)
KERNELS = ("route_kernel", "l1_kernel", "l2_kernel", "combine_kernel")
T0 = time.time()


def elapsed() -> float:
    return time.time() - T0


@triton.jit
def read_kernel(src, out, n_words, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Read CHUNK int32 words per program (BLOCK at a time, 16-byte loads), keep their xor (never zero-cost)."""
    base = tl.program_id(0).to(tl.int64) * CHUNK
    acc = tl.zeros([BLOCK], tl.int32)
    for i in range(0, CHUNK, BLOCK):
        offs = base + i + tl.arange(0, BLOCK)
        acc ^= tl.load(src + offs, mask=offs < n_words, other=0)
    tl.store(out + tl.program_id(0), tl.xor_sum(acc, axis=0))


def plain_read(src_words: torch.Tensor, nbytes: int, out: torch.Tensor):
    n = nbytes // 4
    if n > src_words.numel():
        raise ValueError(f"the plain read wants {n} words but its source holds {src_words.numel()}")
    chunk = 16384  # 64 KB per program
    grid = (triton.cdiv(n, chunk),)
    return lambda: read_kernel[grid](src_words, out, n, CHUNK=chunk, BLOCK=2048, num_warps=4)


def time_replays(fn, min_s: float, flush: L2Flusher) -> dict:
    """Capture fn in a CUDA graph; replay (L2 flushed before each, outside the events) for >= min_s.
    Without a GPU (a dry run of this script under TRITON_INTERPRET=1): three timed calls, no graph."""
    if not torch.cuda.is_available():
        ts = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e6)
        return {"median_us": statistics.median(ts), "p10_us": min(ts), "p90_us": max(ts), "replays": 3, "graph": None}
    gs = GraphSet(fn, None, warmup=3)
    samples = []
    t_end = time.time() + min_s
    while time.time() < t_end or len(samples) < 30:
        flush()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        gs.replay(0)
        b.record()
        torch.cuda.synchronize()
        samples.append(a.elapsed_time(b) * 1e3)
    s = sorted(samples)
    return {"median_us": statistics.median(s), "p10_us": s[len(s) // 10], "p90_us": s[9 * len(s) // 10],
            "replays": len(s), "graph": gs}


def kineto_us(gs: GraphSet, flush: L2Flusher, replays: int = 30, kernels: tuple[str, ...] = (*KERNELS, "read_kernel")) -> dict:
    """Mean device time per replay of each kernel in the graph (torch.profiler), by kernel name (a name counts
    every kernel whose name contains it)."""
    from torch.profiler import ProfilerActivity, profile

    if gs is None:
        return {}
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            flush()
            gs.replay(0)
        torch.cuda.synchronize()
    out = {}
    for evt in prof.key_averages():
        t = getattr(evt, "device_time_total", None) or getattr(evt, "cuda_time_total", 0.0)
        for k in kernels:
            if k in evt.key:
                out[k] = out.get(k, 0.0) + t / replays
    return out


def launch_bytes(g, t: int, touched: int, slots: int, dw) -> dict:
    """Bytes each launch must move (weights of the touched experts + activations in and out)."""
    e = dw.l1_words[0].numel() * 4 + dw.l1_scales[0].numel()
    e2 = dw.l2_words[0].numel() * 4 + dw.l2_scales[0].numel()
    h, i, k = g.hidden, g.intermediate, g.num_topk
    out = {"route_kernel": t * k * 12 + t * h * 5 + slots * 8, "l1_kernel": touched * e + t * h * 4 + slots * i * 9,
           "l2_kernel": touched * e2 + slots * i * 4 + slots * h * 2, "combine_kernel": slots * h * 2 + t * h * 2,
           "weights": touched * (e + e2)}
    return out


def staged_buffers(g, t: int, device, split_tokens: int = 0, capacity: int = 0) -> tuple:
    inp = make_inputs(g, t, seed=500 + t, outlier_channels=4).to(device)
    buf = DecodeBuffers.allocate(g, max(t, capacity), device, split_tokens=split_tokens)
    stage_into(inp.x, inp.topk_idx, inp.topk_weights, buf.x_q, buf.x_sf, buf.topk_idx, buf.topk_weights, t,
               num_experts=g.num_experts, check=False)
    touched = int(torch.unique(inp.topk_idx[inp.topk_idx >= 0]).numel())
    return inp, buf, touched, int((inp.topk_idx >= 0).sum())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "decode_probe_out"))
    ap.add_argument("--min-s", type=float, default=1.0, help="seconds of replays for the default config")
    ap.add_argument("--var-s", type=float, default=0.3, help="seconds of replays per variant and plain read")
    ap.add_argument("--deadline", type=float, default=165.0, help="skip what is left past this many seconds")
    ap.add_argument("--tokens", type=int, nargs="*", default=list(TOKENS))
    ap.add_argument("--variants", nargs="*", default=None, metavar="NAME",
                    help="variants to time (default all: no-prefetch prefetch warps8 l2-bn32 bm-alt)")
    ap.add_argument("--geometry", default="dsv4-flash", help="a preset; 'tiny' with --device cpu is a dry run")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    dev = torch.device(args.device)
    g = get_geometry(args.geometry)
    res = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__, "triton": triton.__version__,
           "geometry": g.name, "rows": [], "variants": [], "errors": []}

    def save():
        with open(os.path.join(args.out, "decode_probe.json"), "w") as f:
            json.dump(res, f, indent=1, default=str)

    case_weights(args.geometry, str(dev))  # the random MXFP4 experts (cached: selfcheck's cases use them too)
    dw = case_decode_weights(args.geometry, str(dev), 64)
    res["prepare_s"] = round(elapsed(), 1)
    flush = L2Flusher(dev) if dev.type == "cuda" else (lambda: None)
    sink = torch.empty(1 << 16, dtype=torch.int32, device=dev)
    # What the plain read streams: as many bytes as all experts hold (the most any step can touch).
    read_src = torch.empty(g.num_experts * launch_bytes(g, 1, 1, 1, dw)["weights"] // 4, dtype=torch.int32,
                           device=dev)
    variants = {}
    try:
        dw32 = case_decode_weights(args.geometry, str(dev), 32)
        variants = {"no-prefetch": (dw, dict(l1_prefetch=False, l2_prefetch=False)),
                    "prefetch": (dw, dict(l1_prefetch=True, l2_prefetch=True)),
                    "warps8": (dw, dict(l1_warps=8, l2_warps=8)), "l2-bn32": (dw32, {}), "bm-alt": (dw, "alt")}
        variants = {k: v for k, v in variants.items() if args.variants is None or k in args.variants}
    except Exception:  # noqa: BLE001
        res["errors"].append(traceback.format_exc())
    print(f"[decode] weights ready at {elapsed():.0f} s", flush=True)

    for t in args.tokens:
        row = {"tokens": t}
        res["rows"].append(row)
        try:
            d = default_launch_config(t)
            c = run_case(DecodeCase(args.geometry, t, d.block_m, l1_prefetch=d.l1_prefetch, l2_prefetch=d.l2_prefetch,
                                    seed=t), str(dev))
            row.update({k: c[k] for k in ("route", "l1", "l2", "combine", "poison_kept", "calc_diff", "bitwise_frac",
                                          "repeat_identical", "nan")})
            row["correct"] = passed(c)
            print(f"[decode] T={t} correctness {'ok' if row['correct'] else 'FAIL'} calc_diff {c['calc_diff']:.2e} "
                  f"bitwise {c['bitwise_frac']:.6f} ({elapsed():.0f} s)", flush=True)
        except Exception:  # noqa: BLE001
            res["errors"].append(f"T={t} correctness: {traceback.format_exc()}")
        if elapsed() > args.deadline:
            row["skipped"] = "deadline"
            continue
        try:
            inp, buf, touched, slots = staged_buffers(g, t, dev)
            cfg = default_launch_config(t)
            y0 = moe_decode(dw, buf, t, g.clamp, cfg).clone()
            tm = time_replays(lambda: moe_decode(dw, buf, t, g.clamp, cfg), args.min_s, flush)
            kin = kineto_us(tm.pop("graph"), flush)
            nb = launch_bytes(g, t, touched, slots, dw)
            row.update(touched=touched, slots=slots, weight_mb=nb["weights"] / 1e6, graph=tm, kineto_us=kin,
                       launch_mb={k: nb[k] / 1e6 for k in KERNELS},
                       launch_gbps={k: nb[k] / (kin[k] * 1e3) for k in KERNELS if kin.get(k)})
            row["kernels_us"] = sum(kin.get(k, 0.0) for k in KERNELS)
            row["gbps"] = nb["weights"] / (tm["median_us"] * 1e3)
            rd = time_replays(plain_read(read_src, nb["weights"], sink), args.var_s, flush)
            rd_k = kineto_us(rd.pop("graph"), flush)
            row["read"] = {**rd, "kineto_us": rd_k.get("read_kernel"), "gbps": nb["weights"] / (rd["median_us"] * 1e3)}
            row["of_read"] = tm["median_us"] / rd["median_us"]
            if t in FLASHINFER_US:
                row["flashinfer_us_issue25"] = FLASHINFER_US[t]
                row["speedup_vs_flashinfer"] = FLASHINFER_US[t] / tm["median_us"]
            for name, (dwv, kw) in variants.items():
                if elapsed() > args.deadline:
                    break
                if kw == "alt":
                    if t == 1:
                        continue
                    vcfg = dataclasses.replace(cfg, block_m=1 if cfg.block_m != 1 else 2)
                else:
                    vcfg = dataclasses.replace(cfg, **kw)
                buf.y.fill_(float("nan"))
                yv = moe_decode(dwv, buf, t, g.clamp, vcfg).clone()
                vt = time_replays(lambda: moe_decode(dwv, buf, t, g.clamp, vcfg), args.var_s, flush)
                vk = kineto_us(vt.pop("graph"), flush)
                res["variants"].append({"tokens": t, "variant": name, "config": vcfg.__dict__, "graph": vt,
                                        "kineto_us": vk, "same_bits": not first_mismatch(yv, y0)})
            print(f"[decode] T={t} {tm['median_us']:.1f} us (read {rd['median_us']:.1f}) ({elapsed():.0f} s)", flush=True)
        except Exception:  # noqa: BLE001
            res["errors"].append(f"T={t} timing: {traceback.format_exc()}")
        save()
    res["total_s"] = round(elapsed(), 1)
    save()
    print_table(res)
    return 0 if all(r.get("correct") for r in res["rows"]) and not res["errors"] else 1


def print_table(res: dict) -> None:
    def f(v, fmt="{:.1f}"):
        return fmt.format(v) if isinstance(v, (int, float)) else "-"

    print(f"\n{res['device']}, torch {res['torch']}, triton {res['triton']}, {res['geometry']}, {res.get('total_s')} s")
    print("| T | experts | weight MB | decode us | route/l1/l2/combine us (kineto) | read us | of read | GB/s "
          "| FlashInfer us (issue) | speedup | calc_diff | bitwise | repeat | ok |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in sorted(res["rows"], key=lambda r: r["tokens"]):
        k = r.get("kineto_us", {})
        ks = "/".join(f(k.get(n)) for n in KERNELS)
        print(f"| {r['tokens']} | {r.get('touched', '-')} | {f(r.get('weight_mb'))} | {f(r.get('graph', {}).get('median_us'))} "
              f"| {ks} | {f(r.get('read', {}).get('median_us'))} | {f(r.get('of_read'), '{:.2f}')} | {f(r.get('gbps'), '{:.0f}')} "
              f"| {f(r.get('flashinfer_us_issue25'))} | {f(r.get('speedup_vs_flashinfer'), '{:.2f}x')} "
              f"| {f(r.get('calc_diff'), '{:.1e}')} | {f(r.get('bitwise_frac'), '{:.4f}')} | {r.get('repeat_identical', '-')} "
              f"| {r.get('correct', '-')} |")
    if res["variants"]:
        print("\n| T | variant | us | route/l1/l2/combine us (kineto) | same bits |")
        print("|---|---|---|---|---|")
        for v in sorted(res["variants"], key=lambda v: v["tokens"]):
            k = v["kineto_us"]
            print(f"| {v['tokens']} | {v['variant']} | {f(v['graph']['median_us'])} | "
                  f"{'/'.join(f(k.get(n)) for n in KERNELS)} | {v['same_bits']} |")
    if res["errors"]:
        print(f"\n{len(res['errors'])} error(s); first:\n{res['errors'][0][-1500:]}")


if __name__ == "__main__":
    raise SystemExit(main())

"""Issue 9 on the H200: the fused staging kernel (bitwise + speed) and the DeepSeek-V4 block end to end.

    pip install -e ".[fused]" && python3 lab/staging/staging_block.py --out /tmp/staging     (on an H200)

(a) bitwise: the Triton kernel (both casts) vs the reference at every preset and odd T, edge values,
    strided views, padding; NaN / Inf; and against deep_gemm's own per_token_cast_to_fp8 when importable.
(b) speed at DeepSeek-V4-Flash (H=4096, K=6), T = 1, 2, 4, ..., 8192: eager torch path (as the library
    has it, and without its finiteness sync) vs the Triton kernel (no check / flag check / bits cast),
    timed by the harness's own instruments (megamoe.bench.timing: events queued behind a spin, and CUDA-graph
    replays), L2 flushed, inputs rotated, median of >= 50; bytes it must move, GB/s, fraction of the
    device-copy bandwidth measured in the same run; a launch-shape sweep; the cost of the input checks (check=True).
(c) with a fused backend (megamoe.fused): the block end to end (moe_block_fused) vs the reference block
    (same recipe), the kernel launch alone, stage_into into the backend's own buffer (bitwise same y as the
    backend's staging) and the staging share of the routed step.
Every part runs in try/except; results go to $OUT/staging_block.json and $OUT/staging_block.md, a short
table is printed last. Budget: < 4 minutes (parts are skipped past --deadline seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from megamoe.bench.ceilings import measure_copy_gbps  # noqa: E402
from megamoe.bench.timing import time_fn, time_graph  # noqa: E402
from megamoe.geometry import PRESETS  # noqa: E402
from megamoe.inputs import MoEInputs, make_inputs  # noqa: E402
from megamoe.layouts.staging import _INV_448_FP32, per_token_cast_to_fp8  # noqa: E402
from megamoe.staging import stage_into  # noqa: E402
from megamoe.staging.checks import StagingCase, allocate_buffers, make_case  # noqa: E402
from megamoe.staging.selfcheck import check_nonfinite, default_cases, run_cases  # noqa: E402
from megamoe.testing import calc_diff, first_mismatch  # noqa: E402
from lab.staging.staging_block_report import markdown as render_markdown  # noqa: E402

T0 = time.perf_counter()
RESULTS: dict = {"meta": {}, "errors": []}
DEV = "cuda"  # --device cpu (with TRITON_INTERPRET=1) is a dry run of the script itself, timings meaningless


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def as_e4m3(t: torch.Tensor) -> torch.Tensor:
    """A buffer view holding e4m3 codes, whatever byte dtype the package gave it."""
    return t.view(torch.float8_e4m3fn) if t.dtype in (torch.uint8, torch.int8) else t


def elapsed() -> float:
    return time.perf_counter() - T0


def part(name: str):
    """Decorator: run a part, record its result or its traceback, never raise."""

    def wrap(fn):
        def run(*a, **k):
            t = time.perf_counter()
            print(f"\n=== {name} (t = {elapsed():.0f} s)", flush=True)
            try:
                RESULTS[name] = fn(*a, **k)
            except Exception as e:  # noqa: BLE001
                tb = traceback.format_exc()
                print(tb, flush=True)
                RESULTS[name] = {"error": f"{type(e).__name__}: {e}", "traceback": tb}
                RESULTS["errors"].append(name)
            RESULTS.setdefault("part_seconds", {})[name] = round(time.perf_counter() - t, 1)

        return run

    return wrap


# ------------------------------------------------------------------------------------ timing
# The harness's own instruments (megamoe.bench.timing), so these figures mean what the sweep's mean:
#   events  time_fn: one event pair per call, L2 flushed before it (outside the pair), input sets
#           rotated, calls queued behind a spin kernel so the Python launch is not inside the pair
#   graph   time_graph: the call captured in a CUDA graph (one per input set), each replay timed, L2
#           flushed between replays: the kernel as a serving loop under graphs runs it
def events_us(fn, args, *, repeats: int = 50, warmup: int = 5) -> dict:
    t = time_fn(fn, args=args, warmup=warmup, repeats=repeats, flush_l2=True, device=DEV)
    return {"median_us": t.median_us, "spread": t.spread, "repeats": len(t.samples_us), "method": t.method}


def graph_us(fn, args, *, repeats: int = 50) -> dict:
    t = time_graph(fn, args=args, warmup=3, repeats=repeats, flush_l2=True, device=DEV)
    return {"median_us": t.median_us, "spread": t.spread, "repeats": len(t.samples_us), "method": t.method}


def host_us(fn, arg, iters: int = 30) -> float:
    """Wall time per call including the host (sync after each call)."""
    fn(arg)
    sync()
    t = time.perf_counter()
    for _ in range(iters):
        fn(arg)
        sync()
    return (time.perf_counter() - t) * 1e6 / iters


# ------------------------------------------------------------------------------------ (a)
@part("a_bitwise")
def part_a():
    out = {"cases": [], "nonfinite": None, "deep_gemm": None}
    cases = default_cases()
    for cast in ("hw", "bits"):
        rows = run_cases(cases, backend="triton", device=DEV, cast=cast)
        out["cases"] += rows
        bad = [r for r in rows if not r["ok"]]
        print(f"cast={cast}: {len(rows) - len(bad)}/{len(rows)} cases bit-exact", flush=True)
        for r in bad[:5]:
            print("  FAIL", r["case"], r["error"][:300], flush=True)
    out["nonfinite"] = check_nonfinite(backend="triton", device=DEV)
    print("nonfinite:", out["nonfinite"], flush=True)
    # Against DeepGEMM's own function (the target as it runs on CUDA), where the package is here.
    try:
        from deep_gemm.utils.math import per_token_cast_to_fp8 as dg_cast
    except Exception as e:  # noqa: BLE001
        out["deep_gemm"] = f"not importable: {type(e).__name__}: {e}"
    else:
        dg = []
        for case in [StagingCase("dsv4-flash", t) for t in (1, 37, 129, 4096)] + [StagingCase("dsv4-pro", 37, edge=True)]:
            x, idx, w, bufs = make_case(case, DEV)
            stage_into(x, idx, w, *bufs.views(), case.agreed, num_experts=PRESETS[case.preset].num_experts,
                       backend="triton")
            try:
                q, sf = dg_cast(x, use_ue8m0=False)
            except TypeError:
                q, sf = dg_cast(x)
            t = case.tokens
            mism = first_mismatch(bufs.x[:t], q.view(torch.float8_e4m3fn)) or first_mismatch(bufs.x_sf[:t], sf.float())
            dg.append({"case": case.id, "ok": not mism, "mismatch": mism})
        out["deep_gemm"] = dg
        print("vs deep_gemm.per_token_cast_to_fp8:", [(d["case"], d["ok"]) for d in dg], flush=True)
    out["all_ok"] = all(r["ok"] for r in out["cases"]) and all(
        v in ("raised", "set") for v in out["nonfinite"].values())
    return out


# ------------------------------------------------------------------------------------ (b)
_INV_448_ON: dict = {}  # fl32(1/448) per device, made on the first (eager) call: a graph capture cannot copy it


def eager_nocheck(x, idx, w, bufs, a):
    """The eager path's arithmetic without the reference's host-synchronising finiteness check."""
    t, h = x.shape
    xv = x.view(t, h // 128, 128)
    amax = xv.abs().float().amax(dim=2).clamp(min=1e-4)
    inv448 = _INV_448_ON.get(x.device)
    if inv448 is None:
        inv448 = _INV_448_ON[x.device] = _INV_448_FP32.to(x.device)
    sf = amax * inv448
    q = (xv.float() * torch.reciprocal(sf).unsqueeze(2)).clamp(-448, 448).to(torch.float8_e4m3fn).view(t, h)
    bufs.x[:t].copy_(q)
    bufs.x_sf[:t].copy_(sf)
    bufs.topk_idx[:t].copy_(idx)
    bufs.topk_weights[:t].copy_(w)


def copy_bandwidth() -> dict:
    gbps, nbytes = measure_copy_gbps(DEV)
    return {"bytes": 2 * nbytes, "GBps": gbps}


def staging_bytes(t: int, h: int, k: int, idx_bytes: int = 8) -> int:
    read = 2 * t * h + t * k * (idx_bytes + 4)
    write = t * h + 4 * t * (h // 128) + t * k * (idx_bytes + 4)
    return read + write


@part("b_speed")
def part_b(tokens, repeats):
    g = PRESETS["dsv4-flash"]
    h, k, E = g.hidden, g.num_topk, g.num_experts
    bw = copy_bandwidth()
    print(f"device copy bandwidth: {bw['GBps']:.0f} GB/s (read + written)", flush=True)
    cap = max(tokens)
    bufs = allocate_buffers(cap, g, DEV)
    rows = []
    for t in tokens:
        nsets = 4 if t <= 2048 else 2
        sets = []
        for s in range(nsets):
            inp = make_inputs(g, t, seed=100 * t + s, device=DEV, outlier_channels=4)
            sets.append((inp.x, inp.topk_idx, inp.topk_weights))
        fns = {
            "eager": lambda a: stage_into(*a, *bufs.views(), num_experts=E, backend="torch"),
            "eager_nocheck": lambda a: eager_nocheck(*a, bufs, t),
            "triton": lambda a: stage_into(*a, *bufs.views(), num_experts=E, backend="triton", check=False),
            "triton_flag": lambda a: stage_into(*a, *bufs.views(), num_experts=E, backend="triton", check=True),
            "triton_bits": lambda a: stage_into(*a, *bufs.views(), num_experts=E, backend="triton", check=False,
                                                cast="bits"),
            "isfinite_all": lambda a: bool(torch.isfinite(a[0]).all()),
        }
        nbytes = staging_bytes(t, h, k)
        floor_us = nbytes / (bw["GBps"] * 1e9) * 1e6
        row = {"T": t, "bytes": nbytes, "floor_us": floor_us}
        for name, fn in fns.items():
            r = events_us(fn, sets, repeats=repeats)
            row[name + "_us"], row[name + "_spread"] = r["median_us"], r["spread"]
        # The kernel alone, replayed from CUDA graphs: no Python launch anywhere near it.
        for name in ("triton", "eager_nocheck"):
            r = graph_us(fns[name], sets, repeats=repeats)
            row[name + "_graph_us"], row[name + "_graph_spread"] = r["median_us"], r["spread"]
        for name in ("eager", "triton", "triton_flag"):
            row[name + "_host_us"] = host_us(fns[name], sets[0])
        row["GBps"] = nbytes / (row["triton_graph_us"] * 1e-6) / 1e9
        row["frac_floor"] = floor_us / row["triton_graph_us"]
        row["frac_floor_events"] = floor_us / row["triton_us"]
        row["speedup_vs_eager"] = row["eager_us"] / row["triton_us"]
        row["speedup_vs_eager_nocheck"] = row["eager_nocheck_us"] / row["triton_us"]
        # The kernel staged the last set: its bytes must still be the reference's.
        x, idx, w = sets[-1]
        stage_into(x, idx, w, *bufs.views(), num_experts=E, backend="triton")
        check_staged_rows = first_mismatch(bufs.x[:t], per_token_cast_to_fp8(x)[0])
        row["bitwise_ok"] = not check_staged_rows
        rows.append(row)
        print(f"T={t:5d}: eager {row['eager_us']:8.1f} us (no-sync {row['eager_nocheck_us']:7.1f}, graph "
              f"{row['eager_nocheck_graph_us']:7.1f}) | triton {row['triton_us']:6.1f} us, graph {row['triton_graph_us']:6.1f}, "
              f"flag {row['triton_flag_us']:6.1f}, bits {row['triton_bits_us']:6.1f} | {row['GBps']:6.0f} GB/s = "
              f"{row['frac_floor']:.2f} of floor {floor_us:.1f} us", flush=True)
        del sets
    return {"copy_bandwidth": bw, "rows": rows}


@part("b_sweep")
def part_sweep(repeats):
    """Launch shapes (BLOCK_T, BLOCK_G, num_warps) at a few T, each replayed from a CUDA graph; the
    default heuristic beside them."""
    from megamoe.staging.stage import default_blocks

    g = PRESETS["dsv4-flash"]
    configs = [(1, 8, 4), (2, 8, 4), (4, 8, 4), (8, 8, 8), (16, 8, 8), (1, 32, 8), (2, 32, 8), (4, 32, 8),
               (1, 4, 2), (2, 4, 4), (8, 4, 4), (16, 4, 8)]
    rows = []
    for t in (1, 64, 1024, 4096, 8192) if DEV == "cuda" else (1, 8):
        bufs = allocate_buffers(t, g, DEV)
        sets = [(i.x, i.topk_idx, i.topk_weights) for i in (make_inputs(g, t, seed=7 * t + s, device=DEV) for s in range(2))]
        row = {"T": t, "default": list(default_blocks(t, g.hidden // 128))}
        for cfg in configs:
            r = graph_us(lambda a: stage_into(*a, *bufs.views(), num_experts=g.num_experts, backend="triton",
                                              check=False, blocks=cfg),
                         sets, repeats=repeats)
            row[str(cfg)] = r["median_us"]
        best = min(configs, key=lambda c: row[str(c)])
        row["best"], row["best_us"] = list(best), row[str(best)]
        rows.append(row)
        print(f"T={t}: default {row['default']} = {row.get(str(tuple(row['default'])), float('nan')):.1f} us; "
              f"best {best} = {row['best_us']:.1f} us", flush=True)
    return rows


# ------------------------------------------------------------------------------------ (c)
@part("c_block")
def part_c(tokens, repeats, deadline, preset="dsv4-flash"):
    from dataclasses import replace

    from megamoe.fused.registry import available_backends, make_backend
    from megamoe.reference.block import moe_block_fused, moe_block_reference, random_block_params

    avail = available_backends()
    print("backends:", avail, flush=True)
    names = [n for n, ok, _ in avail if ok and n == "flashinfer-mxfp4"]  # the MXFP4 one: same weights as the block
    if not names:
        return {"skipped": "the flashinfer-mxfp4 backend is unavailable", "available": avail}
    name = names[0]
    g = PRESETS[preset]
    t_w = time.perf_counter()
    params = random_block_params(g, seed=0, device=DEV)
    sync()
    out = {"backend": name, "weights_s": time.perf_counter() - t_w, "rows": []}
    cap = max(tokens)
    be = make_backend(name, g, capacity=cap)
    be.prepare_weights(params.experts)
    t_b = time.perf_counter()
    out["plans_built"] = be.build(tokens)
    out["build_s"] = time.perf_counter() - t_b
    print(f"weights {out['weights_s']:.1f} s, {out['plans_built']} plans built in {out['build_s']:.1f} s", flush=True)
    ref_params = replace(params, experts=getattr(be, "kernel_weights", params.experts))
    buf = be.buf
    commit = getattr(buf, "commit_staged", None)
    for t in tokens:
        if elapsed() > deadline:
            out["rows"].append({"T": t, "skipped": f"past the {deadline:.0f} s deadline"})
            continue
        row = {"T": t}
        try:
            x = make_inputs(g, t, seed=t, device=DEV).x
            y_f = moe_block_fused(x, params, g, be, return_parts=True)
            y_r = moe_block_reference(x, ref_params, g, be.recipe, return_parts=True)  # every T, 8192 included
            row["calc_diff_block"] = calc_diff(y_f.y, y_r.y)
            row["calc_diff_routed"] = calc_diff(y_f.routed, y_r.routed)
            row["same_routing"] = bool(torch.equal(y_f.topk_idx, y_r.topk_idx))
            row["max_tokens_per_expert"] = int(torch.bincount(y_f.topk_idx.flatten(), minlength=g.num_experts).max())
            # Where a calc_diff is not finite, say which side holds NaN / Inf and how much of it.
            for side, res in (("fused", y_f), ("reference", y_r)):
                for part_name in ("y", "routed", "shared"):
                    bad = int((~torch.isfinite(getattr(res, part_name).float())).sum())
                    if bad:
                        row[f"nonfinite_{side}_{part_name}"] = bad
            inputs = MoEInputs(x, y_f.topk_idx, y_f.topk_weights)
            y_be = be.run(inputs).clone()
            # stage_into straight into the backend's buffer, then the kernel alone: same y bit for bit?
            a = stage_into(x, inputs.topk_idx, inputs.topk_weights, as_e4m3(buf.x), buf.x_sf, buf.topk_idx,
                           buf.topk_weights, t, num_experts=g.num_experts, backend="triton")
            if commit is not None:
                commit(a)
            y_ours = be.launch(a)[:t].clone()
            row["y_bitwise_vs_backend_staging"] = not first_mismatch(y_ours, y_be)

            def stage(_):
                stage_into(x, inputs.topk_idx, inputs.topk_weights, as_e4m3(buf.x), buf.x_sf, buf.topk_idx,
                           buf.topk_weights, t, num_experts=g.num_experts, backend="triton", check=False)
                if commit is not None:
                    commit(t)

            row["stage_us"] = events_us(stage, [None], repeats=repeats)["median_us"]
            row["stage_graph_us"] = graph_us(stage, [None], repeats=repeats)["median_us"]
            row["launch_us"] = events_us(lambda _: be.launch(t), [None], repeats=repeats)["median_us"]
            row["backend_stage_us"] = events_us(lambda _: be.stage(inputs, t), [None], repeats=min(repeats, 20))["median_us"]
            row["step_us"] = row["stage_graph_us"] + row["launch_us"]
            row["stage_share"] = row["stage_graph_us"] / row["step_us"]
            row["block_fused_host_us"] = host_us(lambda _: moe_block_fused(x, params, g, be), None, iters=5)
            print(f"T={t}: stage {row['stage_us']:.1f} us (graph {row['stage_graph_us']:.1f}) + launch {row['launch_us']:.1f} us -> share "
                  f"{row['stage_share']:.3f}; backend's own staging {row['backend_stage_us']:.1f} us; "
                  f"calc_diff block {row.get('calc_diff_block', float('nan')):.2e}; "
                  f"same y: {row['y_bitwise_vs_backend_staging']}", flush=True)
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {e}"
            row["traceback"] = traceback.format_exc()
            print(row["traceback"], flush=True)
        out["rows"].append(row)
    return out


# ------------------------------------------------------------------------------------ report
def markdown() -> str:
    """This run's report (staging_block_report.markdown), as far as it has got."""
    return render_markdown(RESULTS, elapsed())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("--deadline", type=float, default=300.0, help="seconds after which part (c) skips the rest")
    ap.add_argument("--parts", default="a,b,sweep,c")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--max-log2-tokens", type=int, default=13)
    args = ap.parse_args()
    global DEV
    DEV = args.device
    os.makedirs(args.out, exist_ok=True)
    import triton

    RESULTS["meta"] = {"device": torch.cuda.get_device_name() if DEV == "cuda" else DEV, "torch": torch.__version__, "triton": triton.__version__,
                       "argv": sys.argv}
    tokens = [2**i for i in range(args.max_log2_tokens + 1)]  # 1 .. 8192
    parts = args.parts.split(",")
    if "a" in parts:
        part_a()
    if "b" in parts:
        part_b(tokens, args.repeats)
    if "sweep" in parts:
        part_sweep(max(20, args.repeats // 2))
    if "c" in parts:
        part_c(tokens, max(20, args.repeats // 2), args.deadline)
    RESULTS["meta"]["seconds"] = elapsed()
    with open(os.path.join(args.out, "staging_block.json"), "w") as f:
        json.dump(RESULTS, f, indent=1, default=str)
    md = markdown()
    with open(os.path.join(args.out, "staging_block.md"), "w") as f:
        f.write(md)
    print("\n" + md, flush=True)
    return 0 if not RESULTS["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())

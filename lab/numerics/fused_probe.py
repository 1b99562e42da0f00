"""H200 probe: tensor-core accumulation test vectors, both fused kernels vs reference recipes, L2-input
FP8 code match rates, rounding-point variants, broken layouts. One call; JSON + tensors under $OUT.

    pip install -e ".[fused]" && OUT=/tmp/fp python3 lab/numerics/fused_probe.py     (on an H200)

Inputs that the CPU must re-create for the offline fits are generated on the CPU from fixed seeds
(``tc_probe_inputs``, ``small`` weights and inputs); only the GPU's outputs travel back.
"""

from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))  # the repository root: megamoe and lab
from lab.common.probe_journal import ProbeJournal  # noqa: E402

T0 = time.time()
DEADLINE = float(os.environ.get("PROBE_DEADLINE_S", "330"))
OUT = os.environ.get("OUT", "/tmp/probe_out")
os.makedirs(OUT, exist_ok=True)
RESULTS: dict = {"cases": [], "errors": []}
TENSORS: dict = {}


JOURNAL = ProbeJournal(OUT, "probe.json", RESULTS, t0=T0)
log, dump = JOURNAL.log, JOURNAL.dump


def guarded(what):
    return JOURNAL.guard(what, DEADLINE)


# ------------------------------------------------------------------------------------ TC vectors
def tc_probe_inputs(k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(A [M, k], B [16, k]) e4m3 on the CPU: crafted alignment vectors, then random rows."""
    from megamoe.formats import e4m3_satfinite

    gen = torch.Generator().manual_seed(seed + k)
    rows = []
    # Crafted: a big term at slot 0 and +-2**-j (j = 0..9, e4m3 reaches 2**-9) at slot i. B rows 0..2
    # scale slot 0 by 1, 2**4, 2**8 and the others by 1, 2**-4, 2**-9, so the gap between the terms
    # spans 2**0 .. 2**-26 across the three output columns.
    for i in sorted({1, k // 2, k - 1}):
        for big in (1.0, 1.5, -1.0, 1.875):
            for sgn in (1.0, -1.0):
                for j in range(0, 10):
                    r = torch.zeros(k)
                    r[0] = big
                    r[i] = sgn * 2.0 ** -j
                    rows.append(r)
    # Big + many small of mixed sign (alignment loss accumulates).
    for j in range(1, 20):
        r = torch.full((k,), 2.0 ** -(j % 9 + 1))
        r[0] = 448.0 if j % 2 else -448.0
        r[1::3] *= -1
        rows.append(r)
    craft = torch.stack(rows)
    n_rand = 2048 - craft.shape[0]
    mag = torch.exp2(torch.randint(-8, 8, (n_rand, 1), generator=gen).float())
    rand = torch.randn(n_rand, k, generator=gen) * mag
    rand[: n_rand // 4] *= torch.exp2(torch.randint(-6, 6, (n_rand // 4, k), generator=gen).float())
    a = e4m3_satfinite(torch.cat([craft, rand])).float()
    b = e4m3_satfinite(torch.randn(16, k, generator=gen) * torch.exp2(torch.randint(-3, 3, (16, 1), generator=gen).float())).float()
    b[0] = 1.0
    b[1] = 2.0 ** -4
    b[1, 0] = 2.0 ** 4
    b[2] = 2.0 ** -9
    b[2, 0] = 2.0 ** 8
    return a, b


@guarded("tc_probe")
def tc_probe():
    out = {}
    for k in (32, 64, 128):
        a, b = tc_probe_inputs(k)
        a8 = a.to(torch.float8_e4m3fn).cuda()
        b8 = b.to(torch.float8_e4m3fn).cuda()
        one = torch.tensor(1.0, device="cuda")
        y = torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.float32, use_fast_accum=True)
        TENSORS[f"tc_k{k}"] = y.cpu()
        exact = (a.double() @ b.double().T).float()
        out[k] = {"bitwise_equal_to_exact_fp32": float((y.cpu() == exact).float().mean())}
        try:
            y2 = torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.float32, use_fast_accum=False)
            TENSORS[f"tc_k{k}_slow"] = y2.cpu()
            out[k]["slow_equal_fast"] = float((y2 == y).float().mean())
        except Exception as exc:  # noqa: BLE001
            out[k]["slow_error"] = repr(exc)
    RESULTS["tc_probe"] = out
    log("tc probe", out)


# ------------------------------------------------------------------------------------ kernels
def weights_for(preset):
    from megamoe.geometry import get_geometry
    from megamoe.weights import random_mxfp4_weights

    g = get_geometry(preset)
    if preset == "small":
        w = random_mxfp4_weights(g, seed=0).to("cuda")  # CPU-generated: reproducible offline
    else:
        w = random_mxfp4_weights(g, seed=0, device="cuda")
    return g, w


def time_launch(be, m, block_m=None, iters=20):
    """The launch alone, median of ``iters`` calls, no L2 flush (as the matrix's table times it)."""
    from megamoe.bench.timing import time_fn

    return time_fn(lambda: be.launch(m, block_m), warmup=2, repeats=iters, flush_l2=False, device="cuda").median_us


def run_case(be, g, weights_ref, t, recipes: dict, *, seed, tag, routing=None, save=False, time_it=True, block_m=None):
    from megamoe.fused.compare import compare_l2_inputs, match_pool_tokens
    from megamoe.layouts.staging import per_token_cast_to_fp8
    from megamoe.reference import moe_forward
    from megamoe.inputs import make_inputs
    from megamoe.testing import calc_diff

    inp = make_inputs(g, t, seed=seed, **(routing or {})).to("cuda")
    rec = {"backend": be.name, "geometry": g.name, "T": t, "tag": tag, "seed": seed,
           "forced_block_m": block_m}
    try:
        rec["plan"] = be.plan(t, block_m).describe()
    except Exception as exc:  # noqa: BLE001
        rec["plan"] = repr(exc)
    be.poison_intermediates()
    m = be.stage(inp, t)
    y = be.launch(m, block_m).clone()
    torch.cuda.synchronize()
    rec["nan_out"] = int(torch.isnan(y.float()).sum())
    inter = be.intermediates()
    # second launch, not poisoned: determinism
    be.stage(inp, t)
    y2 = be.launch(m, block_m).clone()
    torch.cuda.synchronize()
    rec["rerun_bitwise_equal"] = bool(torch.equal(y.view(torch.int16), y2.view(torch.int16)))
    for rname, recipe in recipes.items():
        res = moe_forward(inp, weights_ref, recipe, g, keep_stages=True)
        yr = res.y[0]
        d = {"calc_diff": calc_diff(y[:t], yr), "bitwise_frac": float((y[:t].view(torch.int16) == yr.view(torch.int16)).float().mean()) if t else 1.0}
        if inter is not None and t:
            try:
                d.update(compare_l2_inputs(inter, res.ranks[0], inp, g.num_topk))
            except Exception as exc:  # noqa: BLE001
                d["stage_error"] = repr(exc)
        rec[rname] = d
    if time_it and t:
        rec["launch_us"] = time_launch(be, m, block_m)
    if save and inter is not None and t:
        x_q, _ = per_token_cast_to_fp8(inp.x)
        tok = match_pool_tokens(inter["pool_x"], x_q)
        rows = torch.nonzero(tok >= 0).squeeze(1)
        key = f"{be.name}|{g.name}|T{t}|{tag}"
        TENSORS[key] = {"y": y[:t].cpu(), "rows": rows.cpu(), "tok": tok[rows].cpu(),
                        "l2_in": inter["l2_in"][rows].view(torch.uint8).cpu()}
        sf = inter.get("l2_in_sf_kmajor", inter.get("l2_in_sf_raw"))
        if sf is not None and sf.numel() < 4_000_000:
            TENSORS[key]["sf_raw"] = sf.cpu()
    RESULTS["cases"].append(rec)
    short = {k: (v if not isinstance(v, dict) else {kk: vv for kk, vv in v.items() if kk in ("calc_diff", "code_match", "sf_match", "sf_layout")}) for k, v in rec.items()}
    log(short)
    return rec


def main():
    log("torch", torch.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_capability())
    RESULTS["device"] = torch.cuda.get_device_name()
    from megamoe.fused.registry import available_backends

    RESULTS["available"] = available_backends()
    log("available", RESULTS["available"])
    tc_probe()

    from megamoe.fused.deepgemm_fp8 import DeepGEMMFP8
    from megamoe.fused.flashinfer_mxfp4 import FlashInferMXFP4
    from megamoe.recipe import DEEPGEMM_SM90_FP8, FLASHINFER_MXFP4

    fi_tokens = {"small": [1, 7, 64, 300], "dsv4-flash": [1, 128, 2048]}
    fi_forced = {"small": [(64, 8), (64, 24), (7, 64), (300, 8)], "dsv4-flash": [(128, 64), (2048, 24), (1, 64)]}
    setups = {}

    @guarded("fi_setup")
    def fi_setup():
        for preset in ("small", "dsv4-flash"):
            g, w = weights_for(preset)
            be = FlashInferMXFP4(g, capacity=2048 if preset == "dsv4-flash" else 512)
            be.prepare(w)
            be.allocate()
            setups[preset] = (g, w, be)
        jobs = []
        for preset, (g, w, be) in setups.items():
            for t in fi_tokens[preset]:
                jobs.append((be, None, t))
            for t, bm in fi_forced[preset]:
                jobs.append((be, bm, t))
        from megamoe.fused.build import build_plans

        plans = {}  # every plan once, built in the library's one pool (FlashInfer's builds are parallel JIT compiles)
        for be, bm, t in jobs:
            for key, fn in be.build_jobs([t], bm).items():
                plans.setdefault((id(be), key), fn)
        log(f"building {len(plans)} FlashInfer plans")
        errs = [repr(exc) for _, exc, _ in build_plans(plans, max_workers=10)]
        RESULTS["fi_build_errors"] = errs
        log("built", len(plans), "errors", errs[:2])

    fi_setup()

    for preset, (g, w, be) in setups.items():
        wref = be.kernel_weights
        recs = {"fi": FLASHINFER_MXFP4}
        if preset == "small":
            recs["fi_tc"] = FLASHINFER_MXFP4.with_(mma="sm90-fp8-tc")
            recs["fi_g64"] = FLASHINFER_MXFP4.with_(l2_group=64)
            recs["fi_cont"] = FLASHINFER_MXFP4.with_(l2_scale="continuous")
        for t in fi_tokens[preset]:
            guarded(f"fi {preset} T{t}")(run_case)(be, g, wref, t, recs, seed=100 + t, tag="auto", save=preset == "small")
        for t, bm in fi_forced[preset]:
            guarded(f"fi {preset} T{t} bm{bm}")(run_case)(be, g, wref, t, {"fi": FLASHINFER_MXFP4}, seed=100 + t, tag=f"bm{bm}",
                                                          save=preset == "small", block_m=bm)
        # routing edge cases (small only, cheap)
        if preset == "small":
            for tag, routing in (("masked", {"mask_prob": 0.3}), ("skew", {"skew": 1.5}), ("empty", {"empty_experts": (0, 5)}),
                                 ("allmasked", {"fully_masked_tokens": (0, 3)})):
                guarded(f"fi small {tag}")(run_case)(be, g, wref, 64, {"fi": FLASHINFER_MXFP4}, seed=7, tag=tag, routing=routing, time_it=False)

    # Broken layouts: gate/up not interleaved, scales off by one exponent.
    @guarded("fi broken")
    def broken():
        from megamoe.layouts._common import deinterleave_gate_up
        from megamoe.inputs import make_inputs
        from megamoe.testing import calc_diff
        from megamoe.reference import moe_forward

        g, w, be = setups["small"]
        inp = make_inputs(g, 64, seed=5).to("cuda")
        yr = moe_forward(inp, be.kernel_weights, FLASHINFER_MXFP4, g)
        good = (be.l1, be.l2)
        out = {}
        from megamoe.layouts.flashinfer_sm90 import to_flashinfer_sm90
        kw = be.kernel_weights
        import dataclasses as dc
        nointer = dc.replace(kw, l1=deinterleave_gate_up(kw.l1), l1_scale=deinterleave_gate_up(kw.l1_scale))
        be.l1, _ = to_flashinfer_sm90(nointer)
        out["gate_up_not_interleaved"] = calc_diff(be.run(inp), yr)
        off = dc.replace(kw, l2_scale=kw.l2_scale + 1)
        be.l1 = good[0]
        _, be.l2 = to_flashinfer_sm90(off, check=False)
        out["l2_scale_plus_one"] = calc_diff(be.run(inp), yr)
        be.l1, be.l2 = good
        out["good"] = calc_diff(be.run(inp), yr)
        RESULTS["broken"] = out
        log("broken", out)

    broken()
    for _, (g, w, be) in setups.items():
        be.destroy()

    # ---------------- DeepGEMM FP8
    os.environ["DG_PRINT_CONFIGS"] = "1"
    dg_tokens = {"small": [7, 300], "dsv4-flash": [1, 128, 2048]}
    for preset in ("small", "dsv4-flash"):
        @guarded(f"dg setup {preset}")
        def dg_setup():
            from megamoe.layouts.deepgemm_sm90 import to_fp8_block

            g, w = weights_for(preset)
            be = DeepGEMMFP8(g, capacity=2048 if preset == "dsv4-flash" else 512)
            be.prepare(to_fp8_block(w))
            be.allocate()
            return g, be

        r = dg_setup()
        if r is None:
            continue
        g, be = r
        log("dg buffer views", {k: (tuple(getattr(be.buf, k).shape), str(getattr(be.buf, k).dtype)) for k in ("x", "x_sf", "l1_acts", "l1_acts_sf", "l2_acts", "l2_acts_sf")})
        RESULTS[f"dg_views_{preset}"] = {k: (tuple(getattr(be.buf, k).shape), str(getattr(be.buf, k).dtype)) for k in ("x", "x_sf", "topk_idx", "l1_acts", "l1_acts_sf", "l2_acts", "l2_acts_sf")}
        recs = {"dg": DEEPGEMM_SM90_FP8, "dg_pow2": DEEPGEMM_SM90_FP8.with_(l2_scale="pow2_ceil"),
                "dg_g128": DEEPGEMM_SM90_FP8.with_(l2_group=128)}
        if preset == "small":
            recs["dg_tc"] = DEEPGEMM_SM90_FP8.with_(mma="sm90-fp8-tc")
        for t in dg_tokens[preset]:
            guarded(f"dg {preset} T{t}")(run_case)(be, g, be.kernel_weights, t, recs, seed=200 + t, tag="auto", save=preset == "small")
        if preset == "small":
            @guarded("dg T0")
            def zero():
                from megamoe.inputs import make_inputs
                inp = make_inputs(g, 0, seed=1).to("cuda")
                be.stage(inp, 0)
                y = be.launch(0)
                torch.cuda.synchronize()
                RESULTS["dg_T0"] = {"ok": True, "shape": tuple(y.shape)}
            zero()
        be.destroy()

    # ---------------- staged peer
    @guarded("staged")
    def staged():
        from megamoe.fused.staged_deepgemm import StagedDeepGEMM
        from megamoe.layouts.deepgemm_sm90 import to_fp8_block

        for preset, ts in (("small", [7, 300]), ("dsv4-flash", [128])):
            g, w = weights_for(preset)
            be = StagedDeepGEMM(g, capacity=4096)
            be.prepare(to_fp8_block(w))
            be.allocate()
            for t in ts:
                guarded(f"staged {preset} T{t}")(run_case)(be, g, be.kernel_weights, t, {"staged": be.recipe}, seed=300 + t, tag="auto")

    staged()
    torch.save(TENSORS, os.path.join(OUT, "probe_tensors.pt"))
    # short table
    print("\n=== summary ===")
    for r in RESULTS["cases"]:
        cols = [r["backend"][:18], r["geometry"], f"T{r['T']}", r["tag"], str(r.get("plan", ""))[:40], f"{r.get('launch_us', float('nan')):.1f}us"]
        for k, v in r.items():
            if isinstance(v, dict) and "calc_diff" in v:
                cols.append(f"{k}:{v['calc_diff']:.2e}/{v.get('code_match', float('nan')):.4f}/{v.get('sf_match', float('nan')):.3f}")
        print(" | ".join(cols))
    print("errors:", [e["what"] for e in RESULTS["errors"]])
    print("broken:", RESULTS.get("broken"))
    print("tc:", RESULTS.get("tc_probe"))
    dump()


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    main()

"""H200: DeepGEMM's SM90 FP8 x FP4 Mega MoE (pull request #323 source build) probed through megamoe.

    python3 lab/deepgemm_fp4/probe.py --out DIR [--sections lut checkpoint variants lossy plans]

Sections (each writes DIR/fp4_probe.json as it finishes; a deadline skips what is left):
  lut         the kernel's FP4 -> e4m3 decode for all 256 scale bytes x 16 codes, read off the output of a
              crafted layer: one token per expert, L1 weights making every L2 input the same value a (read
              back from the buffer), L2 row h holding one code c under scale byte b at K = 0, so
              y[h] = bf16(a * decode(b, c)), exact in bf16; from it, the two ends of the exact window
  checkpoint  the matrix case that failed (dsv4-flash, T = 128, weights round-tripped through a checkpoint,
              a backend of capacity 128): capacity, weights and inputs varied one at a time
  variants    the kernel's outputs and L2-input codes against reference recipe variants (L2 group 64 / 128,
              power-of-two vs continuous scale, exact-block vs emulated tensor cores)
  lossy       real-like weights (scale bytes below the window) under accept_lossy_scales: the loss
  plans       the configuration of every sweep token count at capacity 8192
  determinism the same launch repeated, after padding-only launches and alternating with other inputs
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))  # the repository root: megamoe and lab

from lab.common.probe_journal import ProbeJournal  # noqa: E402

from megamoe.fused.deepgemm_fp4 import DeepGEMMFP4, plan_record  # noqa: E402
from megamoe.geometry import get_geometry  # noqa: E402
from megamoe.testing import Relaunches, calc_diff  # noqa: E402
from megamoe.inputs import MoEInputs, make_inputs  # noqa: E402

SWEEP_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
MMA = "sm90-fp8-tc-operands"


def raw_backend(g, weights, capacity):
    """A DeepGEMMFP4 over weights its window check would refuse (the LUT probe needs every byte)."""
    from megamoe.fused.process_group import ensure_group
    from megamoe.layouts.deepgemm_sm90 import to_deepgemm_sm90_fp4

    be = DeepGEMMFP4(g, capacity=capacity)
    be.require_available()
    be.group = ensure_group(None)
    be.kernel_weights = weights
    (l1, l1_sf), (l2, l2_sf) = to_deepgemm_sm90_fp4(weights, check=False)
    be.l1, be.l2 = (l1, l1_sf), (l2, l2_sf)
    be._prepared = True
    be.allocate()
    return be


def lut_probe(log):
    from megamoe.formats import E8M0_BIAS, e2m1_decode, e4m3_satfinite
    from megamoe.layouts.fp4_window import decode_probe_layer

    g = get_geometry("small")  # E=16, K=4, H=512, I=256: 8 experts x 512 rows = 4096 (byte, code) pairs
    w, inp, pairs = decode_probe_layer(g, "cuda")
    be = raw_backend(g, w, capacity=8)
    be.build([8])
    be.poison_intermediates()
    be.stage(inp, 8)
    y = be.launch(8).float().cpu()
    torch.cuda.synchronize()
    inter = be.intermediates()
    codes = inter["l2_in"].view(torch.uint8).cpu()
    sf = inter["l2_in_sf_pool"].cpu()
    rows = (codes[:, 0] != 0x7F).nonzero().flatten()  # pool rows the kernel wrote (0x7F = poison)
    a_vals = (codes[rows].view(torch.float8_e4m3fn).float() * sf[rows, :1]).unique()
    a_vals = a_vals[(a_vals != 0) & ~torch.isnan(a_vals)]  # BLOCK_M padding rows hold zeros
    log("lut: pool rows written", rows.numel(), "L2 input values", a_vals.tolist(), "plan", be.plan(8).describe())
    if a_vals.numel() != 1:
        raise RuntimeError(f"crafted L2 input is not one value: {a_vals.tolist()}")
    a = float(a_vals[0])
    kernel = (y.reshape(-1) / a)[pairs.reshape(-1).argsort()].view(256, 16)  # [byte, code]
    exact = (e2m1_decode(torch.arange(16, dtype=torch.uint8))[None, :] * torch.exp2(torch.arange(256.0)[:, None] - E8M0_BIAS))
    exact[255] = float("nan")
    kernel[255] = float("nan")  # byte 0xFF is not handed to the kernel (decode_probe_layer): not measured
    model = e4m3_satfinite(exact).float()

    def same(u, v):
        return (u == v) | (torch.isnan(u) & torch.isnan(v))

    exact_bytes = [b for b in range(256) if bool(same(kernel[b], exact[b]).all())]
    model_bytes = [b for b in range(256) if bool(same(kernel[b], model[b]).all())]
    lo = min(exact_bytes)
    hi = lo
    while hi + 1 in exact_bytes:
        hi += 1
    res = {
        "l2_input_value": a, "plan": be.plan(8).describe(),
        "window_measured": [lo, hi], "bytes_all_codes_exact": exact_bytes,
        "bytes_matching_e4m3_rn_model": model_bytes,
        "bytes_differing_from_model": [b for b in range(256) if b not in model_bytes],
        "all_zero_bytes": [b for b in range(256) if bool((kernel[b] == 0).all())],
        "kernel_table": [[None if v != v else v for v in row] for row in kernel.tolist()],
    }
    log(f"lut: exact window {lo}..{hi}; bytes differing from the e4m3 RN model: {res['bytes_differing_from_model'][:20]}"
        f"{' ...' if len(res['bytes_differing_from_model']) > 20 else ''}")
    be.destroy()
    return res


def run_case(be, inp, m, recipes: dict, log, tag):
    """Launch (poisoned first), then compare with every recipe in ``recipes``. Returns a dict row."""
    from megamoe.fused.compare import compare_l2_inputs
    from megamoe.reference import moe_forward

    be.poison_intermediates()
    be.stage(inp, m)
    y = be.launch(m)[: inp.num_tokens].clone()
    torch.cuda.synchronize()
    inter = be.intermediates()
    row = {"case": tag, "tokens": inp.num_tokens, "launch_tokens": m, "capacity": be.capacity,
           "plan": be.plan(m).describe(), "nan": int(torch.isnan(y.float()).sum())}
    for name, rec in recipes.items():
        t = time.time()
        res = moe_forward(inp, be.kernel_weights, rec, be.g, keep_stages=True)
        cmp = compare_l2_inputs(inter, res.ranks[0], inp, be.g.num_topk)
        row[name] = {"calc_diff": calc_diff(y, res.y[0]), "code_match": cmp.get("code_match"),
                     "sf_match": cmp.get("sf_match"), "sf_layout": cmp.get("sf_layout"),
                     "bitwise": float((y.view(torch.int16) == res.y[0].view(torch.int16)).float().mean()),
                     "ref_s": round(time.time() - t, 1)}
    log(f"{tag:48s} " + "  ".join(f"{k}: diff {v['calc_diff']:.2e} codes {v['code_match'] or 0:.4f}"
                                  for k, v in row.items() if isinstance(v, dict)) + f"  {row['plan']}")
    return row


_RAW: dict = {}


def weights(preset, kind, seed=0):
    """(geometry, weights): random real-like MXFP4 (made once per preset), then as ``kind`` asks."""
    from megamoe.weights import random_mxfp4_weights

    g = get_geometry(preset)
    if (preset, seed) not in _RAW:
        _RAW[(preset, seed)] = random_mxfp4_weights(g, seed=seed, device="cuda")
    w = _RAW[(preset, seed)]
    if kind == "synthetic":
        w = DeepGEMMFP4.synthetic_weights(w)
    elif kind.startswith("checkpoint"):
        import tempfile

        from megamoe.layouts.checkpoint import load_layer, write_checkpoint

        if kind == "checkpoint-synthetic":
            w = DeepGEMMFP4.synthetic_weights(w)
        d = tempfile.mkdtemp(prefix="megamoe-ckpt-")
        write_checkpoint(d, 3, w.to("cpu"), num_files=2)
        w = load_layer(d, 3, device="cuda")
    return g, w


def backend(g, w, capacity, lossy):
    be = DeepGEMMFP4(g, capacity=capacity, accept_lossy_scales=lossy)
    be.prepare(w)
    be.allocate()
    return be


def checkpoint_probe(log):
    """The failing matrix case was dsv4-flash-T128-auto-checkpoint: raw real-like weights (the old backend
    had no lower bound), round-tripped through a checkpoint, on a backend of capacity 128, inputs of seed
    1012; the passing one had the same weights uncheckpointed, capacity 8192, inputs of seed 1128."""
    rows = []
    base = DeepGEMMFP4.recipe
    rec = {"ref": base.with_(mma=MMA)}
    g, w_raw = weights("dsv4-flash", "raw")
    _, w_ckpt = weights("dsv4-flash", "checkpoint-raw")
    same = all(torch.equal(getattr(w_raw, n), getattr(w_ckpt, n)) for n in ("l1", "l1_scale", "l2", "l2_scale"))
    log("checkpoint: round-tripped weights bit-identical to the raw ones:", same)
    rows.append({"weights_roundtrip_identical": same})
    inp = {s: make_inputs(g, 128, seed=s).to("cuda") for s in (1012, 1128)}
    for wname, w in (("raw", w_raw), ("checkpoint", w_ckpt)):
        for cap in (8192, 128):
            be = backend(g, w, cap, lossy=True)
            be.build([128, 127])
            for s in (1012, 1128):
                rows.append(run_case(be, inp[s], 128, rec, log, f"{wname}-cap{cap}-seed{s}"))
            rows.append(run_case(be, MoEInputs(*(t[:127] for t in (inp[1012].x, inp[1012].topk_idx,
                                                                     inp[1012].topk_weights))), 127, rec, log,
                                 f"{wname}-cap{cap}-seed1012-T127"))
            be.destroy()
    for cap in (129, 256, 384):
        be = backend(g, w_raw, cap, lossy=True)
        be.build([128])
        rows.append(run_case(be, inp[1012], 128, rec, log, f"raw-cap{cap}(aligned {be.buf.num_max_tokens_per_rank})-seed1012"))
        be.destroy()
    return rows


def variants_probe(log):
    base = DeepGEMMFP4.recipe
    recs = {"base-tc": base.with_(mma=MMA), "exact-block": base, "group128": base.with_(mma=MMA, l2_group=128),
            "continuous": base.with_(mma=MMA, l2_scale="continuous", l2_amax_floor=1e-10)}
    rows = []
    for preset, cap, ts in (("small", 512, (64, 512)), ("dsv4-flash", 8192, (1, 128, 2048))):
        g, w = weights(preset, "synthetic")
        be = backend(g, w, cap, lossy=False)
        be.build(list(ts))
        for t in ts:
            inp = make_inputs(g, t, seed=500 + t).to("cuda")
            if t > 256:  # the reference of a token depends on its own rows only: compare a subset
                sel = torch.randperm(t, generator=torch.Generator().manual_seed(t))[:256].sort().values.cuda()
                full = inp
                be.poison_intermediates()
                be.stage(full, t)
                y = be.launch(t)[:t].clone()
                sub = MoEInputs(full.x[sel], full.topk_idx[sel], full.topk_weights[sel])
                row = {"case": f"{preset}-T{t} (256-token subset)", "plan": be.plan(t).describe()}
                from megamoe.reference import moe_forward

                for name, r in recs.items():
                    row[name] = {"calc_diff": calc_diff(y[sel], moe_forward(sub, be.kernel_weights, r, g))}
                log(row)
                rows.append(row)
            else:
                rows.append(run_case(be, inp, t, recs, log, f"{preset}-T{t}"))
        be.destroy()
    return rows


def lossy_probe(log):
    base = DeepGEMMFP4.recipe
    g, w = weights("dsv4-flash", "raw")
    be = backend(g, w, 128, lossy=True)
    be.build([1, 128])
    rows = [{"decode_loss": {k: v for k, v in be.decode_loss.items() if k != "tensors"},
             "tensors_changed": len(be.decode_loss["tensors"]),
             "worst_tensors": sorted(be.decode_loss["tensors"], key=lambda x: -x["changed"])[:5]}]
    log("lossy:", be.decode_loss["summary"])
    for t in (1, 128):
        inp = make_inputs(g, t, seed=900 + t).to("cuda")
        rows.append(run_case(be, inp, t, {"e4m3_rn": base.with_(mma=MMA),
                                          "exact_decode": base.with_(mma=MMA, weight_decode="exact")}, log,
                             f"dsv4-flash-T{t}-lossy"))
    be.destroy()
    return rows


def plans_probe(log):
    g = get_geometry("dsv4-flash")
    from bench.device.dg_prebuild import zero_weights  # the weights bench/device/dg_prebuild.py builds with

    be = backend(g, zero_weights(g, "cuda"), 8192, lossy=False)
    t = time.time()
    be.build(list(SWEEP_TOKENS))
    rec = plan_record(be, SWEEP_TOKENS)
    for r in rec:
        log("plan", r)
    be.destroy()
    return {"build_s": round(time.time() - t, 1), "plans": rec}


def _launch(be, inp, m):
    be.y.fill_(float("nan"))  # poison: an unwritten row shows as NaN
    be.stage(inp, m)
    return be.launch(m)[: inp.num_tokens].clone()


def determinism_probe(log):
    """Does one launch depend on what ran before it? Same inputs launched back to back; real launches
    alternating with padding-only ones (every route -1, as a warm-up or an idle data-parallel rank sends);
    two input sets alternating. Each real output against its reference and against the first output."""
    from megamoe.reference import moe_forward

    base = DeepGEMMFP4.recipe.with_(mma=MMA)
    g, w = weights("dsv4-flash", "synthetic")
    dev = torch.device("cuda")  # a step of zero tokens: staged, it is all padding rows
    pad = MoEInputs(x=torch.empty(0, g.hidden, dtype=torch.bfloat16, device=dev),
                    topk_idx=torch.empty(0, g.num_topk, dtype=torch.int64, device=dev),
                    topk_weights=torch.empty(0, g.num_topk, dtype=torch.float32, device=dev))
    rows = []
    plan = [(8192, 128, "1", 100), (8192, 128, "0", 100), (128, 128, "1", 100), (8192, 1, "1", 100),
            (8192, 2048, "1", 40), (8192, 8192, "1", 20)]
    bes = {}
    for cap, t, swap, n in plan:
        os.environ["DG_SM90_FP4_SWAP_AB"] = swap
        if cap not in bes:
            bes[cap] = backend(g, w, cap, lossy=False)
        be = bes[cap]
        be.build([t])
        inps = [make_inputs(g, t, seed=s_).to("cuda") for s_ in (1012, 1128)]
        sub = [(i if t <= 256 else MoEInputs(*(x[:256] for x in (i.x, i.topk_idx, i.topk_weights)))) for i in inps]
        refs = [moe_forward(si, be.kernel_weights, base, g) for si in sub]
        k = min(t, 256)

        def score(y, j):
            return calc_diff(y[:k], refs[j]), int(torch.isnan(y.float()).sum())

        out = {"capacity": cap, "tokens": t, "swap_ab_env": swap, "plan": None, "patterns": {}}
        for pattern in ("same", "after-padding", "alternating-inputs"):
            diffs, nans, seen = [], 0, Relaunches()
            for i in range(n):
                j = (i % 2) if pattern == "alternating-inputs" else 0
                if pattern == "after-padding":
                    _launch(be, pad, t)
                y = _launch(be, inps[j], t)
                d, nn = score(y, j)
                diffs.append(d)
                nans += nn
                seen.add(y, j)
            torch.cuda.synchronize()
            ds = sorted(diffs)
            out["patterns"][pattern] = {"launches": n, "calc_diff_median": ds[len(ds) // 2], "calc_diff_max": ds[-1],
                                        "over_1e-5": sum(d > 1e-5 for d in diffs), "over_1e-6": sum(d > 1e-6 for d in diffs),
                                        "nan_elements": nans, "launches_differing_from_first": seen.changed,
                                        "max_rows_differing": seen.max_rows}
            log(f"determinism cap {cap} T{t} swap-env {swap} {pattern:20s} {out['patterns'][pattern]}")
        out["plan"] = be.plan(t).describe()
        rows.append(out)
    os.environ["DG_SM90_FP4_SWAP_AB"] = "1"
    for be in bes.values():
        be.destroy()
    return rows


def race_probe(log, counts=(1, 2, 4, 7, 8, 16, 32, 64, 96, 128, 192, 256, 300, 512, 1024, 2048, 4096, 8192),
               launches=None):
    """Repeat launches at each token count, two ways: the same input every time, and two inputs alternating
    (each output compared with the first output of its own input). Same-input differences are a race inside
    one launch; alternating-only differences are data of the previous launch read back (stale reads)."""
    g, w = weights("dsv4-flash", "synthetic")
    be = backend(g, w, 8192, lossy=False)
    be.build(list(counts))
    rows = []
    for t in counts:
        inps = [make_inputs(g, t, seed=77 + t + 1000 * j).to("cuda") for j in range(2)]
        n = launches or (60 if t <= 512 else 20)
        p = be.plan(t)
        row = {"tokens": t, "tokens_per_expert": t * g.num_topk / g.num_experts, "launches": n,
               "block_m": p.block_m, **p.detail}
        for pattern in ("same", "alternating"):
            seen = Relaunches()
            for i in range(n):
                j = i % 2 if pattern == "alternating" else 0
                seen.add(_launch(be, inps[j], t), j)
            torch.cuda.synchronize()
            key = "" if pattern == "same" else "alternating_"
            row.update({f"{key}differing_from_first": seen.changed, f"{key}max_rows_differing": seen.max_rows})
        log(f"race T{t:5d} same {row['differing_from_first']:3d}/{n} rows<= {row['max_rows_differing']:3d} "
            f"alternating {row['alternating_differing_from_first']:3d}/{n} rows<= "
            f"{row['alternating_max_rows_differing']:3d}  {p.describe()} early_b={p.detail.get('early_b_decode')}")
        rows.append(row)
    be.destroy()
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp/fp4_probe"))
    p.add_argument("--sections", nargs="+", default=["lut", "checkpoint", "variants", "lossy", "plans"])
    p.add_argument("--deadline", type=float, default=400.0, help="sections not begun by then are skipped (s)")
    p.add_argument("--race-tokens", type=int, nargs="+", help="token counts of the race section (default: the sweep's)")
    p.add_argument("--race-launches", type=int, help="launches per count and pattern (default: 60, 20 above 512)")
    a = p.parse_args()
    from megamoe.provenance import imported_kernel_modules

    ok, why = DeepGEMMFP4.availability()
    journal = ProbeJournal(a.out, "fp4_probe.json", {"errors": [], "available": [ok, why]})
    journal.data["card"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    journal.data["modules"] = imported_kernel_modules()
    journal.log("available", ok, why, journal.data["modules"].get("deep_gemm"))
    if not ok:
        journal.dump()
        sys.exit(1)
    fns = {"lut": lut_probe, "checkpoint": checkpoint_probe, "variants": variants_probe, "lossy": lossy_probe,
           "plans": plans_probe, "determinism": determinism_probe,
           "race": lambda log: race_probe(log, *([tuple(a.race_tokens)] if a.race_tokens else []),
                                          launches=a.race_launches)}
    for name in a.sections:
        journal.guard(name, a.deadline, key=name)(fns[name])(journal.log)
    journal.log("done", {k: v for k, v in journal.data.get("seconds", {}).items()})


if __name__ == "__main__":
    main()

"""Humming on one Hopper GPU: what the backend's recipe rests on, each step checked and written to JSON.

    python3 lab/humming/probe.py --out DIR [--quick]

1. rebase     Humming's process_fused_e8m0_scale (via humming.transform) vs megamoe.layouts.humming.rebase_fused_e8m0,
              byte for byte, on random and below-window weights; the code rewrite over every (delta, code) pair.
2. staging    humming.forward.may_quant_input vs per_token_cast_to_fp8_div448 (and how often DeepGEMM's rule differs).
3. stages     one step through the backend against the reference, stage by stage (gate/up bf16, the down input's
              FP8 codes, the slot outputs, y) under candidate recipes (MMA model, accumulation).
Each section catches its own errors, so one failure leaves the others' results.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback

import torch


def section(name, out, fn):
    t0 = time.time()
    try:
        out[name] = fn()
        out[name + "_s"] = round(time.time() - t0, 1)
        print(f"[probe] {name}: ok in {time.time() - t0:.1f}s: {json.dumps(out[name], default=str)[:1500]}", flush=True)
    except Exception as exc:  # noqa: BLE001 - the next section still runs
        out[name] = {"error": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc()[-3000:]}
        print(f"[probe] {name}: FAILED {type(exc).__name__}: {exc}\n{traceback.format_exc()[-3000:]}", flush=True)


def rebase_check():
    from humming import ops, transform
    from humming.schema import HummingInputSchema, Mxfp4WeightSchema

    from megamoe.check.matrix import below_window
    from megamoe.geometry import get_geometry
    from megamoe.layouts.humming import _SHRUNK, rebase_fused_e8m0, to_humming_mxfp4
    from megamoe.weights import random_mxfp4_weights

    dev = torch.device("cuda")
    res = {}
    # (a) every (delta, code) pair through the kernel Humming's transform calls
    d = torch.arange(32, dtype=torch.uint8).repeat_interleave(2)  # 64 groups of 32 codes
    codes = torch.arange(16, dtype=torch.uint8).repeat(2)  # 32 codes: each code twice
    packed = (codes[0::2] | (codes[1::2] << 4)).repeat(64, 1)  # [64, 16] bytes
    got = ops.process_mxfp4_w4a8_weight(packed.view(torch.int32).to(dev).contiguous().view(-1),
                                        d.to(dev).contiguous())
    got = got.view(torch.uint8).view(64, 16).cpu()
    lo, hi = got & 0xF, got >> 4
    kernel = torch.stack([lo, hi], -1).view(64, 32)[:, :16]
    want = _SHRUNK[d.long().clamp(max=31)]
    res["code_table_pairs"] = int(kernel.numel())
    res["code_table_mismatch"] = int((kernel != want).sum())
    if res["code_table_mismatch"]:
        res["code_table_kernel"] = kernel[::2].tolist()
    # (b) whole sublayers through humming.transform's own rebase
    in_schema = HummingInputSchema.from_config({"dtype": "float8e4m3", "input_scale_group_size": 128})
    for preset in ("small", "dsv4-flash"):
        g = get_geometry(preset)
        w = random_mxfp4_weights(g, seed=1, device=dev if preset != "small" else "cpu").to(dev)
        for kind, ww in (("random", w), ("below-window", below_window(w, seed=2))):
            for name, sub in to_humming_mxfp4(ww).items():
                e, n, half_k = sub.weight.shape
                ws, tensors = Mxfp4WeightSchema().convert_humming(
                    tensors={"weight": sub.weight, "weight_scale": sub.weight_scale},
                    shape_n_stacks=[n // 2, n // 2] if name == "w13" else [n], shape_k_stacks=[2 * half_k],
                    param_dtype=torch.bfloat16, num_experts=e, device=dev)
                config = transform.prepare_layer_config(shape_n=n, shape_k=2 * half_k, weight_schema=ws,
                                                        input_schema=in_schema, num_experts=e, pad_n_to_multiple=256,
                                                        pad_k_to_multiple=128, torch_dtype=torch.bfloat16, device=dev)
                padded = transform.check_and_pad_tensors(config, tensors)
                hw, hs, hws2 = transform.process_fused_e8m0_scale(config, padded["weight"], padded["weight_scale"],
                                                                  padded.get("weight_scale_2"))
                ours = rebase_fused_e8m0(sub.weight, sub.weight_scale)
                hw8 = hw.contiguous().view(torch.uint8).view(e, -1, half_k)[:, :n]
                hs8 = hs.contiguous().view(torch.uint8).view(e, -1, 2 * half_k // 32)[:, :n]
                key = f"{preset}/{kind}/{name}"
                res[key] = {
                    "use_fused_e8m0_scale": bool(config.use_fused_e8m0_scale),
                    "weight_scale_2_type": str(config.weight_scale_2_type),
                    "codes_bytes_differing": int((hw8 != ours.codes).sum()),
                    "scale_bytes_differing": int((hs8 != ours.scale).sum()),
                    "ws2_equal": bool(torch.equal(hws2.float().view(-1).cpu(), ours.weight_scale_2.cpu())),
                    "codes_rewritten": int((ours.codes != sub.weight).sum()),
                    "humming_shapes": [list(hw.shape), list(hs.shape), list(hws2.shape)],
                }
    return res


def staging_check():
    from humming import transform
    from humming.forward import may_quant_input
    from humming.schema import HummingInputSchema, Mxfp4WeightSchema

    from megamoe.layouts.staging import per_token_cast_to_fp8, per_token_cast_to_fp8_div448

    dev = torch.device("cuda")
    in_schema = HummingInputSchema.from_config({"dtype": "float8e4m3", "input_scale_group_size": 128})
    ws = Mxfp4WeightSchema().to_humming_schema(torch.bfloat16)
    out = {}
    for h in (512, 4096, 2048):
        config = transform.prepare_layer_config(shape_n=512, shape_k=h, weight_schema=ws, input_schema=in_schema,
                                                num_experts=16, pad_n_to_multiple=256, pad_k_to_multiple=128,
                                                torch_dtype=torch.bfloat16, device=dev)
        gen = torch.Generator(device=dev).manual_seed(h)
        t = 333
        x = (torch.randn(t, h, generator=gen, device=dev) * torch.exp2(torch.randint(-20, 20, (t, 1), generator=gen,
                                                                                       device=dev).float()))
        x = x.to(torch.bfloat16)
        buf = torch.empty(t, h, dtype=torch.float8_e4m3fn, device=dev)
        q, s = may_quant_input(config, x, quanted_input=buf)
        torch.cuda.synchronize()
        q2, s2 = per_token_cast_to_fp8_div448(x)
        q3, s3 = per_token_cast_to_fp8(x)
        rec = {"scale_shape": list(s.shape), "scale_stride": list(s.stride()), "scale_dtype": str(s.dtype),
               "q_shape": list(q.shape)}
        sv = s.float()
        if sv.shape != s2.shape and sv.numel() == s2.numel():
            sv = sv.reshape(s2.shape[::-1]).t() if sv.shape[0] == s2.shape[1] else sv.reshape(s2.shape)
        if sv.shape == s2.shape:
            rec["scales_differing_div448"] = int((sv.view(torch.int32) != s2.view(torch.int32)).sum())
            rec["scales_differing_mul_inv448"] = int((sv.view(torch.int32) != s3.view(torch.int32)).sum())
        rec["codes_differing_div448"] = int((q.view(torch.uint8) != q2.view(torch.uint8)).sum())
        rec["codes_differing_mul_inv448"] = int((q.view(torch.uint8) != q3.view(torch.uint8)).sum())
        rec["codes"] = int(q.numel())
        out[f"H{h}"] = rec
    return out


def stages_check(quick: bool):
    from megamoe.fused.registry import make_backend
    from megamoe.inputs import make_inputs
    from megamoe.reference import moe_forward
    from megamoe.testing import calc_diff
    from megamoe.weights import random_mxfp4_weights

    dev = torch.device("cuda")
    out = {}
    runs = [("humming-w4a8", "small", 7), ("humming-w4a16", "small", 7), ("humming-w4a8", "dsv4-flash", 1),
            ("humming-w4a8", "dsv4-flash", 64), ("humming-w4a16", "dsv4-flash", 8)]
    weights = {}
    for name, preset, t in runs[: 3 if quick else None]:
        key = f"{name}/{preset}/T{t}"
        try:
            be = make_backend(name, preset, capacity=max(t, 8))
            if preset not in weights:
                weights[preset] = random_mxfp4_weights(be.g, seed=5, device=dev if preset != "small" else "cpu").to(dev)
            be.prepare(weights[preset])
            be.allocate()
            be.build([t])
            inp = make_inputs(be.g, t, seed=7, mask_prob=0.2).to(dev)
            be.poison_intermediates()
            m = be.stage(inp, t)
            y = be.launch(m).clone()
            torch.cuda.synchronize()
            rec = {"plan": be.plan(t).describe(), "nan": int(torch.isnan(y.float()).sum())}
            g, k = be.g, be.g.num_topk
            cands = {"recipe": be.recipe, "exact-block": be.recipe.with_(mma="exact-block")}
            if be.recipe.stage_x:
                cands["tc-rescale"] = be.recipe.with_(accumulate="rescale")
            for cname, r in cands.items():
                res = moe_forward(inp, be.kernel_weights, r, g, keep_stages=True)
                st = res.ranks[0]
                lay = st.layout
                real = lay.src_token >= 0
                slot = (lay.src_token * k + lay.src_slot)[real]
                c = {"y_calc_diff": calc_diff(y, res.y[0]),
                     "y_bits_equal": float((y.view(torch.int16) == res.y[0].view(torch.int16)).float().mean())}
                gu = be.gate_up[slot]
                ref_gu = st.l1_out[real].to(torch.bfloat16)
                c["gate_up_bits_equal"] = float((gu.view(torch.int16) == ref_gu.view(torch.int16)).float().mean())
                c["gate_up_calc_diff"] = calc_diff(gu, ref_gu)
                if be.act_q is not None:
                    c["down_in_codes_equal"] = float((be.act_q[slot].view(torch.uint8) ==
                                                      st.l2_in[real].view(torch.uint8)).float().mean())
                else:
                    c["down_in_bits_equal"] = float((be.act[slot].view(torch.int16) == st.l2_in[real].to(
                        torch.bfloat16).view(torch.int16)).float().mean())
                dn = be.down[slot]
                ref_dn = st.l2_out[real].to(torch.bfloat16)
                c["down_out_bits_equal"] = float((dn.view(torch.int16) == ref_dn.view(torch.int16)).float().mean())
                c["down_out_calc_diff"] = calc_diff(dn, ref_dn)
                rec[cname] = c
            # relaunch determinism (the align's atomics place slots in any order within an expert)
            diffs = 0
            for _ in range(5):
                be.stage(inp, t)
                y2 = be.launch(m)
                diffs += int(not torch.equal(y2.view(torch.int16), y.view(torch.int16)))
            rec["relaunches_differing"] = diffs
            out[key] = rec
            print(f"[probe] stages {key}: {json.dumps(rec, default=str)}", flush=True)
            be.destroy()
        except Exception as exc:  # noqa: BLE001
            out[key] = {"error": f"{type(exc).__name__}: {exc}", "tb": traceback.format_exc()[-3000:]}
            print(f"[probe] stages {key} FAILED: {traceback.format_exc()[-3000:]}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sections", nargs="*", default=["versions", "rebase", "staging", "stages"])
    a = ap.parse_args()
    out = {}
    path = f"{a.out}/humming_probe.json"

    def versions():
        import humming
        import triton

        from megamoe.provenance import imported_kernel_modules

        return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
                "humming": getattr(humming, "__version__", "?"), "modules": imported_kernel_modules()}

    for name, fn in (("versions", versions), ("rebase", rebase_check), ("staging", staging_check),
                     ("stages", lambda: stages_check(a.quick))):
        if name in a.sections:
            section(name, out, fn)
            with open(path, "w") as f:
                json.dump(out, f, indent=1, default=str)


if __name__ == "__main__":
    main()

"""Does a warp-level FP8 MMA (PTX ``mma.sync.m16n8k32.e4m3``) sum a k32 group like the warpgroup MMA (wgmma)
that recipe megamoe-decode-tc models? Run on one H200:

    PYTHONPATH=$PWD python3 lab/numerics/mma_sync_probe.py --out $OUT

A Triton kernel of one warp per problem issues the instruction through inline PTX, each lane holding its own
fragment registers (one tensor element per lane); its outputs are compared bit for bit with
``megamoe.reference.tensorcore.tc_dot`` under each model, on A = decoded e2m1 * 2**-6 (the decode kernels'
weights) and on A = any finite e4m3, with B = random e4m3 (staged activations). When no model matches all,
``fit_tensorcore_model`` ranks the grid. Results: $OUT/mma_sync_probe.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from megamoe.reference.tensorcore import MODELS, fit_tensorcore_model, tc_dot  # noqa: E402


@triton.jit
def mma_sync_kernel(a_ptr, b_ptr, c_ptr):
    """Problem p = program_id: A uint8 [16, 32] (row-major e4m3), B uint8 [8, 32] (token-major), C fp32 [16, 8]."""
    p = tl.program_id(0).to(tl.int64)
    lane = tl.arange(0, 32)
    g = lane // 4
    q = lane % 4
    aw = a_ptr.to(tl.pointer_type(tl.int32)) + p * 128  # 16 x 32 bytes as 128 words, 8 per row
    bw = b_ptr.to(tl.pointer_type(tl.int32)) + p * 64
    a0 = tl.load(aw + g * 8 + q)
    a1 = tl.load(aw + (g + 8) * 8 + q)
    a2 = tl.load(aw + g * 8 + 4 + q)
    a3 = tl.load(aw + (g + 8) * 8 + 4 + q)
    b0 = tl.load(bw + g * 8 + q)
    b1 = tl.load(bw + g * 8 + 4 + q)
    zero = tl.zeros([32], tl.float32)
    c0, c1, c2, c3 = tl.inline_asm_elementwise(
        "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, "
        "{$10, $10, $10, $10};",
        "=f,=f,=f,=f,r,r,r,r,r,r,f", [a0, a1, a2, a3, b0, b1, zero],
        dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)
    cp = c_ptr + p * 128
    tl.store(cp + g * 8 + 2 * q, c0)
    tl.store(cp + g * 8 + 2 * q + 1, c1)
    tl.store(cp + (g + 8) * 8 + 2 * q, c2)
    tl.store(cp + (g + 8) * 8 + 2 * q + 1, c3)


def e2m1_as_e4m3(n: int, gen) -> torch.Tensor:
    """Random e2m1 codes placed as e4m3 bytes worth e2m1 * 2**-6 (the decode kernels' A operand)."""
    c = torch.randint(0, 16, (n,), generator=gen)
    return (((c & 7) << 2) | ((c & 8) << 4)).to(torch.uint8)


def finite_e4m3(n: int, gen) -> torch.Tensor:
    c = torch.randint(0, 256, (n,), generator=gen).to(torch.uint8)
    return torch.where((c & 0x7F) == 0x7F, c & 0xF0, c)  # NaN codes -> finite


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "mma_sync_out"))
    ap.add_argument("--problems", type=int, default=4096)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__, "cases": []}
    p = args.problems
    for name, a_codes in (("decoded-e2m1", e2m1_as_e4m3(p * 512, gen)), ("any-e4m3", finite_e4m3(p * 512, gen))):
        b_codes = finite_e4m3(p * 256, gen)
        a = a_codes.view(p, 16, 32).cuda()
        b = b_codes.view(p, 8, 32).cuda()
        c = torch.full((p, 16, 8), float("nan"), device="cuda")
        mma_sync_kernel[(p,)](a, b, c, num_warps=1)
        torch.cuda.synchronize()
        av = a.view(torch.float8_e4m3fn).float().cpu()
        bv = b.view(torch.float8_e4m3fn).float().cpu()
        got = c.cpu()
        row = {"case": name, "problems": p, "nan": int(torch.isnan(got).sum())}
        for mname, mdl in MODELS.items():
            ref = tc_dot(av, bv, mdl)
            row[mname] = float((ref.view(torch.int32) == got.view(torch.int32)).float().mean())
        if row.get("sm90-fp8-tc-operands", 0) < 1.0:
            sub = slice(0, min(p, 64))
            fits = fit_tensorcore_model(av[sub], bv[sub], got[sub])[:5]
            row["best_fits"] = [(m, f.name) for m, f in fits]
        res["cases"].append(row)
        print(json.dumps(row), flush=True)
    with open(os.path.join(args.out, "mma_sync_probe.json"), "w") as f:
        json.dump(res, f, indent=1)
    return 0 if all(r["sm90-fp8-tc-operands"] == 1.0 for r in res["cases"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())

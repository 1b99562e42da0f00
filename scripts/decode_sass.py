"""Compile the decode kernels for sm_90 on any machine (no GPU: Triton's bundled ptxas) and report registers,
spills and the instruction mix of the K loops, the numbers docs/decode-kernel.md and docs/decode-kernel-tc.md quote.

    python3 scripts/decode_sass.py [--block-m 1] [--warps 4] [--prefetch]      the CUDA-core kernels
    python3 scripts/decode_sass.py --tc [--pdl] [--pack [--split 2]] [--route]   the tensor-core kernels
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from megamoe.decode.triton_gemv import l1_kernel, l2_kernel  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
L1_SIG = dict(w_ptr="*i32", s_ptr="*u8", x_ptr="*fp32", xsf_ptr="*fp32", num_touched_ptr="*i32", touched_ptr="*i32",
              seg_start_ptr="*i32", seg_count_ptr="*i32", row_token_ptr="*i32", row_weight_ptr="*fp32", l1_ptr="*fp32",
              q_ptr="*u8", x2_ptr="*fp32", sf2_ptr="*fp32", clamp="fp32")
L2_SIG = dict(w_ptr="*i32", s_ptr="*u8", x2_ptr="*fp32", sf2_ptr="*fp32", num_touched_ptr="*i32", touched_ptr="*i32",
              seg_start_ptr="*i32", seg_count_ptr="*i32", out_ptr="*i16")


def compile_sass(fn, sig: dict, const: dict, warps: int, options: dict | None = None, with_ttgir: bool = False):
    """(SASS text, resource usage line[, TTGIR]) of fn compiled for sm_90."""
    # Pointers divisible by 16, as the launcher's specialization makes them (torch allocations are): without it
    # the compiler cannot prove wide loads aligned and emits byte loads the real kernel does not have.
    attrs = {(i,): [["tt.divisibility", 16]] for i, v in enumerate(sig.values()) if v.startswith("*")}
    src = ASTSource(fn=fn, signature={**sig, **dict.fromkeys(const, "constexpr")}, constexprs=const, attrs=attrs)
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, **(options or {})})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(c.asm["cubin"])
        f.flush()
        sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", f.name], capture_output=True, text=True).stdout
        res = subprocess.run([os.path.join(BIN, "cuobjdump"), "-res-usage", f.name], capture_output=True, text=True).stdout
    usage = " ".join(re.findall(r"REG:\d+ STACK:\d+ SHARED:\d+", res))
    return (sass, usage, c.asm["ttgir"]) if with_ttgir else (sass, usage)


def loop_mix(sass: str, marker: str = "HADD2.F32") -> tuple[int, collections.Counter]:
    """Instructions of the K loop: of the innermost loops (backward branches with no loop inside), the one holding
    the most instructions named ``marker`` (the fp16 decode conversion; the MMA for the tensor-core kernels),
    the first in the code on a tie (L1's packed loop, or part 0's with a split K): (count, mix by opcode)."""
    lines = re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*?);", sass)
    addr = [(int(a, 16), op, rest) for a, op, rest in lines]
    spans = []
    for pc, op, rest in addr:
        m = re.search(r"0x([0-9a-f]+)", rest) if op == "BRA" else None
        if m and int(m.group(1), 16) < pc:
            spans.append((int(m.group(1), 16), pc))
    inner = [(a, b) for a, b in spans if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in spans)]
    loops = []
    for a, b in inner:
        body = [o for p, o, _ in addr if a <= p <= b]
        loops.append((sum(o.startswith(marker) or marker in o for o in body), -a, body))
    _, _, body = max(loops, key=lambda x: (x[0], x[1]))
    return len(body), collections.Counter(body)


TC_L1_SIG = dict(w_ptr="*u8", s_ptr="*i32", x_ptr="*fp8e4nv", xsf_ptr="*fp32", num_touched_ptr="*i32",
                 touched_ptr="*i32", seg_start_ptr="*i32", seg_count_ptr="*i32", row_token_ptr="*i32",
                 row_weight_ptr="*fp32", l1_ptr="*fp32", q_ptr="*u8", sf2_ptr="*fp32", terms_ptr="*fp32",
                 cnt_ptr="*i32", idx_ptr="*i64", tw_ptr="*fp32", slot_row_ptr="*i32",
                 T="i32", expert_lo="i32", num_local="i32", clamp="fp32", probe_ptr="*i32")
TC_L2_SIG = dict(w_ptr="*u8", s_ptr="*i32", q_ptr="*fp8e4nv", sf2_ptr="*fp32", num_touched_ptr="*i32",
                 touched_ptr="*i32", seg_start_ptr="*i32", seg_count_ptr="*i32", out_ptr="*i16", probe_ptr="*i32")


def tc_report(pdl: bool = False, pack: bool = False, split: int = 1, route: bool = False) -> int:
    """The tensor-core kernels with the backend's launch options: registers, spills inside / outside the K loop,
    the loop's instructions per weight, and the layout conversions left in the TTGIR (none between the decode
    and the MMA: the only ones are the epilogue's)."""
    from megamoe.decode import LaunchConfig
    from megamoe.decode.triton_tc import l1_tc_kernel, l2_tc_kernel
    from megamoe.decode.triton_tc_ops import no_probe

    cfg = LaunchConfig()
    geo = dict(H=4096, I=2048, ASM=True, PDL=pdl, PACK=pack, PROBE=no_probe)  # (a launch binds PROBE's default)
    for name, fn, sig, const, cap, groups in (
        ("l1_tc_kernel", l1_tc_kernel, TC_L1_SIG, dict(STORE_L1=False, SPLIT=split, ROUTE=route, K=6, S_PAD=8,
                                                       E_PAD=512, **geo), cfg.tc_l1_maxnreg, 4),
        ("l2_tc_kernel", l2_tc_kernel, TC_L2_SIG, geo, cfg.tc_l2_maxnreg, 4),
    ):
        opts = {"num_stages": cfg.tc_stages, "launch_pdl": pdl, **({"maxnreg": cap} if cap else {})}
        sass, res, ttgir = compile_sass(fn, sig, const, 4, opts, with_ttgir=True)
        n, mix = loop_mix(sass, "GMMA")
        spills_in_loop = sum(c for op, c in mix.items() if op.startswith(("LDL", "STL")))
        weights = groups * 64 * 32 // 128  # per thread per iteration
        print(f"{name} (cap {cap}, {cfg.tc_stages} stages): {res}; K loop {n} instructions for {weights} weights per "
              f"thread = {n / weights:.2f} per weight; spills in the loop {spills_in_loop}; layout conversions in the "
              f"TTGIR {ttgir.count('ttg.convert_layout')}")
        print("   " + ", ".join(f"{op} {c}" for op, c in mix.most_common(12)))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--block-m", type=int, default=1)
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--bn2", type=int, default=32, help="L2 rows per program")
    ap.add_argument("--prefetch", action="store_true", help="the next K-iteration's tile loaded first")
    ap.add_argument("--tc", action="store_true", help="the tensor-core kernels (megamoe-decode-tc) instead")
    ap.add_argument("--pdl", action="store_true", help="with --tc: programmatic dependent launch")
    ap.add_argument("--pack", action="store_true", help="with --tc: the packed passes (four groups per MMA)")
    ap.add_argument("--split", type=int, default=1, help="with --tc --pack: L1's packed K loop in this many parts")
    ap.add_argument("--route", action="store_true", help="with --tc: L1 routes for itself (one token's slots)")
    args = ap.parse_args()
    if args.tc:
        return tc_report(args.pdl, args.pack, args.split, args.route)
    geo = dict(H=4096, I=2048, G=16, BLOCK_M=args.block_m, ASM=True, PREFETCH=args.prefetch)
    for name, fn, sig, const, rows_words in (
        ("l1_kernel", l1_kernel, L1_SIG, dict(BN=32, STORE_L1=False, **geo), 2),
        ("l2_kernel", l2_kernel, L2_SIG, dict(BN=args.bn2, L2_GROUP=32, **geo), 1),
    ):
        sass, res = compile_sass(fn, sig, const, args.warps)
        n, mix = loop_mix(sass)
        # weights per thread per K-iteration: halves x 4 words x (BN rows x 16 groups / threads) x 8
        weights = rows_words * 4 * (const["BN"] * 16 // (32 * args.warps)) * 8
        print(f"{name} (BLOCK_M {args.block_m}, {args.warps} warps): {res}; K loop {n} instructions for {weights} "
              f"weights per thread = {n / weights:.2f} per weight")
        print("   " + ", ".join(f"{op} {c}" for op, c in mix.most_common(12)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

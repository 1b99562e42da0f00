"""Checks of the 1-token CUDA step (megamoe/decode/cuda_step.py) on an SM90 GPU, against the three Triton launches
it replaces and against the eager reference (recipe megamoe-decode-tc):

    stages   route's outputs, l2_q, l2_sf and slot_out equal to the Triton launches' bit for bit, from the same
             staged token (both buffers poisoned first)
    whole    y equal to the Triton launches' and to the reference bit for bit (calc_diff 0); rows past the step
             still poisoned; ``repeats`` poisoned relaunches bit-identical; then another token in the same
             buffers, every stage right again; every count the step keeps between its CTAs
             (``DecodeBuffers.step_sync``) back at zero after its launches, as the next launch needs

    python3 lab/cuda_step/selfcheck.py [--repeats 8] [--mode regs [--mode ll ...]]   (one H200) -> JSON rows;
                                                                                exit 1 on a failure

Without ``--mode`` it checks the library's step as users run it (``moe_decode`` with ``LaunchConfig.tc_cuda_step1``).
``--mode`` checks a probe variant whose y is meant to be right (``Y_RIGHT_MODES``, names of ``step.MODES``) instead,
launched through the lab's build (step.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]  # megamoe and lab; the tests' decode checks (decode_selfcheck.py)

from lab.cuda_step import step as probe_step  # noqa: E402
from megamoe.decode import cuda_step, tc  # noqa: E402
from megamoe.decode.layout_tc import prepare_tc_weights  # noqa: E402
from megamoe.decode.moe import DecodeBuffers, moe_decode  # noqa: E402
from megamoe.inputs import make_inputs  # noqa: E402
from megamoe.recipe import MEGAMOE_DECODE_TC  # noqa: E402
from megamoe.testing import calc_diff, first_mismatch  # noqa: E402
from decode_selfcheck import DecodeCase, case_weights, copy_staged, geometry_of, written  # noqa: E402
from decode_tc_selfcheck import ROUTE_FIELDS  # noqa: E402

FIELDS = ROUTE_FIELDS + ("l2_q", "l2_sf", "slot_out", "y")  # route's outputs L1-L2 read, then every later stage
CASES = (
    DecodeCase("dsv4-flash", 1, seed=101),
    DecodeCase("dsv4-flash", 1, seed=102),
    DecodeCase("dsv4-flash", 1, routing="masked", seed=103),
    DecodeCase("dsv4-flash", 1, routing="skewed", seed=104),
    DecodeCase("dsv4-flash", 1, routing="allmasked", seed=105),
)


Y_RIGHT_MODES = ("touch", "plain", "ahead", "regs", "regs-l1", "ll", "ll-combine")  # variants meant to keep the bits


def _mode_bits(mode: str) -> int:
    """A sum of Y_RIGHT_MODES ('regs-l1+ll') that some kernel instance compiles -> step.step's mode, or
    ValueError naming why not."""
    if not set(mode.split("+")) <= set(Y_RIGHT_MODES):
        raise ValueError(f"mode must be of {Y_RIGHT_MODES}, joined by '+' (the variants meant to keep the step's "
                         f"bits), got {mode!r}")
    bits = sum(probe_step.MODES[m] for m in set(mode.split("+")))
    if (why := probe_step.mode_error(bits)) is not None:
        raise ValueError(f"mode {mode!r} is no kernel instance's: {why}")
    return bits


def run_step_case(case: DecodeCase, repeats: int = 8, capacity: int = 2, mode: str | None = None) -> dict:
    """One staged token through the Triton launches and through the CUDA step (buffers for ``capacity`` tokens,
    so that a row past the step shows whether it kept its poison); ``mode``: a probe variant of the step instead,
    ``Y_RIGHT_MODES`` joined by '+' (``regs-l1+ll``)."""
    bits = None if mode is None else _mode_bits(mode)
    from megamoe.reference import moe_forward
    from megamoe.staging import stage_into

    t0 = time.time()
    g = geometry_of(case.geometry)
    w = case_weights(case.geometry, "cuda")
    tw = prepare_tc_weights(w)
    inp = make_inputs(g, 1, seed=3000 + case.seed, outlier_channels=4, **case.routing_kwargs()).to("cuda")
    bufs = [DecodeBuffers.allocate(g, capacity, "cuda", split_tokens=1) for _ in range(2)]
    stage_into(inp.x, inp.topk_idx, inp.topk_weights, bufs[0].x_q, bufs[0].x_sf, bufs[0].topk_idx,
               bufs[0].topk_weights, 1, num_experts=g.num_experts, backend="torch")
    copy_staged(bufs[0], bufs[1])
    triton_cfg = tc.tc_launch_config(1, g.num_topk)  # the backend's launch
    cuda_cfg = dataclasses.replace(triton_cfg, tc_cuda_step1=True)
    row = {"case": case.id, **dataclasses.asdict(case), "launch": cuda_cfg.tc_cuda_step1, "mode": mode,
           "unsupported": cuda_step.unsupported(tw, bufs[1], 1)}
    sync = None  # the LL words past the counts: the lab's own buffer (buf.step_sync holds the counts only)
    if bits is not None and row["unsupported"] is None:
        sync = probe_step.sync_buffer(tw, "cuda")

    # (not named cuda_step: that is the module, read below)
    def launch_step():
        if mode is None:
            moe_decode(tw, bufs[1], 1, g.clamp, cuda_cfg)
        elif row["unsupported"] is None:  # (else the row fails on "unsupported")
            probe_step.step(tw, bufs[1], g.clamp, mode=bits, sync=sync)

    def mismatches() -> str:
        return "; ".join(f"{f}: {m}" for f in FIELDS if (m := first_mismatch(written(bufs[1], f, 1),
                                                                             written(bufs[0], f, 1))))

    def launch_both() -> str:
        """Both buffers poisoned, the Triton launches into 0 and the step into 1: the stages that differ."""
        for b in bufs:
            b.poison_()
        moe_decode(tw, bufs[0], 1, g.clamp, triton_cfg)
        launch_step()
        torch.cuda.synchronize()
        return mismatches()

    row["stages"] = launch_both()
    n = int((bufs[1].slot_row[: g.num_topk] >= 0).sum())
    row["rows"] = n
    row["poison_kept"] = bool(torch.isnan(bufs[1].y[1:].float()).all() and (bufs[1].l2_q[n:] == 0x7F).all()
                              and (bufs[1].slot_out[n:].view(torch.uint8) == 0x7F).all())
    y = bufs[1].y[:1].clone()
    ref = moe_forward(inp, w, MEGAMOE_DECODE_TC, g)
    # (no routed slot: y must be all zero, and calc_diff of two zero vectors says nothing; 1.0 if any is not)
    row["calc_diff"] = calc_diff(y, ref) if n else float((y.float() != 0).any())
    row["bitwise_frac"] = float((y.view(torch.int16) == ref.view(torch.int16)).float().mean())
    row["nan"] = int(torch.isnan(y.float()).sum())
    differ = 0
    for _ in range(repeats):
        bufs[1].poison_()
        launch_step()
        differ += bool(mismatches())
    row["relaunches_differing"] = f"{differ} of {repeats}"
    # Then another token in the same buffers: a launch that took anything of the last one's (a count not reset, an
    # LL word of an earlier launch taken for this one's) gives the last token's values where this one's differ.
    other = make_inputs(g, 1, seed=4000 + case.seed, outlier_channels=4, **case.routing_kwargs()).to("cuda")
    stage_into(other.x, other.topk_idx, other.topk_weights, bufs[0].x_q, bufs[0].x_sf, bufs[0].topk_idx,
               bufs[0].topk_weights, 1, num_experts=g.num_experts, backend="torch")
    copy_staged(bufs[0], bufs[1])
    row["next_token"] = launch_both()
    counts = (bufs[1].step_sync if sync is None else sync)[: cuda_step.sync_words(g.hidden)]
    row["counts_left"] = int((counts != 0).sum())  # a relaunch passes its waits early if any is left
    row["seconds"] = round(time.time() - t0, 2)
    return row


def passed_step(row: dict) -> bool:
    """The CUDA step ran (not the Triton fallback), every stage equal to the Triton launches', y bit-identical to
    the reference, poison kept, no relaunch differing, the next token's stages right too, no count left for the
    next launch."""
    return (row["launch"] and row["unsupported"] is None and not row["stages"] and row["bitwise_frac"] == 1.0
            and row["poison_kept"] and not row["nan"] and row["relaunches_differing"].startswith("0 of")
            and not row["next_token"] and row["counts_left"] == 0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--mode", action="append", help="check this probe variant instead of the step (again for "
                    f"more, in one process): of {Y_RIGHT_MODES}, joined by '+'")
    args = ap.parse_args(argv)
    for mode in args.mode or ():  # all refused before any runs
        try:
            _mode_bits(mode)
        except ValueError as exc:
            ap.error(str(exc))
    rows = []
    for mode in args.mode or [None]:
        for case in CASES:
            rows.append(run_step_case(case, args.repeats, mode=mode))
            rows[-1]["passed"] = passed_step(rows[-1])
            print(json.dumps(rows[-1]), flush=True)
    return 0 if all(r["passed"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""Checks of the CUDA-core decode path (``megamoe.decode``, recipe ``megamoe-decode``), a support module of
the tests (``test_decode.py``: under Triton's interpreter in a subprocess, ``interpreter_rows``, and on the GPU)
and of the lab's decode probes: every Triton stage against its torch twin bit for bit, the whole path against the
eager reference, repeat determinism, untouched rows still poisoned, and broken variants that must be caught.

    TRITON_INTERPRET=1 PYTHONPATH=$PWD python3 tests/decode_selfcheck.py --device cpu    -> JSON rows
    ... --order: only the order patterns (``run_order_case``: inputs on which the order of the K blocks shows)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import megamoe
from megamoe.decode import gemv, routing
from megamoe.decode.gemv import LaunchConfig
from megamoe.decode.layout import TileShape, default_tiles, prepare_decode_weights
from megamoe.decode.moe import DecodeBuffers, moe_decode
from megamoe.geometry import Geometry, get_geometry
from megamoe.inputs import make_inputs
from megamoe.recipe import MEGAMOE_DECODE
from megamoe.testing import calc_diff, first_mismatch
from megamoe.weights import MXFP4Weights, random_mxfp4_weights


@dataclass(frozen=True)
class DecodeCase:
    geometry: str
    tokens: int
    block_m: int = 1
    routing: str = "uniform"  # uniform | masked | skewed | allmasked
    bn2: int = 64
    broken: str = ""  # "" | gate-up-swapped | l2-scale-off-by-one
    l1_prefetch: bool = False  # L1 / L2 load the next K-iteration's tile first (LaunchConfig)
    l2_prefetch: bool = False
    groups: tuple[int, int] | None = None  # 32-K groups per K-iteration of L1, L2 (None: default_tiles)
    seed: int = 0

    @property
    def id(self) -> str:
        parts = [self.geometry, f"T{self.tokens}", f"bm{self.block_m}", f"bn2-{self.bn2}"]
        parts += [self.routing] if self.routing != "uniform" else []
        parts += [f"prefetch-{'l1' * self.l1_prefetch}{'l2' * self.l2_prefetch}"] if self.l1_prefetch or self.l2_prefetch else []
        parts += [f"g{self.groups[0]}x{self.groups[1]}"] if self.groups else []
        parts += [f"BROKEN-{self.broken}"] if self.broken else []
        return "-".join(parts)

    def routing_kwargs(self) -> dict:
        return {"uniform": {}, "masked": {"mask_prob": 0.3}, "skewed": {"skew": 3.0},
                "allmasked": {"fully_masked_tokens": (0,)}}[self.routing]


# "wide" has the production tile structure (16 groups per K-iteration in both GEMMs: 4 promotion blocks
# per L1 iteration, 16 per L2 iteration) at a size the interpreter runs in seconds.
GEOMETRIES = {"wide": Geometry("decode-wide", num_experts=4, num_topk=2, hidden=512, intermediate=512)}

# Small enough for the interpreter: every BLOCK_M, a chunk loop longer than one pass (skewed: one expert
# gets most tokens), masked slots, a token with every slot masked, several L2 tile widths, four K-iterations
# per program (with and without the prefetch), and two broken variants that the reference comparison must
# catch.
CPU_CASES = (
    DecodeCase("tiny", 1, 1, bn2=256, seed=1),
    DecodeCase("tiny", 4, 2, "masked", bn2=128, seed=2),
    DecodeCase("tiny", 6, 4, "skewed", bn2=256, seed=3),
    DecodeCase("wide", 2, 2, "allmasked", bn2=512, seed=4),
    DecodeCase("tiny", 5, 2, "masked", bn2=64, seed=7),
    DecodeCase("wide", 3, 2, "masked", bn2=128, groups=(4, 4), seed=8),
    DecodeCase("wide", 3, 4, "masked", bn2=128, groups=(4, 4), l1_prefetch=True, l2_prefetch=True, seed=9),
    DecodeCase("tiny", 3, 1, broken="gate-up-swapped", bn2=256, seed=5),
    DecodeCase("tiny", 3, 1, broken="l2-scale-off-by-one", bn2=256, seed=6),
)


def geometry_of(name: str) -> Geometry:
    return GEOMETRIES[name] if name in GEOMETRIES else get_geometry(name)


@functools.lru_cache(maxsize=4)
def case_weights(name: str, device: str):
    """One random weight set per geometry, generated on ``device`` (the inputs are fresh per case)."""
    return random_mxfp4_weights(geometry_of(name), seed=0, device=device)


@functools.lru_cache(maxsize=4)
def case_decode_weights(name: str, device: str, bn2: int = 64, groups: tuple[int, int] | None = None):
    """``case_weights`` prepared for the kernel with an L2 tile of bn2 rows and, if given, (L1, L2) groups per
    K-iteration (fewer groups: more K-iterations per program on a small geometry) (cached)."""
    g = geometry_of(name)
    t1, t2 = default_tiles(g.hidden, g.intermediate, bn2=bn2)
    if groups:
        t1, t2 = TileShape(t1.bn, groups[0]), TileShape(t2.bn, groups[1])
    return prepare_decode_weights(case_weights(name, device), t1, t2)

STAGE_FIELDS = {
    "route": ("num_touched", "touched", "seg_start", "seg_count", "row_token", "row_weight", "slot_row", "x32"),
    "l1": ("l1_out", "l2_q", "l2_x", "l2_sf"),
    "l2": ("slot_out",),
    "combine": ("y",),
}


def written(buf: DecodeBuffers, name: str, t: int) -> torch.Tensor:
    """The part of a buffer a launch of t tokens writes (rows past it must keep their poison)."""
    n = int((buf.slot_row[: t * buf.num_topk] >= 0).sum()) if name not in ("x32", "y", "num_touched") else 0
    w = int(buf.num_touched[0])
    rows = {"num_touched": 1, "touched": w, "seg_start": w, "seg_count": w, "x32": t, "y": t,
            "slot_row": t * buf.num_topk}.get(name, n)
    return getattr(buf, name)[:rows]


def copy_staged(src: DecodeBuffers, dst: DecodeBuffers) -> None:
    """The staged inputs of src (x_q, x_sf, topk_idx, topk_weights) into dst: two buffers, one step."""
    for name in ("x_q", "x_sf", "topk_idx", "topk_weights"):
        getattr(dst, name).copy_(getattr(src, name))


def make_case(case: DecodeCase, device):
    """(geometry, checkpoint weights, decode weights, inputs, staged buffers) of one case."""
    from megamoe.staging import stage_into

    g = geometry_of(case.geometry)
    w = case_weights(case.geometry, str(device))
    dw = case_decode_weights(case.geometry, str(device), case.bn2, case.groups)
    if case.broken == "gate-up-swapped":
        dw = dataclasses.replace(dw, l1_words=dw.l1_words.flip(3).contiguous(), l1_scales=dw.l1_scales.flip(3).contiguous())
    elif case.broken == "l2-scale-off-by-one":
        dw = dataclasses.replace(dw, l2_scales=(dw.l2_scales + 1).contiguous())
    inp = make_inputs(g, case.tokens, seed=1000 + case.seed, outlier_channels=4, **case.routing_kwargs()).to(device)
    buf = DecodeBuffers.allocate(g, case.tokens, device)
    stage_into(inp.x, inp.topk_idx, inp.topk_weights, buf.x_q, buf.x_sf, buf.topk_idx, buf.topk_weights,
               case.tokens, num_experts=g.num_experts, backend="torch")
    return g, w, dw, inp, buf


def run_case(case: DecodeCase, device="cpu", repeat: bool = True) -> dict:
    """Stage by stage (Triton vs twin, from the same inputs), then the whole path vs the reference; with
    ``repeat``, the whole path once more from poisoned buffers, which must give the same bits."""
    from megamoe.reference import moe_forward

    t0 = time.time()
    g, w, dw, inp, buf = make_case(case, device)
    t = case.tokens
    row = {"case": case.id, **dataclasses.asdict(case)}
    cfg = LaunchConfig(block_m=case.block_m, store_l1=True, l1_prefetch=case.l1_prefetch, l2_prefetch=case.l2_prefetch)
    if case.broken:  # the whole path once, against the reference: it must differ
        y = moe_decode(dw, buf, t, g.clamp, cfg)
        row["calc_diff"] = calc_diff(y, moe_forward(inp, w, MEGAMOE_DECODE, g))
        row["seconds"] = round(time.time() - t0, 2)
        return row
    twin = DecodeBuffers.allocate(g, case.tokens, device)
    copy_staged(buf, twin)
    buf.poison_()
    twin.poison_()
    stages = (
        ("route", lambda b, f: f(b.topk_idx, b.topk_weights, b.x_q, t, b.expert_lo, b.num_local, b),
         routing.route, routing.route_torch),
        ("l1", lambda b, f: f(dw, b, t, g.clamp, cfg), gemv.l1, gemv.l1_torch),
        ("l2", lambda b, f: f(dw, b, t, cfg), gemv.l2, gemv.l2_torch),
        ("combine", lambda b, f: f(b, t, g.num_topk, cfg), gemv.combine, gemv.combine_torch),
    )
    for name, call, kernel, torch_twin in stages:
        call(buf, kernel)
        call(twin, torch_twin)
        msgs = [f"{f}: {m}" for f in STAGE_FIELDS[name]
                if (m := first_mismatch(written(buf, f, t), written(twin, f, t)))]
        row[name] = "; ".join(msgs)
    n = int((buf.slot_row[: t * g.num_topk] >= 0).sum())
    row["poison_kept"] = bool(torch.isnan(buf.l2_x[n:]).all() and torch.isnan(buf.y[t:].float()).all())
    y = buf.y[:t].clone()
    ref = moe_forward(inp, w, MEGAMOE_DECODE, g)
    row["calc_diff"] = calc_diff(y, ref)
    row["bitwise_frac"] = float((y.view(torch.int16) == ref.view(torch.int16)).float().mean())
    row["nan"] = int(torch.isnan(y.float()).sum())
    if case.routing == "allmasked":
        row["masked_rows_zero"] = bool((y[0].float() == 0).all())
    if repeat:
        buf.poison_()
        y2 = moe_decode(dw, buf, t, g.clamp, cfg).clone()
        row["repeat_identical"] = not first_mismatch(y2, y)
    row["seconds"] = round(time.time() - t0, 2)
    return row


def passed(row: dict) -> bool:
    """A sound case: every stage equal to its twin, bit-identical to the reference, repeatable, poison kept.
    A broken case passes when the reference comparison catches it."""
    if row["broken"]:
        return row["calc_diff"] > 1e-3
    stages_ok = not any(row[s] for s in STAGE_FIELDS)
    return (stages_ok and row["bitwise_frac"] == 1.0 and row.get("repeat_identical", True) and row["poison_kept"]
            and row["nan"] == 0 and row.get("masked_rows_zero", True))


# ------------------------------------------------------------------------------------ the order of the K blocks
# Inputs on which the order of the FP32 additions shows, under the interpreter too (shared with
# decode_tc_selfcheck.py). x is 1.0 at every K and each nonzero 32-K group of a weight row holds one product, the
# code of +-1.0 at its first K with the scale byte 127 + log2 |v|, worth v = A = 2**24, 1 or -A: every group sum is
# exact in any matmul. In FP32 (A + 1) - A is 0 (A + 1 rounds to A, ties to even) but (-A + 1) + A is 1: a row
# whose terms are A, 1, -A in ascending K is 0 when they are added in ascending K and 1 in reverse (its mirror
# -A, 1, A the other way round). A table row: ({32-K group: v}, the row's output in the recipe's order).
ORDER_A = A = 2.0**24
ORDER_GEOMETRY = Geometry("decode-order", num_experts=2, num_topk=1, hidden=512, intermediate=256)
ORDER_EXPERT = 1  # both tokens' one slot
ORDER_SF = (1.0, 0.5)  # per token: x_sf of every 128-K block (L1), l2_sf of every group (L2); the term is
#                        fl32(sf * block): a power of two keeps the pattern

# This path's blocks are exact float64 sums of their groups (a block's bytes span <= 24 binades, checked at
# prepare): A, 1, -A inside one 128-K block is 1 in any order, and only the promotion order of the blocks shows.
L1_ORDER_ROWS = (  # L1: H = 512, four 128-K blocks of four groups
    ({0: A, 1: 1.0, 2: -A}, 1.0),  # in block 0: exact, whatever the order
    ({0: A, 4: 1.0, 8: -A}, 0.0),  # blocks 0, 1, 2
    ({4: A, 8: 1.0, 12: -A}, 0.0),  # blocks 1, 2, 3 (with 4 groups per K iteration: across iterations)
    ({0: -A, 4: 1.0, 8: A}, 1.0),  # the mirror
)
L2_ORDER_ROWS = (  # L2: I = 256, eight groups, each its own promotion block
    ({0: A, 1: 1.0, 2: -A}, 0.0),
    ({1: -A, 2: 1.0, 3: A}, 1.0),  # the mirror
    ({3: A, 4: 1.0, 5: -A}, 0.0),  # with 4 groups per K iteration: across iterations
    ({2: A, 5: 1.0, 7: -A}, 0.0),
)
ORDER_CONFIGS = (((16, 8), 1, False), ((4, 4), 2, True))  # (L1, L2 groups per K iteration), block_m, prefetch


def order_id(groups: tuple[int, int], block_m: int, prefetch: bool) -> str:
    return f"order-g{groups[0]}x{groups[1]}-bm{block_m}" + "-prefetch" * prefetch


def order_l1_channels(n: int) -> list[int]:
    """The gate channels of n table rows, one per 32-channel tile as far as they go (up: channel + 1's)."""
    return [(k * 33) % ORDER_GEOMETRY.intermediate for k in range(n)]


def order_l2_rows(n: int) -> list[int]:
    """The L2 output rows of n table rows, one per 64-row tile as far as they go."""
    return [(k * 65) % ORDER_GEOMETRY.hidden for k in range(n)]


def order_weights(l1_rows, l2_rows) -> MXFP4Weights:
    """ORDER_GEOMETRY's checkpoint, codes zero except the tables' rows in expert ORDER_EXPERT: L1's on the gate
    channels ``order_l1_channels`` and on the up channels one further, L2's on ``order_l2_rows``."""
    from megamoe.formats import pack_e2m1

    g = ORDER_GEOMETRY
    e, h, i = g.num_experts, g.hidden, g.intermediate
    c1, s1 = torch.zeros(e, 2 * i, h, dtype=torch.uint8), torch.full((e, 2 * i, h // 32), 127, dtype=torch.uint8)
    c2, s2 = torch.zeros(e, h, i, dtype=torch.uint8), torch.full((e, h, i // 32), 127, dtype=torch.uint8)

    def put(codes, scales, row, pattern):
        for grp, v in pattern.items():
            codes[ORDER_EXPERT, row, 32 * grp] = 2 if v > 0 else 10  # e2m1 +1.0 / -1.0
            scales[ORDER_EXPERT, row, grp] = 127 + int(math.log2(abs(v)))

    for (pattern, _), c in zip(l1_rows, order_l1_channels(len(l1_rows))):
        put(c1, s1, c, pattern)
        put(c1, s1, i + (c + 1) % i, pattern)
    for (pattern, _), r in zip(l2_rows, order_l2_rows(len(l2_rows))):
        put(c2, s2, r, pattern)
    return MXFP4Weights(pack_e2m1(c1), s1, pack_e2m1(c2), s2)


def order_buffers(device, split_tokens: int = 0) -> tuple[DecodeBuffers, DecodeBuffers]:
    """(the kernels', the twins') buffers of ORDER_GEOMETRY: two tokens staged to ORDER_EXPERT, poisoned, then x_q =
    1.0 and x_sf = ORDER_SF, routed by route_torch (x32 = 1.0)."""
    from megamoe.staging import stage_into

    g, t = ORDER_GEOMETRY, len(ORDER_SF)
    bufs = []
    for _ in range(2):
        buf = DecodeBuffers.allocate(g, t, device, split_tokens=split_tokens)
        stage_into(torch.ones(t, g.hidden, dtype=torch.bfloat16, device=device),
                   torch.full((t, 1), ORDER_EXPERT, dtype=torch.int64, device=device), torch.ones(t, 1, device=device),
                   buf.x_q, buf.x_sf, buf.topk_idx, buf.topk_weights, t, num_experts=g.num_experts, backend="torch")
        buf.poison_()
        buf.x_q[:t] = 1.0
        buf.x_sf[:t] = torch.tensor(ORDER_SF, device=device)[:, None]
        routing.route_torch(buf.topk_idx, buf.topk_weights, buf.x_q, t, buf.expert_lo, buf.num_local, buf)
        bufs.append(buf)
    return bufs[0], bufs[1]


def _order_sf(buf: DecodeBuffers) -> torch.Tensor:
    """ORDER_SF of each pool row's token, [2, 1]."""
    return torch.tensor(ORDER_SF, device=buf.x_sf.device)[buf.row_token[: len(ORDER_SF)].long()][:, None]


def order_l2_inputs(*bufs: DecodeBuffers) -> None:
    """L2's own inputs, the same in each: 1.0 at every K (l2_q e4m3 codes, l2_x values), l2_sf = the row's ORDER_SF."""
    for b in bufs:
        t = len(ORDER_SF)
        b.l2_q[:t] = 0x38  # e4m3 1.0
        b.l2_x[:t] = 1.0
        b.l2_sf[:t] = _order_sf(b)


def order_by_hand(buf: DecodeBuffers, twin: DecodeBuffers, l1_rows, l2_rows) -> dict:
    """The tables' rows in l1_out (gate and up) and slot_out of both buffers against the tables' values times
    the row's ORDER_SF: {"l1_by_hand": ..., "l2_by_hand": ...}, '' where they agree, else who and the first
    mismatch."""
    t, i = len(ORDER_SF), ORDER_GEOMETRY.intermediate
    sf = _order_sf(buf)
    chans = order_l1_channels(len(l1_rows))
    cols = torch.tensor(chans + [i + (c + 1) % i for c in chans], device=sf.device)
    want1 = (sf * torch.tensor([v for _, v in l1_rows], device=sf.device)).repeat(1, 2)
    rows2 = torch.tensor(order_l2_rows(len(l2_rows)), device=sf.device)
    want2 = (sf * torch.tensor([v for _, v in l2_rows], device=sf.device)).to(torch.bfloat16)
    return {"l1_by_hand": "; ".join(f"{who}: {m}" for who, b in (("kernel", buf), ("twin", twin))
                                    if (m := first_mismatch(b.l1_out[:t, cols], want1))),
            "l2_by_hand": "; ".join(f"{who}: {m}" for who, b in (("kernel", buf), ("twin", twin))
                                    if (m := first_mismatch(b.slot_out[:t, rows2].view(torch.bfloat16), want2)))}


def passed_order(row: dict) -> bool:
    return not (row["l1"] or row["l1_by_hand"] or row["l2"] or row["l2_by_hand"])


def run_order_case(device="cpu", groups: tuple[int, int] = (16, 8), block_m: int = 1, prefetch: bool = False) -> dict:
    """L1 and L2 on the order patterns (two tokens, one expert), each against its twin (the recipe's
    promoted_gemm) bit for bit and against the tables' values (``order_by_hand``)."""
    t0 = time.time()
    g, t = ORDER_GEOMETRY, len(ORDER_SF)
    t1, t2 = default_tiles(g.hidden, g.intermediate)
    t1, t2 = TileShape(t1.bn, groups[0]), TileShape(t2.bn, groups[1])
    dw = prepare_decode_weights(order_weights(L1_ORDER_ROWS, L2_ORDER_ROWS).to(device), t1, t2)
    cfg = LaunchConfig(block_m=block_m, store_l1=True, l1_prefetch=prefetch, l2_prefetch=prefetch)
    buf, twin = order_buffers(device)
    row = {"case": order_id(groups, block_m, prefetch), "interpreter": torch.device(device).type == "cpu"}
    gemv.l1(dw, buf, t, g.clamp, cfg)
    gemv.l1_torch(dw, twin, t, g.clamp, cfg)
    row["l1"] = "; ".join(f"{f}: {m}" for f in STAGE_FIELDS["l1"]
                          if (m := first_mismatch(written(buf, f, t), written(twin, f, t))))
    order_l2_inputs(buf, twin)
    gemv.l2(dw, buf, t, cfg)
    gemv.l2_torch(dw, twin, t, cfg)
    row["l2"] = first_mismatch(written(buf, "slot_out", t), written(twin, "slot_out", t))
    row.update(order_by_hand(buf, twin, L1_ORDER_ROWS, L2_ORDER_ROWS))
    row["seconds"] = round(time.time() - t0, 2)
    return row


# A self-check under Triton's interpreter takes minutes of one core. tests/conftest.py starts the ones the selected
# tests need when collection ends, so that they run on the second core beside the rest of the suite, and
# ``interpreter_rows`` then collects the process already running. The limit is far from what a run takes (about
# 4 minutes for the tensor-core check on a busy 2-core machine): a slower CI machine must not fail on time.
INTERPRETER_TIMEOUT_S = 1800.0
_STARTED: dict = {}  # (script, *args) -> (its running self-check, its stdout file, its stderr file)


def start_interpreter_rows(script: Path, args: tuple[str, ...] = ()) -> None:
    """Start ``script --device cpu *args`` under Triton's interpreter now, in the background (once), on the megamoe
    this process imported (TRITON_INTERPRET must be set before triton is imported: hence a subprocess)."""
    import tempfile

    key = (str(Path(script).resolve()), *args)
    if key not in _STARTED:
        root = str(Path(megamoe.__file__).resolve().parents[1])
        env = dict(os.environ, TRITON_INTERPRET="1",
                   PYTHONPATH=os.pathsep.join(filter(None, (root, os.environ.get("PYTHONPATH")))))
        # Files, not pipes: nobody reads while it runs, and a full pipe would stall it.
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        proc = subprocess.Popen([sys.executable, key[0], "--device", "cpu", *args], env=env, stdout=out, stderr=err)
        _STARTED[key] = (proc, out, err)


def stop_interpreter_rows() -> None:
    """End the self-checks started and never collected (a run stopped early, -x): none outlives the test session."""
    while _STARTED:
        proc, out_file, err_file = _STARTED.popitem()[1]
        proc.kill()
        proc.wait()
        out_file.close(), err_file.close()


def interpreter_rows(script: Path, timeout: float = INTERPRETER_TIMEOUT_S, args: tuple[str, ...] = ()) -> dict:
    """Collect ``script --device cpu *args`` run under Triton's interpreter (started here if conftest did not start
    it) -> its JSON rows (the last line of its output) by ``case``."""
    start_interpreter_rows(script, args)
    proc, out_file, err_file = _STARTED.pop((str(Path(script).resolve()), *args))
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"{script} did not finish within {timeout:.0f} s") from None
    out_file.seek(0), err_file.seek(0)
    out, err = out_file.read(), err_file.read()
    out_file.close(), err_file.close()
    lines = out.strip().splitlines()
    if not lines:
        raise AssertionError(f"{script} printed nothing (exit {proc.returncode}):\n{err[-3000:]}")
    return {r["case"]: r for r in json.loads(lines[-1])}


def selfcheck_main(argv, doc: str, order_case, order_configs, case_rows, case_passed) -> int:
    """The command line of a decode self-check (this one and ``decode_tc_selfcheck.py``): ``--device`` (cpu) and
    ``--order``, the order patterns alone (``order_case(device, *config)`` per config, judged by ``passed_order``),
    else the self-check's ``case_rows(device)`` (judged by ``case_passed``). Prints the rows as one JSON line;
    exit 0 when every row passed, else 1."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--order", action="store_true", help="only the order patterns (run_order_case), seconds")
    args = ap.parse_args(argv)
    if args.order:
        rows, ok = [order_case(args.device, *c) for c in order_configs], passed_order
    else:
        rows, ok = case_rows(args.device), case_passed
    print(json.dumps(rows))
    return 0 if all(ok(r) for r in rows) else 1


def case_rows(device) -> list[dict]:
    """The self-check's rows: every case; only the first repeats (the interpreter runs programs one after another,
    so a repeat checks little there: once is enough)."""
    return [run_case(c, device, repeat=i == 0) for i, c in enumerate(CPU_CASES)]


def main(argv=None) -> int:
    return selfcheck_main(argv, __doc__, run_order_case, ORDER_CONFIGS, case_rows, passed)


if __name__ == "__main__":
    raise SystemExit(main())


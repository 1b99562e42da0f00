"""The read ceiling's candidates on one H200 (issue 47): every plain read megamoe can launch, at sizes from 1 MiB to
8 GiB, the 1-token step's 80.2 MB (DeepSeek-V4-Flash, six experts) among them, by three clocks.

    PYTHONPATH=$PWD python3 bench/device/read_ceiling.py --out $OUT

Candidates (megamoe.bench.ceilings.ReadCandidate names): the CUDA read (megamoe/bench/read_kernel.cu: 128-bit
ld.global.nc.L1::no_allocate loads, grid-stride) and Triton's persistent read with each load hint (cg, evict-first,
plain), each at 4 / 8 / 16 / 32 blocks per SM, and the streaming read that was the roofline's read until issue 47.
Clocks, per candidate and size, the L2 flushed before every call:
  events    megamoe.bench.timing.time_fn: a CUDA event pair per call (the project's clock; what ReadCeiling keeps)
  do_bench  triton.testing.do_bench, median (its own flush)
  kineto    megamoe.bench.kineto.kineto_us: the read kernel's CUPTI time, one trace per size and kernel kind
Check: the xor of each candidate's per-block outputs against the buffer's xor folded by torch (a read that skips or
repeats a word fails). Then ``ReadCeiling`` itself on each size: the read the sweep keeps and its streaming read.
Results: $OUT/read_ceiling.json (written after each size) and a table. Planned to stay under 60 s on an H200
(17 candidates x 4 sizes x 3 clocks, about 15 Triton compiles on a fresh machine); not yet run there. On a CPU
(``--device cpu``, TRITON_INTERPRET=1, small ``--sizes``) it checks its own plumbing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from megamoe.bench.ceilings import (  # noqa: E402
    BLOCKS_PER_SM, STREAM, Ceilings, ReadCandidate, ReadCeiling, default_candidates, xor_of)
from megamoe.bench.kineto import kineto_us  # noqa: E402
from megamoe.provenance import run_metadata  # noqa: E402
from megamoe.bench.roofline import step_floor  # noqa: E402
from megamoe.bench.timing import time_fn  # noqa: E402
from megamoe.geometry import get_geometry  # noqa: E402

KINETO_CALLS = 5  # per candidate and size


def step_bytes(tokens: int) -> int:
    """Bytes of a DeepSeek-V4-Flash MXFP4 step routing ``tokens`` x 6 slots to distinct experts (the floor's)."""
    g = get_geometry("dsv4-flash")
    idx = torch.arange(tokens * g.num_topk).remainder(g.num_experts).view(tokens, g.num_topk)
    return int(step_floor(g, idx, Ceilings("-", 1.0, 1.0, 1.0), "mxfp4").bytes)


def default_sizes() -> list[int]:
    """1 MiB; the 1-token step (80.2 MB) and the 8-token step (642 MB); 8 GiB and 8 bytes, past 2**31 words."""
    return [2**20, step_bytes(1), step_bytes(8), 2**33 + 8]


def all_candidates(dev) -> tuple[list[ReadCandidate], list[str]]:
    """Every read this device can launch: the defaults (``default_candidates``) and Triton's other load hints."""
    from megamoe.bench.read_kernel import HINTS

    cands, notes = default_candidates(dev)
    if any(c.kernel == "triton" for c in cands):
        cands += [ReadCandidate("triton", k, h) for h in HINTS if h != "cg" for k in BLOCKS_PER_SM]
    return cands, notes


def torch_xor(buf: torch.Tensor) -> int:
    """The xor of every int32 word of ``buf`` (as uint32), folded in halves by torch: no read kernel in it."""
    x, acc = buf, 0
    while x.numel() > 1:
        if x.numel() % 2:
            acc ^= int(x[-1])
            x = x[:-1]
        half = x.numel() // 2
        x = x[:half] ^ x[half:]
    return (acc ^ (int(x[0]) if x.numel() else 0)) & 0xFFFFFFFF


def time_size(n: int, cands: list[ReadCandidate], dev, sms: int, min_time_s: float) -> list[dict]:
    gen = torch.Generator(device=dev).manual_seed(n)  # the buffer ReadCeiling makes for this size
    buf = torch.randint(-2**31, 2**31 - 1, (n // 4,), dtype=torch.int32, generator=gen, device=dev)
    want = torch_xor(buf)
    cuda = dev.type == "cuda"
    rows, calls = [], []
    for c in cands:
        fn, out = c.prepare(buf, sms)
        t = time_fn(fn, warmup=3, repeats=20, device=dev, min_time_s=min_time_s if cuda else 0.0)
        got = xor_of(out)
        row = {"bytes": n, "candidate": c.name, "blocks": None if out is None else out.numel(),
               "events_us": t.median_us, "events_spread": t.spread, "calls": len(t.samples_us),
               "gbps": n / (t.median_us * 1e3), "xor_ok": got is None or got == want}
        if cuda:
            import triton.testing

            row["do_bench_us"] = triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median") * 1e3
        rows.append(row)
        calls.append(fn)
    for kernel in dict.fromkeys(c.kernel for c in cands) if cuda else ():
        # one trace per kernel kind (one whose launches CUPTI missed spoils only its own): call k of the trace is
        # the kind's candidate k % (their count), each one kernel after the flush
        idx = [i for i, c in enumerate(cands) if c.kernel == kernel]
        try:
            k = kineto_us(lambda f: f(), args=[calls[i] for i in idx], calls=KINETO_CALLS * len(idx), device=dev)
            for j, i in enumerate(idx):
                per = sorted(k["kineto_calls"][j::len(idx)])
                rows[i].update(kineto_us=per[len(per) // 2], kineto_kernels=k["kernels"])
        except Exception as exc:  # noqa: BLE001 - the second clock is a cross-check; the events stand alone
            for i in idx:
                rows[i]["kineto_error"] = f"{type(exc).__name__}: {exc}"
    del buf, calls
    if cuda:
        torch.cuda.empty_cache()
    return rows


def fmt(v) -> str:
    return "-" if v is None else f"{v:,.1f}"


def table(rows: list[dict], ceiling: dict | None) -> str:
    """One block per size: the candidates fastest first by the events clock, then what ReadCeiling kept."""
    n = rows[0]["bytes"]
    ok = [r for r in rows if r["xor_ok"]]
    best = min(ok, key=lambda r: r["events_us"]) if ok else None
    stream = next((r for r in rows if r["candidate"] == STREAM), None)
    head = f"\n{n:,} bytes ({n / 1e6:,.1f} MB): fastest " + (f"{best['candidate']} {fmt(best['events_us'])} us" if best
                                                             else "- (no read matched torch's xor)")
    if best and stream:
        head += f", streaming read {fmt(stream['events_us'])} us ({stream['events_us'] / best['events_us']:.3f}x)"
    out = [head,
           f"{'candidate':<22} {'blocks':>7} {'events us':>10} {'GB/s':>7} {'do_bench us':>11} {'kineto us':>10}  xor"]
    for r in sorted(rows, key=lambda r: r["events_us"]):
        out.append(f"{r['candidate']:<22} {r['blocks'] or '-':>7} {fmt(r['events_us']):>10} {r['gbps']:>7,.0f} "
                   f"{fmt(r.get('do_bench_us')):>11} {fmt(r.get('kineto_us')):>10}  {'ok' if r['xor_ok'] else 'WRONG'}")
    if ceiling:
        dropped = f", dropped {ceiling['rejected']}" if ceiling["rejected"] else ""
        out.append(f"ReadCeiling: {ceiling['best']} {fmt(ceiling['us'])} us, streaming read "
                   f"{fmt(ceiling['stream_us'])} us{dropped}")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for read_ceiling.json")
    ap.add_argument("--sizes", type=int, nargs="+", help="bytes per read (rounded up to 16); default: 1 MiB .. 8 GiB")
    ap.add_argument("--candidates", nargs="+", help="ReadCandidate names (default: every read this device has)")
    ap.add_argument("--min-time-s", type=float, default=0.05, help="events clock: samples for at least this long")
    ap.add_argument("--no-ceiling", action="store_true", help="skip ReadCeiling's own pass over the sizes")
    ap.add_argument("--device", default=None)
    args = ap.parse_args()
    t0 = time.perf_counter()
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.candidates:
        cands, notes = [ReadCandidate.parse(n) for n in args.candidates], []
    else:
        cands, notes = all_candidates(dev)
    sizes = [max(16, -(-s // 16) * 16) for s in (args.sizes or default_sizes())]
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 1
    os.makedirs(args.out, exist_ok=True)
    res = {"meta": run_metadata(dev), "sms": sms, "candidates": [c.name for c in cands], "notes": notes,
           "sizes": sizes, "rows": [], "ceiling": [],
           "clocks": {"events": "megamoe.bench.timing.time_fn, median, L2 flushed", "do_bench":
                      "triton.testing.do_bench(warmup=5, rep=20, return_mode='median')",
                      "kineto": f"megamoe.bench.kineto.kineto_us, median of {KINETO_CALLS} calls per candidate"}}
    print(f"[read_ceiling] {res['meta']['card']}, {sms} SMs; {len(cands)} candidates; sizes {sizes}"
          + "".join(f"\n  note: {n}" for n in notes))
    read = None if args.no_ceiling else ReadCeiling(dev)

    def write() -> None:
        res["wall_seconds"] = round(time.perf_counter() - t0, 1)
        with open(os.path.join(args.out, "read_ceiling.json"), "w") as f:
            json.dump(res, f, indent=1)

    for n in sizes:
        rows = time_size(n, cands, dev, sms, args.min_time_s)
        res["rows"] += rows
        rec = None
        if read is not None:
            rec = read.record(n)
            res["ceiling"].append(rec)
        print(table(rows, rec), flush=True)
        write()
    bad = [f"{r['candidate']} at {r['bytes']}" for r in res["rows"] if not r["xor_ok"]]
    print(f"\n[read_ceiling] {len(res['rows'])} timings in {res['wall_seconds']} s; "
          + (f"WRONG xor: {bad}" if bad else "every read's xor matches torch's"))
    if bad:
        sys.exit(1)


if __name__ == "__main__":
    main()

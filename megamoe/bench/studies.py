"""The studies of ``megamoe bench`` (``--studies``), each a function of the running ``megamoe.bench.sweep.Sweep``:

    overhead   the harness's figure against a bare timed loop of the same calls (ABBA rounds): what every
               device-bound figure rests on, so it runs first; within 2% is the bar (then staging, block_m, ragged)
    block_m    every legal BLOCK_M of each fused backend forced at every token count, against the plan's choice
    ragged     a ragged data-parallel step (4 ranks at 0.25 .. 1.75 x a mean): each rank timed alone on one GPU
               at its own count (its own plan) and padded with -1 routes to the agreed count (the shared plan);
               an EP step is bounded below by its slowest rank, so the two maxima are compared
    staging    per_token_cast_to_fp8 (the library's and DeepGEMM's), each backend's public stage() (its input
               validation syncs the host) and its bare cast + copy, as fractions of its kernel time

and two pieces of the sweep itself: ``second_clock`` (the kineto figure beside a row) and ``drift`` (each
backend's first case timed again after the sweep).

In append mode (a second process on the same card) a study is not run again for a backend an earlier
process already studied (``Sweep.studied``).
"""

from __future__ import annotations

from typing import Callable

from ..inputs import make_inputs, pad_inputs, ragged_counts
from ..progress import Progress
from .roofline import step_floor
from .backends import select_timing
from .kineto import kineto_us
from .timing import GraphSet, overhead_check, time_fn


def overhead(sw) -> None:
    """The row's own input set(s), in the same order, by the row's own path (graph replays for capturable
    backends, launches otherwise); host-bound backends have no device-bound figure to check."""
    cuda = sw.dev.type == "cuda"
    for b in sw.backends:
        if b.host_bound or sw.studied("overhead", b.name):
            continue
        for t in sw.cfg.overhead_tokens:
            if (t not in sw.cfg.tokens and t > max(sw.cfg.tokens)) or t > b.max_tokens:
                continue
            try:
                path = select_timing(b, sw.dev.type, sw.cfg.graph_capturable)
                fn, args = b.timer(sw.sets(b, t))
                if path == "cuda-graph":
                    gs = GraphSet(fn, args, warmup=sw.cfg.warmup)
                    fn, args = gs.replay, list(range(gs.sets))
                oc = overhead_check(fn, args=args, device=sw.dev, rounds=sw.cfg.overhead_rounds,
                                    settle_s=sw.cfg.settle_s if cuda else 0.0,
                                    min_warmup_s=sw.cfg.warmup_ms / 1e3 if cuda else 0.0)
                sw.results["overhead"].append({"backend": b.name, "process": sw.meta["process"], "tokens": t,
                                               "path": path, **oc})
            except Exception as exc:  # noqa: BLE001
                sw.error(f"overhead {b.name} T={t}", exc)


def block_m(sw) -> None:
    toks = sw.cfg.block_m_tokens or sorted(sw.cfg.tokens)
    forced = []
    for b in sw.backends:
        if not b.fused or sw.studied("block_m", b.name):
            continue
        for bm in b.legal_block_ms():
            try:
                forced.append((b.with_block_m(bm), bm))
            except Exception as exc:  # noqa: BLE001
                sw.error(f"block_m {b.name} force {bm}", exc)
    if not forced:
        sw.results["skipped"]["study block_m"] = "no backend here can force BLOCK_M"
        return
    with Progress(sw.cfg.progress, len(forced) * len(toks), "BLOCK_M") as prog:
        for fb, bm in forced:
            for t in toks:
                prog.step(f"BLOCK_M {bm} {fb.name} T={t}")
                if t > fb.max_tokens:
                    continue
                if not sw.time_left():
                    sw.results["skipped"][f"block_m {fb.name} {bm} T={t}"] = "deadline"
                    continue
                try:
                    chk = sw.check(fb, t)
                    tm = sw.time_case(fb, t, [sw.inputs(t)], study=True)
                    fl = step_floor(sw.g, sw.inputs(t).topk_idx, sw.ceilings, fb.weight_format)
                    sw.results["block_m"].append({"backend": fb.name, "process": sw.meta["process"], "tokens": t,
                                                  "forced_block_m": bm, "median_us": tm.median_us, "spread": tm.spread,
                                                  "floor_us": fl.floor_us, "plan": fb.plan(t), **chk})
                except Exception as exc:  # noqa: BLE001
                    sw.error(f"block_m {fb.name} bm={bm} T={t}", exc)


def ragged(sw) -> None:
    from ..layouts.plans import agreed_token_count

    cap = max(sw.cfg.tokens)
    for b in sw.backends:
        if not b.fused or sw.studied("ragged", b.name) or b.max_tokens < cap:
            continue
        for mean in sw.cfg.ragged_means:
            if not sw.time_left():
                sw.results["skipped"][f"ragged {b.name} mean={mean}"] = "deadline"
                continue
            counts = ragged_counts(mean, cap=cap)
            agreed = min(int(agreed_token_count(counts)), cap)
            ranks = []
            for r, c in enumerate(counts):
                try:
                    own_in = make_inputs(sw.g, c, seed=9000 + r, device=sw.dev)
                    own = sw.time_case(b, c, [own_in], study=True)
                    pad = sw.time_case(b, agreed, [pad_inputs(own_in, agreed)], study=True)
                    ranks.append({"rank": r, "tokens": c, "own_us": own.median_us, "padded_us": pad.median_us,
                                  "own_block_m": b.plan(c).get("block_m"), "agreed_block_m": b.plan(agreed).get("block_m")})
                except Exception as exc:  # noqa: BLE001
                    sw.error(f"ragged {b.name} mean={mean} rank={r}", exc)
            if ranks:
                own, padded = max(x["own_us"] for x in ranks), max(x["padded_us"] for x in ranks)
                sw.results["ragged"].append({"backend": b.name, "process": sw.meta["process"], "mean_tokens": mean,
                                             "counts": counts, "agreed": agreed, "ranks": ranks, "step_own_us": own,
                                             "step_padded_us": padded, "padding_cost": padded / own - 1})


def staging(sw) -> None:
    from ..layouts.staging import per_token_cast_to_fp8

    kern = {(r["backend"], r["tokens"]): r["us"] for r in sw.results["rows"] if r["pass"] == 0}
    try:
        from deep_gemm.utils.math import per_token_cast_to_fp8 as _dg  # type: ignore[import-not-found]

        dg_cast = lambda x: _dg(x, use_ue8m0=False)  # noqa: E731 - SM90: FP32 scales
    except Exception:  # noqa: BLE001 - deep_gemm absent (a CPU) or without this helper
        dg_cast = None
    first_process = sw.prev is None or not sw.prev.get("staging")
    for t in sorted(sw.cfg.tokens):
        x = [sw.inputs(t, k).x for k in range(sw.cfg.rotate)]
        cases: list[tuple[str, Callable, list | None, str | None]] = []
        if first_process:
            cases.append(("megamoe per_token_cast_to_fp8", per_token_cast_to_fp8, x, None))
            if dg_cast is not None:
                cases.append(("deep_gemm per_token_cast_to_fp8", dg_cast, x, None))
        for b in sw.backends:
            if not sw.studied("staging", b.name) and t <= b.max_tokens:
                cases += [(f"{b.name}: {label}", fn, None, b.name) for label, fn in b.stage_parts(sw.inputs(t)).items()]
        for what, fn, args, bname in cases:
            try:
                tm = time_fn(fn, args=args, warmup=sw.cfg.warmup, repeats=sw.cfg.repeats,
                             flush_l2=args is None and sw.cfg.flush_l2, device=sw.dev)
                row = {"what": what, "backend": bname, "process": sw.meta["process"], "tokens": t,
                       "median_us": tm.median_us, "spread": tm.spread}
                for (kb, kt), us in kern.items():
                    if kt == t and (bname is None or kb == bname) and not kb.startswith("reference"):
                        row[f"frac_of {kb}"] = tm.median_us / us
                sw.results["staging"].append(row)
            except Exception as exc:  # noqa: BLE001
                sw.error(f"staging {what} T={t}", exc)


def second_clock(sw, b, t: int, row: dict) -> None:
    """The kineto (CUPTI) figure beside the event figure of a device-bound row: ``kineto_us`` and the
    ratio events / kineto (about 1 for a one-kernel call; above 1 by the launch gaps of a pipeline)."""
    try:
        fn, args = b.timer(sw.sets(b, t))
        k = kineto_us(fn, args=args, calls=sw.cfg.kineto_calls, flush_l2=sw.cfg.flush_l2 and args is None,
                      device=sw.dev)
        row.update(kineto_us=k["kineto_us"], kineto_kernels=k["kernels"], events_over_kineto=row["us"] / k["kineto_us"])
    except Exception as exc:  # noqa: BLE001 - the second clock failing leaves the first one standing
        row["kineto_error"] = f"{type(exc).__name__}: {exc}"


def drift(sw) -> None:
    """Each device-bound backend's first case timed again now, against its first pass."""
    rows = {(r["backend"], r["tokens"]): r for r in sw.results["rows"] if r["pass"] == 0}
    for b in sw.backends:
        ts = [t for t in sorted(sw.cfg.tokens) if (b.name, t) in rows and not b.host_bound]
        if not ts:
            continue
        try:
            tm = sw.time_case(b, ts[0], sw.sets(b, ts[0]))
            start = rows[(b.name, ts[0])]["median_us"]
            change = tm.median_us / start - 1 if start > 0 else float("nan")
            sw.results["drift"].append({"backend": b.name, "tokens": ts[0], "start_us": start, "end_us": tm.median_us,
                                        "change": change, "flag": bool(abs(change) >= sw.cfg.repeat_limit)})
        except Exception as exc:  # noqa: BLE001
            sw.error(f"drift {b.name}", exc)

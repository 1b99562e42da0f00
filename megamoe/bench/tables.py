"""Tables derived from a sweep's rows, and the merge of two processes' results into one document.

    repeatability(rows)        per device-bound (backend, tokens): its pass medians and their spread, flagged at 3%
    speedups(rows)             per token count and fused backend: unfused / fused, reference / fused
    best_block_m(study, rows)  per (backend, tokens): the fastest forced BLOCK_M against the plan's own
    cross_process(rows)        a backend timed in two processes on the same card: its two readings per token count
    merge_results(prev, cur)   ``megamoe bench --append``: one document over both processes (check_appendable first)
"""

from __future__ import annotations

import gzip
import json
import os

# Lists of a results document that hold one entry per timed thing; merged by concatenation.
MERGED_LISTS = ("rows", "drift", "block_m", "ragged", "staging", "overhead", "errors")


def pass_spread(medians) -> float:
    """The repeatability spread of one case's pass medians: (max - min) / min (nan when min <= 0)."""
    return (max(medians) - min(medians)) / min(medians) if min(medians) > 0 else float("nan")


def first_pass(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["pass"] == 0]


def repeatability(rows: list[dict], limit: float = 0.03) -> list[dict]:
    """Per device-bound (backend, tokens) with two passes or more: the medians in pass order, their spread
    (max - min) / min, and ``flag`` when it reaches ``limit``. Host-bound rows have one pass: no bar applies."""
    by: dict = {}
    for r in rows:
        if not r.get("host_bound"):
            by.setdefault((r["backend"], r["tokens"]), []).append((r["pass"], r["median_us"]))
    out = []
    for (b, t), pm in by.items():
        meds = [m for _, m in sorted(pm, key=lambda x: x[0])]
        if len(meds) >= 2:
            spread = pass_spread(meds)
            out.append({"backend": b, "tokens": t, "medians_us": meds, "spread": spread,
                        "flag": bool(not spread < limit)})
    return out


def speedups(rows: list[dict]) -> list[dict]:
    """Per token count and fused backend (first pass): unfused time / fused time, and reference / fused."""
    first = first_pass(rows)
    out = []
    for t in sorted({r["tokens"] for r in first}):
        at = [r for r in first if r["tokens"] == t]
        unfused = [r for r in at if not r["fused"] and not r["backend"].startswith("reference")]
        ref = [r for r in at if r["backend"].startswith("reference")]
        for f in (r for r in at if r["fused"]):
            row = {"tokens": t, "fused": f["backend"], "fused_us": f["us"]}
            if unfused:
                row.update(unfused=unfused[0]["backend"], unfused_us=unfused[0]["us"],
                           speedup=unfused[0]["us"] / f["us"])
            if ref:
                row.update(speedup_vs_reference=ref[0]["us"] / f["us"])
            out.append(row)
    return out


def best_block_m(study: list[dict], rows: list[dict]) -> list[dict]:
    """Per (backend, tokens): the fastest forced BLOCK_M against the plan's own choice. Where a BLOCK_M the
    backend was forced to elsewhere was not timed (a deadline, an error) there is no best: ``missing`` lists
    those BLOCK_Ms and ``best_block_m`` / ``plan_over_best`` are None (the best of an incomplete set would be a
    false comparison)."""
    plan = {(r["backend"], r["tokens"]): r for r in first_pass(rows)}
    by: dict = {}
    forced: dict = {}
    for s in study:
        by.setdefault((s["backend"], s["tokens"]), []).append(s)
        forced.setdefault(s["backend"], set()).add(s["forced_block_m"])
    out = []
    for (b, t), ss in sorted(by.items()):
        missing = sorted(forced[b] - {s["forced_block_m"] for s in ss})
        best = None if missing else min(ss, key=lambda s: s["median_us"])
        p = plan.get((b, t))
        out.append({"backend": b, "tokens": t, "best_block_m": best and best["forced_block_m"],
                    "best_us": best and best["median_us"], "missing": missing,
                    "plan_block_m": p and p.get("block_m"), "plan_us": p and p["median_us"],
                    "plan_over_best": (p["median_us"] / best["median_us"]) if (p and best) else None,
                    "times_us": {s["forced_block_m"]: s["median_us"] for s in ss}})
    return out


def cross_process(rows: list[dict]) -> list[dict]:
    """A backend timed in more than one process (``--append``; e.g. FlashInfer beside each deep_gemm build):
    per token count, its first-pass figure in each process and the change of the last against the first."""
    by: dict = {}
    for r in first_pass(rows):
        by.setdefault((r.get("backend_name", r["backend"]), r["tokens"]), {})[r.get("process", 1)] = r["us"]
    out = []
    for (b, t), per in sorted(by.items()):
        if len(per) >= 2:
            ps = sorted(per)
            out.append({"backend": b, "tokens": t, "processes": ps, "us": [per[p] for p in ps],
                        "change": per[ps[-1]] / per[ps[0]] - 1})
    return out


def derive(results: dict, limit: float = 0.03) -> None:
    """(Re)compute every derived table of a results document from its rows and studies."""
    rows = results["rows"]
    results["repeatability"] = repeatability(rows, limit)
    results["speedup"] = speedups(rows)
    results["block_m_best"] = best_block_m(results.get("block_m", []), rows) if results.get("block_m") else []
    results["cross_process"] = cross_process(rows)


def merge_results(prev: dict, cur: dict) -> dict:
    """Process n's results appended to an earlier document (same preset, tokens and card, checked before the
    run). A backend already timed by an earlier process keeps its name in ``backend_name`` and is shown as
    "name [pN]", so both readings stand side by side in every table and plot."""
    n = cur["meta"]["process"]
    seen = {r.get("backend_name", r["backend"]) for r in prev["rows"]}
    out = {k: v for k, v in prev.items()}
    for key in MERGED_LISTS:
        extra = [dict(e) for e in cur.get(key, [])]
        for e in extra:
            if "backend" in e and e["backend"] in seen:
                e["backend_name"], e["backend"] = e["backend"], f"{e['backend']} [p{n}]"
        out[key] = list(prev.get(key, [])) + extra
    out["skipped"] = {**prev.get("skipped", {}), **{f"process {n}: {k}": v for k, v in cur.get("skipped", {}).items()}}
    out["processes"] = list(prev.get("processes") or [prev["meta"]]) + [cur["meta"]]
    out["backends"] = list(prev.get("backends", [])) + [{**b, "process": n} for b in cur.get("backends", [])]
    out["wall_seconds"] = round(prev.get("wall_seconds", 0) + cur.get("wall_seconds", 0), 2)
    derive(out, cur["meta"].get("config", {}).get("repeat_limit", 0.03))
    return out


def load_results(folder: str | os.PathLike) -> dict:
    """A results folder's ``results.json``, or its ``results.json.gz`` (how committed sweeps are kept)."""
    path = os.path.join(folder, "results.json")
    if os.path.isfile(path):
        with open(path) as f:
            return json.load(f)
    if os.path.isfile(path + ".gz"):
        with gzip.open(path + ".gz", "rt") as f:
            return json.load(f)
    raise ValueError(f"{str(folder)!r} holds no results.json (or results.json.gz) of a megamoe bench run")


def check_appendable(prev: dict, cfg: object, meta: dict) -> None:
    """Raise ValueError unless ``prev`` was taken at the same preset and token list on the same card."""
    pc = prev["meta"].get("config", {})
    for what, a, b in (("preset", pc.get("preset"), cfg.preset), ("tokens", pc.get("tokens"), sorted(cfg.tokens))):
        if a != b:
            raise ValueError(f"--append: the results in the folder were taken with {what} {a}, this run has {b}")
    ids = [((m.get("gpu") or {}).get("uuid") or m.get("card")) for m in (prev["meta"], meta)]
    if ids[0] != ids[1]:
        raise ValueError(f"--append: the results in the folder come from card {ids[0]}, this process runs on {ids[1]}")

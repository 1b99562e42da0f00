"""``results.jsonl``: one JSON record per timed row of a ``megamoe bench`` run, for tools that read baselines
line by line (a serving project's CI, a spreadsheet). Written beside ``results.json`` from the same document,
so it holds the same numbers; ``bench/README.md`` lists the fields.

    backend, tokens, pass          what was timed (tokens per rank), and which pass of the sweep
    geometry                       {name, num_experts, num_topk, hidden, intermediate}
    median_us, mean_us, stderr_us, min_us, spread, repeats, method
                                   the figure (median of the samples) and how it spread; method: cuda-events,
                                   cuda-graph or perf_counter (host-bound rows: use mean and stderr)
    correct, calc_diff, nan, recipe
                                   the output checked against the backend's own recipe before it was timed
    block_m, plan                  the BLOCK_M (or the tile) the launch ran, and the backend's plan detail
    floor_us, read_us, frac_of_read the roofline figures of the same row
    card, gpu_uuid, date, commit, dirty, process
                                   where and when; ``process`` tells the sweep's processes apart
    modules                        the kernel module the row ran, as imported (name, version, file, build)
    versions                       torch, CUDA, triton and the packages that process imported
"""

from __future__ import annotations

import json
import os

ROW_FIELDS = ("backend", "tokens", "pass", "median_us", "mean_us", "stderr_us", "min_us", "spread", "repeats", "method",
              "correct", "calc_diff", "nan", "block_m", "plan", "floor_us", "read_us", "frac_of_read", "kineto_us")


def records(results: dict) -> list[dict]:
    """The records of a results document (module docstring), one per row in ``results["rows"]``."""
    metas = {m.get("process", 1): m for m in (results.get("processes") or [results["meta"]])}
    provenance = {(b.get("process", 1), b["name"]): b.get("provenance") for b in results.get("backends", [])}
    recipes = {b["name"]: b.get("recipe") for b in results.get("backends", [])}
    out = []
    for row in results.get("rows", []):
        proc = row.get("process", 1)
        meta = metas.get(proc, results["meta"])
        name = row.get("backend_name", row["backend"])
        rec = {k: row.get(k) for k in ROW_FIELDS}
        rec["backend"] = name
        rec["recipe"] = recipes.get(name) or _recipe_name(name)
        rec["geometry"] = {k: meta.get("geometry", {}).get(k) for k in ("name", "num_experts", "num_topk", "hidden",
                                                                         "intermediate")}
        rec.update(card=meta.get("card"), gpu_uuid=(meta.get("gpu") or {}).get("uuid"), date=meta.get("date"),
                   commit=meta.get("commit"), dirty=meta.get("dirty"), process=proc,
                   modules=provenance.get((proc, name)), versions=meta.get("versions"))
        out.append(rec)
    return out


def _recipe_name(backend: str) -> str | None:
    from ..fused.registry import BACKENDS

    cls = BACKENDS.get(backend)
    return getattr(getattr(cls, "recipe", None), "name", None)


def write_jsonl(results: dict, out_dir: str) -> str:
    """Write ``results.jsonl`` (whole, then moved into place) and return its path."""
    path = os.path.join(out_dir, "results.jsonl")
    with open(path + ".tmp", "w") as f:
        for rec in records(results):
            f.write(json.dumps(rec, default=repr, sort_keys=True) + "\n")
    os.replace(path + ".tmp", path)
    return path

"""The README's sweep table from a results folder: per token count, the floor and both reads, every backend's
median (us, with its BLOCK_M), the fastest backend, and the Mega MoE (DeepGEMM FP4) over Humming W4A8.

    python3 bench/readme_table.py bench/results/<folder>            # Markdown on stdout (results.json[.gz])

Rows are the median of the passes of each (backend, tokens); a backend timed by two processes (the anchor) shows
process 1's figure. Only rows whose output matched their recipe before timing count for "fastest".
"""

from __future__ import annotations

import gzip
import json
import statistics
import sys
from pathlib import Path

ORDER = ("flashinfer-mxfp4", "deepgemm-sm90-fp8", "deepgemm-sm90-fp4", "megamoe-decode-tc", "humming-w4a8",
         "humming-w4a16", "deepgemm-staged-fp8", "megamoe-decode", "reference")
LABEL = {"flashinfer-mxfp4": "FlashInfer MXFP4", "deepgemm-sm90-fp8": "DeepGEMM FP8",
         "deepgemm-sm90-fp4": "DeepGEMM FP4 (PR #323, patched)", "megamoe-decode-tc": "megamoe-decode-tc",
         "humming-w4a8": "Humming W4A8", "humming-w4a16": "Humming W4A16", "deepgemm-staged-fp8": "unfused DeepGEMM FP8",
         "megamoe-decode": "megamoe-decode", "reference": "reference (ms)"}


def medians(results: dict) -> dict:
    """{(backend, tokens): {"us", "block_m", "correct"}} over the passes of each row (process 1's when two timed it)."""
    acc: dict = {}
    for r in results["rows"]:
        if r.get("backend", "").endswith("]"):  # "name [p2]": the anchor's second reading
            continue
        acc.setdefault((r["backend"], r["tokens"]), []).append(r)
    out = {}
    for key, rows in acc.items():
        out[key] = {"us": statistics.median(r["median_us"] if r.get("method") != "perf_counter" else r["mean_us"]
                                            for r in rows),
                    "block_m": rows[0].get("block_m"), "correct": all(r.get("correct", True) for r in rows),
                    "read_us": rows[0].get("read_us"), "read_us_stream": rows[0].get("read_us_stream"),
                    "floor_us": rows[0].get("floor_us")}
    return out


def table(results: dict) -> str:
    m = medians(results)
    tokens = sorted({t for _, t in m})
    backends = [b for b in ORDER if any((b, t) in m for t in tokens)]
    head = ["tokens", "floor / read / streaming read (us)"] + [LABEL[b] for b in backends] + \
        ["fastest", "DeepGEMM FP4 / Humming W4A8"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for t in tokens:
        any_row = next(m[(b, t)] for b in backends if (b, t) in m)
        fl = lambda v: f"{v:,.1f}" if v is not None and v < 100 else (f"{v:,.0f}" if v is not None else "-")  # noqa: E731
        cells = [str(t), f"{fl(any_row['floor_us'])} / {fl(any_row['read_us'])} / {fl(any_row['read_us_stream'])}"]
        timed = {}
        for b in backends:
            r = m.get((b, t))
            if r is None:
                cells.append("-")
                continue
            us = r["us"] / 1000 if b == "reference" else r["us"]
            mark = "" if r["correct"] else " (FAIL)"
            bm = f" ({r['block_m']})" if r["block_m"] and b != "reference" else ""
            cells.append(f"{fl(us)}{bm}{mark}")
            if b != "reference" and r["correct"]:
                timed[b] = r["us"]
        best = min(timed, key=timed.get) if timed else "-"
        cells.append(LABEL.get(best, best))
        fp4, h8 = m.get(("deepgemm-sm90-fp4", t)), m.get(("humming-w4a8", t))
        cells.append(f"{fp4['us'] / h8['us']:.2f}" if fp4 and h8 else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def load(folder: Path) -> dict:
    """A results folder's results.json, or results.json.gz where the committed copy is kept compressed."""
    plain, packed = folder / "results.json", folder / "results.json.gz"
    if plain.is_file():
        return json.loads(plain.read_text())
    with gzip.open(packed, "rt") as f:
        return json.load(f)


if __name__ == "__main__":
    print(table(load(Path(sys.argv[1]))))

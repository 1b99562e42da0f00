"""Read levels_probe.py's traces: how far apart two adjacent passes of a given length land.

For each trace and pass length W: the trace is cut into consecutive windows of W seconds; each window's
median is one pass; adjacent windows are the A and B of an interleaved sweep row. Reported: the
fraction of adjacent pairs at or over 3% apart, the median and the worst pair. For host traces also the
correlation of the reference's per-window median with the CPU probe's (does the host's speed explain it?).

Usage: python3 bench/device/levels_analyse.py levels.json [--md out.md]
"""

from __future__ import annotations

import argparse
import json
import statistics


def windows(t_s: list[float], vals: list[float], w: float) -> list[list[float]]:
    out, cur, edge = [], [], w
    for t, v in zip(t_s, vals):
        if t >= edge:
            if cur:
                out.append(cur)
            cur = []
            while t >= edge:
                edge += w
        cur.append(v)
    return out  # the last, partial window is dropped


def pair_spreads(meds: list[float]) -> list[float]:
    return [abs(a - b) / min(a, b) for a, b in zip(meds, meds[1:]) if min(a, b) > 0]


def corr(x: list[float], y: list[float]) -> float:
    """Pearson correlation (statistics.correlation); nan for fewer than 3 points or a constant series."""
    if len(x) < 3:
        return float("nan")
    try:
        return statistics.correlation(x, y)
    except statistics.StatisticsError:
        return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("--md", default=None)
    a = ap.parse_args()
    doc = json.load(open(a.path))
    lines = [f"card {doc['meta'].get('card')} commit {doc['meta'].get('commit')} cpu {doc.get('cpu_model')} "
             f"pinned {doc.get('pinned', {}).get('cpu')} of {doc.get('nproc')}", ""]
    lines.append("| trace | calls | median us | W (s) | passes | pairs >= 3% | median pair | worst pair | corr w/ CPU probe |")
    lines.append("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for tr in doc["traces"]:
        if "error" in tr:
            lines.append(f"| {tr['what']} T={tr.get('tokens')} | error {tr['error'][:80]} |||||||")
            continue
        key = "samples_us" if "samples_us" in tr else "probe_us"
        vals, t_s = tr[key], tr["t_s"]
        name = f"{tr['what']}" + (f" T={tr['tokens']}" if "tokens" in tr else "")
        host = "probe_us" in tr and "samples_us" in tr
        if key == "probe_us":  # the CPU probe alone
            ws = [0.1, 0.5, 1.0]
        elif host:  # the reference, ~10-100 ms a call
            ws = [0.5, 1.0, 2.0, 4.0]
        else:  # a kernel
            ws = [0.05, 0.1, 0.25, 0.5, 1.0]
        for w in ws:
            win = windows(t_s, vals, w)
            meds = [statistics.median(x) for x in win]
            ps = pair_spreads(meds)
            if not ps:
                continue
            c = ""
            if host:
                pw = windows(t_s, tr["probe_us"], w)
                c = f"{corr(meds, [statistics.median(x) for x in pw]):.2f}"
            over = sum(p >= 0.03 for p in ps)
            lines.append(f"| {name} | {len(vals)} | {statistics.median(vals):.1f} | {w} | {len(meds)} | "
                         f"{over}/{len(ps)} | {100 * statistics.median(ps):.2f}% | {100 * max(ps):.2f}% | {c} |")
    text = "\n".join(lines)
    print(text)
    if a.md:
        with open(a.md, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()

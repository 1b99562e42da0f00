"""Nsight Compute's per-instruction warp-stall samples, summarised: per kernel launch of a source page exported as
CSV (``ncu -i REPORT --page source --csv --print-source sass``; gzip allowed), the samples in all, the share of each
stall reason, and the instructions with the most samples (index in the launch's SASS, share, instruction, its three
main reasons, times executed). Sampling is statistical: a kernel of ~50 us gives a few thousand samples.

    python3 lab/common/ncu_source_top.py step1-source.csv.gz --top 20 --names step no-load bare
"""

from __future__ import annotations

import argparse
import csv
import gzip
import io
from collections import Counter

SAMPLES = "Warp Stall Sampling (All Samples)"


def launches(text: str) -> list[list[dict]]:
    """The CSV's launches, each a list of rows (one per SASS instruction, in address order)."""
    return [list(csv.DictReader(io.StringIO(part.split("\n", 1)[1])))
            for part in text.split('"Kernel Name",')[1:]]


def count(row: dict, col: str) -> int:
    return int(row.get(col) or 0)


def summary(rows: list[dict], top: int) -> list[str]:
    reasons = [c for c in rows[0] if c.startswith("stall_") and "Not Issued" not in c]
    total = sum(count(r, SAMPLES) for r in rows)
    by_reason = Counter({c[6:]: sum(count(r, c) for r in rows) for c in reasons})
    out = [f"{total} samples; " + ", ".join(f"{k} {v / total:.1%}" for k, v in by_reason.most_common(8))]
    for i in sorted(sorted(range(len(rows)), key=lambda i: -count(rows[i], SAMPLES))[:top]):
        r = rows[i]
        main = sorted(((count(r, c), c[6:]) for c in reasons), reverse=True)[:3]
        out.append(f"  [{i:5d}] {count(r, SAMPLES) / total:5.1%}  {r['Source'].strip()[:58]:58s}  "
                   + ", ".join(f"{n} {k}" for n, k in main if n) + f"  (executed {r['Instructions Executed']})")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--names", nargs="*", default=[], help="a name per launch, in order")
    args = ap.parse_args()
    opener = gzip.open if args.csv.endswith(".gz") else open
    with opener(args.csv, "rt") as f:
        text = f.read()
    for k, rows in enumerate(launches(text)):
        name = args.names[k] if k < len(args.names) else f"launch {k}"
        print(f"{name}: " + "\n".join(summary(rows, args.top)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

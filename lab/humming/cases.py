"""A few matrix cases of a Humming backend, by id, on one GPU (the two questions of JOURNAL.md's last entry).

    python3 lab/humming/cases.py humming-w4a8 --out /tmp/h/a.json small-T300-auto dsv4-flash-T1-auto ...
    VLLM_BATCH_INVARIANT=1 python3 lab/humming/cases.py humming-w4a8 --out /tmp/h/b.json dsv4-flash-T1-auto

A case id is the matrix's (``megamoe.check.matrix.Case.id``): GEOMETRY-T<tokens>-auto[-ROUTING]; the seed is the
matrix's own for that kind of case, so the rows compare with a full matrix run's.
"""

from __future__ import annotations

import argparse

from megamoe.check.matrix import Case, format_table, run_matrix

SEEDS = {"masked": 11, "allmasked": 11, "empty-expert": 11, "skewed": 11}


def parse(case_id: str) -> Case:
    geo_t, _, rest = case_id.partition("-T")
    tokens, _, tail = rest.partition("-auto")
    routing = tail.lstrip("-") or "uniform"
    t = int(tokens)
    return Case(geo_t, t, routing=routing, seed=SEEDS.get(routing, t))


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("backend")
    ap.add_argument("cases", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeats", type=int, default=4)
    a = ap.parse_args()
    cases = [parse(c) for c in a.cases]
    assert [c.id for c in cases] == a.cases, ([c.id for c in cases], a.cases)
    rows = run_matrix(a.backend, cases, out_json=a.out, ref_max_tokens=256, repeats=a.repeats)
    print(format_table(rows))

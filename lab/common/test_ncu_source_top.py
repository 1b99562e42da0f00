"""lab/common/ncu_source_top.py: Nsight Compute's source page (CSV) summarised per launch. Checked on a hand-made
CSV of two launches whose samples are known."""

import gzip
import random
from lab.common import ncu_source_top as mod


def _csv(launches):
    """Each launch a list of (sass, samples by reason) -> the text of ncu's --page source --csv export."""
    reasons = ["stall_long_sb", "stall_barrier", "stall_wait"]
    head = ",".join(f'"{c}"' for c in ["Address", "Source", "Warp Stall Sampling (All Samples)",
                                          "Instructions Executed", *reasons,
                                          *(f"{r} (Not Issued)" for r in reasons)])
    out = []
    for k, rows in enumerate(launches):
        out.append(f'"Kernel Name","kernel_{k}",')
        out.append(head)
        for i, (sass, by) in enumerate(rows):
            vals = [by.get(r, 0) for r in reasons]
            out.append(",".join(f'"{v}"' for v in [hex(0x1000 + 16 * i), sass, sum(vals), 7, *vals, *vals]))
    return "\n".join(out) + "\n"


def test_totals_shares_and_top_instructions(tmp_path):
    rng = random.Random(11)
    launches = []
    for _ in range(2):
        rows = [(f"OP{i} R{i}", {"stall_long_sb": rng.randrange(0, 5), "stall_wait": rng.randrange(0, 3)})
                for i in range(30)]
        rows[rng.randrange(30)] = ("SYNCS.PHASECHK.TRANS64.TRYWAIT P0", {"stall_long_sb": 200, "stall_barrier": 40})
        launches.append(rows)
    path = tmp_path / "src.csv.gz"
    with gzip.open(path, "wt") as f:
        f.write(_csv(launches))
    with gzip.open(path, "rt") as f:
        parsed = mod.launches(f.read())
    assert len(parsed) == 2
    for rows, made in zip(parsed, launches):
        total = sum(sum(by.values()) for _, by in made)
        lines = mod.summary(rows, top=1)
        assert lines[0].startswith(f"{total} samples; long_sb ")
        long_sb = sum(by.get("stall_long_sb", 0) for _, by in made)
        assert f"long_sb {long_sb / total:.1%}" in lines[0]
        hot = next(i for i, (s, _) in enumerate(made) if s.startswith("SYNCS"))
        assert len(lines) == 2 and lines[1].startswith(f"  [{hot:5d}] {240 / total:5.1%}  SYNCS.PHASECHK")
        assert "200 long_sb, 40 barrier" in lines[1] and "(executed 7)" in lines[1]

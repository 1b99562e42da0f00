"""Read the tensor-core decode launches' timeline: when each program of the gate/up and the down launch reached
each point, on the GPU (lab/decode/stamps.py records it through the library kernels' PROBE hook).

    stamps = stamp_buffer(buf, programs)              # int64 [2, P, 16], -1 everywhere (a point no program reached)
    stamped_step(tw, buf, T, clamp, cfg, stamps)      # lab.decode.stamps: each program stores its SM id and points
    summary = summarize(stamps)                       # microseconds from the gate/up launch's first start, per point

    python3 lab/decode/timeline.py STAMPS.pt  # a saved replay's table, clocks and loop spread

    stamps int64 [2, P, 16]   per launch (0 gate/up, 1 down) and program: the SM id in word 0; for each point k
                              (``POINTS``) the GPU's %globaltimer (ns, one clock for every SM) in word k and the
                              SM's %clock64 (cycles) in word 8 + k; -1 where a program never reached a point

The points, in both launches: 1 start, 2 past ``griddepcontrol.wait``, 3 work item known (the gate/up launch: after
its own route when it routes for itself), 4 K loop done, 5 exit; a program past the step's work items records 1, 2
and 5 only.
"""

from __future__ import annotations

import torch

POINTS = {1: "start", 2: "waited", 3: "item", 4: "loop done", 5: "exit"}
LAUNCHES = ("l1", "l2")  # the gate/up launch, the down launch (the names the saved summaries use)
WORDS = 16  # int64 per program: SM id, 7 timer words, 8 clock words

__all__ = ["LAUNCHES", "POINTS", "WORDS", "stamp_buffer", "summarize", "loop_spread", "table", "main"]


def stamp_buffer(buf, programs: int) -> torch.Tensor:
    """int64 [2, programs, 16] filled with -1 (a point no program reached stays -1), on the buffers' device."""
    return torch.full((len(LAUNCHES), programs, WORDS), -1, dtype=torch.int64, device=buf.x_q.device)


def _quantiles(v: torch.Tensor) -> dict:
    if v.numel() == 0:
        return {}
    q = torch.quantile(v.double(), torch.tensor([0.0, 0.1, 0.5, 0.9, 1.0], dtype=torch.float64))
    return dict(zip(("min", "p10", "p50", "p90", "max"), (round(float(x), 3) for x in q)))


def summarize(stamps: torch.Tensor) -> dict:
    """stamps int64 [2, P, 16] after one launch of the step -> per launch: programs that ran, SMs used, the most
    programs one SM held at once, and for each point the quantiles over programs of its time in us from L1's
    first start (``"at_us"``); the K loop's span per program from the SM clock (``"loop_cycles"``, and in us
    at the clock rate seen); ``"timer_step_ns"``: the smallest nonzero step between globaltimer values (its
    resolution, as seen); ``"clock_ghz"``: SM cycles per globaltimer ns over the programs' start-to-exit spans
    of at least 2 us."""
    if stamps.dim() != 3 or stamps.shape[0] != len(LAUNCHES) or stamps.shape[2] != WORDS:
        raise ValueError(f"stamps must be int64 [2, P, {WORDS}], got {tuple(stamps.shape)}")
    s = stamps.cpu()
    ran = [s[i][s[i, :, 1] >= 0] for i in range(len(LAUNCHES))]
    if ran[0].numel() == 0:
        raise ValueError("no gate/up program recorded a start: did the launch stamp into this buffer?")
    t0 = int(ran[0][:, 1].min())
    out: dict = {"launches": {}}
    stamped = torch.cat([r[:, 1:6].reshape(-1) for r in ran])
    stamped = torch.unique(stamped[stamped >= 0])
    steps = stamped.diff()
    out["timer_step_ns"] = int(steps[steps > 0].min()) if (steps > 0).any() else None
    every = torch.cat(ran)
    every = every[(every[:, 5] >= 0) & (every[:, 5] - every[:, 1] >= 2000)]
    ghz = float((every[:, 13] - every[:, 9]).sum() / (every[:, 5] - every[:, 1]).sum()) if every.numel() else None
    out["clock_ghz"] = round(ghz, 3) if ghz else None
    for name, r in zip(LAUNCHES, ran):
        if r.numel() == 0:
            out["launches"][name] = {"programs": 0}
            continue
        at = {}
        for k, label in POINTS.items():
            v = r[:, k]
            at[label] = _quantiles((v[v >= 0] - t0).double() / 1e3)
        worked = r[(r[:, 3] >= 0) & (r[:, 4] >= 0)]
        cycles = (worked[:, 12] - worked[:, 11]).double()
        sm = r[:, 0]
        out["launches"][name] = {
            "programs": int(r.shape[0]), "working": int(worked.shape[0]), "sms": int(torch.unique(sm).numel()),
            "max_resident_per_sm": _max_resident(sm, r[:, 1], r[:, 5]),
            "at_us": at, "loop_cycles": _quantiles(cycles),
            **({"loop_us": _quantiles(cycles / (ghz * 1e3))} if ghz else {}),
        }
    return out


def _max_resident(sm: torch.Tensor, start: torch.Tensor, end: torch.Tensor) -> int:
    """The most programs any one SM held at the same time ([start, end] by globaltimer; an end it did not
    record counts as never ending)."""
    end = torch.where(end >= 0, end, torch.iinfo(torch.int64).max)
    best = 0
    for s_id in torch.unique(sm).tolist():
        m = sm == s_id
        ev = sorted([(int(t), 1) for t in start[m]] + [(int(t), -1) for t in end[m]], key=lambda e: (e[0], e[1]))
        live = 0
        for _, d in ev:  # an exit at the same instant as a start is counted first
            live += d
            best = max(best, live)
    return best


def loop_spread(rows: torch.Tensor) -> dict:
    """One launch's programs with a work item, int64 [P, 16] rows as stamped -> how their K loops (in SM
    cycles) spread: the standard deviation over programs, that of the per-SM means (what the SM a program runs
    on explains), and the mean loop per number of working programs an SM held, all in cycles."""
    w = rows[(rows[:, 11] >= 0) & (rows[:, 12] >= 0)]
    loop = (w[:, 12] - w[:, 11]).double()
    sm = w[:, 0]
    ids, inverse, counts = torch.unique(sm, return_inverse=True, return_counts=True)
    sums = torch.zeros(ids.numel(), dtype=torch.float64).index_add_(0, inverse, loop)
    means = sums / counts
    by_count = {int(c): round(float(means[counts == c].mean()), 1) for c in torch.unique(counts)}
    return {"programs": int(w.shape[0]), "sd_cycles": round(float(loop.std(unbiased=False)), 1),
            "sd_of_sm_means_cycles": round(float(means.std(unbiased=False)), 1),
            "mean_loop_by_programs_per_sm": by_count}


def table(summary: dict) -> str:
    """A markdown table of ``summarize``'s point times: one row per launch and point, p10 / p50 / p90 / max."""
    lines = ["| launch | point | min | p10 | p50 | p90 | max (us from L1's first start) |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for name, d in summary["launches"].items():
        for label, q in d.get("at_us", {}).items():
            if q:
                lines.append(f"| {name} | {label} | " + " | ".join(f"{q[k]:.2f}" for k in ("min", "p10", "p50",
                                                                                          "p90", "max")) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Print a saved replay's table, its clocks and each launch's loop spread (``loop_spread``)."""
    import argparse
    import json

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("stamps", help="a torch file with 'stamps': [L1 rows, L2 rows] (the probe's stamps-T*.pt)")
    args = ap.parse_args(argv)
    saved = torch.load(args.stamps, map_location="cpu")
    rows = saved["stamps"]
    programs = max(r.shape[0] for r in rows)
    stamps = torch.full((len(LAUNCHES), programs, WORDS), -1, dtype=torch.int64)
    for i, r in enumerate(rows):
        stamps[i, : r.shape[0]] = r
    summary = summarize(stamps)
    print(table(summary))
    print(f"timer step {summary['timer_step_ns']} ns, SM clock {summary['clock_ghz']} GHz")
    for name, r in zip(LAUNCHES, rows):
        print(name, json.dumps(loop_spread(r)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

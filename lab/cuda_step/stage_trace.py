"""Read a saved trace of the 1-token CUDA step (``probe.py --traces``: int64 [CTAs, 1 + 4, slots], row 0 when
the load warp issued each stage, row 1 + w when warpgroup w found each of its stages landed; %globaltimer ns, -1
or 0 where nothing was recorded) and say where the load warp stopped.

    python3 lab/cuda_step/stage_trace.py TRACE.pt [TRACE.pt ...] [--l1-stages 16 --l2-stages 8 --gap-us 1.0]

Per trace, in us from the first issue of any CTA:
- the load warp's gaps longer than ``--gap-us`` between two issues, summed per CTA (p50 / max), and how much of it
  fell just before a tile's first stage;
- the p50 over CTAs of the gap before each tile's first stage;
- when the last stage was issued, and when its warpgroup found the CTA's last stage (p50 / max);
- the whole grid's issues per ``--window-us`` window, and the windows in which no CTA issued anything
  (``issue_windows``): a hole there is time the DRAM stream lost everywhere at once;
- the computing warpgroups' pace, from one stage found to the next (``warpgroup_pace``; no-load traces too);
- with ``--experts``, the gaps before tile starts by how long before them the tile's page was first asked for
  (``page_stops``), against the gaps inside tiles;
- whether the long gaps were a full ring (``ring_stops``): stage k goes to ring slot k % ``--ring``, freed once
  warpgroup (k - ring) % 4 has read stage k - ring; the time of each gap after that read (plus ``--free-us`` for
  the decode that frees it) is time the ring did not explain.

Tile boundaries assume the CTA's L1 tiles come before its L2 tiles, in equal numbers or one more L1 tile (the
step's default `lag` with as many L1 as L2 tiles per expert, as at DeepSeek-V4-Flash: 16 stages per L1 tile and
8 per L2 tile there). No GPU needed."""

from __future__ import annotations

import argparse
import statistics

import torch


def tile_starts(stages: int, l1_stages: int, l2_stages: int) -> list[int]:
    """The stage indices (> 0) where a CTA's tiles begin, for a CTA with ``stages`` stages: a L1 tiles, then b L2
    tiles, a = b or a = b + 1. Empty when no such split exists."""
    for b in range(stages // l2_stages + 1):
        for a in (b, b + 1):
            if a * l1_stages + b * l2_stages == stages:
                starts = [l1_stages * i for i in range(1, a + 1)] + [a * l1_stages + l2_stages * i for i in range(1, b)]
                return [s for s in starts if 0 < s < stages]
    return []


def _relative(trace: torch.Tensor, base: int) -> torch.Tensor:
    """int64 %globaltimer ns -> float64 ns from ``base`` (meaningless where nothing was recorded). The difference is
    taken in int64: the timer counts ns since 1970 (~1.8e18), where a float64 step is 256 ns."""
    return (trace - base).double()


def _issues(trace: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """trace -> (the trace in float64 us from the first issue of any CTA, NaN where nothing was recorded; per CTA
    its issue times, in the same us)."""
    issued = trace[:, 0]
    if not (issued > 0).any():
        raise ValueError("the trace holds no issue times (row 0); a no-load probe mode records none")
    t = (_relative(trace, int(issued[issued > 0].min())) / 1e3).masked_fill(trace <= 0, float("nan"))
    return t, [t[c, 0, : int((issued[c] > 0).sum())] for c in range(t.shape[0])]


def summarize(trace: torch.Tensor, l1_stages: int = 16, l2_stages: int = 8, gap_us: float = 1.0) -> dict:
    """trace int64 [CTAs, 1 + warpgroups, slots] -> the figures above (us)."""
    t, per_cta = _issues(trace)
    gaps_total, gaps_at_starts, last_issue, last_found = [], [], [], []
    before_start: dict[int, list[float]] = {}
    for c, times in enumerate(per_cta):
        n = times.numel()
        if n == 0:
            continue
        gaps = times[1:] - times[:-1]  # gaps[k - 1]: before stage k
        long = gaps > gap_us
        gaps_total.append(float(gaps[long].sum()))
        starts = tile_starts(n, l1_stages, l2_stages)
        gaps_at_starts.append(sum(float(gaps[k - 1]) for k in starts if long[k - 1]))
        for k in starts:
            before_start.setdefault(k, []).append(float(gaps[k - 1]))
        last_issue.append(float(times[-1]))
        found = t[c, 1:]
        last_found.append(float(found[~found.isnan()].max()))
    p50 = statistics.median
    return {
        "ctas": len(gaps_total),
        "gaps_per_cta_us": {"p50": round(p50(gaps_total), 2), "max": round(max(gaps_total), 2)},
        "gaps_before_tile_starts_p50_us": round(p50(gaps_at_starts), 2),
        "gap_before_stage_p50_us": {k: round(p50(v), 2) for k, v in sorted(before_start.items())},
        "last_issue_us": {"p50": round(p50(last_issue), 2), "max": round(max(last_issue), 2)},
        "last_found_us": {"p50": round(p50(last_found), 2), "max": round(max(last_found), 2)},
    }


def issue_windows(trace: torch.Tensor, window_us: float = 1.0) -> dict:
    """Stages issued by the whole grid per window of ``window_us`` from the first issue (``issued``, one count per
    window up to the last issue), and the starts (us) of the windows with none (``idle``)."""
    times = torch.cat(_issues(trace)[1])  # us from the first issue
    k = (times / window_us).floor().long()
    counts = torch.bincount(k).tolist()
    return {"window_us": window_us, "issued": counts,
            "idle": [round(i * window_us, 2) for i, n in enumerate(counts) if n == 0]}


def ring_stops(trace: torch.Tensor, ring: int = 20, gap_us: float = 1.0, free_us: float = 0.5) -> dict:
    """The load warp's gaps longer than ``gap_us`` (us, summed over CTAs): in all, and the part of them after the slot
    the next issue needed was read (found) plus ``free_us``. A stage k < ring finds its slot unused."""
    t, per_cta = _issues(trace)
    parts = t.shape[1] - 1
    total = unexplained = 0.0
    for c, times in enumerate(map(torch.Tensor.tolist, per_cta)):
        for k in range(1, len(times)):
            if times[k] - times[k - 1] <= gap_us:
                continue
            free = float("-inf")
            if k >= ring:
                j = k - ring
                found = float(t[c, 1 + j % parts, j // parts])
                free = found + free_us if found == found else float("inf")  # NaN: never found
            total += times[k] - times[k - 1]
            unexplained += max(0.0, times[k] - max(times[k - 1], free))
    return {"long_gaps_us": round(total, 1), "after_the_slot_was_free_us": round(unexplained, 1)}


def warpgroup_pace(trace: torch.Tensor) -> dict:
    """The computing warpgroups' pace: per CTA and warpgroup, the time (us) from finding one of its stages landed to
    finding its next (rows 1 + w, which every probe mode records, no-load ones included): p10 / p50 / p90 and the
    mean over all of them. Where the stream keeps ahead (no-load modes) this is the time a warpgroup takes per
    stage, tile ends included in the mean; in the step it is the larger of that and the stream's pace."""
    steps = []
    for c in range(trace.shape[0]):
        for w in range(1, trace.shape[1]):
            found = trace[c, w]
            found = found[found > 0]
            steps.append((found[1:] - found[:-1]).double() / 1e3)  # differences in int64, as ``_relative``
    steps = torch.cat(steps) if steps else torch.empty(0, dtype=torch.float64)
    if steps.numel() == 0:
        raise ValueError("the trace holds no two stages found by one warpgroup (rows 1..)")
    q = torch.quantile(steps, torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64)).tolist()
    return {"steps": steps.numel(), "p10": round(q[0], 3), "p50": round(q[1], 3), "p90": round(q[2], 3),
            "mean": round(float(steps.mean()), 3)}


def page_stops(trace: torch.Tensor, experts: list[int], hidden: int = 4096, intermediate: int = 2048,
               page_bytes: int = 2 << 20, old_us: float = 3.0) -> dict:
    """The load warp's gaps before each tile's first stage, by how long before the gap began the tile's code page
    (``page_bytes``, weights assumed to start on a page) was first issued by any CTA: "first" (not before the
    gap began: this gap may include its first translation), "recent" (under ``old_us``) and "old"; and the gaps
    inside tiles. n, p50 and mean (us) each. ``experts``: the step's items in slot order (``probe.py``'s
    token: 183 59 202 95 89 31). Assumes the step's default schedule: a CTA's L1 tiles blockIdx.x + r G, then its
    L2 tiles the same way; a CTA whose stage count disagrees raises ValueError."""
    _, per_cta = _issues(trace)
    G, tpe1, tpe2 = trace.shape[0], intermediate // 32, hidden // 64
    stages1, stages2 = hidden // 128 // 2, intermediate // 128 // 2  # two K blocks per stage
    per1, per2 = page_bytes // (hidden // 128 * 4096), page_bytes // (intermediate // 128 * 4096)  # tiles per page
    n = len(experts) * tpe1

    def tiles(c):  # (first stage, page) of each of CTA c's tiles
        out, k = [], 0
        for j in range(c, n, G):
            out.append((k, ("L1", (experts[j // tpe1] * tpe1 + j % tpe1) // per1)))
            k += stages1
        for j in range(c, len(experts) * tpe2, G):
            out.append((k, ("L2", (experts[j // tpe2] * tpe2 + j % tpe2) // per2)))
            k += stages2
        return out, k

    first: dict = {}
    plans = []
    for c, times in enumerate(per_cta):
        plan, total = tiles(c)
        if total != times.numel():
            raise ValueError(f"CTA {c} issued {times.numel()} stages where the schedule gives it {total}")
        plans.append(plan)
        for k, page in plan:
            first[page] = min(first.get(page, float("inf")), float(times[k]))
    groups: dict[str, list[float]] = {"first": [], "recent": [], "old": [], "inside tiles": []}
    for times, plan in zip(per_cta, plans):
        starts = dict(plan)
        for k in range(1, times.numel()):
            gap = float(times[k] - times[k - 1])
            if k not in starts:
                groups["inside tiles"].append(gap)
                continue
            lead = float(times[k - 1]) - first[starts[k]]
            groups["first" if lead <= 0 else "recent" if lead < old_us else "old"].append(gap)
    return {name: {"n": len(v), "p50": round(statistics.median(v), 3), "mean": round(statistics.fmean(v), 3)}
            for name, v in groups.items() if v}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--l1-stages", type=int, default=16)
    ap.add_argument("--l2-stages", type=int, default=8)
    ap.add_argument("--gap-us", type=float, default=1.0)
    ap.add_argument("--window-us", type=float, default=1.0)
    ap.add_argument("--ring", type=int, default=20, help="ring stages (step1_probe.json's 'stages')")
    ap.add_argument("--free-us", type=float, default=0.5)
    ap.add_argument("--experts", type=int, nargs="*", help="the step's experts in slot order: tile-start gaps by "
                    "when their page was first asked for (page_stops; probe.py's token: 183 59 202 95 89 31)")
    args = ap.parse_args()
    for path in args.traces:
        trace = torch.load(path)
        print(path)
        print(f"  a warpgroup from one stage found to its next, us: {warpgroup_pace(trace)}")
        if not (trace[:, 0] > 0).any():
            print("  no issue times (a no-load probe mode): nothing more to say of the load warp")
            continue
        for k, v in summarize(trace, args.l1_stages, args.l2_stages, args.gap_us).items():
            print(f"  {k}: {v}")
        w = issue_windows(trace, args.window_us)
        print(f"  stages issued per {w['window_us']} us, all CTAs: {w['issued']}")
        print(f"  windows with no issue anywhere, from (us): {w['idle']}")
        print(f"  long gaps, all CTAs: {ring_stops(trace, args.ring, args.gap_us, args.free_us)}")
        if args.experts:
            print(f"  gaps by when the tile's page was first asked for: {page_stops(trace, args.experts)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

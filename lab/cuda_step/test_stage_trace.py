"""lab/cuda_step/stage_trace.py: where the 1-token CUDA step's load warp stopped, read from a saved trace (the
traces themselves come from the H200). Checked on hand-made traces whose gaps are known."""

import pathlib
import random

import pytest
import torch
from lab.cuda_step import stage_trace as mod
from lab.cuda_step import testdata

def test_tile_starts_put_the_l1_tiles_first():
    assert mod.tile_starts(72, 16, 8) == [16, 32, 48, 56, 64]  # 3 L1 tiles, 3 L2 tiles
    assert mod.tile_starts(48, 16, 8) == [16, 32, 40]  # 2 and 2
    assert mod.tile_starts(24, 16, 8) == [16]  # 1 and 1
    assert mod.tile_starts(40, 16, 8) == [16, 32]  # 2 L1 tiles and 1 L2 tile
    assert mod.tile_starts(7, 16, 8) == []


def _trace(issue_us, found_us, base_ns):
    """One CTA per row: issue times (us) and the last found time (us) -> int64 [CTAs, 5, 80], -1 where unset."""
    t = torch.full((len(issue_us), 5, 80), -1, dtype=torch.int64)
    for c, (iss, found) in enumerate(zip(issue_us, found_us)):
        t[c, 0, : len(iss)] = torch.tensor([base_ns + round(x * 1e3) for x in iss])
        t[c, 1 + c % 4, 0] = base_ns + round(found * 1e3)
    return t


def test_the_summary_finds_the_gaps_put_in():
    rng = random.Random(7)
    base = rng.randrange(17 * 10**17, 19 * 10**17)  # %globaltimer: ns since 1970, where a float64 step is 256 ns
    issue, found, stalls = [], [], []
    for c in range(5):
        stall = 2.0 + c  # before the second L1 tile (stage 16) only; every other step 0.5 us
        times, now = [], rng.uniform(0.0, 0.3)
        for k in range(72):
            if k:
                now += 0.5 + (stall if k == 16 else 0.0)
            times.append(now)
        issue.append(times)
        found.append(times[-1] + 2.5)
        stalls.append(stall + 0.5)
    s = mod.summarize(_trace(issue, found, base))
    first = min(x[0] for x in issue)
    assert s["ctas"] == 5
    assert s["gaps_per_cta_us"] == {"p50": pytest.approx(sorted(stalls)[2], abs=0.01),
                                   "max": pytest.approx(max(stalls), abs=0.01)}
    assert s["gaps_before_tile_starts_p50_us"] == pytest.approx(sorted(stalls)[2], abs=0.01)
    assert s["gap_before_stage_p50_us"][16] == pytest.approx(sorted(stalls)[2], abs=0.01)
    assert s["gap_before_stage_p50_us"][48] == pytest.approx(0.5, abs=0.01)
    lasts = sorted(x[-1] - first for x in issue)
    assert s["last_issue_us"]["max"] == pytest.approx(lasts[-1], abs=0.01)
    assert s["last_found_us"]["p50"] == pytest.approx(lasts[2] + 2.5, abs=0.01)


def test_a_trace_without_issue_times_is_refused():
    with pytest.raises(ValueError, match="no issue times"):
        mod.summarize(torch.full((2, 5, 8), -1, dtype=torch.int64))


def test_issue_windows_count_every_issue_and_find_the_hole():
    rng = random.Random(3)
    base = rng.randrange(17 * 10**17, 19 * 10**17)
    # three CTAs issuing every 0.25 us from 0 to 5.75 us, then nothing until 8.0 us, then to 10.75 us
    issue = [[0.25 * k for k in range(24)] + [8.0 + 0.25 * k for k in range(12)] for _ in range(3)]
    w = mod.issue_windows(_trace(issue, [x[-1] + 1.0 for x in issue], base), window_us=1.0)
    assert sum(w["issued"]) == 3 * 36
    assert w["issued"][:6] == [12] * 6 and w["issued"][8:] == [12, 12, 12]
    assert w["idle"] == [6.0, 7.0]
    with pytest.raises(ValueError, match="no issue times"):
        mod.issue_windows(torch.full((2, 5, 8), -1, dtype=torch.int64))


def test_ring_stops_tell_a_full_ring_from_a_free_one():
    base = 10**12
    ring, n = 8, 16
    t = torch.full((1, 5, 40), -1, dtype=torch.int64)
    issue = [0.25 * k for k in range(n)]
    issue[12:] = [x + 3.0 for x in issue[12:]]  # a 3.25 us gap before stage 12, whose slot stage 4 held
    issue[14:] = [x + 2.0 for x in issue[14:]]  # and a 2.25 us gap before stage 14 (slot of stage 6)
    found = [x + 1.0 for x in issue]
    found[4] = issue[11] + 2.0  # stage 4 read 2 us into the first gap: the ring explains 2.5 us of it
    t[0, 0, :n] = torch.tensor([base + round(x * 1e3) for x in issue])
    for k in range(n):
        t[0, 1 + k % 4, k // 4] = base + round(found[k] * 1e3)
    s = mod.ring_stops(t, ring=ring, gap_us=1.0, free_us=0.5)
    assert s["long_gaps_us"] == pytest.approx(3.25 + 2.25, abs=0.01)
    assert s["after_the_slot_was_free_us"] == pytest.approx((3.25 - 2.5) + 2.25, abs=0.01)


def test_warpgroup_pace_reads_the_steps_put_in():
    base = 5 * 10**12
    t = torch.full((2, 5, 8), -1, dtype=torch.int64)
    t[0, 1, :3] = torch.tensor([base, base + 1000, base + 3000])  # warpgroup 0 of CTA 0: 1 us, then 2 us
    t[1, 3, :2] = torch.tensor([base + 500, base + 4500])  # warpgroup 2 of CTA 1: 4 us
    t[1, 2, 0] = base  # one stage only: no step
    pace = mod.warpgroup_pace(t)
    assert pace["steps"] == 3 and pace["p50"] == 2.0 and pace["mean"] == pytest.approx(7 / 3, abs=1e-3)
    with pytest.raises(ValueError, match="no two stages found"):
        mod.warpgroup_pace(torch.full((2, 5, 8), -1, dtype=torch.int64))


def test_warpgroup_pace_of_run_36_sets_the_skeleton_below_the_decode_below_the_step():
    """Run 36's traces: with no loads a warpgroup takes longer per stage with the decode and MMAs than without
    (the skeleton), and the step with its loads is slower than both."""
    p50 = {name: mod.warpgroup_pace(testdata.load(f))["p50"] for name, f in
           (("skeleton", "run36-trace-noload_bare-f1dd35e.pt"), ("noload", "run36-trace-noload-784b68b.pt"),
            ("step", "run36-trace-784b68b.pt"))}
    assert 0.3 < p50["skeleton"] < p50["noload"] < p50["step"] < 3, p50


def test_times_keep_their_ns_at_the_timers_magnitude():
    """%globaltimer counts ns since 1970 (~1.8e18 in 2026), where a float64 step is 256 ns: the differences are
    taken in int64 first, so gaps of 100 ns and 1,100 ns come out as 0.1 and 1.1 us, not 0 / 0.256 and 1.024."""
    base = 1_796_415_275_896_614_592  # a value from run 36's trace
    issue = [0.0, 0.1, 1.2, 1.3]  # us: gaps of 0.1, 1.1 and 0.1
    t = _trace([issue], [2.45], base)
    s = mod.summarize(t, l1_stages=2, l2_stages=2, gap_us=1.0)
    assert s["gaps_per_cta_us"] == {"p50": 1.1, "max": 1.1}
    assert s["last_issue_us"]["p50"] == 1.3 and s["last_found_us"]["p50"] == 2.45
    t[0, 1, :2] = torch.tensor([base + 100, base + 1300])
    assert mod.warpgroup_pace(t)["p50"] == 1.2


def test_page_stops_sort_tile_starts_by_when_their_page_was_first_asked_for():
    """8 CTAs, experts 3 and 0 (16 L1 and 16 L2 tiles each at H = 1024, I = 512: 4 stages per L1 tile, 2 per L2
    tile, 2 L1 tiles or 4 L2 tiles per 64 KB page). Every CTA has 4 L1 then 4 L2 tiles and issues a stage every
    0.25 us, 2.0 us before each tile's first; CTA c starts 2.5 c us late. A page's tiles sit on neighbouring CTAs of
    one round, so a CTA's lead on its page is 2.5 (c - c0) - 2.0 us, c0 the page's first CTA: L1 tile starts
    -2.0 / 0.5 (first / recent), L2 tile starts -2.0 / 0.5 / 3.0 / 5.5 (first / recent / old / old, "old" from
    2 us). Counted from the gap's end instead (2.5 (c - c0)) the L1 ones at 2.5 would be old."""
    base = 1_796_415_275_896_614_592
    starts = [4, 8, 12, 16, 18, 20, 22]  # tile starts among the 24 stages
    issue = []
    for c in range(8):
        t, times = 2.5 * c, []
        for i in range(24):
            if i:
                t += 2.0 if i in starts else 0.25
            times.append(t)
        issue.append(times)
    t = torch.full((8, 5, 40), -1, dtype=torch.int64)
    for c, times in enumerate(issue):
        t[c, 0, :24] = torch.tensor([base + round(x * 1e3) for x in times])
    s = mod.page_stops(t, [3, 0], hidden=1024, intermediate=512, page_bytes=64 << 10, old_us=2.0)
    assert {k: v["n"] for k, v in s.items()} == {"first": 12 + 8, "recent": 12 + 8, "old": 16, "inside tiles": 128}
    assert all(s[k]["p50"] == 2.0 for k in ("first", "recent", "old")) and s["inside tiles"]["mean"] == 0.25
    with pytest.raises(ValueError, match="CTA 0 issued 23 stages where the schedule gives it 24"):
        t[0, 0, 23] = -1
        mod.page_stops(t, [3, 0], hidden=1024, intermediate=512, page_bytes=64 << 10)

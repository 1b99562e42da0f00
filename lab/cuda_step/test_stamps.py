"""lab/cuda_step/stamps.py: the 1-token CUDA step's last item, followed through a saved timeline (the timelines
themselves come from the H200). Checked on hand-made timelines whose figures are known."""

import random

import pytest
import torch
from lab.cuda_step import stamps as mod

SET_UP, L1_DONE, INPUT_IN, DONE, ENTERED = 0, 3, 4, 5, 6


def _timeline(rows_us, base_ns):
    """rows_us: per CTA a dict column -> us -> int64 [CTAs, 8], -1 where unset."""
    t = torch.full((len(rows_us), 8), -1, dtype=torch.int64)
    for c, row in enumerate(rows_us):
        for col, us in row.items():
            t[c, col] = base_ns + round(us * 1e3)
    return t


def test_the_last_items_ctas_follow_the_schedule():
    # 6 items of 64 tiles on 132 CTAs: the last item's tiles 320..383 sit on CTAs 56..119
    assert mod.last_item_ctas(132, 6, 64) == list(range(56, 120))
    # 3 items of 4 tiles on 5 CTAs: tiles 8..11 on CTAs 3, 4, 0, 1
    assert mod.last_item_ctas(5, 3, 4) == [0, 1, 3, 4]
    with pytest.raises(ValueError, match="3 CTAs .* 4 tiles"):
        mod.last_item_ctas(3, 3, 4)


def test_the_last_item_is_followed_through_known_times():
    rng = random.Random(11)
    base = rng.randrange(17 * 10**17, 19 * 10**17)  # %globaltimer: ns since 1970, where a float64 step is 256 ns
    ctas, items, tiles = 10, 3, 4  # L1 and L2 tiles 8..11 of the last item: CTAs 8, 9, 0, 1
    last = {0, 1, 8, 9}
    rows = []
    for c in range(ctas):
        l1 = 20.0 + 0.5 * c if c in last else 12.0 + rng.uniform(0, 2)  # the last item's L1 ends: 20.0 .. 24.5
        arrival = 26.0 + 0.25 * c if c in last else 15.0 + rng.uniform(0, 2)
        rows.append({SET_UP: rng.uniform(0.0, 0.3) if c else 0.0, ENTERED: -2.0, L1_DONE: l1, INPUT_IN: arrival,
                     DONE: arrival + (3.0 if c != 9 else 7.0)})
    s = mod.last_item(_timeline(rows, base), items, tiles, tiles)
    assert s["l1_done"] == {"min": 20.0, "p50": pytest.approx(22.25), "max": 24.5}
    # arrivals on CTAs 0, 1, 8, 9: 26.0, 26.25, 28.0, 28.25
    assert s["input_in"] == {"min": 26.0, "p50": pytest.approx(27.12, abs=0.01), "max": 28.25}
    assert s["signal_us"] == {"p50": pytest.approx(27.125 - 24.5, abs=0.01), "max": pytest.approx(28.25 - 24.5)}
    assert s["after_input_us"] == {"p50": pytest.approx(3.0), "max": pytest.approx(7.0)}
    assert s["last_done"] == pytest.approx(35.25)
    p = mod.points(_timeline(rows, base))
    assert p["set up"]["min"] == 0.0 and p["entered"]["p50"] == -2.0
    assert p["done"]["max"] == pytest.approx(35.25)
    assert "last block asked for" not in p  # a point no CTA reached


def test_a_timeline_missing_the_points_it_needs_is_refused():
    with pytest.raises(ValueError, match="no set-up stamps"):
        mod.points(torch.full((4, 8), -1, dtype=torch.int64))
    t = torch.full((5, 8), -1, dtype=torch.int64)
    t[:, SET_UP] = 10**12
    t[:, L1_DONE] = 10**12 + 5000
    with pytest.raises(ValueError, match="'last L2 input in'"):
        mod.last_item(t, 3, 4, 4)

"""Read a saved timeline of the 1-token CUDA step and follow its last item: when that item's L1 tiles were done,
when its L2 input row reached the CTAs that need it, and when those CTAs finished.

    python3 lab/cuda_step/stamps.py STAMPS.pt [STAMPS.pt ...] [--items 6 --l1-tiles 64 --l2-tiles 64]

A timeline is what ``probe.py --timelines`` saves (stamps-*.pt): int64 [CTAs, 8], the %globaltimer (ns) at
which each CTA reached each of ``step.STAMP_POINTS`` (set up, last L1 block asked for, last block asked
for, L1 done, last L2 input in, done, entered), -1 where it did not.

Which CTA holds which tile follows the step's schedule (``Schedule`` in megamoe/decode/cuda/cuda_step_params.cuh):
L1 tile j (of item j // l1_tiles) on CTA j % G, L2 tile k (of item k // l2_tiles) on CTA k % G, each CTA taking
its tiles in increasing order. So a CTA's "L1 done" is the end of its last L1 tile's epilogue, and its "last L2
input in" the arrival of its last L2 tile's item. For the last item both are exact when the grid has at least as
many CTAs as the item has tiles (G >= l1_tiles, l2_tiles), which the defaults (DeepSeek-V4-Flash: 6 items of 64
L1 and 64 L2 tiles, 132 CTAs) satisfy. No GPU needed.

Figures in us from the first CTA's set-up:
- ``points``: min / p50 / max over CTAs of each stamp;
- ``last_item``: its L1 tiles' ends (``l1_done``), its input row's arrival on the CTAs of its L2 tiles
  (``input_in``), the signal (``signal_us``: arrival p50 and max, each less the last L1 end), what those CTAs
  took after the arrival (``after_input_us``, p50 / max), and when the last CTA of the grid finished.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))
from lab.cuda_step.step import STAMP_POINTS  # noqa: E402  (the columns; importing it needs no GPU)

SET_UP, L1_DONE, INPUT_IN, DONE = (STAMP_POINTS.index(n) for n in ("set up", "L1 done", "last L2 input in", "done"))


def _median(v: torch.Tensor) -> float:
    return float(statistics.median(v.tolist()))  # the mean of the middle two for an even count, as elsewhere here


def _spread(v: torch.Tensor) -> dict:
    return {"min": round(float(v.min()), 2), "p50": round(_median(v), 2), "max": round(float(v.max()), 2)}


def _us(stamps: torch.Tensor) -> torch.Tensor:
    """int64 [CTAs, 8] ns -> float64 us from the first set-up (NaN where a point was not reached). The difference is
    taken in int64: the timer counts ns since 1970 (~1.8e18), where a float64 step is 256 ns."""
    if not (stamps[:, SET_UP] >= 0).any():
        raise ValueError("the timeline holds no set-up stamps (column 0): was it recorded?")
    us = (stamps - stamps[:, SET_UP][stamps[:, SET_UP] >= 0].min()).double() / 1e3
    return us.masked_fill(stamps < 0, float("nan"))


def points(stamps: torch.Tensor) -> dict:
    """Per stamp point reached by any CTA: min / p50 / max over the CTAs that reached it."""
    us = _us(stamps)
    out = {}
    for k, name in enumerate(STAMP_POINTS):
        col = us[:, k][~us[:, k].isnan()]
        if col.numel():
            out[name] = _spread(col)
    return out


def last_item_ctas(ctas: int, items: int, tiles: int) -> list[int]:
    """The CTAs holding the last item's tiles (``tiles`` per item), where each is that CTA's last tile of the
    kind. ValueError when the grid is too small for that (fewer CTAs than the item has tiles)."""
    if ctas < tiles:
        raise ValueError(f"a grid of {ctas} CTAs gives some CTA two of the last item's {tiles} tiles: its stamp "
                         "would not say which of them it marks")
    return sorted({j % ctas for j in range((items - 1) * tiles, items * tiles)})


def last_item(stamps: torch.Tensor, items: int = 6, l1_tiles: int = 64, l2_tiles: int = 64) -> dict:
    """The last item's way through the step (the figures in the module's docstring)."""
    us = _us(stamps)
    ctas = us.shape[0]
    l1 = us[last_item_ctas(ctas, items, l1_tiles)]
    l2 = us[last_item_ctas(ctas, items, l2_tiles)]
    for name, rows, col in (("L1 done", l1, L1_DONE), ("last L2 input in", l2, INPUT_IN), ("done", l2, DONE)):
        if rows[:, col].isnan().any():
            raise ValueError(f"a CTA of the last item has no '{name}' stamp (column {col})")
    l1_end = float(l1[:, L1_DONE].max())
    arrival = l2[:, INPUT_IN]
    after = l2[:, DONE] - arrival
    return {
        "l1_done": _spread(l1[:, L1_DONE]),
        "input_in": _spread(arrival),
        "signal_us": {"p50": round(_median(arrival) - l1_end, 2), "max": round(float(arrival.max()) - l1_end, 2)},
        "after_input_us": {"p50": round(_median(after), 2), "max": round(float(after.max()), 2)},
        "last_done": round(float(us[:, DONE].nan_to_num(float("-inf")).max()), 2),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stamps", nargs="+")
    ap.add_argument("--items", type=int, default=6)
    ap.add_argument("--l1-tiles", type=int, default=64)
    ap.add_argument("--l2-tiles", type=int, default=64)
    args = ap.parse_args()
    for path in args.stamps:
        s = torch.load(path)
        print(path)
        for name, v in points(s).items():
            print(f"  {name}: {v}")
        for k, v in last_item(s, args.items, args.l1_tiles, args.l2_tiles).items():
            print(f"  last item, {k}: {v}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

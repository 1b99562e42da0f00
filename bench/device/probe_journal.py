"""What the one-off H200 probes (dg_probe.py, fused_probe.py) share: a log line stamped with the seconds
since the probe started, and the probe's record dumped as JSON under $OUT after every case, so a call cut
short by its time limit still brings back what it measured.

    journal = ProbeJournal("/tmp/out", "probe.json", {"cases": [], "errors": []})
    journal.log("case", 3)   # -> "[   0.0s] case 3"
    journal.dump()           # -> /tmp/out/probe.json
"""

from __future__ import annotations

import json
import os
import time


class ProbeJournal:
    """A probe's record (``data``, a dict the probe fills) and where it is written (``out_dir/filename``)."""

    def __init__(self, out_dir: str, filename: str, data: dict, t0: float | None = None) -> None:
        os.makedirs(out_dir, exist_ok=True)
        self.path = os.path.join(out_dir, filename)
        self.data = data
        self.t0 = time.time() if t0 is None else t0

    def elapsed(self) -> float:
        return time.time() - self.t0

    def log(self, *parts) -> None:
        print(f"[{self.elapsed():6.1f}s]", *parts, flush=True)

    def dump(self) -> None:
        # default=str: shapes, dtypes and devices land as their printed form rather than failing the dump
        with open(self.path, "w") as f:
            json.dump(self.data, f, indent=1, default=str)

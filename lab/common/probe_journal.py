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
import traceback


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

    def guard(self, what: str, deadline_s: float, key: str | None = None):
        """Decorator for one case or section of a probe: not begun once ``deadline_s`` seconds have passed
        (recorded in ``data['errors']``), an exception recorded there instead of raised, the record dumped
        after. With ``key``, the result is stored in ``data[key]`` and the seconds in ``data['seconds'][key]``."""
        def deco(fn):
            def run(*a, **k):
                if self.elapsed() > deadline_s:
                    self.data["errors"].append({"what": what, "error": "skipped: deadline"})
                    return None
                t = time.time()
                try:
                    out = fn(*a, **k)
                    if key is not None:
                        self.data[key] = out
                    return out
                except Exception as exc:  # noqa: BLE001 - one case must not stop the probe
                    tb = traceback.format_exc()
                    self.log(f"FAILED {what}: {exc}\n{tb}")
                    self.data["errors"].append({"what": what, "error": f"{type(exc).__name__}: {exc}", "tb": tb[-3000:]})
                    return None
                finally:
                    if key is not None:
                        self.data.setdefault("seconds", {})[key] = round(time.time() - t, 1)
                    self.dump()
            return run
        return deco

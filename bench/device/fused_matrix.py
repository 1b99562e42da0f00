"""H200: the differential matrix for every available backend in one call; JSON + markdown under $OUT.

    source .whl/prelude.sh && cp .fi_extra/* $MEGAMOE_SITE/flashinfer/data/csrc/ && \
        export PYTHONPATH=$PWD:$PYTHONPATH && python bench/device/fused_matrix.py
"""

import json
import os
import time

import torch

from megamoe.check.matrix import Case, default_cases, format_table, run_matrix
from megamoe.fused.registry import available_backends

OUT = os.environ.get("OUT", "/tmp/matrix_out")
os.makedirs(OUT, exist_ok=True)
T0 = time.time()
BUDGET = float(os.environ.get("MATRIX_BUDGET_S", "380"))
print("device", torch.cuda.get_device_name(), "available", available_backends(), flush=True)
rows = []
plan = [
    ("flashinfer-mxfp4", dict(quick=True, time_iters=10), 0.72),
    ("deepgemm-sm90-fp8", dict(quick=True, time_iters=10), 1.0),
]
for name, kw, frac in plan:
    tag = kw.pop("tag", "")
    left = BUDGET * frac - (time.time() - T0)
    if left < 20:
        rows.append({"backend": name, "case": "all", "status": "skipped", "reason": "device time budget"})
        continue
    r = run_matrix(name, kw.pop("cases", None), os.path.join(OUT, f"{name}{tag}.json"), deadline_s=left, **kw)
    for x in r:
        x["reference_mma"] = "sm90-fp8-tc" if tag == "tc" else "exact-block"
        x.pop("tb", None) if x.get("status") != "error" else None
    rows += r
meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "available": available_backends(),
        "wall_s": time.time() - T0}
with open(os.path.join(OUT, "matrix.json"), "w") as f:
    json.dump({"meta": meta, "rows": rows}, f, indent=1, default=str)
md = format_table(rows)
open(os.path.join(OUT, "matrix.md"), "w").write(md + "\n")
print(md)

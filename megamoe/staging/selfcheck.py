"""Bitwise self-check of a staging backend over the case matrix; prints one JSON line per case.

    python -m megamoe.staging.selfcheck --backend triton --device cpu      (with TRITON_INTERPRET=1)
    python -m megamoe.staging.selfcheck --backend triton --device cuda --cast hw bits

The tests run it in a subprocess under Triton's interpreter (the interpreter must be switched on
before triton is imported); the device script calls ``run_cases`` directly.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback

import torch

from ..geometry import PRESETS
from .checks import StagingCase, check_staged, make_case
from .stage import stage_into

ODD_TOKENS = (1, 3, 37, 129)


def default_cases(presets=tuple(PRESETS), tokens=ODD_TOKENS) -> list[StagingCase]:
    """Every preset x odd T with padding; edge values, a column-major x_sf and int32 ids on top."""
    cases = [StagingCase(p, t, seed=i) for i, p in enumerate(presets) for t in tokens]
    cases += [StagingCase(p, 37, edge=True) for p in presets]
    cases += [StagingCase("small", 37, pad=0, spare=0, sf_col_major=True),
              StagingCase("dsv4-pro", 37, sf_col_major=True), StagingCase("tiny", 3, idx_dtype=torch.int32),
              StagingCase("small", 0, pad=5)]
    return cases


def run_cases(cases, *, backend: str, device: str, cast: str = "auto") -> list[dict]:
    rows = []
    for case in cases:
        row = {"case": case.id, "backend": backend, "cast": cast, "device": device}
        t0 = time.perf_counter()
        try:
            x, idx, w, bufs = make_case(case, device)
            got = stage_into(x, idx, w, *bufs.views(), case.agreed, num_experts=PRESETS[case.preset].num_experts,
                             backend=backend, cast=cast)
            if got != case.agreed:
                raise AssertionError(f"stage_into returned {got}, expected the agreed count {case.agreed}")
            check_staged(bufs, x, idx, w, case.agreed, case.id)
            row["ok"] = True
        except Exception as e:  # noqa: BLE001 - each case reports its own failure
            row.update(ok=False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc(limit=4))
        row["seconds"] = round(time.perf_counter() - t0, 3)
        rows.append(row)
    return rows


def check_nonfinite(*, backend: str, device: str) -> dict:
    """NaN and Inf in x and a bad expert id (999) must raise, and a caller's error flag must get the
    matching bits (validate.X_NONFINITE, ROUTE_ID_OUT_OF_RANGE) without a raise."""
    from ..validate import ROUTE_ID_OUT_OF_RANGE, X_NONFINITE

    e = PRESETS["tiny"].num_experts
    out = {}
    for name, val in (("nan", float("nan")), ("inf", float("inf")), ("route", 999)):
        x, idx, w, bufs = make_case(StagingCase("tiny", 3), device)
        if name == "route":
            idx[1, 0] = val
        else:
            x[1, 7] = val
        try:
            stage_into(x, idx, w, *bufs.views(), num_experts=e, backend=backend)
            out[name] = "no error (BAD)"
        except ValueError as err:
            want = "topk_idx must be in" if name == "route" else "NaN or Inf"
            out[name] = "raised" if want in str(err) else f"wrong error: {err}"
    if backend == "triton":
        for name, bit in (("flag", X_NONFINITE), ("route_flag", ROUTE_ID_OUT_OF_RANGE)):
            x, idx, w, bufs = make_case(StagingCase("tiny", 3), device)
            if name == "flag":
                x[2, 100] = float("-inf")
            else:
                idx[2, 1] = -7
            flag = torch.zeros(1, dtype=torch.int32, device=device)
            stage_into(x, idx, w, *bufs.views(), num_experts=e, backend=backend, error_flag=flag)
            out[name] = "set" if int(flag.item()) == bit else f"{int(flag.item())} (BAD: want {bit})"
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="triton")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--cast", nargs="+", default=["auto"])
    ap.add_argument("--presets", nargs="+", default=list(PRESETS))
    ap.add_argument("--tokens", nargs="+", type=int, default=list(ODD_TOKENS))
    args = ap.parse_args(argv)
    cases = default_cases(tuple(args.presets), tuple(args.tokens))
    ok = True
    for cast in args.cast:
        for row in run_cases(cases, backend=args.backend, device=args.device, cast=cast):
            ok &= row["ok"]
            print(json.dumps(row), flush=True)
    nf = check_nonfinite(backend=args.backend, device=args.device)
    print(json.dumps({"nonfinite": nf}), flush=True)
    ok &= all(v in ("raised", "set") for v in nf.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

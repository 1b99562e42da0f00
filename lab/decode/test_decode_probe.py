"""lab/decode/decode_probe.py's arithmetic and its last table, on a CPU (the probe itself runs on the H200)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="the decode probe's read kernel is Triton")

from lab.decode import decode_probe as probe  # noqa: E402
from megamoe.decode import prepare_decode_weights  # noqa: E402
from megamoe.geometry import get_geometry  # noqa: E402
from megamoe.weights import random_mxfp4_weights  # noqa: E402


def test_decode_probe_bytes_and_table(capsys):
    """The device script's arithmetic and its last table, on synthetic rows (it runs once on the H200)."""
    g = get_geometry("tiny")
    w = random_mxfp4_weights(g, seed=0)
    nb = probe.launch_bytes(g, 3, 5, 6, prepare_decode_weights(w))
    assert nb["weights"] == 5 * g.expert_weight_bytes()  # 0.53125 bytes per weight, scales included
    row = {"tokens": 8, "touched": 44, "weight_mb": 588.2, "graph": {"median_us": 170.0},
           "kineto_us": dict.fromkeys(probe.KERNELS, 1.0), "read": {"median_us": 150.0}, "of_read": 1.13, "gbps": 3460,
           "flashinfer_us_issue25": 225.0, "speedup_vs_flashinfer": 1.32, "calc_diff": 0.0, "bitwise_frac": 1.0,
           "repeat_identical": True, "correct": True}
    probe.print_table({"device": "H200", "torch": "x", "triton": "y", "geometry": "dsv4-flash", "total_s": 1,
                       "rows": [row, {"tokens": 64}], "errors": [],
                       "variants": [{"tokens": 8, "variant": "warps8", "graph": {"median_us": 1.0},
                                     "kineto_us": {}, "same_bits": True}]})
    out = capsys.readouterr().out
    assert "| 8 | 44 | 588.2 | 170.0 |" in out and "1.32x" in out and "| 64 | - |" in out

"""results.jsonl: one record per timed row, carrying what a baseline file must (backend, tokens, geometry,
median and spread, correctness, BLOCK_M / tile, card, versions, commit), for every process of an appended run."""

from __future__ import annotations

import json

from megamoe.bench.jsonl import records, write_jsonl
from megamoe.bench.report import write_all


def _results():
    geo = {"name": "dsv4-flash", "num_experts": 256, "num_topk": 6, "hidden": 4096, "intermediate": 2048}
    meta = lambda p, card: {"process": p, "card": card, "date": f"2026-12-05T0{p}:00:00Z", "commit": "abc", "dirty": False,  # noqa: E731
                            "geometry": geo, "gpu": {"uuid": f"u{p}"}, "versions": {"torch": "2.11"}}
    rows = [{"backend": "humming-w4a8", "tokens": 1, "pass": 0, "median_us": 64.8, "mean_us": 65.0, "stderr_us": 0.1,
             "min_us": 63.0, "spread": 0.02, "repeats": 100, "method": "cuda-graph", "correct": True, "calc_diff": 0.0,
             "nan": False, "block_m": 40, "plan": {"tiles": "gate/up 40x128x128"}, "process": 1},
            {"backend": "flashinfer-mxfp4 [p2]", "backend_name": "flashinfer-mxfp4", "tokens": 1, "pass": 0,
             "median_us": 75.0, "process": 2, "correct": True, "block_m": 8}]
    return {"meta": meta(1, "H200"), "processes": [meta(1, "H200"), meta(2, "H200")], "rows": rows,
            "backends": [{"name": "humming-w4a8", "provenance": {"module": "humming", "version": "0.1.20"}},
                         {"name": "flashinfer-mxfp4", "process": 2, "provenance": {"module": "flashinfer"}}]}


def test_records_carry_each_rows_process_meta_and_module():
    recs = records(_results())
    assert [r["backend"] for r in recs] == ["humming-w4a8", "flashinfer-mxfp4"]
    a, b = recs
    assert a["median_us"] == 64.8 and a["block_m"] == 40 and a["correct"] is True and a["recipe"] == "humming-w4a8"
    assert a["geometry"]["hidden"] == 4096 and a["card"] == "H200" and a["commit"] == "abc"
    assert a["modules"] == {"module": "humming", "version": "0.1.20"} and a["gpu_uuid"] == "u1"
    assert b["process"] == 2 and b["date"].startswith("2026-12-05T02") and b["modules"] == {"module": "flashinfer"}


def test_write_all_writes_the_jsonl_beside_the_json(tmp_path, monkeypatch):
    import megamoe.bench.report as report

    monkeypatch.setattr(report, "to_markdown", lambda results: "stub\n")  # these rows carry too little for the tables
    res = _results()
    written = write_all(res, str(tmp_path), plots=False)
    path = tmp_path / "results.jsonl"
    assert str(path) in written
    lines = path.read_text().splitlines()
    assert len(lines) == len(res["rows"]) and json.loads(lines[0])["tokens"] == 1
    assert write_jsonl(res, str(tmp_path)) == str(path)

"""``megamoe check`` through ``megamoe.cli.main``: exit codes, the printed tables, the JSON report."""

from __future__ import annotations

import json

import pytest
import torch

import megamoe.check as check_mod
from megamoe.check import DEFAULT_RECIPES
from megamoe.cli import main


def test_check_tiny_ep_passes(tmp_path, capsys):
    out = tmp_path / "report.json"
    rc = main(["check", "--preset", "tiny", "--tokens", "11", "--ranks", "2", "--block-m", "64", "--seed", "3",
               "--json", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    for needle in ("error vs the exact recipe per stage", "flashinfer-mxfp4", "deepgemm-sm90-fp8", "L2 in",
                   "rows per expert: min", "EP R=2 BLOCK_M=64 == one rank", "all checks passed"):
        assert needle in text, f"{needle!r} missing from the output:\n{text}"
    assert "fused backends" in text
    rep = json.loads(out.read_text())
    assert rep["ok"] and rep["ranks"] == 2 and sum(rep["tokens_per_rank"]) == 11
    assert len(rep["expert_rows"]) == 8 and rep["histogram"]["max"] >= rep["histogram"]["min"]
    ys = [e for e in rep["errors"] if e["stage"] == "y"]
    assert {e["recipe"] for e in ys} == set(DEFAULT_RECIPES) and all(0 < e["calc_diff"] < 5e-3 for e in ys)


def test_check_fails_when_ep_differs_from_one_rank(monkeypatch, capsys):
    orig = check_mod.moe_forward

    def off_by_one_ulp(inp, w, recipe, g, **kw):
        y = orig(inp, w, recipe, g, **kw)
        y = y.clone()
        y.view(torch.int16)[0, 0] += 1  # one bf16 ulp in one element
        return y

    monkeypatch.setattr(check_mod, "moe_forward", off_by_one_ulp)
    rc = main(["check", "--preset", "tiny", "--tokens", "6", "--recipes", "deepgemm-sm90-fp4"])
    text = capsys.readouterr().out
    assert rc == 1
    assert "FAIL" in text and "1/" in text and "check(s) FAILED" in text


@pytest.mark.parametrize("args,rc,needle", [
    (["check", "--preset", "tiny", "--ranks", "3"], 2, "num_ranks must divide num_experts=8"),
    (["check", "--preset", "tiny", "--tokens", "4", "--recipes", "deepgemm-sm90-fp4", "--backend", "nope"], 1,
     "backend nope"),
], ids=["ranks-not-dividing", "unknown-backend"])
def test_check_bad_arguments(args, rc, needle, capsys):
    assert main(args) == rc
    assert needle in capsys.readouterr().out


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "check" in capsys.readouterr().out


def test_bench_ranks_spawns_real_ranks(capsys):
    from megamoe.cli import main

    assert main(["bench", "--ranks", "2", "--preset", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "2 gloo ranks" in out and "agreement all-reduce" in out

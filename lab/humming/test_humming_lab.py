"""The Humming study's own tools on a CPU: case ids parse back to the matrix's cases, and the tuning-list tool's
card description carries every field Humming's heuristics read (checked where humming-kernels is importable)."""

from __future__ import annotations

import importlib.util

import pytest

from lab.humming.cases import parse


@pytest.mark.parametrize("case_id, routing, seed", [("small-T300-auto", "uniform", 300),
                                                     ("dsv4-flash-T1-auto", "uniform", 1),
                                                     ("dsv4-flash-T128-auto-masked", "masked", 11)])
def test_case_ids_round_trip_with_the_matrix_seeds(case_id, routing, seed):
    c = parse(case_id)
    assert (c.id, c.routing, c.seed) == (case_id, routing, seed)


@pytest.mark.skipif(importlib.util.find_spec("humming") is None, reason="humming-kernels is not installed")
def test_the_described_card_gives_humming_its_dsv4_flash_lists(monkeypatch):
    from lab.humming.tuning_lists import describe_card_as_h100, lists

    describe_card_as_h100(monkeypatch.setattr)
    gate_up, down = lists(256, 4096, 2048, {"dtype": "float8e4m3", "input_scale_group_size": 128}, False)
    assert [c["block_shape"][0] for _, _, c in gate_up] == [c["block_shape"][0] for _, _, c in down]

"""The kernel pictures' numbers: DeepGEMM's restated heuristics against what the H200 printed, the CTA
anatomy against the recorded plans, and the pipeline / schedule models' invariants. CPU only."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from megamoe import get_geometry
from megamoe.teaching.anatomy import deepgemm_fp4_anatomy, deepgemm_fp8_anatomy, fits, flashinfer_anatomy
from megamoe.bench.tables import load_results
from megamoe.teaching.anatomy import recorded_plans
from megamoe.layouts.deepgemm_configs import SM90_SMEM_CAPACITY, deepgemm_sm90_fp4_config, deepgemm_sm90_fp8_config
from megamoe.teaching.plans_viz import L1, L2, interleaved_schedule, pipeline_events, static_schedule
from megamoe.inputs import make_routing

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results"
SWEEP = load_results(RESULTS / json.loads((RESULTS / "CITED.json").read_text())["sweep"])
PLANS = recorded_plans(SWEEP)
COMPARED = ("block_m", "block_n", "num_experts_per_wave", "num_stages", "smem_size", "num_dispatch_threads",
            "num_non_epilogue_threads", "num_epilogue_threads")


def _printed(text: str) -> tuple[dict, dict]:
    """A DG_PRINT_CONFIGS line: (the key's arguments, the config's fields) as ints / bools."""
    key, cfg = re.findall(r"MegaMoESM90Config\(([^)]*)\)", text)
    parse = lambda s: {k: (v == "true") if v in ("true", "false") else int(v)  # noqa: E731
                       for k, v in (kv.split("=") for kv in s.split(", "))}
    return parse(key), parse(cfg)


@pytest.mark.parametrize("tokens", sorted(t for b, t in PLANS if b == "deepgemm-sm90-fp8"))
def test_fp8_config_is_what_the_h200_printed_in_the_cited_sweep(tokens):
    plan = PLANS["deepgemm-sm90-fp8", tokens]
    recorded = {**plan["detail"], "block_m": plan["block_m"]}
    mine = deepgemm_sm90_fp8_config("dsv4-flash", tokens, num_max_tokens_per_rank=8448)
    assert {k: mine[k] for k in COMPARED} == {k: recorded[k] for k in COMPARED}
    assert (mine["swap_ab"], mine["reuse_accum"], mine["num_max_pool_tokens"]) == (
        recorded["swap_ab"], recorded["reuse_accum"], recorded["num_max_pool_tokens"])


def test_fp8_config_is_what_the_probe_printed_on_two_geometries():
    cases = json.loads((RESULTS / "2026-12-02-h200-dg-probe.json").read_text())["cases"]
    assert len(cases) >= 8
    for case in cases:
        key, printed = _printed(case["config_print"])
        mine = deepgemm_sm90_fp8_config(case["geometry"], key["num_tokens"], num_ranks=key["num_ranks"],
                                        num_max_tokens_per_rank=key["num_max_tokens_per_rank"])
        assert {k: mine[k] for k in COMPARED} == {k: printed[k] for k in COMPARED}, case["geometry"] + str(key)
        assert mine["swap_ab"] == key["swap_ab"]


def test_fp4_config_matches_configurations_worked_by_hand():
    """Worked from DeepGEMM PR #323's sm90_mega_moe.hpp / sm90_mega.hpp for DeepSeek-V4-Flash on 132 SMs.
    T=1: 0.023 rows per expert -> BLOCK_M 64, two math warpgroups, the split-N band (64 dispatch + 320
    non-epilogue threads: 2 loaders + 8 decode warps), no stage cap; per stage 8192 (A) + 16384 (decoded
    B) + 8192 (packed B) + 512 + 512 (scales) + 16 + 8 (decode-done barrier) = 33816 B; fixed 9216
    (dispatch) + 20480 (swap-AB CD) + 1024 (shared-amax scratch) + 144 = 30864 B -> 5 stages, 199944 B.
    T=4096: 96 rows -> BLOCK_M 128, the 2-warpgroup decode-offload band (192 non-epilogue threads);
    per stage 16384 + 16384 + 8192 + 1024 + 512 + 16 + 16 = 42528 B, fixed 9216 + 32768 + 144 -> 4 stages."""
    t1 = deepgemm_sm90_fp4_config("dsv4-flash", 1)
    assert (t1["block_m"], t1["block_n"], t1["num_epilogue_threads"], t1["num_dispatch_threads"],
            t1["num_non_epilogue_threads"], t1["num_stages"], t1["smem_size"], t1["num_experts_per_wave"]) == (
        64, 128, 256, 64, 320, 5, 199944, 256)
    assert t1["swap_ab"] and not t1["math_wg_participates_in_decode"] and t1["first_decode_assist_warp"] == 2
    t4k = deepgemm_sm90_fp4_config("dsv4-flash", 4096)
    assert (t4k["block_m"], t4k["num_non_epilogue_threads"], t4k["num_stages"], t4k["smem_size"]) == (128, 192, 4, 212240)
    assert not t4k["swap_ab"]
    for t in (1, 7, 64, 300, 2048, 8192):
        assert deepgemm_sm90_fp4_config("dsv4-flash", t)["smem_size"] <= SM90_SMEM_CAPACITY
    with pytest.raises(ValueError, match=r"num_tokens must be in \[1, num_max_tokens_per_rank=8448\], got 0"):
        deepgemm_sm90_fp4_config("dsv4-flash", 0)


def test_anatomy_of_every_recorded_plan():
    g = get_geometry("dsv4-flash")
    for (backend, t), plan in PLANS.items():
        if backend == "flashinfer-mxfp4":
            a = flashinfer_anatomy(plan["detail"], g)
            d = plan["detail"]
            split_decode = d["swap_ab"] and not d["rs_swap_ab"] and d["block_m"] >= 16
            assert a.threads == (640 if split_decode else 384)  # sm90_mxfp4_num_threads
            assert a.role("math WG1").registers == (152 if split_decode else 208)
            assert a.combine_ring_bytes == 3 * 8 * g.hidden * 2 and fits(a)
        elif backend == "deepgemm-sm90-fp8":
            a = deepgemm_fp8_anatomy({**plan["detail"], "block_m": plan["block_m"]}, g)
            assert a.smem_bytes == plan["detail"]["smem_size"], t
            assert a.threads == sum(plan["detail"][k] for k in ("num_dispatch_threads", "num_non_epilogue_threads",
                                                                 "num_epilogue_threads"))
        else:
            continue
        assert [r.first_warp for r in a.roles] == [sum(r.warps for r in a.roles[:i]) for i in range(len(a.roles))]
    fp4 = deepgemm_fp4_anatomy(deepgemm_sm90_fp4_config(g, 1), g)
    assert fp4.smem_bytes == 199944 and fp4.role("decode").warps == 8 and fp4.threads == 640


@pytest.mark.parametrize("stages, decode", [(3, True), (4, False), (8, False)])
def test_pipeline_model_keeps_the_ring_rules(stages, decode):
    a = flashinfer_anatomy({"block_m": 24 if decode else 8, "block_n": 256, "num_stages": stages,
                            "swap_ab": True, "rs_swap_ab": False, "num_experts_per_wave": 32}, "dsv4-flash")
    ev = pipeline_events(a, 32, load_steps=4)
    loads = [e for e in ev if e[0] == "TMA load"]
    mmas = {e[1]: e for e in ev if e[0] == "WGMMA"}
    assert [e[1] for e in loads] == list(range(32)) and len(mmas) == 32
    assert any(e[0] == "decode" for e in ev) == decode
    for lane, k, st, t0, t1 in loads:
        assert st == k % stages
        if k >= stages:  # a stage is refilled only after the WGMMA of the block it held
            assert t0 >= mmas[k - stages][4]
        in_flight = sum(1 for e in loads if e[3] <= t0 < e[4])
        assert in_flight <= stages
    for k in range(1, 32):
        assert mmas[k][3] >= mmas[k - 1][4]
    bubbles = sum(mmas[k][3] - mmas[k - 1][4] for k in range(1, 32))
    assert (bubbles == 0) == (stages > 4 and not decode)  # 4-step loads need more than 4 stages


@pytest.mark.parametrize("tokens", [1, 37, 512, 8192])
def test_schedules_run_every_task_once_and_l2_after_its_l1(tokens):
    g = get_geometry("dsv4-flash")
    idx, _ = make_routing(tokens, g.num_experts, g.num_topk, gen=torch.Generator().manual_seed(tokens))
    counts = torch.bincount(idx[idx >= 0], minlength=g.num_experts).tolist()
    for a, schedule in ((flashinfer_anatomy(PLANS["flashinfer-mxfp4", min(tokens, 8192) if tokens != 37 else 32]["detail"], g),
                         interleaved_schedule),
                        (deepgemm_fp8_anatomy(deepgemm_sm90_fp8_config(g, tokens), g), static_schedule)):
        blocks = sum(-(-c // a.block_m) for c in counts)
        grid = schedule(counts, a, g, 132)
        flat = [v for row in grid for v in row]
        assert flat.count(L1) == blocks * 2 * g.intermediate // a.block_n
        assert flat.count(L2) == blocks * g.hidden // a.block_n
        assert len(grid) == 132
        if schedule is interleaved_schedule:  # step by step, L2 claims never outrun the L1 claims of their blocks
            steps = max(map(len, grid))
            n1, n2, c1, c2 = 2 * g.intermediate // a.block_n, g.hidden // a.block_n, 0, 0
            for s in range(steps):
                for row in grid:
                    v = row[s] if s < len(row) else 0
                    c1 += v == L1
                    c2 += v == L2
                    if v == L2:
                        assert c1 >= min(((c2 - 1) // n2 + 1) * n1, blocks * n1)


def test_the_pictures_draw():
    mpl = pytest.importorskip("matplotlib", reason="pip install -e .[plot]")
    mpl.use("Agg")
    import matplotlib.pyplot as plt

    from megamoe.teaching.plans_viz import draw_dispatch_combine, draw_pipeline, draw_schedule, draw_smem, draw_warps

    g = get_geometry("dsv4-flash")
    a = flashinfer_anatomy(PLANS["flashinfer-mxfp4", 512]["detail"], g)
    fig, axes = plt.subplots(5, 1, figsize=(8, 12))
    draw_warps(axes[0], [a], ["FI"])
    draw_smem(axes[1], [a], ["FI"])
    draw_pipeline(axes[2], a, 8)
    draw_dispatch_combine(axes[3], g, num_ranks=2)
    draw_schedule(axes[4], interleaved_schedule([3] * g.num_experts, a, g, 132), "FI")
    assert len(axes[0].patches) == len(a.roles) and len(axes[1].patches) >= a.num_stages
    assert len(axes[3].patches) == 2 * 3 + 2  # three buffers per rank, two arrows
    plt.close(fig)

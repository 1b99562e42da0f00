"""DeepGEMM SM90 plan read-back (no GPU): the heuristic's printout and the JIT source's template
arguments, as seen on the H200 (lab/numerics/dg_probe.py, 2026-12-02), and the recipe they imply."""

from __future__ import annotations

import pytest

from megamoe.check import CheckReport, run_backend
from megamoe.fused import deepgemm_fp8 as dg
from megamoe.recipe import DEEPGEMM_SM90_FP8

# Verbatim from the H200 (small geometry, 300 tokens; DeepSeek-V4-Flash, 1 token).
PRINT_300 = ("MegaMoESM90Config(num_ranks=1, num_experts=16, hidden=512, intermediate_hidden=256, "
             "num_max_tokens_per_rank=768, num_tokens=300, num_topk=4, swap_ab=false): MegaMoESM90Config("
             "block_m=128, block_n=256, block_k=128, cluster_size=1, num_max_pool_tokens=6144, "
             "num_padded_sf_pool_tokens=98304, swizzle_acts_mode=128, swizzle_weights_mode=128, "
             "num_experts_per_wave=16, num_stages=3, smem_size=223504, num_dispatch_threads=64, "
             "num_non_epilogue_threads=64, num_epilogue_threads=512)\n")
SRC_300 = ("auto ptr = reinterpret_cast<void*>(&sm90_fp8_mega_moe_impl< 768, 512, 256, 16, 4, 16, 128, 256, 128, "
           "6144, 98304, 3, 64, 64, 512, 132, 1, 0x1.4p+3f, true, 112, true, true, false, false, false >);")
SRC_1 = ("&sm90_fp8_mega_moe_impl< 8448, 4096, 2048, 256, 6, 256, 64, 128, 128, 99840, 1597440, 8, 64, 64, 256, "
         "132, 1, 0x1.4p+3f, true, 0, false, false, true, false, true >")


def test_parse_config_print_takes_the_chosen_config():
    cfg = dg.parse_config_print("JIT noise\n" + PRINT_300)
    assert cfg["block_m"] == 128 and cfg["block_n"] == 256 and cfg["num_stages"] == 3
    assert cfg["num_epilogue_threads"] == 512 and "num_tokens" not in cfg  # the input line is not the config
    assert dg.parse_config_print("nothing printed") == {}


def test_parse_template_args():
    a = dg.parse_template_args(SRC_300)
    assert a["block_m"] == 128 and a["reuse_accum_as_final"] is True and a["fp8_swap_ab"] is False
    assert a["epilogue_register_budget"] == 112 and a["hidden"] == 512
    b = dg.parse_template_args(SRC_1)
    assert b["block_m"] == 64 and b["reuse_accum_as_final"] is False and b["fp8_swap_ab"] is True
    assert dg.parse_template_args("template <int x> void f();") is None


def test_find_kernel_args_matches_the_printed_config(tmp_path):
    (tmp_path / "k1").mkdir()
    (tmp_path / "k1" / "kernel.cu").write_text(SRC_1)
    (tmp_path / "k2").mkdir()
    (tmp_path / "k2" / "kernel.cu").write_text(SRC_300)
    args = dg.find_kernel_args(dg.parse_config_print(PRINT_300), str(tmp_path))
    assert args is not None and args["reuse_accum_as_final"] is True and args["num_stages"] == 3
    other = dict(dg.parse_config_print(PRINT_300), num_stages=5)
    assert dg.find_kernel_args(other, str(tmp_path)) is None


@pytest.mark.parametrize("src,hidden,want", [(SRC_300, 512, "rescale"), (SRC_1, 4096, "promote"),
                                             (SRC_300, 7168, "rescale-ratio")])
def test_recipe_for_kernel(src, hidden, want):
    r = dg.recipe_for_kernel(DEEPGEMM_SM90_FP8, dg.parse_template_args(src), {}, hidden, "sm90-fp8-tc")
    assert r.accumulate == want and r.mma == "sm90-fp8-tc" and r.l2_group == 64


def test_recipe_without_source_infers_from_tile():
    cfg = dg.parse_config_print(PRINT_300)
    assert dg.recipe_for_kernel(DEEPGEMM_SM90_FP8, None, cfg, 512, "exact-block").accumulate == "rescale"
    assert dg.recipe_for_kernel(DEEPGEMM_SM90_FP8, None, dict(cfg, block_m=64, block_n=128), 512,
                                "exact-block").accumulate == "promote"


def test_capture_stdout_fd_reads_c_level_output():
    import ctypes

    libc = ctypes.CDLL(None)
    _, text = dg.capture_stdout_fd(lambda: libc.printf(b"MegaMoESM90Config(block_m=64, block_n=128)\n"))
    assert dg.parse_config_print(text) == {"block_m": 64, "block_n": 128}


def _report():
    return CheckReport(preset="small", geometry={}, tokens_per_rank=[1], seed=0, block_m=8, ranks=1, recipes=[],
                       expert_rows=[1], pool_rows=[], stage_shapes={})


@pytest.mark.parametrize("status,ok", [("pass", True), ("detected", True), ("FAIL", False),
                                       ("NOT DETECTED", False), ("error", False)])
def test_check_backend_fails_on_a_failed_case(monkeypatch, status, ok):
    from megamoe.check import matrix

    rows = [{"case": "a", "status": "pass"}, {"case": "b", "status": status}]
    monkeypatch.setattr(matrix, "run_matrix", lambda name, out_json=None, **kw: rows)
    rep = _report()
    rep.backends = [("fake", True, "")]
    run_backend(rep, "fake")
    assert rep.ok is ok
    assert rep.backend_results == {"fake": rows}


def test_recipe_for_defaults_and_deepgemm_before_build():
    """Every backend answers recipe_for (the matrix calls it on all of them); before a DeepGEMM build
    has read the plan back it is the base recipe with the requested block-sum model."""
    from megamoe.fused.flashinfer_mxfp4 import FlashInferMXFP4
    from megamoe.recipe import FLASHINFER_MXFP4

    fi = FlashInferMXFP4("small", capacity=8)
    assert fi.recipe_for(8) is FLASHINFER_MXFP4
    assert fi.recipe_for(8, "sm90-fp8-tc") == FLASHINFER_MXFP4.with_(mma="sm90-fp8-tc")
    d = dg.DeepGEMMFP8("small", capacity=8)
    assert d.recipe_for(8, "sm90-fp8-tc") == DEEPGEMM_SM90_FP8.with_(mma="sm90-fp8-tc")
    assert d.plan(8).block_m == 0

"""DeepGEMM SM90 FP4 backend, the parts a CPU can check: the decode window (refusal, measured loss, the
synthetic shift), the plan read back from the heuristic's printout and the JIT source, the source build's
pin check. The kernel itself runs in the gpu-marked tests and lab/deepgemm_fp4/probe.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megamoe.formats import E8M0_BIAS, dequantize_mxfp4, e2m1_decode, e4m3_satfinite, pack_e2m1
from megamoe.fused.deepgemm_build import JIT_CACHE_OWNER, PATCH_DIR, PIN, SourceError, apply_patches, own_jit_cache, verify_source
from megamoe.fused.deepgemm_fp4 import KERNEL_NAME, TEMPLATE_PARAMS, parse_fp4_config_key
from megamoe.fused.deepgemm_fp8 import parse_config_print, parse_template_args
from megamoe.geometry import Geometry, get_geometry
from megamoe.layouts.fp4_window import check_fp4_window, shift_into_window
from megamoe.layouts.random import random_mxfp4_bytes
from megamoe.recipe import DEEPGEMM_SM90_FP4

R = DEEPGEMM_SM90_FP4


def _one_group_weights(byte: int, codes: list[int]):
    """tiny-shaped weights, all codes 0 except expert 0 l2 row 0 group 0 = ``codes`` under scale ``byte``."""
    g = get_geometry("tiny")
    w = random_mxfp4_bytes(g, seed=3, num_experts=2, scale_bytes=(120, 130))
    w = dataclasses.replace(w, l1=torch.zeros_like(w.l1), l2=torch.zeros_like(w.l2), l2_scale=w.l2_scale.clone())
    row = torch.zeros(g.intermediate, dtype=torch.uint8)
    row[: len(codes)] = torch.tensor(codes, dtype=torch.uint8)
    w.l2[0, 0] = pack_e2m1(row)
    w.l2_scale[0, 0, 0] = byte
    return w


def test_window_ends_follow_the_e4m3_rule():
    """Independent decode: byte b is in the window iff e4m3 RN of c x 2**(b-127) equals it for all 16 codes."""
    codes = e2m1_decode(torch.arange(16, dtype=torch.uint8))
    exact = [b for b in range(255)
             if torch.equal(e4m3_satfinite(codes * 2.0 ** (b - E8M0_BIAS)).float(), codes * 2.0 ** (b - E8M0_BIAS))
             and (codes * 2.0 ** (b - E8M0_BIAS)).abs().max() <= 448]
    assert (exact[0], exact[-1], len(exact)) == (R.min_scale_byte, R.max_scale_byte, 15)


@pytest.mark.parametrize("byte,changed,to_zero", [(118, 2, 1), (114, 7, 7), (119, 0, 0), (133, 0, 0)])
def test_below_window_refused_then_measured(byte, changed, to_zero):
    codes = list(range(8))  # 0, .5, 1, 1.5, 2, 3, 4, 6 (code 0 is zero whatever the scale)
    w = _one_group_weights(byte, codes)
    if not changed:
        assert check_fp4_window(w, R) is None
        return
    with pytest.raises(ValueError, match=rf"expert 0 l2: 1 groups, bytes down to {byte}: {changed} of [\d,]+ weights "
                                         rf"decode differently \({to_zero} to zero.*accept_lossy_scales=True"):
        check_fp4_window(w, R, who="deepgemm-sm90-fp4")
    loss = check_fp4_window(w, R, accept_below=True)
    (t,) = loss["tensors"]
    assert (t["expert"], t["tensor"], t["changed"], t["to_zero"]) == (0, "l2", changed, to_zero)
    # independent: the values the kernel table gives vs exact, for this group alone
    vals = dequantize_mxfp4(w.l2[0, 0, :16], w.l2_scale[0, 0, :1])
    kern = e4m3_satfinite(vals).float()
    assert int((kern != vals).sum()) == changed
    assert t["max_abs_error"] == float((kern - vals).abs().max())


def test_above_window_and_nan_byte_always_refused():
    with pytest.raises(ValueError, match="above byte 133.*wraps"):
        check_fp4_window(_one_group_weights(134, [7]), R, accept_below=True)
    w = _one_group_weights(125, [3])
    w.l1_scale[1, 2, 0] = 0xFF  # on an all-zero group: still NaN
    with pytest.raises(ValueError, match=r"weights.l1_scale holds 1 E8M0 byte\(s\) 0xFF.*first at \[1, 2, 0\]"):
        check_fp4_window(w, R, accept_below=True)


def test_shift_into_window_moves_each_tensor_by_one_power_of_two():
    g = Geometry("k4096", num_experts=2, num_topk=1, hidden=4096, intermediate=256)
    w = random_mxfp4_bytes(g, seed=5, scale_bytes=(108, 118))
    s = shift_into_window(w, R)
    assert check_fp4_window(s, R) is None
    for name in ("l1", "l2"):
        d = getattr(s, f"{name}_scale").to(torch.int16) - getattr(w, f"{name}_scale").to(torch.int16)
        for e in range(2):
            assert d[e].unique().numel() == 1  # one shift per (expert, tensor)
    assert torch.equal(s.l1, w.l1) and torch.equal(s.l2, w.l2)
    with pytest.raises(ValueError, match="span more than"):
        shift_into_window(random_mxfp4_bytes(g, seed=5, scale_bytes=(100, 130)), R)


PRINTOUT = (
    "MegaMoESM90FP4Config(num_ranks=1, num_experts=256, hidden=4096, intermediate_hidden=2048, "
    "num_max_tokens_per_rank=8192, num_tokens=128, num_topk=6, early_b_decode=false, decode_done_mbarrier=true, "
    "swap_ab=true, swap_ab_fast_amax=false): MegaMoESM90Config(block_m=64, block_n=128, block_k=128, "
    "cluster_size=1, num_max_pool_tokens=98304, num_padded_sf_pool_tokens=1572864, swizzle_acts_mode=128, "
    "swizzle_weights_mode=0, num_experts_per_wave=16, num_stages=5, smem_size=220000, num_dispatch_threads=64, "
    "num_non_epilogue_threads=320, num_epilogue_threads=256)\n"
)


def test_plan_printout_and_template_args_parse():
    cfg, key = parse_config_print(PRINTOUT), parse_fp4_config_key(PRINTOUT)
    assert (cfg["block_m"], cfg["block_n"], cfg["num_stages"], cfg["num_epilogue_threads"]) == (64, 128, 5, 256)
    assert (key["swap_ab"], key["decode_done_mbarrier"], key["num_tokens"]) == (True, True, 128)
    args = ["8192", "4096", "2048", "256", "6", "16", "64", "128", "128", "98304", "1572864", "5", "64", "320",
            "256", "132", "1", "10.0f", "true", "true", "false", "0", "2", "false", "true", "false", "false",
            "true", "false"]
    src = f"auto ptr = reinterpret_cast<void*>(&{KERNEL_NAME}<\n        " + ",\n        ".join(args) + "\n    >);"
    got = parse_template_args(src, KERNEL_NAME, TEMPLATE_PARAMS)
    assert len(TEMPLATE_PARAMS) == len(args) == 29
    assert (got["num_max_tokens_per_rank"], got["block_m"], got["swap_ab"], got["ss_nsplit"]) == (8192, 64, True, False)
    assert got["first_decode_assist_warp"] == 2 and got["activation_clamp"] == "10.0f"


def test_build_refuses_a_tree_that_is_not_the_pin(tmp_path):
    with pytest.raises(SourceError, match="lacks csrc/tvm_ffi_api.cpp"):
        verify_source(tmp_path)
    for rel in ("csrc/tvm_ffi_api.cpp", "sgl_deep_gemm/__init__.py", "sgl_deep_gemm/cuda_helpers.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("// not the pinned file\n")
    for rel in ("deep_gemm/include/deep_gemm", "third-party/cutlass/include/cute", "third-party/cutlass/include/cutlass",
                "third-party/fmt/include/fmt"):
        (tmp_path / rel).mkdir(parents=True)
    with pytest.raises(SourceError, match=rf"not DeepGEMM pull request #{PIN.pull} at {PIN.commit}: .*sgl_deep_gemm/__init__.py"):
        verify_source(tmp_path)
    assert PIN.version == "2.6.1+pr323.g8ddf7f9"


def test_patches_only_add_proxy_fences():
    """megamoe's patches to the pull request change memory ordering only: every hunk adds lines, and every
    added line is a comment, a preprocessor line of the fence macros, or a call of one of them."""
    assert PIN.patches and PIN.build_version(True) == PIN.version + f".megamoe{len(PIN.patches)}"
    assert PIN.build_version(False) == PIN.version
    for name in PIN.patches:
        lines = (PATCH_DIR / name).read_text().splitlines()
        body = lines[next(i for i, x in enumerate(lines) if x.startswith("--- a/")):]
        removed = [x for x in body[2:] if x.startswith("-")]
        added = [x[1:].strip() for x in body[2:] if x.startswith("+")]
        assert not removed, removed
        calls = [x for x in added if x.startswith("MEGAMOE_FENCE_PROXY_ASYNC_")]
        assert len(calls) >= 10
        other = [x for x in added if x and x not in calls and not x.startswith(("//", "#"))]
        assert other == [], other


def test_patch_that_does_not_apply_is_refused_by_name(tmp_path):
    target = tmp_path / "include/deep_gemm/impls/sm90_fp8_fp4_mega_moe.cuh"
    target.parent.mkdir(parents=True)
    target.write_text("// some other revision of the kernel\n" * 40)
    with pytest.raises(SourceError, match=PIN.patches[0]):
        apply_patches(tmp_path)


def test_kernel_cache_of_another_build_is_emptied(tmp_path):
    """DeepGEMM keys its cache on the launcher source, not the headers: a patched build must not reuse the
    kernels an unpatched one compiled (or the other way round)."""
    cache = own_jit_cache(tmp_path, "v-raw")
    (cache / "cache").mkdir()
    (cache / "cache" / "kernel.cubin").write_bytes(b"x")
    assert (own_jit_cache(tmp_path, "v-raw") / "cache" / "kernel.cubin").exists()  # same build: kept
    cache = own_jit_cache(tmp_path, "v-patched")
    assert not (cache / "cache").exists() and (cache / JIT_CACHE_OWNER).read_text().strip() == "v-patched"
    (cache / JIT_CACHE_OWNER).unlink()
    (cache / "stray.cubin").write_bytes(b"x")
    assert not (own_jit_cache(tmp_path, "v-patched") / "stray.cubin").exists()  # no owner recorded: emptied


def test_decode_probe_layer_reads_the_decode_table_through_the_reference():
    """The LUT probe's crafted layer, run through the eager reference of the kernel's recipe, must give back
    e4m3 RN(code x 2**(byte-127)) for every pair (byte 255, NaN in E8M0, is left out: the reference refuses it)."""
    from megamoe.layouts.fp4_window import decode_probe_layer
    from megamoe.reference import moe_forward

    g = get_geometry("small")
    w, inp, pairs = decode_probe_layer(g)
    res = moe_forward(inp, w, R, g, keep_stages=True)
    st = res.ranks[0]
    a = (st.l2_in.float() * st.l2_in_sf.repeat_interleave(R.l2_group, dim=1)).unique()
    assert a.numel() == 1 and float(a) > 0
    table = (res.y[0].float() / a).reshape(-1)[pairs.reshape(-1).argsort()].view(256, 16)
    codes = e2m1_decode(torch.arange(16, dtype=torch.uint8))
    want = e4m3_satfinite(codes[None] * torch.exp2(torch.arange(256.0)[:, None] - E8M0_BIAS)).float()
    assert torch.equal(table[:255], want[:255])


def test_fp8_backends_refuse_the_source_build(monkeypatch, tmp_path):
    """Only one deep_gemm per process: a result of the FP8 backends must never come from the PR #323 build."""
    import json
    import sys
    import types

    from megamoe.fused.deepgemm_fp8 import source_build_reason

    pkg = tmp_path / "deep_gemm"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "BUILD.json").write_text(json.dumps({"source": "DeepGEMM PR #323 at 8ddf7f9"}))
    fake = types.ModuleType("deep_gemm")
    fake.__file__ = str(pkg / "__init__.py")
    fake.__version__ = PIN.version
    monkeypatch.setitem(sys.modules, "deep_gemm", fake)
    assert "deepgemm-sm90-fp8 is verified on sgl-deep-gemm 0.1.5.post1" in source_build_reason("deepgemm-sm90-fp8")
    assert "DeepGEMM PR #323 at 8ddf7f9" in source_build_reason("deepgemm-sm90-fp8")
    (pkg / "BUILD.json").unlink()
    assert source_build_reason("deepgemm-sm90-fp8") == ""


def test_decode_options_the_printout_does_not_name_are_kept_only_where_every_cached_match_agrees(tmp_path):
    """DeepSeek-V4-Flash T = 8 and T = 16 print the same configuration and options; their kernels differ
    in wide_load_decode and l2_arrival_counter only. With both cached, neither may be reported as T = 16's."""
    from megamoe.fused.deepgemm_fp4 import PRINTED_OPTIONS, agreed_template_args
    from megamoe.fused.deepgemm_fp8 import find_all_kernel_args

    base = dict(zip(TEMPLATE_PARAMS, ["8448", "4096", "2048", "256", "6", "16", "64", "128", "128", "99840",
                                      "1597440", "5", "64", "320", "256", "132", "1", "10.0f", "true", "false",
                                      "false", "0", "2", "false", "true", "false", "false", "true", "false"]))
    kernels = {"t8": base, "t16": {**base, "wide_load_decode": "true", "l2_arrival_counter": "true"},
               "early_b": {**base, "early_b_decode": "true"}}  # another printed option: never a match here
    for name, args in kernels.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "kernel.cu").write_text(
            f"auto ptr = reinterpret_cast<void*>(&{KERNEL_NAME}<\n    " + ",\n    ".join(args[k] for k in TEMPLATE_PARAMS)
            + "\n>);")
    cfg = parse_config_print(PRINTOUT.replace("98304", "99840").replace("1572864", "1597440"))
    key = parse_fp4_config_key(PRINTOUT)
    printed = {k: key[k] for k in PRINTED_OPTIONS}
    found = find_all_kernel_args(cfg, str(tmp_path), KERNEL_NAME, TEMPLATE_PARAMS,
                                 {"num_max_tokens_per_rank": 8448, **printed})
    assert len(found) == 2  # t8 and t16; the early-B kernel differs in a printed option
    agreed = agreed_template_args(found)
    assert agreed["ambiguous"] == ["l2_arrival_counter", "wide_load_decode"]
    assert "wide_load_decode" not in agreed and agreed["first_decode_assist_warp"] == 2 and agreed["swap_ab"] is True
    (tmp_path / "t16" / "kernel.cu").unlink()
    alone = agreed_template_args(find_all_kernel_args(cfg, str(tmp_path), KERNEL_NAME, TEMPLATE_PARAMS,
                                                      {"num_max_tokens_per_rank": 8448, **printed}))
    assert "ambiguous" not in alone and alone["wide_load_decode"] is False
    assert agreed_template_args([]) is None


def test_unpatched_build_is_reported_not_silently_used():
    from megamoe.fused.deepgemm_fp4 import missing_patches_warning

    patched = {"version": PIN.build_version(True), "patches": [{"name": n, "sha256": "x"} for n in PIN.patches]}
    assert missing_patches_warning(patched) == ""
    raw = {"version": PIN.version, "patches": []}
    assert PIN.patches[0] in missing_patches_warning(raw) and "lacks" in missing_patches_warning(raw)
    assert "not a megamoe build" in missing_patches_warning(None)

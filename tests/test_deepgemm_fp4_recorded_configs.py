"""``deepgemm_sm90_fp4_config`` against every configuration the DeepGEMM SM90 FP4 kernel reported on an H200.

The expected values are the committed results of ``bench/device/deepgemm_fp4.sh`` (DeepGEMM PR #323 at 8ddf7f9,
``bench/results/2026-12-03_nvidia-h200_deepgemm-fp4``): what the kernel's heuristic printed per launch
(``DG_PRINT_CONFIGS``), the decode options read from its JIT sources, and the number of kernels its prebuild
compiled. Nothing here comes from the model under test. CPU only.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import pytest

from megamoe.fused.fp4_records import JIT_SOURCE_FLAGS, prebuild_cubins, recorded_fp4_configs
from megamoe.layouts.deepgemm_configs import buffer_tokens_per_rank, deepgemm_sm90_fp4_config

FOLDER = Path(__file__).resolve().parent.parent / "bench" / "results" / "2026-12-03_nvidia-h200_deepgemm-fp4"
RECORDS = recorded_fp4_configs(FOLDER)
FULL = [r for r in RECORDS if r.full]
# Every template argument of sm90_fp8_fp4_mega_moe_impl that depends on the launch (impls/sm90_fp8_fp4_mega_moe.hpp).
KERNEL_ARGS = ("num_max_tokens_per_rank", "num_experts_per_wave", "block_m", "block_n", "block_k",
               "num_max_pool_tokens", "num_padded_sf_pool_tokens", "num_stages", "num_dispatch_threads",
               "num_non_epilogue_threads", "num_epilogue_threads", "wide_load_decode",
               "math_wg_participates_in_decode", "num_math_wg_decode_warps", "first_decode_assist_warp",
               "early_b_decode", "decode_done_mbarrier", "l2_arrival_counter", "ss_nsplit", "swap_ab",
               "swap_ab_fast_amax")


def model(r):
    return deepgemm_sm90_fp4_config(r.geometry, r.tokens, num_max_tokens_per_rank=buffer_tokens_per_rank(r.capacity),
                                    swap_ab_enabled=r.swap_ab_enabled)


def printed_fields(r) -> dict:
    """The fields of a record that the launch itself printed (every one but the JIT-source flags)."""
    return {k: v for k, v in r.fields.items() if k not in JIT_SOURCE_FLAGS}


def test_the_results_hold_both_geometries_and_every_capacity():
    seen = {(r.geometry, r.capacity) for r in RECORDS}
    assert {("small", 512), ("small", 64), ("small", 8), ("dsv4-flash", 8192), ("dsv4-flash", 128)} <= seen
    assert len(RECORDS) >= 120 and len(FULL) >= 40
    assert {r.tokens for r in FULL} >= {1, 16, 64, 96, 128, 1024, 2048, 4096, 8192}


@pytest.mark.parametrize("r", RECORDS, ids=lambda r: f"{r.geometry}-cap{r.capacity}-T{r.tokens}"
                         f"{'' if r.swap_ab_enabled else '-noswap'}-{'full' if r.full else 'summary'}")
def test_every_printed_field_is_what_the_h200_printed(r):
    """Block shape, stages, shared memory, threads, experts per wave, pool sizes, swap-AB and the printed
    decode flags (early-B decode, decode-done barrier, fast amax), exactly, for every recorded launch."""
    mine = model(r)
    expected = printed_fields(r)
    assert {k: mine[k] for k in expected} == expected, r.source


def test_decode_flags_from_the_jit_sources():
    """The JIT-source flags of a record are its own kernel's only where no other recorded launch of its
    capacity shares the fields the backend matched the cached kernel by; there they must be exact.
    Elsewhere the backend may have read a sibling's kernel: the recorded flags must then be the model's
    flags of one of the siblings (and are, for T = 16, 64 and 1024 at DeepSeek-V4-Flash)."""
    family = defaultdict(set)
    for r in FULL:
        family[r.kernel_family()].add(r.tokens)
    exact = sibling = 0
    for r in FULL:
        names = [k for k in JIT_SOURCE_FLAGS if k in r.fields]
        got = {k: r.fields[k] for k in names}
        mine = {k: model(r)[k] for k in names}
        if len(family[r.kernel_family()]) == 1:
            assert mine == got, r.source + f" T={r.tokens}"
        if mine == got:
            exact += 1
            continue
        siblings = sorted(family[r.kernel_family()] - {r.tokens})
        options = [{k: deepgemm_sm90_fp4_config(r.geometry, t, num_max_tokens_per_rank=buffer_tokens_per_rank(
            r.capacity))[k] for k in names} for t in siblings]
        assert got in options, f"{r.source} T={r.tokens}: recorded {got}, model {mine}, siblings {siblings}"
        sibling += 1
    assert exact + sibling == len(FULL) and exact >= 36


def test_the_prebuild_compiled_as_many_kernels_as_the_model_has_distinct_launches():
    """The prebuild left N cubins in a fresh JIT cache (one per distinct template-argument set; megamoe
    launches no other DeepGEMM JIT kernel). The model must give exactly N distinct argument sets for the
    prebuild's launches: the decode flags are part of that count (without them the launches fall into
    fewer kernels), so this checks them where the plan records cannot."""
    launches = [r for r in RECORDS if r.source.startswith("build-log.txt")]
    kernels, shapes = set(), set()
    for r in launches:
        c = {**model(r), "num_max_tokens_per_rank": buffer_tokens_per_rank(r.capacity)}
        kernels.add((r.geometry,) + tuple(c[k] for k in KERNEL_ARGS))
        shapes.add((r.geometry,) + tuple(c[k] for k in KERNEL_ARGS[:11]))
    assert len(kernels) == prebuild_cubins(FOLDER)
    assert len(shapes) < len(kernels)


def test_buffer_alignment_and_bad_capacity():
    assert [buffer_tokens_per_rank(c) for c in (1, 8, 128, 384, 385, 512, 8192)] == [384, 384, 384, 384, 768, 768, 8448]
    with pytest.raises(ValueError, match="capacity must be a positive token count, got 0"):
        buffer_tokens_per_rank(0)

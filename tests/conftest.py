"""Shared fixtures and the ``gpu`` marker's auto-skip.

Tests marked ``@pytest.mark.gpu`` run only where torch sees a CUDA device of compute capability 9.x
(Hopper, the only target of the SM90 kernels); everywhere else they are skipped with the reason.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from megamoe.fused.registry import BACKENDS, BUILTIN, register_backend
from megamoe.geometry import get_geometry
from megamoe.testing import weights_for_recipe
from megamoe.weights import random_mxfp4_weights


@functools.lru_cache(maxsize=1)
def _gpu_skip_reason() -> str:
    """'' when an SM90 GPU is usable, else why not (the library's own check)."""
    from megamoe.fused.base import cuda_hopper_reason

    reason = cuda_hopper_reason()
    return f"needs an SM90 (Hopper) GPU: {reason}" if reason else ""


# The quick loop, `python3 -m pytest -q -m "not slow"`, leaves out the tests marked slow in their files and these,
# each several seconds on 2 cores (pytest --durations): notebooks, end-to-end sweeps and checks, subprocess and
# multi-process runs, builds. `python3 -m pytest -q` (what CI runs) runs every one of them.
QUICK_LOOP_LEAVES_OUT = (
    "tests/test_notebooks.py::test_notebook_executes_and_renders",
    "tests/test_docs.py::test_quickstart_python_runs_on_a_cpu",
    "tests/test_bench_sweep.py::test_run_sweep_sh_dry_run_on_a_cpu",
    "tests/test_bench_sweep.py::test_two_processes_on_one_card_make_one_document",
    "tests/test_bench_sweep.py::test_the_sweep_end_to_end_on_a_cpu",
    "tests/test_bench_sweep.py::test_the_sweep_plot_uses_the_palette",
    "tests/test_bench_timing.py::test_pytest_benchmark_records_and_compares_the_device_time",
    "tests/test_bench_timing.py::test_the_triton_read_kernel_reads_every_word_once",
    "tests/test_external_backend.py::test_callable_wrapping_the_reference_passes_bit_for_bit",
    "tests/test_external_backend.py::test_a_subclass_registered_as_a_decorator_runs_through_the_matrix",
    "tests/test_external_backend.py::test_a_broken_kernel_fails_the_same_cases",
    "tests/test_staged_peer.py::test_staged_forward_equals_old_glue_and_reference_bitwise",
    "tests/test_cuda_step1.py::test_source_builds_and_agrees_with_the_python_constants",
    "tests/test_decode.py::test_prepare_roundtrips_the_checkpoint",
    "tests/test_ep_sim.py::test_ep_bit_identical_to_one_rank[small-R4",
    "tests/test_layouts_checkpoint.py::test_matrix_checkpoint_weights_round_trip_before_the_backend_rebases_them",
    "tests/test_packaging.py::test_sdist_",
    "tests/test_reference.py::test_kernel_recipe_bit_identical_to_oracle[flashinfer-mxfp4-dsv4flash",
    "tests/test_reference.py::test_exact_recipe_vs_dense_oracle[dsv4flash",
    "tests/test_distributed_ranks.py::test_torchrun_",
    "tests/test_distributed_ranks.py::test_hanging_rank_bounded_by_timeout",
    "tests/test_distributed_ranks.py::test_geometry_mismatch_reported_on_every_rank",
    "tests/test_distributed_ranks.py::test_failing_rank_reported_on_every_rank",
    "tests/test_step1_ab.py::test_the_summary_prints_from_the_command_line",
    "tests/test_cli.py::test_check_tokens_per_rank_over_simulated_ranks",
    "tests/test_cli.py::test_bench_defaults_on_a_cpu_write_a_new_folder_each_run",
    "tests/test_cli.py::test_ctrl_c_exits_130_without_a_traceback",
    "tests/test_cli.py::test_check_dist_",
    "tests/test_cli.py::test_bench_on_a_cpu_says_why_its_studies_are_empty",
    "tests/test_cli.py::test_check_tables_show_full_names_and_numbers_at_any_width",
    "bench/test_bench_reference.py::test_bench_reference_forward",
)


@pytest.hookimpl(tryfirst=True)  # before -m selects: a test marked here is left out of -m "not slow"
def pytest_collection_modifyitems(config, items):
    for item in items:  # node ids are relative to the repository root (pyproject.toml's folder)
        if item.nodeid.startswith(QUICK_LOOP_LEAVES_OUT):
            item.add_marker(pytest.mark.slow)
    reason = _gpu_skip_reason()
    if not reason:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Weights are read-only in every test: build each (preset, seed) once per session.
@functools.lru_cache(maxsize=None)
def cached_weights(preset: str, seed: int = 0, num_experts: int | None = None, recipe: str | None = None):
    """(Geometry, weights) of a preset; with ``recipe``, the weights as that kernel takes them
    (FP8 block weights, or scale bytes rebased into its window: ``testing.weights_for_recipe``)."""
    if recipe is not None:
        g, w = cached_weights(preset, seed, num_experts)
        return g, weights_for_recipe(w, recipe)
    g = get_geometry(preset)
    if num_experts is not None:
        g = g.with_(num_experts=num_experts, num_topk=min(g.num_topk, num_experts))
    return g, random_mxfp4_weights(g, seed=seed)


@pytest.fixture(scope="session")
def tiny():
    """(Geometry, MXFP4Weights) of the ``tiny`` preset: E=8, K=2, H=256, I=128."""
    return cached_weights("tiny", 0)


@pytest.fixture(scope="session")
def small():
    """(Geometry, MXFP4Weights) of the ``small`` preset: E=16, K=4, H=512, I=256."""
    return cached_weights("small", 0)


@pytest.fixture(scope="session")
def weights_for():
    """cached_weights as a fixture: weights_for(preset, seed=0, num_experts=None, recipe=None) -> (g, weights)."""
    return cached_weights


@pytest.fixture
def registered():
    """Register classes for one test; every one is removed afterwards, whatever happened."""
    names = []

    def add(cls, **kw):
        register_backend(cls, **kw)
        names.append(cls.name)
        return cls

    yield add
    for n in names:
        BACKENDS.pop(n, None)
    assert set(BACKENDS) == BUILTIN


@pytest.fixture
def gen():
    """A fresh seeded CPU generator per test."""
    return torch.Generator().manual_seed(1234)


# The Triton-interpreter self-checks behind these tests' fixtures take minutes of one core each: started when
# collection ends (only for the tests selected, e.g. not under -m "not slow"), they run beside the rest of the suite
# on the second core, and the fixtures collect them (decode_selfcheck.interpreter_rows).
INTERPRETER_SELF_CHECKS = {"tests/test_decode.py::test_triton_interpreter": "decode_selfcheck.py",
                           "tests/test_decode_tc.py::test_triton_interpreter": "decode_tc_selfcheck.py"}


def pytest_collection_finish(session):
    if session.config.option.collectonly or importlib.util.find_spec("triton") is None:
        return
    from decode_selfcheck import start_interpreter_rows

    root = Path(__file__).resolve().parents[1]
    for item in session.items:
        rel = f"{Path(item.fspath).resolve().relative_to(root).as_posix()}::{item.originalname or item.name}"
        for prefix, script in INTERPRETER_SELF_CHECKS.items():
            if rel.startswith(prefix):
                start_interpreter_rows(Path(__file__).with_name(script))


def pytest_sessionfinish(session):
    if "decode_selfcheck" in sys.modules:
        sys.modules["decode_selfcheck"].stop_interpreter_rows()

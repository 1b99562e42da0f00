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

from megamoe.geometry import get_geometry
from megamoe.testing import weights_for_recipe
from megamoe.weights import random_mxfp4_weights


@functools.lru_cache(maxsize=1)
def _gpu_skip_reason() -> str:
    """'' when an SM90 GPU is usable, else why not (the library's own check)."""
    from megamoe.fused.base import cuda_hopper_reason

    reason = cuda_hopper_reason()
    return f"needs an SM90 (Hopper) GPU: {reason}" if reason else ""


def pytest_collection_modifyitems(config, items):
    reason = _gpu_skip_reason()
    if not reason:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def device_script():
    """load(name): bench/device/<name>.py as a module, for CPU tests of what a device script computes (the scripts
    themselves run on the H200). Their folder goes on sys.path: they import each other by name."""
    folder = Path(__file__).resolve().parents[1] / "bench" / "device"
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

    @functools.lru_cache(maxsize=None)
    def load(name: str):
        spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod

    return load


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
def gen():
    """A fresh seeded CPU generator per test."""
    return torch.Generator().manual_seed(1234)


# The Triton-interpreter self-checks behind these tests' fixtures take minutes of one core each: started when
# collection ends (only for the tests selected, e.g. not under -m "not slow"), they run beside the rest of the suite
# on the second core, and the fixtures collect them (megamoe.testing.interpreter_rows).
INTERPRETER_SELF_CHECKS = {"tests/test_decode.py::test_triton_interpreter": "megamoe.decode.selfcheck",
                           "tests/test_decode_tc.py::test_triton_interpreter": "megamoe.decode.selfcheck_tc"}


def pytest_collection_finish(session):
    if session.config.option.collectonly or importlib.util.find_spec("triton") is None:
        return
    from megamoe.testing import start_interpreter_rows

    root = Path(__file__).resolve().parents[1]
    for item in session.items:
        rel = f"{Path(item.fspath).resolve().relative_to(root).as_posix()}::{item.originalname or item.name}"
        for prefix, module in INTERPRETER_SELF_CHECKS.items():
            if rel.startswith(prefix):
                start_interpreter_rows(module)


def pytest_sessionfinish(session):
    if "megamoe.testing" in sys.modules:
        sys.modules["megamoe.testing"].stop_interpreter_rows()

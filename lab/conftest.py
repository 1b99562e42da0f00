"""The ``gpu`` marker's auto-skip for the studies' tests, as tests/conftest.py has it for the library's: a test marked
``@pytest.mark.gpu`` runs only where torch sees an SM90 (Hopper) GPU, and is skipped with the reason elsewhere."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config, items):
    from megamoe.fused.base import cuda_hopper_reason

    reason = cuda_hopper_reason()
    if reason:
        for item in items:
            if "gpu" in item.keywords and item.path.is_relative_to(config.rootpath / "lab"):
                item.add_marker(pytest.mark.skip(reason=f"needs an SM90 (Hopper) GPU: {reason}"))

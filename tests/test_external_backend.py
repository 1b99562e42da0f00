"""A kernel from outside the package, checked through the same matrix as the built-in ones, on the CPU.

A toy backend wrapping the reference must pass every case bit for bit; a toy with one deliberate bug
(a dropped top-k slot, a 1% output scale) must fail the same cases. Registration refuses what it cannot
run, before anything runs.
"""

from __future__ import annotations

import pytest
import torch

from megamoe import get_geometry
from megamoe.fused.base import FusedBackend, Plan
from megamoe.fused.external import backend_from_callable
from megamoe.check.matrix import Case, run_matrix
from megamoe.fused.registry import BACKENDS, get_backend_class, register_backend, unregister_backend
from megamoe.reference import moe_forward
from megamoe.inputs import MoEInputs

from toy_backend import ToyBackend

RECIPE = "flashinfer-mxfp4"
CASES = [Case("tiny", 7, seed=1), Case("tiny", 40, routing="masked", seed=2),
         Case("tiny", 16, routing="allmasked", seed=3), Case("tiny", 5, ragged=(5, 12), seed=4),
         Case("small", 9, routing="skewed", seed=5)]


def reference_kernel(inputs: MoEInputs, weights) -> torch.Tensor:
    g = get_geometry("tiny") if inputs.x.shape[1] == get_geometry("tiny").hidden else get_geometry("small")
    return moe_forward(inputs, weights, RECIPE, g)


def drops_last_slot(inputs: MoEInputs, weights) -> torch.Tensor:
    idx = inputs.topk_idx.clone()
    idx[:, -1] = -1
    return reference_kernel(MoEInputs(inputs.x, idx, inputs.topk_weights), weights)


def scaled_output(inputs: MoEInputs, weights) -> torch.Tensor:
    return (reference_kernel(inputs, weights).float() * 1.01).to(torch.bfloat16)


def _quiet(*_a, **_k):
    pass


def test_callable_wrapping_the_reference_passes_bit_for_bit(registered):
    registered(backend_from_callable("toy-reference", reference_kernel, recipe=RECIPE, device="cpu"))
    rows = run_matrix("toy-reference", CASES, log=_quiet)
    assert [r["status"] for r in rows] == ["pass"] * len(CASES), [(r["case"], r.get("error")) for r in rows]
    for r in rows:
        assert r["calc_diff"] == 0.0 and r["bitwise_frac"] == 1.0 and r["nan"] == 0, r
        assert r["reference_recipe"]["name"] == RECIPE
    assert rows[2]["masked_rows_zero"] is True


@pytest.mark.parametrize("bug", [drops_last_slot, scaled_output], ids=lambda f: f.__name__)
def test_a_broken_kernel_fails_the_same_cases(registered, bug):
    registered(backend_from_callable(f"toy-{bug.__name__}", bug, recipe=RECIPE, device="cpu"))
    rows = run_matrix(f"toy-{bug.__name__}", CASES[:2], log=_quiet)
    assert [r["status"] for r in rows] == ["FAIL", "FAIL"], rows
    assert all(r["calc_diff"] > 1e-5 for r in rows)


def test_a_subclass_registered_as_a_decorator_runs_through_the_matrix(registered):
    """The class route: a FusedBackend subclass with its own plan and launch, defined in the test (the rest, staging
    included, from the CPU toy in tests/toy_backend.py)."""

    class HalfBlockToy(ToyBackend):
        name = "toy-subclass"

        def plan(self, num_tokens, block_m=None):
            return Plan(block_m=block_m or 8, forced=block_m is not None)

        def launch(self, num_tokens, block_m=None):
            self.launched.append(block_m)
            return super().launch(num_tokens, block_m)  # the reference: the same bits at any BLOCK_M

    assert registered(HalfBlockToy) is HalfBlockToy
    assert get_backend_class("toy-subclass") is HalfBlockToy
    HalfBlockToy.launched = []
    rows = run_matrix("toy-subclass", [Case("tiny", 11, seed=6), Case("tiny", 11, block_m=16, seed=6)], log=_quiet,
                      repeats=1)
    assert [r["status"] for r in rows] == ["pass", "pass"], rows
    assert rows[1]["plan"] == "BLOCK_M 16 (forced)"
    assert HalfBlockToy.launched == [None, None, 16, 16]  # each case's launch and relaunch ran its own BLOCK_M


def test_registration_refuses_what_it_cannot_run(registered):
    ok = backend_from_callable("toy-ok", reference_kernel, device="cpu")
    with pytest.raises(TypeError, match="subclass of megamoe.fused.base.FusedBackend"):
        register_backend(reference_kernel)
    with pytest.raises(ValueError, match="name must be a non-empty str"):
        register_backend(type("Nameless", (ok,), {"name": ""}))
    with pytest.raises(TypeError, match="must define availability"):
        register_backend(type("NoProbe", (FusedBackend,), {"name": "toy-no-probe"}))
    with pytest.raises(ValueError, match="'flashinfer-mxfp4' is a built-in backend"):
        register_backend(type("Shadow", (ok,), {"name": "flashinfer-mxfp4"}))
    registered(ok)
    twin = type("Twin", (ok,), {"name": "toy-ok"})
    with pytest.raises(ValueError, match="already registered"):
        register_backend(twin)
    register_backend(twin, replace=True)
    assert get_backend_class("toy-ok") is twin
    with pytest.raises(ValueError, match="built in and cannot be removed"):
        unregister_backend("deepgemm-sm90-fp8")
    unregister_backend("toy-ok")
    with pytest.raises(ValueError, match="unknown backend 'toy-ok'"):
        unregister_backend("toy-ok")


def test_backends_all_leaves_out_only_the_backends_that_say_so(registered):
    """``--backends all`` (``registry.all_backend_names``): every built-in backend but the exact CUDA-core decode
    kernel (its tensor-core sibling, a subclass, stays in), in registry order; a registered backend counts unless
    its class sets ``in_all = False``; ``in_all`` must be a bool."""
    from megamoe.fused.registry import all_backend_names

    assert all_backend_names() == [n for n in BACKENDS if n != "megamoe-decode"]
    assert "megamoe-decode-tc" in all_backend_names() and "megamoe-decode" in BACKENDS
    toy = registered(backend_from_callable("toy-in", reference_kernel, device="cpu"))
    registered(type("ToyOut", (toy,), {"name": "toy-out", "in_all": False}))
    assert all_backend_names()[-1] == "toy-in" and "toy-out" not in all_backend_names()
    with pytest.raises(TypeError, match=r"register_backend: ToyOne.in_all must be a bool, got int 1"):
        register_backend(type("ToyOne", (toy,), {"name": "toy-one", "in_all": 1}))


def test_callable_with_the_wrong_output_is_named(registered):
    registered(backend_from_callable("toy-fp32", lambda inp, w: reference_kernel(inp, w).float(), device="cpu"))
    rows = run_matrix("toy-fp32", [Case("tiny", 3)], log=_quiet)
    assert rows[0]["status"] == "error"
    assert "toy-fp32: the callable must return y [3, 256] bfloat16, got (3, 256) torch.float32" in rows[0]["error"]
    with pytest.raises(TypeError, match="fn must be callable"):
        backend_from_callable("toy-none", None)


def test_a_cuda_callable_on_a_cpu_machine_says_why(registered):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the unavailable path is not reachable")
    registered(backend_from_callable("toy-cuda", reference_kernel, device="cuda"))
    rows = run_matrix("toy-cuda", [Case("tiny", 3)], log=_quiet)
    assert rows == [{"backend": "toy-cuda", "case": "all", "status": "unavailable",
                     "reason": "no GPU: torch.cuda.is_available() is False (the callable was registered for cuda)"}]

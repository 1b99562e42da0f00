"""Your own kernel as a backend: a plain callable becomes a ``FusedBackend`` class, so that the
differential matrix checks it and the benchmark sweep times it like the built-in kernels.

    def my_moe(inputs: MoEInputs, weights: MXFP4Weights) -> torch.Tensor:   # y [T, H] bfloat16
        ...                                                                  # inputs.x [T, H] bf16,
                                                                             # topk_idx / _weights [T, K]
    MyKernel = backend_from_callable("my-kernel", my_moe, recipe="flashinfer-mxfp4", device="cuda")
    register_backend(MyKernel)                        # megamoe.fused.registry
    rows = run_matrix("my-kernel", [Case("small", 64), Case("dsv4-flash", 128, routing="masked")])

The callable receives the weights exactly as the reference does (checkpoint form, all experts of the
one rank), and ``recipe`` names the reference it is held to (where it rounds: ``megamoe.recipe``).
A callable runs in one process: its group is ``OneRank`` (rank 0 of 1), so no torch.distributed
group is created for it. A kernel with its own symmetric buffer, plan and staging subclasses
``FusedBackend`` directly (see ``megamoe.fused.base`` for the hooks) and is registered the same way.
"""

from __future__ import annotations

import re
from typing import Callable

import torch

from ..recipe import Recipe, get_recipe
from ..inputs import MoEInputs
from .base import FusedBackend, Plan


class OneRank:
    """The process group of a single-process backend: rank 0 of 1 (the two calls FusedBackend makes)."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


class FunctionBackend(FusedBackend):
    """Base of the classes ``backend_from_callable`` makes; ``fn`` and ``run_on`` are set there."""

    fn: Callable[[MoEInputs, object], torch.Tensor]
    run_on: torch.device = torch.device("cuda")
    persistent = False

    def __init__(self, geometry, *, group=None, **kwargs) -> None:
        super().__init__(geometry, group=group if group is not None else OneRank(), **kwargs)

    @classmethod
    def availability(cls) -> tuple[bool, str]:
        if cls.run_on.type == "cuda" and not torch.cuda.is_available():
            return False, "no GPU: torch.cuda.is_available() is False (the callable was registered for cuda)"
        return True, ""

    @property
    def device(self) -> torch.device:
        if self.run_on.type == "cuda" and self.run_on.index is None:
            return torch.device("cuda", torch.cuda.current_device())
        return self.run_on

    fixed_tile = "a callable backend has no BLOCK_M to choose"

    def legal_block_ms(self, num_tokens: int | None = None) -> tuple[int, ...]:
        return ()  # fixed_tile

    def plan(self, num_tokens: int) -> Plan:
        return Plan(block_m=0, detail={"source": f"callable {self.kernel}"})

    def _prepare(self, weights) -> None:
        self.kernel_weights = weights  # what the reference of the matrix uses too

    def _allocate(self) -> None:
        pass

    def _stage(self, inputs: MoEInputs, m: int) -> None:
        self._inputs = inputs

    def launch(self, num_tokens: int) -> torch.Tensor:
        inputs = self._inputs
        y = type(self).fn(inputs, self.kernel_weights)
        want = (inputs.num_tokens, self.g.hidden)
        if not isinstance(y, torch.Tensor) or tuple(y.shape) != want or y.dtype != torch.bfloat16:
            got = f"{tuple(y.shape)} {y.dtype}" if isinstance(y, torch.Tensor) else type(y).__name__
            raise ValueError(f"{self.name}: the callable must return y {list(want)} bfloat16, got {got}")
        return y


def backend_from_callable(name: str, fn: Callable[[MoEInputs, object], torch.Tensor], *,
                          recipe: str | Recipe = "flashinfer-mxfp4", device: str | torch.device = "cuda",
                          allows_zero_tokens: bool = False) -> type[FunctionBackend]:
    """A ``FusedBackend`` class named ``name`` that runs ``fn(inputs, weights) -> y [T, H] bf16`` on
    ``device`` and is checked against the reference with ``recipe``. Register it with
    ``megamoe.fused.registry.register_backend``. ``allows_zero_tokens``: whether ``fn`` takes T = 0."""
    if not callable(fn):
        raise TypeError(f"backend_from_callable: fn must be callable, got {type(fn).__name__}")
    rec = recipe if isinstance(recipe, Recipe) else get_recipe(recipe)
    label = getattr(fn, "__qualname__", type(fn).__name__)
    attrs = {"name": name, "fn": staticmethod(fn), "recipe": rec, "run_on": torch.device(device),
             "kernel": f"{getattr(fn, '__module__', '?')}.{label}", "allows_zero_tokens": bool(allows_zero_tokens)}
    cls_name = re.sub(r"\W", "_", name.title()) or "Callable"
    return type(cls_name, (FunctionBackend,), attrs)

"""The one place the harness meets what it times. ``BenchBackend`` is what the sweep drives; two kinds:

    CallableBackend   any ``fn(inputs: MoEInputs) -> y [T, H]``: the eager reference, plain torch ops, a kernel
                      of your own; the harness rotates among input sets when timing it
    FusedBench        a ``megamoe.fused`` backend class (``FusedBackend``), driven through its one spelling:
                      ``cls(g, capacity=...)``, ``prepare(cls.synthetic_weights(w))``, ``allocate()``,
                      ``build_jobs``, ``stage`` (untimed) and ``launch`` (timed), ``plan``, each given its
                      ``block_m`` as an argument (``with_block_m``: a view at a forced BLOCK_M).
                      The staged buffer cannot be rotated, so the L2 is flushed between calls instead.

Two properties steer how a backend is timed (``select_timing``):

    graph_capturable  the class promises that ``launch`` may be captured in a CUDA graph after build: timed by
                      graph replays, staging done once before capture
    host_bound        the timed call syncs the host (the eager reference; an unfused peer that is not
                      capturable): its figure is host time, reported as mean +- standard error under a fixed
                      budget, one pass, never retaken
"""

from __future__ import annotations

import traceback
from typing import Any, Callable, Sequence

import torch

from ..geometry import Geometry
from ..inputs import MoEInputs


class BenchBackend:
    """Protocol: one timed thing at one geometry."""

    name: str = "?"
    weight_format: str = "mxfp4"  # picks the bytes per weight of the roofline floor
    fused: bool = False
    rotatable: bool = True  # whether timing may cycle among several input sets
    graph_capturable: bool = False
    host_bound: bool = False
    max_tokens: int = 1 << 62  # the most tokens per rank it runs (megamoe-decode: 64); larger counts are skipped
    build_lane: str | None = None  # megamoe.fused.build: None builds in parallel threads

    def prepare(self, weights) -> None:
        """Convert / upload weights (not timed)."""

    def build_jobs(self, token_counts, block_m: int | None = None) -> dict:
        """{plan key: zero-argument build} for every plan the token counts need (at a forced BLOCK_M)."""
        return {}

    def run(self, inputs: MoEInputs) -> torch.Tensor:
        """Stage + launch + read back y [T, H] (for correctness)."""
        raise NotImplementedError

    def reference(self, inputs: MoEInputs, weights) -> torch.Tensor | None:
        """The output this backend must match (its recipe's eager reference), or None."""
        return None

    def reference_key(self, num_tokens: int):
        """Backends with equal keys share one reference output per input (cached by the sweep)."""
        return self.name

    def timer(self, input_sets: Sequence[MoEInputs]) -> tuple[Callable, list | None]:
        """(fn, args) for ``time_fn``: the timed region only. Staging happens here, untimed."""
        raise NotImplementedError

    def stage_parts(self, inputs: MoEInputs) -> dict[str, Callable[[], Any]]:
        """{label: callable} that stage ``inputs`` (the staging study), or {}."""
        return {}

    def plan(self, num_tokens: int) -> dict:
        return {}

    def legal_block_ms(self) -> tuple[int, ...]:
        return ()

    def with_block_m(self, block_m: int) -> "BenchBackend":
        raise NotImplementedError(f"{self.name}: forcing BLOCK_M is not supported")

    def provenance(self) -> dict | None:
        return None

    def close(self) -> None:
        pass


class CallableBackend(BenchBackend):
    """Times ``fn(inputs)``; ``reference_fn(inputs, weights)`` gives the output to check against."""

    def __init__(self, name: str, fn: Callable[[MoEInputs], torch.Tensor], *, weight_format: str = "mxfp4",
                 reference_fn: Callable | None = None, fused: bool = False, plan: dict | None = None,
                 graph_capturable: bool = False, host_bound: bool = False):
        self.name, self.fn, self.weight_format, self.fused = name, fn, weight_format, fused
        self.graph_capturable, self.host_bound = bool(graph_capturable), bool(host_bound)
        self.reference_fn, self._plan = reference_fn, plan or {}

    def run(self, inputs):
        return self.fn(inputs)

    def reference(self, inputs, weights):
        return None if self.reference_fn is None else self.reference_fn(inputs, weights)

    def timer(self, input_sets):
        return self.fn, list(input_sets)

    def plan(self, num_tokens: int) -> dict:
        return dict(self._plan)


def reference_backend(g: Geometry, weights, recipe: str = "flashinfer-mxfp4", name: str = "reference") -> CallableBackend:
    """The eager reference (megamoe.reference.moe_forward) with ``recipe``, on the weights a kernel of that recipe
    reads (scales moved into its legal range), timed like any backend: host-bound."""
    from ..layouts.ranges import repair_ranges
    from ..reference import moe_forward

    weights = repair_ranges(weights, recipe)
    return CallableBackend(name, lambda inp: moe_forward(inp, weights, recipe, g), plan={"recipe": recipe},
                           host_bound=True)


def _jsonable(v):
    if isinstance(v, (int, float, str, bool)) or v is None:
        return v
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    return repr(v)


class FusedBench(BenchBackend):
    """One ``megamoe.fused`` backend (see the module docstring). ``with_block_m`` gives a view that shares the
    prepared object and hands its BLOCK_M to every call (``block_m=``); the base hands None, the plan's own choice.
    Nothing is pinned on the shared object, so a view and the base cannot leak into each other."""

    rotatable = False

    def __init__(self, cls, g: Geometry, capacity: int, *, obj=None, block_m: int | None = None):
        self.cls, self.g, self.block_m = cls, g, block_m
        self.name, self.weight_format, self.fused = cls.name, cls.weight_format, bool(cls.fused)
        self.graph_capturable = cls.graph_capturable is True
        self.host_bound = not self.graph_capturable and not self.fused
        self.owner = obj is None
        self.obj = cls(g, capacity=capacity) if obj is None else obj
        self.obj.resolve_block_m(block_m)  # a view at a BLOCK_M the backend cannot honour is refused when made
        self.build_lane = self.obj.build_lane
        self.max_tokens = self.obj.capacity

    def prepare(self, weights) -> None:
        self.obj.prepare(self.cls.synthetic_weights(weights))
        self.obj.allocate()

    def build_jobs(self, token_counts, block_m: int | None = None) -> dict:
        token_counts = [t for t in token_counts if t <= self.max_tokens]
        return self.obj.build_jobs(token_counts, block_m if block_m is not None else self.block_m)

    def run(self, inputs):
        return self.obj.run(inputs, block_m=self.block_m)

    def reference(self, inputs, weights):
        """The recipe's reference with exact block sums: the sweep's check is a bound (calc_diff <= 1e-3), and
        emulating the tensor cores (a recipe's ``mma``) at 8192 tokens takes minutes; the matrix does that."""
        from ..reference import moe_forward

        return moe_forward(inputs, self.obj.kernel_weights, self._check_recipe(inputs.num_tokens), self.g)

    def _check_recipe(self, num_tokens: int):
        return self.obj.recipe_for(num_tokens).with_(mma="exact-block")

    def reference_key(self, num_tokens: int):
        return (self.name, repr(self._check_recipe(num_tokens)))

    def timer(self, input_sets):
        t, bm = input_sets[0].num_tokens, self.block_m
        self.obj.resolve_block_m(bm)  # refused here, before staging, not inside the timed call
        self.obj.stage(input_sets[0], t)
        return (lambda: self.obj.launch(t, bm)), None

    def stage_parts(self, inputs) -> dict:
        """The public ``stage`` (input validation included, which syncs the host) and the bare cast + copy into
        the buffer (the ``_stage`` hook). Staging does not depend on BLOCK_M."""
        t = inputs.num_tokens
        self.obj.stage(inputs, t)  # allocate / validate once
        return {"stage() incl. input validation": lambda: self.obj.stage(inputs, t),
                "cast + copy into the buffer": lambda: self.obj._stage(inputs, t)}

    def plan(self, num_tokens: int) -> dict:
        p = self.obj.plan(num_tokens, self.block_m)
        return {"block_m": p.block_m, "forced": p.forced, **{k: _jsonable(v) for k, v in p.detail.items()}}

    def legal_block_ms(self) -> tuple[int, ...]:
        return tuple(self.obj.legal_block_ms())

    def with_block_m(self, block_m: int) -> "FusedBench":
        """A view at ``block_m`` sharing the prepared object; one the backend cannot honour is refused."""
        return FusedBench(self.cls, self.g, self.obj.capacity, obj=self.obj, block_m=block_m)

    def provenance(self) -> dict | None:
        return self.cls.provenance()

    def close(self) -> None:
        if self.owner:
            self.obj.destroy()


def fused_registry() -> dict:
    """``megamoe.fused.registry.BACKENDS``: {name: backend class}."""
    from ..fused.registry import BACKENDS

    return dict(BACKENDS)


def make_backends(g: Geometry, weights, capacity: int, names: Sequence[str] | None = None, *,
                  log: Callable[[str], None] = print) -> tuple[list[BenchBackend], dict[str, str]]:
    """Every requested backend built and prepared (``names`` None: every registered one with ``in_all`` that runs
    here, and the reference); returns (backends, {name: why skipped})."""
    reg = fused_registry()
    out: list[BenchBackend] = []
    skipped: dict[str, str] = {}
    from ..fused.registry import all_backend_names

    for name in (list(names) if names is not None else [*(n for n in all_backend_names() if n in reg), "reference"]):
        if name == "reference":
            out.append(reference_backend(g, weights))
            continue
        if name not in reg:
            skipped[name] = f"not a registered backend (megamoe.fused.registry: {sorted(reg)})"
            continue
        ok, why = reg[name].availability()
        if not ok:
            skipped[name] = why or "unavailable"
            continue
        try:  # a backend with a token limit (megamoe-decode: 64 per rank) runs the counts it supports
            b = FusedBench(reg[name], g, min(capacity, getattr(reg[name], "max_tokens_per_rank", None) or capacity))
            b.prepare(weights)
            out.append(b)
        except Exception as exc:  # noqa: BLE001 - one backend failing must not stop the others
            log(f"[bench] backend {name} failed to prepare:\n{traceback.format_exc()}")
            skipped[name] = f"{type(exc).__name__}: {exc}"
    return out, skipped


def select_timing(b: BenchBackend, device_type: str, use_graphs: bool = True) -> str:
    """"perf_counter" without CUDA; "cuda-graph" for a backend that promises ``graph_capturable`` (when
    ``use_graphs``); otherwise "cuda-events"."""
    if device_type != "cuda":
        return "perf_counter"
    return "cuda-graph" if use_graphs and getattr(b, "graph_capturable", False) is True else "cuda-events"

"""The one place the harness meets the things it times.

``BenchBackend`` is the protocol the sweep drives. Two implementations:

    CallableBackend   any ``fn(inputs: MoEInputs) -> y [T, H]``: the eager reference, plain torch ops,
                      anything; the harness rotates among input sets when timing it
    FusedAdapter      an object from ``megamoe.fused.registry.BACKENDS`` (built from a geometry +
                      ``num_max_tokens_per_rank``): ``prepare_weights(weights)``, ``stage(inputs, T)``,
                      ``launch(T)`` (kernel only, no host sync), ``run(inputs)``, a plan report with
                      BLOCK_M, and a way to force BLOCK_M. Only ``launch`` is timed; the staged buffer
                      cannot be rotated, so the L2 is flushed between calls instead.

Two properties steer how the sweep times a backend (``megamoe.bench.sweep.select_timing``):

    graph_capturable  the backend promises that its timed call may be captured in a CUDA graph (after
                      build): FusedAdapter reads the fused class's ``graph_capturable`` (missing = False);
                      such a backend is timed by graph replays, staging done once before capture
    host_bound        the timed call syncs the host and launches many small kernels (the eager
                      reference; an unfused peer whose launch is not capturable): timed with events, but
                      with the host-bound hygiene (gc off, allocator cache emptied first, more repeats)

Everything the fused package spells differently is looked up here (``_first_attr``), nowhere else.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Sequence

import torch

from ..geometry import Geometry
from ..inputs import MoEInputs

_FORCE_KWARGS = ("block_m", "force_block_m", "forced_block_m")


def _first_attr(obj, names: Sequence[str]):
    for n in names:
        if hasattr(obj, n):
            return getattr(obj, n)
    return None


def _to_dict(plan) -> dict:
    if plan is None:
        return {}
    if isinstance(plan, dict):
        return dict(plan)
    if dataclasses.is_dataclass(plan):
        return {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)}
    if hasattr(plan, "_asdict"):
        return dict(plan._asdict())
    if hasattr(plan, "__dict__"):
        return {k: v for k, v in vars(plan).items() if not k.startswith("_")}
    return {"plan": repr(plan)}


def _jsonable(v):
    if isinstance(v, (int, float, str, bool)) or v is None:
        return v
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    return repr(v)


def block_m_of(plan: dict) -> int | None:
    for key in ("block_m", "BLOCK_M", "blockm", "bm"):
        if key in plan and plan[key] is not None:
            try:
                return int(plan[key])
            except (TypeError, ValueError):
                return None
    return None


class BenchBackend:
    """Protocol: one timed thing at one geometry. Subclasses fill in the methods."""

    name: str = "?"
    weight_format: str = "mxfp4"  # picks the bytes per weight of the roofline floor
    fused: bool = False
    rotatable: bool = True  # whether timing may cycle among several input sets
    jit_group: str | None = None  # builds of one group run one after another (sweep.build_all)
    graph_capturable: bool = False  # the timed call may be captured in a CUDA graph (after build)
    host_bound: bool = False  # the timed call syncs the host (its figure is host time)

    def prepare(self, weights) -> None:
        """Convert / upload weights (not timed)."""

    def build(self, token_counts: Sequence[int]) -> None:
        """Build every JIT plan the given token counts need (not timed; may run in a thread)."""

    def run(self, inputs: MoEInputs) -> torch.Tensor:
        """Stage + launch + read back y [T, H] (for correctness)."""
        raise NotImplementedError

    def reference(self, inputs: MoEInputs, weights) -> torch.Tensor | None:
        """The output this backend must match (its recipe's eager reference), or None."""
        return None

    def reference_key(self):
        """Backends with equal keys share one reference output per input (cached by the sweep)."""
        return self.name

    def timer(self, input_sets: Sequence[MoEInputs]) -> tuple[Callable, list | None]:
        """(fn, args) for ``time_fn``: the timed region only. Staging happens here, untimed."""
        raise NotImplementedError

    def stage_fn(self, inputs: MoEInputs) -> Callable[[], Any] | None:
        """A callable that stages ``inputs`` for a launch (for the staging-cost study), or None."""
        return None

    def stage_parts(self, inputs: MoEInputs) -> dict[str, Callable[[], Any]]:
        return {}

    def build_jobs(self, token_counts, block_ms=(None,)) -> list[tuple[object, Callable[[], Any]]]:
        return [((self.name, tuple(token_counts)), lambda: self.build(token_counts))]

    def plan(self, num_tokens: int) -> dict:
        return {}

    def legal_block_ms(self, num_tokens: int | None = None) -> list[int]:
        return []

    def with_block_m(self, block_m: int) -> "BenchBackend":
        raise NotImplementedError(f"{self.name}: forcing BLOCK_M is not supported")

    def close(self) -> None:
        pass


class CallableBackend(BenchBackend):
    """Times ``fn(inputs)``; ``reference_fn(inputs, weights)`` gives the output to check against."""

    def __init__(self, name: str, fn: Callable[[MoEInputs], torch.Tensor], *, weight_format: str = "mxfp4",
                 reference_fn: Callable | None = None, fused: bool = False, plan: dict | None = None,
                 graph_capturable: bool = False, host_bound: bool = False):
        self.name, self.fn, self.weight_format, self.fused = name, fn, weight_format, fused
        self.graph_capturable, self.host_bound = bool(graph_capturable), bool(host_bound)
        self.reference_fn = reference_fn
        self._plan = plan or {}

    def run(self, inputs: MoEInputs) -> torch.Tensor:
        return self.fn(inputs)

    def reference(self, inputs, weights):
        return None if self.reference_fn is None else self.reference_fn(inputs, weights)

    def timer(self, input_sets):
        return self.fn, list(input_sets)

    def plan(self, num_tokens: int) -> dict:
        return dict(self._plan)


def reference_backend(g: Geometry, weights, recipe: str = "flashinfer-mxfp4", name: str | None = None) -> CallableBackend:
    """The eager reference (megamoe.reference.moe_forward) with ``recipe``, timed like any backend."""
    from ..reference import moe_forward

    try:  # time it on what a kernel would read: scales moved into the recipe's legal range
        from ..layouts.ranges import repair_ranges

        weights = repair_ranges(weights, recipe)
    except Exception:  # noqa: BLE001 - the raw weights time the same arithmetic
        pass
    fn = lambda inp: moe_forward(inp, weights, recipe, g)  # noqa: E731
    return CallableBackend(name or f"reference ({recipe})", fn, weight_format="mxfp4", plan={"recipe": recipe},
                           host_bound=True)


class FusedAdapter(BenchBackend):
    """Wraps one ``megamoe.fused`` backend object (see the module docstring)."""

    rotatable = False

    def __init__(self, name: str, factory: Callable, g: Geometry, num_max_tokens_per_rank: int, *,
                 block_m: int | None = None, group=None, **kwargs):
        self.name, self.factory, self.g = name, factory, g
        self.num_max_tokens = num_max_tokens_per_rank
        self.forced_block_m = block_m
        self.kwargs = kwargs
        self.group = group
        self.obj = self._construct(block_m)
        self.weight_format = str(_first_attr(self.obj, ("weight_format", "WEIGHT_FORMAT")) or _guess_format(name))
        fused = _first_attr(self.obj, ("fused", "is_fused"))
        self.fused = bool(fused) if fused is not None else ("unfused" not in name and "grouped" not in name)
        self._weights = None

    @property
    def jit_group(self) -> str | None:
        """Builds in one group must not overlap (deep_gemm's JIT include parser is process-global and
        not thread-safe): the object's own ``jit_group``, else "deep_gemm" for the DeepGEMM backends."""
        v = _first_attr(self.obj, ("jit_group",))
        if isinstance(v, str):
            return v
        mod = type(self.obj).__module__ or ""
        return "deep_gemm" if ("deepgemm" in self.name.lower() or "deepgemm" in mod or "deep_gemm" in mod) else None

    @property
    def graph_capturable(self) -> bool:
        """The fused class's promise (``graph_capturable = True``) that launch() may be captured after
        build(); a missing attribute is False."""
        return getattr(self.obj, "graph_capturable", False) is True

    @property
    def host_bound(self) -> bool:
        """The object's own ``host_bound`` / ``syncs_host`` when it says; else a launch that is not
        capturable and not a fused kernel (the unfused peer's torch glue syncs the host)."""
        v = _first_attr(self.obj, ("host_bound", "syncs_host"))
        if isinstance(v, bool):
            return v
        return not self.graph_capturable and not self.fused

    def _construct(self, block_m):
        kw = dict(self.kwargs)
        if self.group is not None:
            kw["group"] = self.group
        if block_m is not None:
            params = _params(self.factory)
            key = next((k for k in _FORCE_KWARGS if k in params), None)
            if key is None and not _takes_kwargs(self.factory):
                obj = self.factory(self.g, num_max_tokens_per_rank=self.num_max_tokens, **kw)
                setter = _first_attr(obj, ("force_block_m", "set_block_m"))
                if setter is None:
                    raise NotImplementedError(f"{self.name}: no way to force BLOCK_M found")
                setter(block_m)
                return obj
            kw[key or "block_m"] = block_m
        return self.factory(self.g, num_max_tokens_per_rank=self.num_max_tokens, **kw)

    def prepare(self, weights) -> None:
        self._weights = weights
        self.obj.prepare_weights(weights)

    def build(self, token_counts) -> None:
        fn = _first_attr(self.obj, ("build_plans", "build", "warmup", "compile"))
        if fn is None:
            return
        try:
            fn(list(token_counts))
        except TypeError:
            for t in token_counts:
                fn(t)

    def run(self, inputs):
        out = self.obj.run(inputs)
        return out[0] if isinstance(out, (tuple, list)) else out

    def reference(self, inputs, weights):
        ref = _first_attr(self.obj, ("reference", "reference_forward"))
        if callable(ref):  # the backend's own reference
            try:
                return ref(inputs)
            except TypeError:
                return ref(inputs, weights)
        recipe = _first_attr(self.obj, ("recipe",))
        if recipe is None:
            return None
        from ..reference import moe_forward

        w = _first_attr(self.obj, ("reference_weights", "kernel_weights"))  # what the kernel reads (repaired)
        w = w() if callable(w) else w
        return moe_forward(inputs, w if w is not None else weights, recipe, self.g)

    def reference_key(self):
        return (self.name, repr(_first_attr(self.obj, ("recipe",))))

    def timer(self, input_sets):
        inp = input_sets[0]
        t = inp.num_tokens
        self.obj.stage(inp, t)
        return (lambda: self.obj.launch(t)), None

    def stage_fn(self, inputs):
        return lambda: self.obj.stage(inputs, inputs.num_tokens)

    def stage_parts(self, inputs) -> dict[str, Callable[[], Any]]:
        """{label: callable} for the staging study: the public ``stage`` (validation included, which
        syncs the host) and, when there is one, the bare cast + copy into the buffer (``_stage``)."""
        t = inputs.num_tokens
        parts = {"stage() incl. input validation": lambda: self.obj.stage(inputs, t)}
        if callable(getattr(self.obj, "_stage", None)):
            self.obj.stage(inputs, t)  # allocate / validate once
            parts["cast + copy into the buffer"] = lambda: self.obj._stage(inputs, t)
        return parts

    def plan(self, num_tokens: int) -> dict:
        fn = _first_attr(self.obj, ("plan_report", "plan", "plan_for", "report"))
        try:
            p = fn(num_tokens) if callable(fn) else fn
        except TypeError:
            p = fn()
        d = {k: _jsonable(v) for k, v in _to_dict(p).items()}
        if self.forced_block_m is not None:
            d.setdefault("forced_block_m", self.forced_block_m)
        return d

    def legal_block_ms(self, num_tokens=None) -> list[int]:
        fn = _first_attr(self.obj, ("legal_block_ms",))
        if fn is not None:
            try:
                return list(fn(num_tokens) if callable(fn) else fn)
            except TypeError:
                return list(fn())
        if "flashinfer" in self.name:
            try:
                from ..layouts.plans import flashinfer_legal_block_ms

                try:
                    return list(flashinfer_legal_block_ms(self.g, num_tokens))
                except TypeError:
                    return list(flashinfer_legal_block_ms())
            except ImportError:
                return [8, 24, 64]  # KERNELS.md: FlashInfer's H200 block Ms
        return []

    def with_block_m(self, block_m: int) -> "BenchBackend":
        """The same backend with BLOCK_M pinned. Shares the prepared object (weights and buffer are
        not rebuilt) when it has ``set_force_block_m``; otherwise builds a second one."""
        if callable(getattr(self.obj, "set_force_block_m", None)):
            return ForcedBlockM(self, block_m)
        a = FusedAdapter(self.name, self.factory, self.g, self.num_max_tokens, block_m=block_m, group=self.group, **self.kwargs)
        if self._weights is not None:
            a.prepare(self._weights)
        return a

    def build_jobs(self, token_counts, block_ms=(None,)) -> list[tuple[object, Callable[[], Any]]]:
        """[(plan key, zero-arg build callable)] for every plan the token counts need, for each forced
        BLOCK_M in ``block_ms`` (None = the plan's own choice), so one thread pool builds them all."""
        job = getattr(self.obj, "_build_job", None)
        setter = getattr(self.obj, "set_force_block_m", None)
        if not callable(job) or (any(b is not None for b in block_ms) and not callable(setter)):
            return [((self.name, tuple(token_counts)), lambda: self.build(token_counts))]
        jobs: dict = {}
        before = getattr(self.obj, "force_block_m", None)
        try:
            for bm in block_ms:
                if callable(setter):
                    setter(bm)
                for t in token_counts:
                    key, fn = job(int(t))
                    jobs.setdefault((self.name, repr(key)), fn)
        finally:
            if callable(setter):
                setter(before)
        return list(jobs.items())

    def close(self) -> None:
        fn = _first_attr(self.obj, ("close", "destroy"))
        if callable(fn):
            fn()


class ForcedBlockM(BenchBackend):
    """A view of a FusedAdapter with BLOCK_M pinned through ``set_force_block_m`` on the shared
    object; every entry point pins it first (the sweep uses one view at a time), close() unpins."""

    rotatable = False

    @property
    def graph_capturable(self) -> bool:
        return self.base.graph_capturable

    @property
    def jit_group(self) -> str | None:
        return self.base.jit_group

    @property
    def host_bound(self) -> bool:
        return self.base.host_bound

    def __init__(self, base: FusedAdapter, block_m: int):
        self.base, self.block_m = base, block_m
        self.name, self.weight_format, self.fused = base.name, base.weight_format, base.fused
        self.base.obj.set_force_block_m(block_m)  # raises on an illegal BLOCK_M

    def _pin(self) -> None:
        self.base.obj.set_force_block_m(self.block_m)

    def build(self, token_counts) -> None:
        self._pin()
        self.base.build(token_counts)

    def build_jobs(self, token_counts, block_ms=(None,)):
        return self.base.build_jobs(token_counts, (self.block_m,))

    def run(self, inputs):
        self._pin()
        return self.base.run(inputs)

    def reference(self, inputs, weights):
        return self.base.reference(inputs, weights)

    def reference_key(self):
        return self.base.reference_key()

    def timer(self, input_sets):
        self._pin()
        return self.base.timer(input_sets)

    def stage_fn(self, inputs):
        return None

    def plan(self, num_tokens):
        self._pin()
        d = self.base.plan(num_tokens)
        d.setdefault("forced_block_m", self.block_m)
        return d

    def close(self) -> None:
        self.base.obj.set_force_block_m(None)


def _params(fn) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


def _takes_kwargs(fn) -> bool:
    try:
        return any(p.kind is p.VAR_KEYWORD for p in inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False


def _guess_format(name: str) -> str:
    return "fp8_block" if "fp8" in name.lower() and "mxfp4" not in name.lower() else "mxfp4"


def fused_registry() -> dict:
    """``megamoe.fused.registry.BACKENDS`` ({} when the package is not there yet)."""
    try:
        from ..fused.registry import BACKENDS  # type: ignore[import-not-found]
    except ImportError:
        return {}
    return dict(BACKENDS)


def backend_available(entry) -> tuple[bool, str]:
    """Ask a registry entry whether it can run here (kernel package importable, SM90)."""
    fn = _first_attr(entry, ("available", "is_available", "availability"))
    if fn is None:
        return torch.cuda.is_available(), "" if torch.cuda.is_available() else "no CUDA device"
    try:
        res = fn() if callable(fn) else fn
    except Exception as exc:  # noqa: BLE001
        return False, f"{type(exc).__name__}: {exc}"
    if isinstance(res, tuple):
        return bool(res[0]), str(res[1]) if len(res) > 1 else ""
    return bool(res), ""


def make_backends(g: Geometry, weights, num_max_tokens: int, names: Sequence[str] | None = None, *,
                  include_reference: bool = True, reference_recipe: str = "flashinfer-mxfp4",
                  log: Callable[[str], None] = print) -> tuple[list[BenchBackend], dict[str, str]]:
    """Build (and prepare) every requested backend; returns (backends, {name: why skipped})."""
    import traceback

    reg = fused_registry()
    skipped: dict[str, str] = {}
    wanted = list(names) if names else [*reg, "reference"]
    out: list[BenchBackend] = []
    for name in wanted:
        if name == "reference":
            if include_reference:
                out.append(reference_backend(g, weights, reference_recipe, name="reference"))
            continue
        if name not in reg:
            skipped[name] = "not in megamoe.fused.registry.BACKENDS" + ("" if reg else " (registry not importable)")
            continue
        ok, why = backend_available(reg[name])
        if not ok:
            skipped[name] = why or "unavailable"
            continue
        try:
            a = FusedAdapter(name, reg[name], g, num_max_tokens)
            a.prepare(weights)
            out.append(a)
        except Exception as exc:  # noqa: BLE001 - one backend failing must not stop the sweep
            log(f"[bench] backend {name} failed to build:\n{traceback.format_exc()}")
            skipped[name] = f"{type(exc).__name__}: {exc}"
    return out, skipped

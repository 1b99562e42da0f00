"""One interface over every fused (and the unfused peer) SM90 Mega MoE backend.

Life cycle (one rank; every rank of a group calls the same sequence):

    be = make_backend("flashinfer-mxfp4", geometry, capacity=8192)     # nothing touches the GPU yet
    be.prepare(weights)           # once: checkpoint form -> megamoe.layouts -> range check -> device
    be.allocate(group=None)       # symmetric buffer over `group` (a 1-rank group is made if None)
    be.build([1, 64, 2048])       # every plan those token counts need (megamoe.fused.build)
    be.stage(inputs, num_tokens)  # FP8 staging + copy into the buffer, rows past T routed to -1
    y = be.launch(num_tokens)     # the kernel alone: no host sync, no allocation   -> [num_tokens, H]
    y = be.run(inputs)            # stage + launch, returns y[:T]

``plan(num_tokens, block_m=None)`` reports the plan / BLOCK_M a launch will use. BLOCK_M is an argument of
every call whose plan depends on it (``plan``, ``build_jobs`` / ``build``, ``launch``, ``run``): None is the
plan's own choice (or the ``force_block_m`` the instance was made with), and a value the backend cannot honour
is refused (ValueError naming ``block_m``, the legal values and the value given) before anything runs;
``legal_block_ms()`` lists what may be asked, and a backend whose tile is fixed says by what (``fixed_tile``).
``intermediates()`` returns what the kernel leaves in its buffer (pool rows of x, the L2 input
FP8 codes and scales) for the stage-level checks. All-SM persistent kernels must not run beside other
GPU work: ``launch`` runs on the current stream and the caller keeps that stream to itself.
CUDA graphs: capture only after ``build`` has built every plan the graph will launch.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field

import torch

from ..inputs import MoEInputs
from ..recipe import Recipe
from ..validate import as_int, check_output, check_step


class BackendUnavailable(RuntimeError):
    """The backend cannot run here; the message says why (no GPU, not Hopper, package or kernel missing)."""


@dataclass
class Plan:
    """What one launch uses. ``detail`` holds the package's own plan object or fields."""

    block_m: int
    forced: bool = False
    detail: dict = field(default_factory=dict)

    DESCRIBED = ("block_n", "swap_ab", "rs_swap_ab", "num_stages", "num_experts_per_wave", "source", "batch_invariant",
                 "down_repicked", "decode_loss")

    def describe(self) -> str:
        extra = ", ".join(f"{k}={v}" for k, v in self.detail.items() if k in self.DESCRIBED)
        return f"BLOCK_M {self.block_m}{' (forced)' if self.forced else ''}{'; ' + extra if extra else ''}"


def kernel_availability(importer, label: str, required: tuple[str, ...]) -> tuple[bool, str]:
    """(ok, reason) for a backend: an SM90 GPU, the package importable through ``importer()``, and
    every attribute in ``required`` present on it. The reason names the first thing missing."""
    why = cuda_hopper_reason()
    if why:
        return False, why
    try:
        mod = importer()
    except Exception as exc:  # noqa: BLE001
        return False, f"package missing: {label} not importable ({type(exc).__name__}: {exc})"
    for attr in required:
        if not hasattr(mod, attr):
            version = getattr(mod, "__version__", None)
            return False, f"kernel missing: {label}{f' {version}' if version else ''} has no {attr}"
    return True, ""


def cuda_hopper_reason() -> str:
    """'' when an SM90 GPU is usable, else why not."""
    if not torch.cuda.is_available():
        return "no GPU: torch.cuda.is_available() is False"
    major, minor = torch.cuda.get_device_capability()
    if major != 9:
        return f"not Hopper: device capability {major}.{minor}, the kernels are SM90 only"
    return ""


def _takes_block_m(fn) -> bool:
    """Whether a hook takes ``block_m`` (a subclass written before BLOCK_M was an argument does not)."""
    return "block_m" in inspect.signature(fn).parameters


def _checked_launch(launch):
    """``launch`` with its token count checked first (an int in [0, capacity]: 6.9 is refused, not run as
    6) and its ``block_m`` resolved (``FusedBackend.resolve_block_m``). Host-side only, so a launch stays free of
    syncs and capturable in a CUDA graph."""
    takes = _takes_block_m(launch)

    @functools.wraps(launch)
    def checked(self, num_tokens: int, block_m: int | None = None) -> torch.Tensor:
        m = as_int("num_tokens", num_tokens, lo=0, hi=self.capacity, who=f"{self.name} launch")
        bm = self.resolve_block_m(block_m)
        return launch(self, m, bm) if takes else launch(self, m)

    checked.checks_token_count = True
    checked.takes_block_m = takes
    return checked


def _checked_plan(plan):
    """``plan`` with its ``block_m`` resolved first, as ``launch`` resolves it, so the plan reported is the one a
    launch with the same arguments runs."""
    takes = _takes_block_m(plan)

    @functools.wraps(plan)
    def checked(self, num_tokens: int, block_m: int | None = None) -> Plan:
        bm = self.resolve_block_m(block_m)
        return plan(self, num_tokens, bm) if takes else plan(self, num_tokens)

    checked.checks_block_m = True
    checked.takes_block_m = takes
    return checked


class LossyScalesOptIn:
    """For a backend whose weight decode has a window with no exact repair (DeepGEMM SM90 FP4's table, Humming
    W4A8's rebase): ``accept_lossy_scales=True`` runs weights outside it, and ``prepare`` leaves what they lose in
    ``decode_loss`` for every result to report. Put it before FusedBackend in the bases."""

    def __init__(self, geometry, *, accept_lossy_scales: bool = False, **kwargs) -> None:
        super().__init__(geometry, **kwargs)
        self.accept_lossy_scales = bool(accept_lossy_scales)
        self.decode_loss: dict | None = None


class FusedBackend:
    """Base class; subclasses set the class attributes and implement the ``_`` hooks.

    Every subclass's ``launch`` and ``plan`` are wrapped (``__init_subclass__``) so that the token count and
    ``block_m`` are checked the same way whichever backend it is: the documented ``stage_into`` + ``launch``
    path never hands a kernel a truncated or out-of-capacity count, nor a BLOCK_M it would not run.

    BLOCK_M hooks: a backend that can choose BLOCK_M (``legal_block_ms()`` not empty) takes ``block_m`` in
    ``plan(num_tokens, block_m=None)``, ``_build_job(num_tokens, block_m=None)`` and ``launch(num_tokens,
    block_m=None)``, already resolved (an int from ``legal_block_ms()``, or None for the plan's own choice). A
    backend with a fixed tile keeps ``plan(num_tokens)`` / ``launch(num_tokens)``: no block_m ever reaches it.
    """

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        own = cls.__dict__.get("launch")
        if own is not None and not getattr(own, "checks_token_count", False):
            cls.launch = _checked_launch(own)
        own = cls.__dict__.get("plan")
        if own is not None and not getattr(own, "checks_block_m", False):
            cls.plan = _checked_plan(own)
        # Hooks that would never see a block_m asked per call: such a backend refuses one (resolve_block_m) rather
        # than run its own plan while the caller records another.
        cls._hooks_without_block_m = tuple(
            name for name in ("plan", "_build_job", "launch")
            if not getattr(getattr(cls, name), "takes_block_m", _takes_block_m(getattr(cls, name))))

    name: str = ""
    recipe: Recipe
    weight_format: str = "mxfp4"  # what ``prepare`` takes: "mxfp4" (MXFP4Weights) or "fp8_block"
    persistent: bool = True  # an all-SM persistent kernel
    kernel: str = ""
    fused: bool = True  # one fused kernel (False: the unfused peer, a pipeline of kernels and torch glue)
    # A promise: after build(), launch() neither syncs the host nor allocates, so it may be captured in a
    # CUDA graph and replayed after each stage() of the same token count (megamoe bench times it so).
    graph_capturable: bool = False
    # Plans are independent JIT compiles that may build in parallel threads. False (the safe default): they
    # build one at a time in the kernel package's lane, as builds that launch the kernel must.
    parallel_builds: bool = False
    # Whether ``--backends all`` stands for this backend too (``registry.all_backend_names``). False only for a
    # backend kept for what it shows, not to be raced, with its reason beside it; a backend named runs either way.
    in_all: bool = True
    # A backend whose BLOCK_M cannot be chosen (``legal_block_ms()`` empty) says here what fixes its tile; the
    # refusal of any block_m quotes it.
    fixed_tile: str = ""
    _hooks_without_block_m: tuple[str, ...] = ()  # set per subclass (__init_subclass__)

    def __init__(self, geometry, *, capacity: int, force_block_m: int | None = None, group=None) -> None:
        """``geometry`` (a Geometry or a preset name); ``capacity``: the most tokens one rank stages in a
        step (the symmetric buffer is sized for it); ``force_block_m``: the BLOCK_M of every call that passes
        no ``block_m`` (None: the plan's own), checked here and fixed for the instance's life; ``group``: the
        EP process group (None: a 1-rank group is made at ``allocate``)."""
        from ..geometry import get_geometry

        if capacity is None:
            raise ValueError("capacity (max tokens per rank) must be a positive int, got None")
        self.g = get_geometry(geometry)
        self.capacity = as_int("capacity (max tokens per rank)", capacity, lo=1, who=self.name)
        self.group = group
        self._prepared = False
        self._allocated = False
        self._force_block_m = None
        self._force_block_m = self.resolve_block_m(force_block_m, "force_block_m")

    # ---------------------------------------------------------------- availability
    @classmethod
    def availability(cls) -> tuple[bool, str]:
        """(ok, reason). reason is '' when ok."""
        raise NotImplementedError

    @classmethod
    def require_available(cls) -> None:
        ok, why = cls.availability()
        if not ok:
            raise BackendUnavailable(f"backend {cls.name!r} is unavailable: {why}")

    # Top-level module of the kernel package (provenance() reads what was imported from it).
    kernel_module: str | None = None

    @classmethod
    def provenance(cls) -> dict | None:
        """Version, file and build record of the kernel module this backend runs, as imported in this
        process (``megamoe.provenance``); None before the module is imported."""
        from ..provenance import module_provenance

        return module_provenance(cls.kernel_module) if cls.kernel_module else None

    @classmethod
    def synthetic_weights(cls, weights):
        """The random (synthetic) weights a test or benchmark hands this backend. Default: unchanged,
        because ``prepare`` maps every legal checkpoint exactly. A backend whose decoder has a narrower
        window and no global scale to absorb the rest (DeepGEMM SM90 FP4) overrides this to move each
        tensor by a power of two into its window: that changes the layer's values, so it is only for
        synthetic weights, never for a checkpoint."""
        return weights

    # ---------------------------------------------------------------- plans
    def legal_block_ms(self) -> tuple[int, ...]:
        """The BLOCK_Ms ``block_m`` may ask for; () when the tile is fixed (``fixed_tile`` says by what)."""
        raise NotImplementedError

    @property
    def force_block_m(self) -> int | None:
        """The BLOCK_M of calls that pass none (the constructor's ``force_block_m``; None: the plan's own)."""
        return self._force_block_m

    @force_block_m.setter
    def force_block_m(self, value) -> None:
        raise AttributeError(f"{self.name}: force_block_m is fixed at construction (state re-pinned between calls "
                             f"is how a plan and its record drift apart); pass block_m= to plan, build, launch or run "
                             f"instead (got {value!r})")

    def resolve_block_m(self, block_m, arg: str = "block_m") -> int | None:
        """The BLOCK_M a call runs: ``block_m``, or the instance's ``force_block_m`` when it is None. Refused before
        anything runs, naming ``arg``, the legal values and the value given: a non-int (TypeError), a value not in
        ``legal_block_ms()`` (ValueError; any value when the tile is fixed), or a value asked per call of a backend
        whose hooks do not take ``block_m`` (it would run its own plan under the caller's label)."""
        if block_m is None:
            return self._force_block_m
        bm = as_int(arg, block_m, who=self.name)
        legal = tuple(self.legal_block_ms())
        if not legal:
            fixed = self.fixed_tile or "it has no BLOCK_M to choose"
            raise ValueError(f"{self.name}: {arg} must be None, its tile is fixed ({fixed}): legal values (), got {bm}")
        if bm not in legal:
            raise ValueError(f"{self.name}: {arg} must be one of {legal} (or None), got {bm}")
        if arg == "block_m" and self._hooks_without_block_m:
            raise ValueError(
                f"{self.name}: {arg}={bm} would be ignored: its {', '.join(self._hooks_without_block_m)} take no "
                "block_m argument (a backend that chooses BLOCK_M takes it in plan(num_tokens, block_m=None), "
                "_build_job(num_tokens, block_m=None) and launch(num_tokens, block_m=None))")
        return bm

    def plan(self, num_tokens: int, block_m: int | None = None) -> Plan:
        raise NotImplementedError

    def recipe_for(self, num_tokens: int, mma: str | None = None) -> Recipe:
        """The reference recipe of the plan a launch of num_tokens runs, with block-sum model ``mma``
        (None: the recipe's own). Backends whose numerics depend on the plan override this."""
        return self.recipe if mma is None else self.recipe.with_(mma=mma)

    def build_jobs(self, token_counts, block_m: int | None = None) -> dict:
        """{plan key: zero-argument callable that builds it} for every plan the token counts need at ``block_m``
        (None: the plan's own; several counts often share one plan)."""
        bm = self.resolve_block_m(block_m)
        takes = "_build_job" not in self._hooks_without_block_m
        jobs: dict = {}
        for t in token_counts:
            if t > 0:
                key, fn = self._build_job(int(t), bm) if takes else self._build_job(int(t))
                jobs.setdefault((self.name, key), fn)
        return jobs

    @property
    def build_lane(self) -> str | None:
        """None when plans may build in parallel threads (``parallel_builds``); else the lane whose jobs
        run one at a time (``megamoe.fused.build``): the kernel package, shared by its backends."""
        return None if self.parallel_builds else (self.kernel_module or self.name)

    def build(self, token_counts, max_workers: int = 8, block_m: int | None = None) -> int:
        """Build every plan the token counts need at ``block_m`` (``megamoe.fused.build``). Returns how many were
        built."""
        from .build import build_plans

        self.resolve_block_m(block_m)  # the argument's error before the life cycle's
        self._need_allocated("build")
        jobs = self.build_jobs(token_counts, block_m)
        errors = build_plans(jobs, {k: self.build_lane for k in jobs}, max_workers)
        if errors:
            raise errors[0][1]
        return len(jobs)

    def _build_job(self, num_tokens: int, block_m: int | None = None):
        """(hashable key of the plan, zero-argument callable that builds it) at the resolved ``block_m``."""
        return (num_tokens, block_m), (lambda: None)

    # ---------------------------------------------------------------- life cycle
    def prepare(self, weights) -> None:
        """Once: weights in the checkpoint form (MXFP4Weights, or FP8BlockWeights for FP8 backends),
        all experts; this rank's experts go through megamoe.layouts (range check included) to the GPU."""
        from .process_group import ensure_group

        self.require_available()
        weights.check_geometry(self.g)
        self.group = ensure_group(self.group)
        el = self.g.experts_per_rank(self.num_ranks)
        self.local_weights = weights.experts(self.rank * el, (self.rank + 1) * el)
        self._prepare(self.local_weights.to(self.device))
        self._prepared = True

    def prepare_weights(self, weights) -> None:
        """prepare(weights), then allocate() over the group given at construction (if not done)."""
        self.prepare(weights)
        if not self._allocated:
            self.allocate()

    def allocate(self, group=None) -> None:
        from .process_group import ensure_group

        self.require_available()
        self.group = ensure_group(group if group is not None else self.group)
        if self.g.num_experts % self.group.size():
            raise ValueError(f"{self.g.num_experts} experts do not divide over {self.group.size()} ranks")
        self._allocate()
        self._allocated = True

    @property
    def num_ranks(self) -> int:
        return 1 if self.group is None else self.group.size()

    @property
    def rank(self) -> int:
        return 0 if self.group is None else self.group.rank()

    def check_inputs(self, inputs: MoEInputs, num_tokens: int | None = None) -> int:
        """Shapes, dtypes, device, routing (ids in range, no expert twice in a token, finite weights),
        finite x and the token count (an int, T <= m <= capacity), checked before anything runs by the
        one check the reference and ``stage_into`` use too (``megamoe.validate.check_step``). Returns
        the token count the launch will use (``num_tokens`` or T)."""
        if not isinstance(inputs, MoEInputs):
            raise TypeError(f"{self.name}: inputs must be MoEInputs, got {type(inputs).__name__}")
        g = self.g
        return check_step(inputs.x, inputs.topk_idx, inputs.topk_weights, hidden=g.hidden, num_topk=g.num_topk,
                          num_experts=g.num_experts, device=self.device, who=self.name,
                          device_label="the backend runs on", num_tokens=num_tokens, capacity=self.capacity,
                          allow_zero=self.allows_zero_tokens)

    allows_zero_tokens = False

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    def stage(self, inputs: MoEInputs, num_tokens: int | None = None) -> int:
        """Validate, stage FP8 activations and routing into the buffer (rows T..num_tokens-1 are
        padding routed to -1). Returns the launch token count. Syncs the host (validation)."""
        self._need_allocated("stage")
        m = self.check_inputs(inputs, num_tokens)
        self._stage(inputs, m)
        self._staged = m
        return m

    def launch(self, num_tokens: int, block_m: int | None = None) -> torch.Tensor:
        """Run the kernel on what ``stage`` wrote, at ``block_m`` (None: the plan's own). Returns y [num_tokens, H]
        bf16 (a view of the backend's output buffer, overwritten by the next launch)."""
        raise NotImplementedError

    def run(self, inputs: MoEInputs, num_tokens: int | None = None, block_m: int | None = None) -> torch.Tensor:
        """stage + launch at ``block_m`` -> y [T, H]; a NaN / Inf in y (from inputs check_inputs accepted) raises
        ``validate.NonFiniteOutputError`` instead of being returned (one more host sync)."""
        self.resolve_block_m(block_m)  # refused before staging, not after
        m = self.stage(inputs, num_tokens)
        y = self.launch(m, block_m)[: inputs.num_tokens]
        check_output("y", y, self.name, "the kernel's FP32 accumulators overflowed (activations near the bf16 "
                     "maximum) or the kernel misbehaved; the reference says which (megamoe.reference)")
        return y

    def intermediates(self) -> dict | None:
        """What the kernel left in its buffer: {'pool_x': e4m3 [P, H], 'l2_in': e4m3 [P, I],
        'l2_in_sf': fp32 [P, I/G] (or a raw region to be decoded by the checker), ...} or None."""
        return None

    def poison_intermediates(self) -> None:
        """Fill the buffer's intermediate regions with NaN bytes before a checked launch."""

    # ---------------------------------------------------------------- helpers
    def _need_allocated(self, what: str) -> None:
        if not self._prepared:
            raise RuntimeError(f"{self.name}: call prepare(weights) before {what}()")
        if not self._allocated:
            raise RuntimeError(f"{self.name}: call allocate(group) before {what}()")

    def _prepare(self, weights) -> None:
        raise NotImplementedError

    def _allocate(self) -> None:
        raise NotImplementedError

    def _stage(self, inputs: MoEInputs, m: int) -> None:
        """Default for the fused kernels, whose symmetric buffer exposes x / x_sf / topk_idx /
        topk_weights views: one pass over x straight into them (megamoe.staging: Triton on CUDA),
        bit-exact with per_token_cast_to_fp8; rows T..m-1 become padding routed to -1. check_inputs
        already checked every value (``validate.check_step``), so staging skips its checks (no host sync)."""
        from ..staging import stage_into

        b = self.buf
        stage_into(inputs.x, inputs.topk_idx, inputs.topk_weights, b.x, b.x_sf, b.topk_idx, b.topk_weights, m,
                   num_experts=self.g.num_experts, check=False)

    def _padding_inputs(self) -> MoEInputs:
        """A step of zero tokens on this device: staged to m rows it is m padding rows (warm-up launches)."""
        g, dev = self.g, self.device
        return MoEInputs(x=torch.empty(0, g.hidden, dtype=torch.bfloat16, device=dev),
                         topk_idx=torch.empty(0, g.num_topk, dtype=torch.int64, device=dev),
                         topk_weights=torch.empty(0, g.num_topk, dtype=torch.float32, device=dev))

    def destroy(self) -> None:
        pass

"""The fused Mega MoE kernels over an expert-parallel group: one launcher for 1, 2, 4 or 8 ranks.

The kernel spans one NVLink domain (EP <= 8 on an H200 node); every rank stages its own tokens into
the symmetric buffer the backend allocates over the EP group, then all ranks launch together. A
1-rank group goes through exactly the same code (agreement, padding, same-setup check, launch).

    launcher = FusedEPLauncher(backend, weights, g, group=ep_group)   # checks, prepare, allocate
    y, agreement = launcher.step(inputs)                              # y [T, H] bf16, this rank's T

Per step: every rank all-reduces its token count (``agree_on_step``), pads to the agreed count with
rows routed to -1 (FlashInfer's plan is chosen from the count, so every rank must pass the same one),
hands the DeepGEMM plan hint to the backend where it takes one, and launches.

The coupling with ``megamoe.fused`` is the small ``EPBackend`` protocol below; ``ReferenceEPBackend``
implements it with the distributed reference, so the launcher's path also runs on CPU (gloo).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from ..geometry import Geometry
from ..inputs import MoEInputs, pad_inputs
from ..recipe import get_recipe
from ..validate import as_int, check_step, check_weights
from .agreement import StepAgreement, agree_on_step, check_same_setup, local_check, setup_fingerprint

MAX_EP_RANKS = 8  # one NVLink domain of an H200 node


@runtime_checkable
class EPBackend(Protocol):
    """What the launcher needs from a fused backend (``megamoe.fused.base.FusedBackend`` has it).

    prepare(weights)        all E experts in checkpoint form; the backend keeps this rank's E_l
    allocate(group)         collective: the symmetric buffer over the EP group
    run(inputs, num_tokens) stage this rank's T tokens padded to num_tokens, launch -> y [T, H]
    Optional: ``set_plan_hint(hint)`` (DeepGEMM's mean-tokens hint), ``recipe``.
    """

    name: str

    def prepare(self, weights) -> None: ...

    def allocate(self, group=None) -> None: ...

    def run(self, inputs: MoEInputs, num_tokens: int | None = None) -> torch.Tensor: ...


def check_ep_ranks(num_ranks: int, max_ranks: int = MAX_EP_RANKS) -> None:
    """EP group size must be a power of two in [1, max_ranks] (the kernels' rank counts)."""
    if not isinstance(num_ranks, int) or num_ranks < 1 or num_ranks & (num_ranks - 1) or num_ranks > max_ranks:
        raise ValueError(f"EP group size must be a power of two in [1, {max_ranks}] (one NVLink domain), "
                         f"got {num_ranks!r}")


def check_hopper(device: "torch.device | int | None" = None, capability: "tuple[int, int] | None" = None) -> None:
    """Raise unless ``device`` is an SM90 (Hopper) GPU. ``capability`` overrides the query (tests)."""
    if capability is None:
        if not torch.cuda.is_available():
            raise RuntimeError("the fused Mega MoE launcher needs a Hopper (SM90) GPU: "
                               "torch.cuda.is_available() is False")
        capability = torch.cuda.get_device_capability(device)
    if tuple(capability)[0] != 9:
        name = torch.cuda.get_device_name(device) if torch.cuda.is_available() else "this device"
        raise RuntimeError(f"the fused Mega MoE kernels are SM90 only: expected device capability 9.x, "
                           f"got {capability[0]}.{capability[1]} ({name})")


class FusedEPLauncher:
    """One fused backend over the EP group ``group`` (default: the world group).

    Construction is collective: it checks the group size (power of two, <= 8), the GPU (Hopper, unless
    ``require_hopper=False`` for CPU stand-ins), that every rank holds the same geometry, recipe and
    weights (``SetupMismatchError`` on every rank otherwise), then prepares the weights and allocates
    the symmetric buffer over the group.
    """

    def __init__(
        self,
        backend: EPBackend,
        weights,
        g: Geometry,
        *,
        group=None,
        require_hopper: bool = True,
        max_ranks: int = MAX_EP_RANKS,
        max_tokens_per_rank: int | None = None,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("FusedEPLauncher needs an initialised process group: run under torchrun "
                               "(megamoe.distributed.init_from_env) or megamoe.distributed.spawn")
        if not isinstance(backend, EPBackend):
            raise TypeError(f"backend must implement prepare/allocate/run (EPBackend), got {type(backend).__name__}")
        self.group = group if group is not None else dist.group.WORLD
        self.num_ranks = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.backend, self.g, self.max_tokens_per_rank = backend, g, max_tokens_per_rank
        # This rank's own checks are told to every rank in the same exchange as the setup (a rank that
        # raised here alone would leave the others waiting in check_same_setup's collective).
        error = local_check(self._check_here, weights, max_ranks, require_hopper)
        fp = {} if error is not None else setup_fingerprint(
            g, getattr(backend, "recipe", None), weights, backend=getattr(backend, "name", type(backend).__name__),
            num_ranks=self.num_ranks, max_tokens_per_rank=max_tokens_per_rank)
        check_same_setup(self.group, fp, error)
        backend.prepare(weights)
        backend.allocate(self.group)
        self.last: StepAgreement | None = None

    def _check_here(self, weights, max_ranks: int, require_hopper: bool) -> None:
        check_ep_ranks(self.num_ranks, max_ranks)
        self.g.experts_per_rank(self.num_ranks)
        if require_hopper:
            check_hopper(torch.cuda.current_device() if torch.cuda.is_available() else None)
        if self.max_tokens_per_rank is not None:
            as_int("max_tokens_per_rank", self.max_tokens_per_rank, lo=1)
        check_weights(weights, f"rank {self.rank}: weights")

    def _check_step(self, inputs: MoEInputs) -> None:
        if not isinstance(inputs, MoEInputs):
            raise TypeError(f"inputs must be MoEInputs, got {type(inputs).__name__}")
        g = self.g
        check_step(inputs.x, inputs.topk_idx, inputs.topk_weights, hidden=g.hidden, num_topk=g.num_topk,
                   num_experts=g.num_experts, device=inputs.x.device, who=f"rank {self.rank}")

    def step(self, inputs: MoEInputs) -> tuple[torch.Tensor, StepAgreement]:
        """Collective: this rank's x [T, H] -> (y [T, H], the step's agreement). T may differ per rank.
        Each rank checks its own step first; a refusal on any rank is known to all in the agreement's
        all-reduce, and every rank raises (``RankInputError``) before the launch."""
        error = local_check(self._check_step, inputs)
        a = agree_on_step(self.group, inputs.num_tokens if error is None else 0, error)
        if self.max_tokens_per_rank is not None and a.agreed > self.max_tokens_per_rank:
            raise ValueError(f"agreed token count {a.agreed} (per-rank counts {list(a.counts)}) exceeds "
                             f"max_tokens_per_rank={self.max_tokens_per_rank} the buffer was sized for")
        padded = pad_inputs(inputs, a.agreed)
        if hasattr(self.backend, "set_plan_hint"):
            self.backend.set_plan_hint(a.hint)
        y = self.backend.run(padded, num_tokens=a.agreed)
        self.last = a
        return y[: inputs.num_tokens], a


class ReferenceEPBackend:
    """EPBackend over the distributed reference (any device, gloo or NCCL): the launcher's CPU stand-in
    and its GPU oracle. Records every call so tests can see what the launcher handed it."""

    def __init__(self, g: Geometry, recipe: str = "flashinfer-mxfp4", scheme: str = "all_to_all", block_m: int = 1):
        self.name = f"reference-{scheme}"
        self.g, self.recipe, self.scheme, self.block_m = g, get_recipe(recipe), scheme, block_m
        self.weights, self.group, self.plan_hint = None, None, None
        self.calls: list[dict[str, Any]] = []

    def prepare(self, weights) -> None:
        weights.check_geometry(self.g)
        self.weights = weights

    def allocate(self, group=None) -> None:
        self.group = group

    def set_plan_hint(self, hint: int) -> None:
        self.plan_hint = hint

    def run(self, inputs: MoEInputs, num_tokens: int | None = None) -> torch.Tensor:
        from .reference import moe_forward_dist

        if self.weights is None:
            raise RuntimeError(f"{self.name}: call prepare(weights) before run()")
        self.calls.append({"num_tokens": num_tokens, "staged": inputs.num_tokens, "plan_hint": self.plan_hint})
        padded = pad_inputs(inputs, num_tokens) if num_tokens is not None else inputs
        y = moe_forward_dist(padded, self.weights, self.recipe, self.g, group=self.group,
                             scheme=self.scheme, block_m=self.block_m)
        return y[: inputs.num_tokens]


def make_fused_backend(name: str, g: Geometry, *, group=None, capacity: int = 256) -> EPBackend:
    """A backend by name: ``reference-<scheme>`` is the CPU stand-in, any other name goes to
    ``megamoe.fused.registry.make_backend(name, g, capacity=..., group=...)``."""
    if name.startswith("reference"):
        scheme = name.split("-", 1)[1] if "-" in name else "all_to_all"
        return ReferenceEPBackend(g, scheme=scheme)
    from ..fused.registry import make_backend

    return make_backend(name, g, capacity=capacity, group=group)

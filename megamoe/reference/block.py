"""The DeepSeek-V4 MoE block: router, routed experts (reference or a fused backend), shared expert.

    logits  = x.float() @ gate_weight.T                                   fp32 [T, E]
    scores  = sqrt(softplus(logits)); pick top-k of scores + bias         (routing.route)
    w       = scores[picked] / sum * routed_scaling                       fp32 [T, K], scaled ONCE here
    routed  = MoE(x, topk_idx, w)                                         [T, H]  (moe_forward or a backend)
    shared  = (silu(min(x W1s^T, c)) * clamp(x W3s^T, -c, c)) W2s^T      [T, H]  FP32 (float64 for "exact")
    y       = routed + shared                                             one final rounding (bf16 for kernel recipes)

Dimension legend: T tokens, H hidden, E experts, K top-k, I_s shared-expert intermediate
(= intermediate * num_shared_experts). The routing weights carry routed_scaling already, so
staging copies them unscaled and a kernel's own ``routed_scaling_factor`` argument (such as
``deep_gemm.mega_moe_pre_dispatch_sm90``'s) must be 1.0 (``megamoe.staging.ROUTED_SCALING_AFTER_STAGING``).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, fields, replace

import torch

from ..geometry import Geometry, get_geometry
from ..inputs import MoEInputs
from ..recipe import Recipe, get_recipe
from ..weights import MXFP4Weights, random_mxfp4_weights
from .pipeline import moe_forward
from .routing import route
from .swiglu import swiglu


@dataclass
class DeepSeekV4MoEParams:
    """One layer's parameters.

    gate_weight              fp32 [E, H]     router
    e_score_correction_bias  fp32 [E]        noaux_tc bias: selection only, never in the weights
    experts                  MXFP4Weights    routed experts (checkpoint form, L1 = [gate; up])
    shared_w1                bf16 [I_s, H]   shared expert gate
    shared_w3                bf16 [I_s, H]   shared expert up
    shared_w2                bf16 [H, I_s]   shared expert down
    """

    gate_weight: torch.Tensor
    e_score_correction_bias: torch.Tensor
    experts: MXFP4Weights
    shared_w1: torch.Tensor
    shared_w3: torch.Tensor
    shared_w2: torch.Tensor

    def check(self, g: Geometry) -> None:
        e, h = g.num_experts, g.hidden
        i_s = self.shared_w1.shape[0] if self.shared_w1.ndim == 2 else -1
        want = {
            "gate_weight": ((e, h), torch.float32),
            "e_score_correction_bias": ((e,), torch.float32),
            "shared_w1": ((i_s, h), torch.bfloat16),
            "shared_w3": ((i_s, h), torch.bfloat16),
            "shared_w2": ((h, i_s), torch.bfloat16),
        }
        for name, (shape, dtype) in want.items():
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape or t.dtype != dtype:
                got = (tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"DeepSeekV4MoEParams.{name} must be {dtype} {shape}, got {got}")
        self.experts.check_geometry(g)
        devs = {t.device for t in (self.gate_weight, self.e_score_correction_bias, self.shared_w1, self.shared_w3,
                                   self.shared_w2, self.experts.l1)}
        if len(devs) != 1:
            raise ValueError(f"DeepSeekV4MoEParams tensors must share one device, got {sorted(map(str, devs))}")

    @property
    def device(self) -> torch.device:
        return self.gate_weight.device

    def to(self, device) -> "DeepSeekV4MoEParams":
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self)})


def random_block_params(geometry: "Geometry | str", seed: int, device="cpu") -> DeepSeekV4MoEParams:
    """Random parameters with real-like magnitudes: gate std 1/sqrt(H), bias ~ 0.1 * N(0, 1) (enough to
    change some selections), MXFP4 experts from ``random_mxfp4_weights``, shared weights std 1/sqrt(K_in)."""
    g = get_geometry(geometry)
    gen = torch.Generator(device=device).manual_seed(seed)
    h, i_s = g.hidden, g.intermediate * g.num_shared_experts
    gate = torch.randn(g.num_experts, h, generator=gen, device=device) / h**0.5
    bias = 0.1 * torch.randn(g.num_experts, generator=gen, device=device)
    w1 = (torch.randn(i_s, h, generator=gen, device=device) / h**0.5).to(torch.bfloat16)
    w3 = (torch.randn(i_s, h, generator=gen, device=device) / h**0.5).to(torch.bfloat16)
    w2 = (torch.randn(h, i_s, generator=gen, device=device) / i_s**0.5).to(torch.bfloat16)
    experts = random_mxfp4_weights(g, seed=seed + 1, device=device)
    return DeepSeekV4MoEParams(gate, bias, experts, w1, w3, w2)


@dataclass
class BlockResult:
    """Every part of one block call: y [T, H]; routed, shared [T, H]; logits fp32 [T, E]; topk [T, K]."""

    y: torch.Tensor
    routed: torch.Tensor
    shared: torch.Tensor
    logits: torch.Tensor
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor


def _check_x(x: torch.Tensor, g: Geometry, params: DeepSeekV4MoEParams) -> None:
    if not isinstance(x, torch.Tensor) or x.ndim != 2 or x.shape[1] != g.hidden:
        raise ValueError(f"x must be [T, {g.hidden}], got {tuple(getattr(x, 'shape', ()))}")
    if x.dtype != torch.bfloat16:
        raise TypeError(f"x must be bfloat16, got {x.dtype}")
    if x.device != params.device:
        raise ValueError(f"x is on {x.device} but the block parameters are on {params.device}")


def route_block(x: torch.Tensor, params: DeepSeekV4MoEParams, g: Geometry):
    """x bf16 [T, H] -> (logits fp32 [T, E], topk_idx int64 [T, K], topk_weights fp32 [T, K]);
    the gate linear in FP32, the weights times routed_scaling (once)."""
    logits = x.float() @ params.gate_weight.T  # [T, E]
    idx, w = route(logits, g, params.e_score_correction_bias)
    return logits, idx, w


def shared_expert(x: torch.Tensor, params: DeepSeekV4MoEParams, g: Geometry, dtype=torch.float32) -> torch.Tensor:
    """x bf16 [T, H] -> [T, H] in ``dtype``: clamped SwiGLU (the routed experts' clamp) of the bf16 weights."""
    xf = x.to(dtype)
    h = torch.cat([xf @ params.shared_w1.to(dtype).T, xf @ params.shared_w3.to(dtype).T], dim=1)  # [T, 2 I_s]
    return swiglu(h, g.clamp) @ params.shared_w2.to(dtype).T


def _finish(routed, shared, logits, idx, w, recipe: Recipe, return_parts: bool):
    acc = shared.dtype
    y = routed.to(acc) + shared
    if recipe.combine_bf16:
        y = y.to(torch.bfloat16)
    return BlockResult(y, routed, shared, logits, idx, w) if return_parts else y


def moe_block_reference(x: torch.Tensor, params: DeepSeekV4MoEParams, geometry: "Geometry | str",
                        recipe: "Recipe | str" = "exact", *, return_parts: bool = False):
    """The block in the eager reference. x bf16 [T, H] -> y [T, H]: bf16 for kernel recipes (routed bf16
    from ``moe_forward``, shared FP32, summed in FP32, one rounding), float64 for ``exact``."""
    g = get_geometry(geometry)
    recipe = get_recipe(recipe)
    params.check(g)
    _check_x(x, g, params)
    logits, idx, w = route_block(x, params, g)
    routed = moe_forward(MoEInputs(x, idx, w), params.experts, recipe, g)
    shared = shared_expert(x, params, g, torch.float64 if recipe.accum == torch.float64 else torch.float32)
    return _finish(routed, shared, logits, idx, w, recipe, return_parts)


# ------------------------------------------------------------------------------------ fused path
class RoutedBackendAdapter:
    """The routed part through a fused backend (``megamoe.fused``: ``prepare_weights(weights)`` once,
    ``run(inputs, num_tokens=...)`` -> y bf16 [T, H]). Prepares each weight set once."""

    def __init__(self, backend) -> None:
        for attr in ("prepare_weights", "run"):
            if not callable(getattr(backend, attr, None)):
                raise TypeError(f"backend {type(backend).__name__} has no {attr}() (expected a megamoe.fused backend)")
        self.backend = backend
        self._prepared_for = None  # weakref to the weights last prepared

    def __call__(self, inputs: MoEInputs, weights, num_tokens: int | None = None) -> torch.Tensor:
        if self._prepared_for is None or self._prepared_for() is not weights:
            self.backend.prepare_weights(weights)
            self._prepared_for = weakref.ref(weights)
        y = self.backend.run(inputs, num_tokens=num_tokens)
        t, h = inputs.x.shape
        if tuple(y.shape) != (t, h) or y.dtype != torch.bfloat16:
            raise ValueError(f"backend {getattr(self.backend, 'name', type(self.backend).__name__)!r} returned "
                             f"{y.dtype} {tuple(y.shape)}, expected torch.bfloat16 {(t, h)}")
        return y


_adapters: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def routed_adapter(backend) -> RoutedBackendAdapter:
    """The (cached) adapter of a backend, so that repeated block calls prepare the weights once."""
    if isinstance(backend, RoutedBackendAdapter):
        return backend
    try:
        ad = _adapters.get(backend)
    except TypeError:  # not weak-referenceable: no cache
        return RoutedBackendAdapter(backend)
    if ad is None:
        ad = _adapters[backend] = RoutedBackendAdapter(backend)
    return ad


def moe_block_fused(x: torch.Tensor, params: DeepSeekV4MoEParams, geometry: "Geometry | str", backend, *,
                    num_tokens: int | None = None, return_parts: bool = False):
    """The block with the routed part through a fused backend; routing and shared expert exactly as in
    ``moe_block_reference`` (so the two differ in the routed part only). ``num_tokens`` is the agreed
    launch count (rows past T are padding routed to -1). x bf16 [T, H] -> y bf16 [T, H]."""
    g = get_geometry(geometry)
    params.check(g)
    _check_x(x, g, params)
    logits, idx, w = route_block(x, params, g)
    routed = routed_adapter(backend)(MoEInputs(x, idx, w), params.experts, num_tokens)
    shared = shared_expert(x, params, g, torch.float32)
    recipe = getattr(backend, "recipe", None) or get_recipe("flashinfer-mxfp4")
    return _finish(routed, shared, logits, idx, w, get_recipe(recipe), return_parts)

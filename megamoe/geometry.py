"""Model geometry of one Mega MoE layer, with presets.

Dimension legend used across the library:
    T   tokens on one rank            K   top-k slots per token
    E   experts (global)              E_l experts local to one rank (E / R)
    H   hidden size                   I   expert intermediate size
    R   expert-parallel ranks         P   rows of the dispatched token pool
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Mapping

from .validate import as_float, as_int


@dataclass(frozen=True)
class Geometry:
    """Shape and routing constants of one MoE layer.

    ``clamp`` is the SwiGLU limit (gate clamped above, up clamped both ways);
    ``routed_scaling`` multiplies the normalised top-k weights once, at routing.
    """

    name: str
    num_experts: int  # E
    num_topk: int  # K
    hidden: int  # H
    intermediate: int  # I
    clamp: float = 10.0
    routed_scaling: float = 1.5
    num_shared_experts: int = 1
    norm_topk_prob: bool = True
    score_func: str = "sqrtsoftplus"  # or "softmax"

    def __post_init__(self) -> None:
        """Every field checked (``megamoe.validate``): integers are ints (8.0 is refused, not read as 8),
        clamp positive (+inf: no clamp, the kernels' own default) and routed_scaling finite and positive (a
        NaN clamp would reach the kernels as their ``activation_clamp`` and make every output row NaN)."""
        who = f"Geometry {self.name!r}"
        if not isinstance(self.name, str):
            raise TypeError(f"Geometry: name must be a str, got {type(self.name).__name__}")
        e = as_int("num_experts", self.num_experts, lo=1, who=who)
        as_int("num_topk", self.num_topk, lo=1, hi=e, who=who)
        for arg in ("hidden", "intermediate"):
            v = as_int(arg, getattr(self, arg), who=who)
            if v <= 0 or v % 128:
                raise ValueError(f"{who}: {arg} must be a positive multiple of 128, got {v!r}")
        as_float("clamp", self.clamp, lo=0.0, lo_open=True, allow_inf=True, who=who)  # +inf: no clamp
        as_float("routed_scaling", self.routed_scaling, lo=0.0, lo_open=True, who=who)
        as_int("num_shared_experts", self.num_shared_experts, lo=0, who=who)
        if not isinstance(self.norm_topk_prob, bool):
            raise TypeError(f"{who}: norm_topk_prob must be a bool, got {self.norm_topk_prob!r}")
        if self.score_func not in ("sqrtsoftplus", "softmax"):
            raise ValueError(f"{who}: score_func must be 'sqrtsoftplus' or 'softmax', got {self.score_func!r}")

    @classmethod
    def from_config(cls, config: Mapping[str, Any], *, name: str | None = None, **overrides) -> "Geometry":
        """The MoE layer of a model config: a HuggingFace-style ``config.json`` dict with DeepSeek's key
        names, or the dict of a Geometry (``dataclasses.asdict``; what every results.json records).

            hidden_size -> hidden                 moe_intermediate_size -> intermediate (per expert)
            n_routed_experts -> num_experts       num_experts_per_tok -> num_topk
            swiglu_limit -> clamp                 routed_scaling_factor -> routed_scaling (absent: 1.0)
            n_shared_experts (absent: 0)          norm_topk_prob (absent: False, HF's default)
            scoring_func -> score_func (absent: "softmax")

        ``num_local_experts`` / ``num_experts`` are accepted for the expert count; ``intermediate_size``
        is not, because in a DeepSeek config it is the dense MLP's width, not an expert's. A config
        whose model has no SwiGLU clamp has no ``swiglu_limit``: pass ``clamp=`` (``float("inf")``:
        none). ``overrides`` replace any field after the config is read (e.g. ``score_func``); a
        ``text_config`` sub-dict (multimodal configs) is read when the top level has no hidden size.
        """
        if not isinstance(config, Mapping):
            raise TypeError(f"Geometry.from_config: config must be a dict, got {type(config).__name__}")
        if "hidden_size" not in config and isinstance(config.get("text_config"), Mapping):
            config = config["text_config"]
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise TypeError(f"Geometry.from_config: unknown override(s) {unknown}; expected fields of {sorted(known)}")
        values: dict[str, Any] = {}
        for field_name, (keys, kind, default) in _CONFIG_KEYS.items():
            if field_name in overrides:
                continue
            key = next((k for k in keys if k in config), None)
            if key is None:
                if default is _REQUIRED:
                    extra = " or pass clamp= (float('inf') for no clamp)" if field_name == "clamp" else ""
                    raise ValueError(f"Geometry.from_config: config has none of {list(keys)} (for {field_name}){extra}")
                values[field_name] = default
                continue
            raw = config[key]
            ok = isinstance(raw, bool) if kind is bool else (
                isinstance(raw, (int, float)) and not isinstance(raw, bool) and (kind is float or float(raw).is_integer())
                if kind in (int, float) else isinstance(raw, str))
            if not ok:
                raise ValueError(f"Geometry.from_config: {key} must be {kind.__name__}, got {raw!r}")
            values[field_name] = kind(raw)
        label = name or config.get("name") or config.get("model_type") or "from-config"
        return cls(name=str(label), **{**values, **overrides})

    def experts_per_rank(self, num_ranks: int) -> int:
        """E_l = E / R; raises when R does not divide E."""
        num_ranks = as_int("num_ranks", num_ranks, who=f"Geometry {self.name!r}")
        if num_ranks <= 0 or self.num_experts % num_ranks:
            raise ValueError(
                f"num_ranks must divide num_experts={self.num_experts}, got num_ranks={num_ranks}"
            )
        return self.num_experts // num_ranks

    def with_(self, **changes) -> "Geometry":
        return replace(self, **changes)

    # Napkin math used by benchmarks and notebooks.
    def expert_weight_bytes(self, bytes_per_weight: float = 0.53125) -> float:
        """Bytes of one expert's L1 + L2 weights (MXFP4: 4 bits + one E8M0 byte per 32)."""
        return (2 * self.intermediate * self.hidden + self.hidden * self.intermediate) * bytes_per_weight

    def flops_per_routed_row(self) -> int:
        """FLOPs of L1 + L2 for one (token, slot) row: 2 * (2I*H + H*I)."""
        return 2 * (2 * self.intermediate * self.hidden + self.hidden * self.intermediate)


_REQUIRED = object()
# Geometry field -> (config keys tried in order, type, default when absent). HF DeepSeek names first.
_CONFIG_KEYS: dict[str, tuple[tuple[str, ...], type, Any]] = {
    "hidden": (("hidden_size", "hidden"), int, _REQUIRED),
    "intermediate": (("moe_intermediate_size", "intermediate"), int, _REQUIRED),
    "num_experts": (("n_routed_experts", "num_local_experts", "num_experts"), int, _REQUIRED),
    "num_topk": (("num_experts_per_tok", "num_topk"), int, _REQUIRED),
    "clamp": (("swiglu_limit", "clamp"), float, _REQUIRED),
    "routed_scaling": (("routed_scaling_factor", "routed_scaling"), float, 1.0),
    "num_shared_experts": (("n_shared_experts", "num_shared_experts"), int, 0),
    "norm_topk_prob": (("norm_topk_prob",), bool, False),
    "score_func": (("scoring_func", "score_func"), str, "softmax"),
}

PRESETS: dict[str, Geometry] = {
    g.name: g
    for g in (
        Geometry("dsv4-flash", num_experts=256, num_topk=6, hidden=4096, intermediate=2048),
        Geometry("dsv4-pro", num_experts=384, num_topk=6, hidden=7168, intermediate=3072),
        # Small presets keep every kernel constraint (H % 256, I % 128) so that they run on
        # the GPU kernels too, not just on the CPU reference.
        Geometry("small", num_experts=16, num_topk=4, hidden=512, intermediate=256),
        Geometry("tiny", num_experts=8, num_topk=2, hidden=256, intermediate=128),
    )
}


def get_geometry(name_or_geometry: "str | Geometry | Mapping") -> Geometry:
    """Look up a preset by name (``dsv4-flash``, ``dsv4-pro``, ``small``, ``tiny``); a Geometry is
    returned as is, a dict is read as a model config (``Geometry.from_config``)."""
    if isinstance(name_or_geometry, Geometry):
        return name_or_geometry
    if isinstance(name_or_geometry, Mapping):
        return Geometry.from_config(name_or_geometry)
    try:
        return PRESETS[name_or_geometry]
    except KeyError:
        raise ValueError(
            f"unknown geometry preset {name_or_geometry!r}; expected one of {sorted(PRESETS)}"
        ) from None

"""Model geometry of one Mega MoE layer, with presets.

Dimension legend used across the library:
    T   tokens on one rank            K   top-k slots per token
    E   experts (global)              E_l experts local to one rank (E / R)
    H   hidden size                   I   expert intermediate size
    R   expert-parallel ranks         P   rows of the dispatched token pool
"""

from __future__ import annotations

from dataclasses import dataclass, replace

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
        clamp and routed_scaling finite and positive (a NaN clamp would reach the kernels as their
        ``activation_clamp`` and make every output row NaN)."""
        who = f"Geometry {self.name!r}"
        if not isinstance(self.name, str):
            raise TypeError(f"Geometry: name must be a str, got {type(self.name).__name__}")
        e = as_int("num_experts", self.num_experts, lo=1, who=who)
        as_int("num_topk", self.num_topk, lo=1, hi=e, who=who)
        for arg in ("hidden", "intermediate"):
            v = as_int(arg, getattr(self, arg), who=who)
            if v <= 0 or v % 128:
                raise ValueError(f"{who}: {arg} must be a positive multiple of 128, got {v!r}")
        as_float("clamp", self.clamp, lo=0.0, lo_open=True, who=who)
        as_float("routed_scaling", self.routed_scaling, lo=0.0, lo_open=True, who=who)
        as_int("num_shared_experts", self.num_shared_experts, lo=0, who=who)
        if not isinstance(self.norm_topk_prob, bool):
            raise TypeError(f"{who}: norm_topk_prob must be a bool, got {self.norm_topk_prob!r}")
        if self.score_func not in ("sqrtsoftplus", "softmax"):
            raise ValueError(f"{who}: score_func must be 'sqrtsoftplus' or 'softmax', got {self.score_func!r}")

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


def get_geometry(name_or_geometry: "str | Geometry") -> Geometry:
    """Look up a preset by name (``dsv4-flash``, ``dsv4-pro``, ``small``, ``tiny``)."""
    if isinstance(name_or_geometry, Geometry):
        return name_or_geometry
    try:
        return PRESETS[name_or_geometry]
    except KeyError:
        raise ValueError(
            f"unknown geometry preset {name_or_geometry!r}; expected one of {sorted(PRESETS)}"
        ) from None

"""Fused FP8 staging of one rank's step into the symmetric buffer (see stage.py)."""

from .stage import (
    BACKENDS,
    ROUTED_SCALING_AFTER_STAGING,
    padding_scale,
    resolve_backend,
    stage_into,
    stage_reference,
    triton_available,
    validate_stage_args,
)

__all__ = [
    "BACKENDS", "ROUTED_SCALING_AFTER_STAGING", "padding_scale", "resolve_backend", "stage_into",
    "stage_reference", "triton_available", "validate_stage_args",
]

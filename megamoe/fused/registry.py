"""Every backend by name and its availability.

    BACKENDS                      {name: backend class}; a class is also the factory
                                  ``cls(geometry, capacity=..., force_block_m=None, group=None)``
    available_backends()          [(name, ok, reason)] for ``megamoe check``
    make_backend(name, g, ...)    an instance
"""

from __future__ import annotations

from .base import FusedBackend
from .deepgemm_fp4 import DeepGEMMFP4
from .deepgemm_fp8 import DeepGEMMFP8
from .flashinfer_mxfp4 import FlashInferMXFP4
from .staged_deepgemm import StagedDeepGEMM

BACKENDS: dict[str, type[FusedBackend]] = {
    cls.name: cls for cls in (FlashInferMXFP4, DeepGEMMFP8, DeepGEMMFP4, StagedDeepGEMM)
}


def get_backend_class(name: str) -> type[FusedBackend]:
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; expected one of {sorted(BACKENDS)}") from None


def available_backends() -> list[tuple[str, bool, str]]:
    """[(name, ok, reason)] for every backend; reason says why not (no GPU, not Hopper, package
    missing, kernel missing) and is '' when ok. Never raises."""
    out = []
    for name, cls in BACKENDS.items():
        try:
            ok, why = cls.availability()
        except Exception as exc:  # noqa: BLE001 - an availability probe must not take the CLI down
            ok, why = False, f"availability check failed: {type(exc).__name__}: {exc}"
        out.append((name, bool(ok), "" if ok else str(why)))
    return out


def make_backend(name: str, geometry, **kwargs) -> FusedBackend:
    return get_backend_class(name)(geometry, **kwargs)

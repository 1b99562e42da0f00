"""Every backend by name and its availability.

    BACKENDS                      {name: backend class}; a class is also the factory
                                  ``cls(geometry, capacity=..., force_block_m=None, group=None)``
    register_backend(cls)         add a backend class defined outside the package (usable as a
                                  decorator); ``megamoe.check.matrix.run_matrix(cls.name, ...)`` and the
                                  benchmark sweep then find it by name like the built-in ones
    unregister_backend(name)      remove one added with register_backend
    load_backend_module(module)   import a user's module that registers backends (``--backend-module``)
    load_entry_points()           the same for every installed package's ``megamoe.backends`` entry point
    available_backends()          [(name, ok, reason)] for ``megamoe check``
    all_backend_names()           what ``--backends all`` stands for: every registered backend whose class has
                                  ``in_all`` (all but ``megamoe-decode``, the exact CUDA-core kernel kept for
                                  teaching and for its exact recipe; it runs when named)
    make_backend(name, g, ...)    an instance
"""

from __future__ import annotations

import importlib
import os
import sys

from .base import FusedBackend
from .deepgemm_fp4 import DeepGEMMFP4
from .deepgemm_fp8 import DeepGEMMFP8
from .flashinfer_mxfp4 import FlashInferMXFP4
from .humming import HummingW4A8, HummingW4A16
from .megamoe_decode import MegaMoEDecode, MegaMoEDecodeTC
from .staged_deepgemm import StagedDeepGEMM

BACKENDS: dict[str, type[FusedBackend]] = {
    cls.name: cls for cls in (FlashInferMXFP4, DeepGEMMFP8, DeepGEMMFP4, StagedDeepGEMM, MegaMoEDecode,
                             MegaMoEDecodeTC, HummingW4A8, HummingW4A16)
}


BUILTIN = frozenset(BACKENDS)


def register_backend(cls: type[FusedBackend], *, replace: bool = False) -> type[FusedBackend]:
    """Register a ``FusedBackend`` subclass under ``cls.name``; returns ``cls`` (so it works as a class
    decorator). Checked here, before anything runs: a subclass of FusedBackend, a non-empty ``name``,
    its own ``availability``, and a name not taken (``replace=True`` swaps a registered external class;
    the built-in names are never replaced)."""
    if not (isinstance(cls, type) and issubclass(cls, FusedBackend)):
        raise TypeError(f"register_backend: cls must be a subclass of megamoe.fused.base.FusedBackend, got {cls!r}")
    name = getattr(cls, "name", "")
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"register_backend: {cls.__name__}.name must be a non-empty str, got {name!r}")
    if cls.availability.__func__ is FusedBackend.availability.__func__:
        raise TypeError(f"register_backend: {cls.__name__} must define availability() -> (ok, reason)")
    if not isinstance(cls.in_all, bool):
        raise TypeError(f"register_backend: {cls.__name__}.in_all must be a bool, got {type(cls.in_all).__name__} "
                        f"{cls.in_all!r}")
    if name in BUILTIN and BACKENDS[name] is not cls:
        raise ValueError(f"register_backend: {name!r} is a built-in backend; pick another name "
                         f"(built-in: {sorted(BUILTIN)})")
    if name in BACKENDS and BACKENDS[name] is not cls and not replace:
        raise ValueError(f"register_backend: {name!r} is already registered to {BACKENDS[name].__qualname__}; "
                         "pass replace=True to swap it")
    BACKENDS[name] = cls
    return cls


def unregister_backend(name: str) -> None:
    """Remove a backend added with ``register_backend`` (the built-in ones stay)."""
    if name in BUILTIN:
        raise ValueError(f"unregister_backend: {name!r} is built in and cannot be removed")
    get_backend_class(name)
    del BACKENDS[name]


ENTRY_POINT_GROUP = "megamoe.backends"
_MODULE_BACKENDS: dict[str, list[str]] = {}  # module -> the names its import registered (a second load: the same)


def load_backend_module(module: str) -> list[str]:
    """Import ``module`` (``PKG.MODULE``, importable from the current folder or the installed packages), whose
    import registers its backends with ``register_backend``; returns the names it registered. An ImportError or the
    module's own error propagates (the CLI turns it into a refused argument)."""
    if not module or not all(part.isidentifier() for part in module.split(".")):
        raise ValueError(f"{module!r} is not a module name (expected PKG.MODULE, e.g. my_kernels.backend)")
    if os.getcwd() not in sys.path and "" not in sys.path:  # as `python -m` does: the user's folder first
        sys.path.insert(0, os.getcwd())
    if module not in _MODULE_BACKENDS:
        before = set(BACKENDS)
        importlib.import_module(module)
        _MODULE_BACKENDS[module] = [n for n in BACKENDS if n not in before]
    return [n for n in _MODULE_BACKENDS[module] if n in BACKENDS]


def load_entry_points() -> tuple[list[str], dict[str, str]]:
    """Every installed ``megamoe.backends`` entry point: one that names a module is imported (it registers its
    backends), one that names a FusedBackend subclass is registered. Returns (names added, {entry point: why it
    failed}); a broken entry point of some other package never stops the caller."""
    from importlib.metadata import entry_points

    before, failed = set(BACKENDS), {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            obj = ep.load()
            if isinstance(obj, type):
                if BACKENDS.get(getattr(obj, "name", None)) is not obj:
                    register_backend(obj)
        except Exception as exc:  # noqa: BLE001 - another package's bug is reported, not raised
            failed[f"{ep.name} = {ep.value}"] = f"{type(exc).__name__}: {exc}"
    return [n for n in BACKENDS if n not in before], failed


def get_backend_class(name: str) -> type[FusedBackend]:
    try:
        return BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown backend {name!r}; expected one of {sorted(BACKENDS)}") from None


def all_backend_names() -> list[str]:
    """The registered backends ``--backends all`` stands for, in registry order: those whose class has ``in_all``
    (``FusedBackend.in_all``). Whether each runs here is the caller's to ask (``availability``)."""
    return [name for name, cls in BACKENDS.items() if cls.in_all]


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

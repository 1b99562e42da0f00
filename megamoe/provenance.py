"""Where the code that ran came from, read from the modules actually imported.

A results file that says "deep_gemm 0.1.5.post1" because that wheel is installed, while a source build of
DeepGEMM earlier on ``sys.path`` was the module that ran, is wrong in the one fact a reviewer needs. So
versions here come from ``sys.modules`` (``__version__`` and ``__file__`` of the imported module), never from
installed-package metadata, and a source build staged by ``megamoe.fused.deepgemm_build`` adds the pull
request and commit it was built from (its ``BUILD.json``).

    module_provenance("deep_gemm") -> {"module": "deep_gemm", "version": "2.6.1+pr323.g8ddf7f9",
                                       "file": ".../deep_gemm/__init__.py", "build": {...} or None}
    imported_kernel_modules()      -> {name: module_provenance(name)} for every kernel package imported
"""

from __future__ import annotations

import json
import os
import sys

KERNEL_MODULES = ("flashinfer", "deep_gemm", "triton", "tvm_ffi")
BUILD_INFO_FILE = "BUILD.json"


def module_provenance(name: str) -> dict | None:
    """Version, file and build record of the imported module ``name``; None when it is not imported."""
    mod = sys.modules.get(name)
    if mod is None:
        return None
    path = getattr(mod, "__file__", None)
    build = None
    if path:
        info = os.path.join(os.path.dirname(path), BUILD_INFO_FILE)
        if os.path.exists(info):
            try:
                with open(info) as f:
                    build = json.load(f)
            except (OSError, ValueError) as exc:
                build = {"error": f"unreadable {BUILD_INFO_FILE}: {exc}"}
    return {"module": name, "version": getattr(mod, "__version__", None), "file": path, "build": build}


def imported_kernel_modules() -> dict[str, dict]:
    """{name: provenance} for the kernel packages this process has imported (none are imported here)."""
    return {n: p for n in KERNEL_MODULES if (p := module_provenance(n)) is not None}

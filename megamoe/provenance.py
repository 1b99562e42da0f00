"""Where the code that ran came from, read from the modules actually imported.

A results file that says "deep_gemm 0.1.5.post1" because that wheel is installed, while a source build of
DeepGEMM earlier on ``sys.path`` was the module that ran, is wrong in the one fact a reviewer needs. So
versions here come from ``sys.modules`` (``__version__`` and ``__file__`` of the imported module), never from
installed-package metadata, and a source build staged by ``megamoe.fused.deepgemm_build`` adds the pull
request and commit it was built from (its ``BUILD.json``).

    module_provenance("deep_gemm") -> {"module": "deep_gemm", "version": "2.6.1+pr323.g8ddf7f9",
                                       "file": ".../deep_gemm/__init__.py", "build": {...} or None}
    imported_kernel_modules()      -> {name: module_provenance(name)} for every kernel package imported
    package_git("rev-parse", "HEAD") -> git's answer about megamoe's own checkout, or "" when it has none

The commit a result records is megamoe's own: git runs in the folder above the package and its answer counts only
when that folder is the top of the checkout. A copy of megamoe inside some other repository (vendored, unpacked
from an sdist into a project) would otherwise record that repository's commit as megamoe's.
"""

from __future__ import annotations

import json
import os
import subprocess
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


def package_root() -> str:
    """The folder that holds the ``megamoe`` package (a checkout's top, for an editable install)."""
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def package_git(*args: str) -> str:
    """``git *args`` in megamoe's own checkout -> its output, stripped; "" when there is no git, no checkout, or
    the checkout around the package is some other repository's (its top is not the package's parent)."""
    root = package_root()

    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], cwd=root, capture_output=True, text=True, timeout=10).stdout.strip()
        except Exception:  # noqa: BLE001 - no git, or not a checkout
            return ""

    top = git("rev-parse", "--show-toplevel")
    if not top or os.path.realpath(top) != os.path.realpath(root):
        return ""
    return git(*args)

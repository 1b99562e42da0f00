"""Where a run and its code came from: the modules actually imported, the commit, the card. What a results file
(``megamoe bench``, ``megamoe check --save``) says about the run that made it.

    module_provenance("deep_gemm") -> {"module": "deep_gemm", "version": "2.6.1+pr323.g8ddf7f9",
                                       "file": ".../deep_gemm/__init__.py", "build": {...} or None}
    imported_kernel_modules()      -> {name: module_provenance(name)} for every kernel package imported
    tree_commit()                  the commit: MEGAMOE_COMMIT, else git's HEAD
    run_metadata(device)           date, card, commit, the megamoe version, python / torch / CUDA versions, every
                                   kernel module as imported, and the card's identity (UUID, serial, PCI bus, power
                                   limit, VBIOS)
    new_results_dir(parent, meta, suffix="")   a fresh folder <date>_<card>_<commit><suffix>[-2, -3, ...]
    gpu_state(device)              SM / memory clock, power, P-state and throttle reasons (nvidia-smi), '' on a CPU

A results file that says "deep_gemm 0.1.5.post1" because that wheel is installed, while a source build of
DeepGEMM earlier on ``sys.path`` was the module that ran, is wrong in the one fact a reviewer needs. So
versions here come from ``sys.modules`` (``__version__`` and ``__file__`` of the imported module), never from
installed-package metadata, and a source build staged by ``megamoe.fused.deepgemm_build`` adds the pull
request and commit it was built from (its ``BUILD.json``).

    package_git("rev-parse", "HEAD") -> git's answer about megamoe's own checkout, or "" when it has none

The commit a result records is megamoe's own: git runs in the folder above the package and its answer counts only
when that folder is the top of the checkout. A copy of megamoe inside some other repository (vendored, unpacked
from an sdist into a project) would otherwise record that repository's commit as megamoe's.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
import sys

import torch

KERNEL_MODULES = ("flashinfer", "deep_gemm", "humming", "triton", "tvm_ffi")
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


# ---- the run: its device, card, commit and versions ------------------------------------------------------------


def resolve_device(device=None) -> torch.device:
    """``device``, else the GPU when torch sees one, else the CPU."""
    if device is not None:
        return torch.device(device)
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def device_name(device=None) -> str:
    """The card's name (torch's), or the CPU's."""
    dev = resolve_device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return f"cpu ({platform.processor() or platform.machine()})"


def _git(*args) -> str:
    """git in megamoe's own checkout only ("" inside another repository: ``package_git``)."""
    return package_git(*args)


def versions() -> dict:
    """megamoe, python, torch and CUDA versions, and each kernel module imported so far (version and path)."""
    from . import __version__

    v = {"megamoe": __version__, "python": platform.python_version(), "torch": torch.__version__,
         "cuda": torch.version.cuda}
    for name, prov in imported_kernel_modules().items():
        v[name] = prov.get("version") or "?"
    return v


def tree_commit() -> str:
    """MEGAMOE_COMMIT if set (a copy of the tree without its git metadata), else git's HEAD, else 'unknown'."""
    return os.environ.get("MEGAMOE_COMMIT") or _git("rev-parse", "--short=10", "HEAD") or "unknown"


def run_metadata(device=None) -> dict:
    """What a results file records about its run (the module docstring's list)."""
    dev = resolve_device(device)
    env_commit = os.environ.get("MEGAMOE_COMMIT")
    meta = {"date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "card": device_name(dev),
            "commit": tree_commit(),
            "dirty": None if env_commit else bool(_git("status", "--porcelain", "--untracked-files=no")),
            "versions": versions(), "kernel_modules": imported_kernel_modules()}
    if dev.type == "cuda":
        p = torch.cuda.get_device_properties(dev)
        meta.update(sm_count=p.multi_processor_count, memory_gib=round(p.total_memory / 2**30, 1),
                    capability=f"{p.major}.{p.minor}", gpu=card_identity(dev, getattr(p, "uuid", None)))
    return meta


def card_identity(dev: torch.device, uuid=None) -> dict:
    """Which physical card ran: its UUID (torch), and serial, PCI bus, power limit and VBIOS where nvidia-smi
    answers. Figures from two runs can differ by more than one run's two passes, and a run may land on another
    H200, so a comparison across runs needs to know whether the card was the same."""
    ident = {"uuid": None if uuid is None else str(uuid)}
    keys = ("serial", "pci.bus_id", "power.limit", "clocks.max.sm", "vbios_version")
    try:
        idx = dev.index if dev.index is not None else torch.cuda.current_device()
        out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(keys)}", "--format=csv,noheader", "-i", str(idx)],
                             capture_output=True, text=True, timeout=20, check=True).stdout
        ident.update(zip(keys, (x.strip() for x in out.strip().split(","))))
    except (OSError, subprocess.SubprocessError, ValueError):
        pass  # no nvidia-smi: the UUID alone
    return ident


def results_dir_name(meta: dict, suffix: str = "") -> str:
    card = "".join(c if c.isalnum() else "-" for c in meta["card"]).strip("-").lower()
    while "--" in card:
        card = card.replace("--", "-")
    return f"{meta['date'][:10]}_{card}_{meta['commit']}{suffix}"


def new_results_dir(parent: str, meta: dict, suffix: str = "") -> str:
    """Create and return a results folder under ``parent`` that did not exist before: reruns never overwrite
    (a second run of the same day, card and commit gets -2, then -3, ...)."""
    base = os.path.join(parent, results_dir_name(meta, suffix))
    os.makedirs(parent, exist_ok=True)
    path, n = base, 1
    while True:
        try:
            os.makedirs(path)
            return path
        except FileExistsError:
            n += 1
            path = f"{base}-{n}"


def gpu_state(device) -> str:
    """SM / memory clock, power, P-state and clock-event reasons from nvidia-smi ('' on a CPU or without it):
    recorded around every CUDA row, so a row whose passes disagree shows whether the card changed state."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return ""
    try:
        idx = torch.cuda.current_device() if dev.index is None else dev.index
        out = subprocess.run(["nvidia-smi", "-i", str(idx), "--query-gpu=clocks.sm,clocks.mem,power.draw,pstate,"
                              "clocks_event_reasons.active", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=5)
        return out.stdout.strip()
    except Exception:  # noqa: BLE001 - diagnostics only
        return ""

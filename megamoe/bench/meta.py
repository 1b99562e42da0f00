"""What a results file says about the run that made it: when, which commit, which card, which code.

    tree_commit()            the commit: MEGAMOE_COMMIT, else git's HEAD
    run_metadata(device)     date, card, commit (tree_commit), the megamoe version, python / torch /
                             CUDA versions, every kernel module as actually imported (megamoe.provenance), and
                             the card's identity (UUID, serial, PCI bus, power limit, VBIOS)
    new_results_dir(parent, meta, suffix="")   a fresh folder <date>_<card>_<commit><suffix>[-2, -3, ...]
    gpu_state(device)        SM / memory clock, power, P-state and throttle reasons (nvidia-smi), '' on a CPU

Versions come from the modules imported in this process, never from installed-package metadata: a wheel of
sgl-deep-gemm may be installed while a source build of DeepGEMM earlier on sys.path is the one that ran.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import subprocess

import torch

from .ceilings import device_name
from .timing import resolve_device


def _git(*args) -> str:
    """git in megamoe's own checkout only ("" inside another repository: ``provenance.package_git``)."""
    from ..provenance import package_git

    return package_git(*args)


def versions() -> dict:
    """megamoe, python, torch and CUDA versions, and each kernel module imported so far (version and path)."""
    from .. import __version__
    from ..provenance import imported_kernel_modules

    v = {"megamoe": __version__, "python": platform.python_version(), "torch": torch.__version__,
         "cuda": torch.version.cuda}
    for name, prov in imported_kernel_modules().items():
        v[name] = prov.get("version") or "?"
    return v


def tree_commit() -> str:
    """MEGAMOE_COMMIT if set (a copy of the tree without its git metadata), else git's HEAD, else 'unknown'."""
    return os.environ.get("MEGAMOE_COMMIT") or _git("rev-parse", "--short=10", "HEAD") or "unknown"


def run_metadata(device=None) -> dict:
    from ..provenance import imported_kernel_modules

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

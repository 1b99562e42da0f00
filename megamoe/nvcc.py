"""nvcc for megamoe's CUDA sources (the 1-token CUDA step, the read ceiling's persistent read): one lookup, and one
cached build of a shared library per sources and flags.

    find_nvcc()                                    ``$CUDA_HOME/bin/nvcc``, else the one on PATH, else None
    build_shared(prefix, main, parts, flags, ...)  nvcc ``flags`` -o <cache>/<prefix>-<hash>.so ``main``; the hash
                                                   covers every file in ``parts`` and the flags; built aside, then
                                                   renamed (two processes may race to build it)
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path


def find_nvcc() -> str | None:
    """The nvcc to build with: ``$CUDA_HOME/bin/nvcc``, else the one on PATH."""
    home = os.environ.get("CUDA_HOME")
    if home and (Path(home) / "bin" / "nvcc").exists():
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def build_shared(prefix: str, main: Path, parts, flags, out_dir: str | os.PathLike | None = None, *,
                 what: str = "this CUDA source", exe: str | None = None, note: str = "") -> Path:
    """Compile ``main`` with ``flags`` into a shared library under ``out_dir`` (else ``$MEGAMOE_CACHE`` or
    ``~/.cache/megamoe``), once per content of ``parts`` (``main`` and the headers it includes) and flags; returns
    its path. ``exe``: the nvcc (the caller's lookup; None: ``find_nvcc``), ``note``: said in a failure's message.
    Raises RuntimeError without nvcc, or with nvcc's message when it fails."""
    exe = exe or find_nvcc()
    if exe is None:
        raise RuntimeError(f"building {what} needs nvcc (CUDA_HOME/bin or PATH)")
    files = sorted({Path(main), *map(Path, parts)})
    key = hashlib.sha256(b"".join(f.read_bytes() for f in files) + " ".join(flags).encode()).hexdigest()[:16]
    root = Path(out_dir or os.environ.get("MEGAMOE_CACHE", Path.home() / ".cache" / "megamoe"))
    lib = root / f"{prefix}-{key}.so"
    if not lib.exists():
        root.mkdir(parents=True, exist_ok=True)
        tmp = lib.with_suffix(f".{os.getpid()}.tmp")
        run = subprocess.run([exe, *flags, "-o", str(tmp), str(main)], capture_output=True, text=True)
        if run.returncode:
            raise RuntimeError(f"nvcc failed on {Path(main).name}{f' ({note})' if note else ''}:\n{run.stderr[-4000:]}")
        tmp.replace(lib)
    return lib

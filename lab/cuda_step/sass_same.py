"""Which step does the lab measure? The lab's probe build (probe_step.cu, over its copy of the kernel in
probe_kernel/) compiles the step as instance 0 (step1_kernel<0>); it must be the step as the library compiled it at
``STUDIED`` (the last revision whose headers carried the probe hooks; git export), instruction by instruction and
encoding by encoding. The library's step now (megamoe/decode/cuda/cuda_step.cu) is that code without the probe modes'
reads, and is reported beside it; ``--rev`` compares with another revision's step instead.

    python3 lab/cuda_step/sass_same.py [--rev f81e963]     (nvcc, cuobjdump and git; no GPU) -> exit 1 if they differ

All for sm_90a with the library's flags. The function's name is left out of the comparison (it holds the source
file's name).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from megamoe.decode import cuda_step  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
STEP = "step1_kernelILi0EE"  # the mangled name's part that says: the instance of kProbe 0
LIBRARY_STEP = "step1_kernelENS_6ParamsE"  # the library's step (no template since the probe hooks left it)
STUDIED = "1a7f0ec"  # the library's step the lab's studies measured (the probe modes' reads in it)
FLAGS = tuple(f for f in cuda_step.NVCC_FLAGS if f not in ("-Xcompiler", "-fPIC", "-shared"))  # a cubin of them


def cuobjdump() -> str | None:
    """$CUDA_HOME/bin/cuobjdump, the one on PATH, or the one Triton bundles."""
    home = os.environ.get("CUDA_HOME")
    if home and (Path(home) / "bin" / "cuobjdump").exists():
        return str(Path(home) / "bin" / "cuobjdump")
    if found := shutil.which("cuobjdump"):
        return found
    try:
        import triton
    except ImportError:
        return None
    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(bundled) if bundled.exists() else None


def step_sass(source: Path, workdir: Path, instance: str = STEP) -> str:
    """The SASS of the step's instance (or another: ``instance``, part of its mangled name) in ``source`` compiled for
    sm_90a: its lines, the function's name left out. The cubin is kept in ``workdir`` for the next instance."""
    cubin = workdir / f"{source.stem}.cubin"
    if not cubin.exists():
        build = subprocess.run([cuda_step.nvcc(), *FLAGS, "-cubin", "-o", str(cubin), str(source)],
                               capture_output=True, text=True)
        if build.returncode:
            raise RuntimeError(f"nvcc failed on {source}:\n{build.stderr[-4000:]}")
    text = subprocess.run([cuobjdump(), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    for block in re.split(r"\n\s*Function : ", text)[1:]:
        name, body = block.split("\n", 1)
        if instance in name:
            return body.split("\n\t\t.....")[0]
    raise RuntimeError(f"no {instance} in {source}'s SASS")


def revision_source(rev: str, dest: Path) -> Path:
    """The step's .cu of git revision ``rev`` with the headers beside it, exported into ``dest``."""
    for folder in ("megamoe/decode/cuda",):
        listing = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", f"{rev}:{folder}"],
                                 capture_output=True, text=True, check=True).stdout.split()
        for name in listing:
            blob = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{folder}/{name}"], capture_output=True,
                                  check=True).stdout
            (dest / name).write_bytes(blob)
        sources = [n for n in listing if n.endswith(".cu")]
        if len(sources) == 1:
            return dest / sources[0]
    raise RuntimeError(f"revision {rev} holds no single .cu in megamoe/decode/cuda")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rev", default=STUDIED, help=f"the revision whose step the lab's instance 0 must be ({STUDIED})")
    args = ap.parse_args(argv)
    if cuda_step.nvcc() is None or cuobjdump() is None:
        print("needs nvcc and cuobjdump (CUDA_HOME/bin, PATH or Triton's)", file=sys.stderr)
        return 2
    count = lambda sass: len(re.findall(r"/[*][0-9a-f]{4,}[*]/", sass))  # noqa: E731
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        lab = step_sass(Path(__file__).with_name("probe_step.cu"), work)
        (work / "rev").mkdir()
        rev = step_sass(revision_source(args.rev, work / "rev"), work / "rev")
        library = step_sass(cuda_step.SOURCE, work, LIBRARY_STEP)
    print(f"lab/cuda_step/probe_step.cu's step: {'the same as' if lab == rev else 'DIFFERENT from'} revision "
          f"{args.rev}'s ({count(lab)} instructions; the revision's {count(rev)})")
    print(f"the library's step now: {count(library)} instructions (without the probe modes' reads)")
    return 0 if lab == rev else 1


if __name__ == "__main__":
    raise SystemExit(main())

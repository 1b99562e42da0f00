"""Build DeepGEMM's SM90 FP8 x FP4 Mega MoE from source, as a dependency outside this package.

    python -m megamoe.fused.deepgemm_build SRC [DEST]        (scripts/build_deepgemm.sh SRC [DEST])

No installable package ships the SM90 FP8 x FP4 Mega MoE: it is DeepGEMM pull request #323 (``PIN`` below,
the one place the project pins it), which carries sgl-project/DeepGEMM pull request #53 onto upstream main.
SRC is a DeepGEMM tree at that ref: a git checkout with its submodules (cutlass, fmt), or the unpacked
source archive of the same commit. The build stages, in DEST (default ``build/deepgemm-pr323``):

    DEST/deep_gemm/            the importable package, laid out as DeepGEMM's own build_sgl_deep_gemm.sh
                               lays it out: sgl_deep_gemm's ``__init__`` and cuda_helpers, deep_gemm's utils,
                               testing, legacy and mega, and the JIT headers (deep_gemm, cute, cutlass)
    DEST/deep_gemm/VERSION     "2.6.1+pr323.g8ddf7f9" (``deep_gemm.__version__``)
    DEST/deep_gemm/BUILD.json  pin, source, torch and date: what ``megamoe.provenance`` reports
    DEST/csrc, DEST/third-party/{cutlass,fmt}/include   what the package compiles ``_C.so`` from
    DEST/jit-cache/            this build's kernel cache (DG_JIT_CACHE_DIR), apart from any other deep_gemm

then imports ``deep_gemm`` once in a child process, which compiles ``_C.so`` (tvm-ffi) against the installed
torch, and checks the SM90 FP4 entry points. It prints how to put DEST on ``sys.path``. Only one ``deep_gemm``
can be imported per process: with DEST first on the path, this build serves the FP4 backend; without it,
sgl-deep-gemm 0.1.5.post1 (the wheel) serves the FP8 backends. Results name the build that ran
(``megamoe.provenance``), so the two are never mixed up silently.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class DeepGEMMPin:
    """The DeepGEMM source the deepgemm-sm90-fp4 backend is built and verified against."""

    repo: str
    pull: int
    commit: str  # short hash of the pull request's head
    base_version: str  # deep_gemm.__version__ upstream at that commit
    # sha256 of the files that define the kernel's numerics and host API: an unpacked archive has no git
    # metadata, so these identify the ref (a git checkout is checked by its HEAD as well).
    files: dict = field(default_factory=dict)
    # megamoe's patches to the staged copy (deepgemm_patches/, applied in order; the source is never touched)
    patches: tuple = ()

    @property
    def version(self) -> str:
        return f"{self.base_version}+pr{self.pull}.g{self.commit}"

    def build_version(self, patched: bool) -> str:
        """``deep_gemm.__version__`` of a build: the pull request's, plus ``.megamoe<N>`` with N patches."""
        return f"{self.version}.megamoe{len(self.patches)}" if patched and self.patches else self.version

    @property
    def fetch(self) -> str:
        return (f"git clone {self.repo} DeepGEMM && cd DeepGEMM && git fetch origin pull/{self.pull}/head && "
                f"git checkout {self.commit} && git submodule update --init --recursive")


PIN = DeepGEMMPin(
    repo="https://github.com/deepseek-ai/DeepGEMM",
    pull=323,
    commit="8ddf7f9",
    base_version="2.6.1",
    files={
        "deep_gemm/include/deep_gemm/impls/sm90_fp8_fp4_mega_moe.cuh":
            "a2a7cd9d204963e05c098ef54c32967d573a8473c0a2b0d8148fe193977a0b1b",
        "deep_gemm/include/deep_gemm/common/fp4_decode_detail.cuh":
            "983febe6f418fa58931987173a9fa4a6561902a26641f2f64196a0d53e3891f4",
        "csrc/apis/sm90_mega.hpp": "f4bca0e61c83b9f4ec45ceb9a15e1fd10363adbd64e2eafb5970ba75eff5b1ef",
        "csrc/jit_kernels/heuristics/sm90_mega_moe.hpp":
            "38ddc2f0c3a0d610c07095452dd811b626d574c856804c640b76e864c05faf79",
        "csrc/jit_kernels/impls/sm90_fp8_fp4_mega_moe.hpp":
            "3d4e24012acc8d496c3713091814406d8833c789393ac434b2108355f2301680",
        "sgl_deep_gemm/__init__.py": "454b60171c9485069d978210a5e66127ef6c1afce51e5fbba55a2b0336ae5d56",
    },
    patches=("0001-sm90-fp4-mega-moe-proxy-fences.patch",),
)
PATCH_DIR = Path(__file__).with_name("deepgemm_patches")
DEFAULT_DEST = Path("build") / f"deepgemm-pr{PIN.pull}"
# What the build must expose for the deepgemm-sm90-fp4 backend.
SM90_FP4_ENTRY_POINTS = ("fp8_fp4_mega_moe", "transform_weights_for_mega_moe_sm90_fp4",
                         "get_symm_buffer_for_sm90_mega_moe")
JIT_CACHE = "jit-cache"
# DeepGEMM keys its kernel cache on the generated launcher source, not on the headers it includes: kernels
# compiled from other headers (an unpatched build) would be reused silently. The cache records the build.
JIT_CACHE_OWNER = "BUILD-VERSION"
_PACKAGE_SUBDIRS = ("utils", "testing", "legacy", "mega")


class SourceError(ValueError):
    """SRC is not a DeepGEMM tree at the pinned ref (the message says what differs)."""


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def verify_source(src: Path, pin: DeepGEMMPin = PIN) -> dict:
    """Raise SourceError unless ``src`` is DeepGEMM at ``pin`` with its submodules; return what was checked."""
    src = Path(src)
    if not src.is_dir():
        raise SourceError(f"SRC {str(src)!r} is not a directory")
    needed = ["csrc/tvm_ffi_api.cpp", "sgl_deep_gemm/__init__.py", "sgl_deep_gemm/cuda_helpers.py",
              "deep_gemm/include/deep_gemm", "third-party/cutlass/include/cute", "third-party/cutlass/include/cutlass",
              "third-party/fmt/include/fmt"]
    missing = [p for p in needed if not (src / p).exists()]
    if missing:
        hint = " (run `git submodule update --init --recursive` in SRC)" if any("third-party" in m for m in missing) else ""
        raise SourceError(f"SRC {str(src)!r} lacks {', '.join(missing)}{hint}: expected a DeepGEMM tree at "
                          f"pull request #{pin.pull} ({pin.commit})")
    changed = [rel for rel, digest in pin.files.items() if not (src / rel).exists() or _sha256(src / rel) != digest]
    if changed:
        raise SourceError(f"SRC {str(src)!r} is not DeepGEMM pull request #{pin.pull} at {pin.commit}: these files "
                          f"differ from the pinned ones: {', '.join(changed)}. Get the pinned tree with: {pin.fetch}")
    head = None
    if (src / ".git").exists():
        try:
            head = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True,
                                  check=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            head = None
        if head and not head.startswith(pin.commit):
            raise SourceError(f"SRC {str(src)!r} is a git checkout at {head[:10]}, expected {pin.commit}")
    return {"files_verified": sorted(pin.files), "git_head": head}


def apply_patches(pkg: Path, pin: DeepGEMMPin = PIN) -> list:
    """Apply ``pin.patches`` to the staged package ``pkg`` (paths in the patches start at the DeepGEMM root,
    ``deep_gemm/...``); returns [{name, sha256}]. Raises SourceError naming the patch that does not apply."""
    if shutil.which("patch"):
        command = ["patch", "-p2", "--forward", "--batch", "--no-backup-if-mismatch", "-i"]
    elif shutil.which("git"):  # `git apply` outside a repository patches plain files as `patch` does
        command = ["git", "apply", "-p2"]
    else:
        raise SourceError("applying megamoe's DeepGEMM patches needs `patch` or `git` (or pass --no-patches to "
                          "build the pull request unpatched)")
    applied = []
    for name in pin.patches:
        path = PATCH_DIR / name
        proc = subprocess.run([*command, str(path)], cwd=str(pkg), capture_output=True, text=True, timeout=60)
        if proc.returncode:
            raise SourceError(f"patch {name} does not apply to {pkg}: {proc.stdout[-800:]}{proc.stderr[-800:]}")
        applied.append({"name": name, "sha256": _sha256(path)})
    return applied


def build_identity(pkg: Path) -> str:
    """What a staged package's kernels are compiled from: its version and the digests of its patches."""
    info = json.loads((Path(pkg) / "BUILD.json").read_text())
    return " ".join([info["version"], *(p["sha256"][:16] for p in info.get("patches", []))])


def own_jit_cache(dest: Path, identity: str) -> Path:
    """``dest/jit-cache``, emptied unless it was filled by this very build (``identity``, see JIT_CACHE_OWNER)."""
    cache = Path(dest) / JIT_CACHE
    owner = cache / JIT_CACHE_OWNER
    if cache.exists() and (not owner.exists() or owner.read_text().strip() != identity):
        shutil.rmtree(cache)
    cache.mkdir(parents=True, exist_ok=True)
    owner.write_text(identity + "\n")
    return cache


def stage(src: Path, dest: Path, pin: DeepGEMMPin = PIN, patched: bool = True) -> Path:
    """Lay out the importable package in ``dest`` (see the module docstring) and apply megamoe's patches
    unless ``patched`` is False; returns ``dest/deep_gemm``."""
    src, dest = Path(src).resolve(), Path(dest).resolve()
    checked = verify_source(src, pin)
    pkg = dest / "deep_gemm"
    if pkg.exists():
        shutil.rmtree(pkg)
    pkg.mkdir(parents=True)
    for name in ("__init__.py", "cuda_helpers.py"):
        shutil.copy2(src / "sgl_deep_gemm" / name, pkg / name)
    for sub in _PACKAGE_SUBDIRS:
        shutil.copytree(src / "deep_gemm" / sub, pkg / sub)
    inc = pkg / "include"
    shutil.copytree(src / "deep_gemm/include/deep_gemm", inc / "deep_gemm")
    for lib in ("cute", "cutlass"):
        shutil.copytree(src / "third-party/cutlass/include" / lib, inc / lib)
    # What `import deep_gemm` compiles _C.so from: <root>/csrc and <root>/third-party/*/include, root = dest.
    for rel in ("csrc", "third-party/cutlass/include", "third-party/fmt/include"):
        if (dest / rel).exists():
            shutil.rmtree(dest / rel)
        shutil.copytree(src / rel, dest / rel)
    patches = apply_patches(pkg, pin) if patched else []
    version = pin.build_version(patched)
    (pkg / "VERSION").write_text(version + "\n")
    import torch

    info = {"source": f"DeepGEMM PR #{pin.pull} at {pin.commit}", "repo": pin.repo, "pull": pin.pull,
            "commit": pin.commit, "version": version, "patches": patches, "src": str(src), **checked,
            "staged_at": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "torch": torch.__version__, "torch_cuda": torch.version.cuda}
    (pkg / "BUILD.json").write_text(json.dumps(info, indent=1) + "\n")
    own_jit_cache(dest, build_identity(pkg))
    return pkg


def build_env(dest: Path) -> dict:
    """Environment of a process that should import this build: DEST first on PYTHONPATH, its own JIT cache."""
    dest = Path(dest).resolve()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(dest), *filter(None, [env.get("PYTHONPATH")])])
    env["DG_JIT_CACHE_DIR"] = str(dest / JIT_CACHE)
    if not env.get("CUDA_HOME") and Path("/usr/local/cuda").is_dir():
        env["CUDA_HOME"] = "/usr/local/cuda"
    return env


def compile_and_check(dest: Path, timeout_s: int = 1200) -> dict:
    """Import the staged package in a child process (compiles _C.so on first import) and check it exposes
    the SM90 FP4 entry points. Returns {'seconds', 'version', 'file', 'so_bytes'}; raises RuntimeError."""
    code = ("import json, time; t = time.time(); import deep_gemm as dg; "
            f"missing = [a for a in {SM90_FP4_ENTRY_POINTS!r} if not hasattr(dg, a)]; "
            "print('MEGAMOE_BUILD ' + json.dumps({'seconds': round(time.time() - t, 1), 'version': dg.__version__, "
            "'file': dg.__file__, 'missing': missing}))")
    env = build_env(dest)
    t0 = _dt.datetime.now()
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout_s,
                          cwd=str(Path(dest).resolve()))
    lines = [x for x in proc.stdout.splitlines() if x.startswith("MEGAMOE_BUILD ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"importing the staged deep_gemm failed (exit {proc.returncode}):\n"
                           f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    res = json.loads(lines[-1][len("MEGAMOE_BUILD "):])
    if res["missing"]:
        raise RuntimeError(f"the staged deep_gemm lacks {res['missing']}")
    if not Path(res["file"]).resolve().is_relative_to(Path(dest).resolve()):
        raise RuntimeError(f"the child process imported deep_gemm from {res['file']}, not from {dest}")
    so = Path(dest) / "deep_gemm" / "_C.so"
    res.update(so_bytes=so.stat().st_size if so.exists() else None,
               wall_s=round((_dt.datetime.now() - t0).total_seconds(), 1))
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m megamoe.fused.deepgemm_build", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", help="DeepGEMM source tree at the pinned ref (git checkout with submodules, or unpacked archive)")
    p.add_argument("dest", nargs="?", default=str(DEFAULT_DEST), help=f"where to stage the package (default: {DEFAULT_DEST})")
    p.add_argument("--no-compile", action="store_true", help="stage only; the first `import deep_gemm` compiles _C.so")
    p.add_argument("--no-patches", action="store_true",
                   help=f"build the pull request as it is, without megamoe's patches ({', '.join(PIN.patches)})")
    a = p.parse_args(argv)
    try:
        pkg = stage(Path(a.src), Path(a.dest), patched=not a.no_patches)
    except SourceError as exc:
        print(f"build_deepgemm: {exc}", file=sys.stderr)
        return 2
    dest = pkg.parent
    print(f"staged {pkg} ({(pkg / 'VERSION').read_text().strip()})")
    if not a.no_compile:
        res = compile_and_check(dest)
        print(f"compiled _C.so ({res['so_bytes']} bytes) and imported deep_gemm {res['version']} in {res['seconds']} s")
    print("Use it (one deep_gemm per process; this one serves deepgemm-sm90-fp4):\n"
          f"  export PYTHONPATH={dest}${{PYTHONPATH:+:$PYTHONPATH}} DG_JIT_CACHE_DIR={dest / JIT_CACHE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

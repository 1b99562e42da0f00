#!/usr/bin/env bash
# Build DeepGEMM's SM90 FP8 x FP4 Mega MoE (pull request #323, pinned in megamoe/fused/deepgemm_build.py)
# from a source tree, outside the package, against the installed torch.
#   bash scripts/build_deepgemm.sh SRC [DEST]      (DEST defaults to build/deepgemm-pr323)
# SRC: a git checkout at the pinned commit with submodules, or the unpacked source archive of it.
# Needs CUDA (nvcc) and apache-tvm-ffi; compiling _C.so takes ~100 s on 16 cores. Prints the
# PYTHONPATH / DG_JIT_CACHE_DIR to export.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: bash scripts/build_deepgemm.sh SRC [DEST]" >&2; exit 2; }
PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} exec python3 -m megamoe.fused.deepgemm_build "$@"

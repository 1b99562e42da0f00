#!/usr/bin/env bash
# An offline wheelhouse for a GPU machine without network: the kernel packages as files in .whl/, plus a
# prelude that installs them there. Run here, on a machine with network, from the project root:
#   bash scripts/wheelhouse.sh [DEEPGEMM_SRC]
# then copy the project (with .whl/) to the H200 machine (Python 3.12, torch 2.11 + CUDA 13 preinstalled) and
# begin each command there with:   source .whl/prelude.sh
#   apache-tvm-ffi 0.1.11       the FFI both kernel packages load through
#   sgl-deep-gemm 0.1.5.post1   `deep_gemm` for the FP8 backends
#   humming-kernels 0.1.20      `humming`: the Humming backends (vLLM main's default MoE GEMMs on Hopper)
#   flashinfer-python 0.7.4     `flashinfer.megamoe`, trimmed to what that module's JIT builds need (the
#                               megamoe sources, the include trees and csrc/*.h, tvm_ffi_utils.h among them:
#                               without it every megamoe JIT build fails)
# DEEPGEMM_SRC (optional): a DeepGEMM tree at the pin of megamoe/fused/deepgemm_build.py, packed as
# .whl/deepgemm-src.tgz for scripts/build_deepgemm.sh on the GPU machine (ARCHIVE= in bench/device/deepgemm_fp4.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
mkdir -p .whl
plat="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
# shellcheck disable=SC2086
ls .whl/apache_tvm_ffi-0.1.11-*.whl >/dev/null 2>&1 || python3 -m pip download -q --no-deps $plat -d .whl apache-tvm-ffi==0.1.11
# shellcheck disable=SC2086
ls .whl/sgl_deep_gemm-0.1.5.post1-*.whl >/dev/null 2>&1 || python3 -m pip download -q --no-deps $plat -d .whl sgl-deep-gemm==0.1.5.post1
# shellcheck disable=SC2086
ls .whl/humming_kernels-0.1.20-*.whl >/dev/null 2>&1 || python3 -m pip download -q --no-deps $plat -d .whl humming-kernels==0.1.20
if [ ! -f .whl/flashinfer-megamoe.tar.gz ]; then
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps -d "$tmp" flashinfer-python==0.7.4
  (cd "$tmp" && python3 -m zipfile -e flashinfer_python-0.7.4-py3-none-any.whl x)
  fi_dir="$tmp/x/flashinfer"
  # Keep every .py (importing flashinfer pulls in many modules), the JIT's include trees, the megamoe sources
  # and the csrc headers; drop the rest (hundreds of MB of other kernels' sources).
  find "$fi_dir" -type f ! -name '*.py' ! -name '*.pyi' ! -name py.typed \
      ! -path "$fi_dir/data/include/*" ! -path "$fi_dir/data/cutlass/*" ! -path "$fi_dir/data/cccl/*" \
      ! -path "$fi_dir/data/spdlog/*" ! -path "$fi_dir/data/csrc/megamoe/*" ! -path "$fi_dir/data/csrc/*.h" -delete
  find "$fi_dir/data/csrc" -mindepth 1 -maxdepth 1 -type d ! -name megamoe -exec rm -rf {} +
  rm -rf "$fi_dir/moe_ep"
  test -f "$fi_dir/data/csrc/tvm_ffi_utils.h"
  tar czf .whl/flashinfer-megamoe.tar.gz -C "$tmp/x" flashinfer flashinfer_python-0.7.4.dist-info
  rm -rf "$tmp"
fi
if [ $# -ge 1 ]; then
  PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} python3 -c "from pathlib import Path; import sys; \
from megamoe.fused.deepgemm_build import verify_source; verify_source(Path(sys.argv[1]))" "$1"
  tar czf .whl/deepgemm-src.tgz -C "$(dirname "$1")" --exclude=.git "$(basename "$1")"
fi
cat > .whl/prelude.sh <<'EOF'
# Source at the start of a command on the GPU machine:  source .whl/prelude.sh
# Installs the wheelhouse into $MEGAMOE_SITE once and puts it and the project on PYTHONPATH.
MEGAMOE_SITE=${MEGAMOE_SITE:-$HOME/.cache/megamoe-site}
if [ ! -d "$MEGAMOE_SITE/flashinfer" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$MEGAMOE_SITE" .whl/*.whl || return 1
  tar xzf .whl/flashinfer-megamoe.tar.gz -C "$MEGAMOE_SITE" || return 1
fi
export MEGAMOE_SITE PYTHONPATH=$PWD:$MEGAMOE_SITE${PYTHONPATH:+:$PYTHONPATH}
export FLASHINFER_CUDA_ARCH_LIST=9.0a PYTHONUNBUFFERED=1
# NVLink multicast off: the kernels here do not need it.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
[ -z "${CUDA_HOME:-}" ] && [ -d /usr/local/cuda ] && export CUDA_HOME=/usr/local/cuda
true
EOF
du -sh .whl && ls .whl

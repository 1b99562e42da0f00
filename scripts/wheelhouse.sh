#!/usr/bin/env bash
# Build .whl/ for the H200 machine: ../shared/device/wheelhouse.sh, then put back the one header its
# trimming drops. FlashInfer's megamoe sources include "tvm_ffi_utils.h" from flashinfer/data/csrc/,
# which the shared script deletes, so every megamoe JIT build fails there with
# "fatal error: tvm_ffi_utils.h: No such file or directory" (seen on the H200, 2026-12-02).
set -euo pipefail
cd "$(dirname "$0")/.."
bash ../shared/device/wheelhouse.sh
tar tzf .whl/flashinfer-megamoe.tar.gz | grep -q 'flashinfer/data/csrc/tvm_ffi_utils.h$' && exit 0
tmp=$(mktemp -d)
python3 -m pip download -q --no-deps -d "$tmp" flashinfer-python==0.7.4
(cd "$tmp" && mkdir x && tar xzf "$OLDPWD/.whl/flashinfer-megamoe.tar.gz" -C x \
  && python3 -m zipfile -e flashinfer_python-0.7.4-py3-none-any.whl full >/dev/null \
  && cp full/flashinfer/data/csrc/tvm_ffi_utils.h x/flashinfer/data/csrc/ \
  && tar czf "$OLDPWD/.whl/flashinfer-megamoe.tar.gz" -C x flashinfer flashinfer_python-0.7.4.dist-info)
rm -rf "$tmp"
tar tzf .whl/flashinfer-megamoe.tar.gz | grep 'tvm_ffi_utils.h$'

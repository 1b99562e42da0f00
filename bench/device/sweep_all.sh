#!/usr/bin/env bash
# The README's sweep on one H200: every backend at the 14 token counts, in two processes on the same card
# (run_sweep.sh), with DeepGEMM's SM90 FP4 Mega MoE (PR #323 + megamoe's fence patch) built from its source
# archive in the same run. Its _C.so compiles on the CPU at nice 19 while process 1 times (no GPU work); its
# kernels compile after process 1 has finished, before process 2 (so no compile runs beside a timed kernel).
#   source .whl/prelude.sh    # the offline wheelhouse (scripts/wheelhouse.sh DEEPGEMM_SRC packs the archive)
#   OUT=/tmp/sweep bash bench/device/sweep_all.sh
# Where one command may run only ~10 minutes, run it in two parts on the same machine with the same OUT:
#   OUT=build/sweep PROCESSES=1 bash bench/device/sweep_all.sh   # the FP4 build starts detached (setsid)
#   OUT=build/sweep PROCESSES=2 bash bench/device/sweep_all.sh   # waits for it, then appends process 2
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:?set OUT}
export DEST=${DEST:-$PWD/build/deepgemm-pr323} ARCHIVE=${ARCHIVE:-.whl/deepgemm-src.tgz}
export PROCESSES=${PROCESSES:-1 2}
TOKENS=${TOKENS:-1 2 4 8 16 32 64 128 256 512 1024 2048 4096 8192}
mkdir -p "$OUT/dg"
ready=$OUT/dg/built
if [ -f "$ARCHIVE" ]; then
  if [[ " $PROCESSES " == *" 1 "* ]]; then
    rm -f "$ready"
    # setsid: the build outlives this script when process 2 runs in a later command
    setsid nice -n 19 env OUT="$OUT/dg" bash -c 'bash bench/device/deepgemm_fp4.sh build; touch "$0"' "$ready" \
      > /dev/null 2>&1 < /dev/null &
  fi
  export DEEPGEMM_FP4_PATH=$DEST
  export BEFORE2="while [ ! -e '$ready' ]; do sleep 2; done; OUT='$OUT/dg' PREBUILD_TOKENS='$TOKENS' bash bench/device/deepgemm_fp4.sh prebuild"
fi
export TOKENS
BACKENDS1=${BACKENDS1:-flashinfer-mxfp4 deepgemm-sm90-fp8 deepgemm-staged-fp8 megamoe-decode-tc humming-w4a8 humming-w4a16} \
  BACKENDS2=${BACKENDS2:-deepgemm-sm90-fp4 flashinfer-mxfp4} bash bench/device/run_sweep.sh
rc=$?
[ "$PROCESSES" = "1" ] || wait
cp "$OUT/dg/log.txt" "$OUT/deepgemm-build.log" 2>/dev/null
exit $rc

#!/usr/bin/env bash
# What megamoe's proxy-fence patch to DeepGEMM PR #323 (megamoe/fused/deepgemm_patches/0001-*.patch) changes,
# measured on one H200: the race probe (identical launches, and two inputs alternating) on four builds that
# share one _C.so: the pull request unpatched, patched, and patched with only its global-memory or only its
# shared-memory fences (the other family compiled out). Run from the repository root:
#   RESTORE=dg-build.tgz OUT=results bash bench/device/fp4_fences.sh [TOKEN_COUNTS...]
# RESTORE: a dg-build.tgz from `bash bench/device/deepgemm_fp4.sh ... pack` (its _C.so serves all four; its
# kernel cache serves the build that compiled it). Leaves the patched build in build/deepgemm-pr323 for the
# matrix, the tests and the sweep; writes $OUT/race.json and $OUT/fences-log.txt.
set -u
OUT=${OUT:-/tmp/fp4-fences}
mkdir -p "$OUT"
TOKENS=${*:-64 96 128 512}
FP4="bash bench/device/deepgemm_fp4.sh"
MAIN=build/deepgemm-pr323
T0=$(date +%s)
say() { echo "[fences $(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/fences-log.txt"; }

OUT=$OUT/raw DEST=$MAIN-raw PATCHES=0 $FP4 stage restore
OUT=$OUT/patched DEST=$MAIN $FP4 stage restore
for only in global shared; do
  off=$([ $only = global ] && echo SHARED || echo GLOBAL)
  d=$MAIN-only-$only
  rm -rf "$d" && cp -r "$MAIN" "$d" && rm -rf "$d/jit-cache"
  sed -i "0,/^#pragma once\$/s//#pragma once\n#define MEGAMOE_NO_${off}_PROXY_FENCE/" \
    "$d/deep_gemm/include/deep_gemm/impls/sm90_fp8_fp4_mega_moe.cuh"
  v="$(cat "$MAIN/deep_gemm/VERSION").only$only"
  echo "$v" > "$d/deep_gemm/VERSION"
  python3 -c "import sys; from megamoe.fused.deepgemm_build import own_jit_cache as o; o(sys.argv[1], sys.argv[2])" "$d" "$v"
done
say "staged: $(cat $MAIN-raw/deep_gemm/VERSION) $(cat $MAIN/deep_gemm/VERSION) $(cat $MAIN-only-*/deep_gemm/VERSION | tr '\n' ' ')"

# Kernels: the patched build compiles everything the matrix, tests and sweep use; the variants only the counts.
OUT=$OUT/patched DEST=$MAIN $FP4 prebuild &
for only in global shared; do OUT=$OUT/only-$only DEST=$MAIN-only-$only PREBUILD_TOKENS="$TOKENS" $FP4 prebuild & done
wait
say "kernels compiled"

for v in raw patched only-global only-shared; do
  d=$MAIN; [ $v != patched ] && d=$MAIN-$v
  OUT=$OUT/$v DEST=$d PROBE_SECTIONS=race PROBE_ARGS="--race-tokens $TOKENS" PROBE_DEADLINE=200 $FP4 probe
  say "$v: $(grep -h 'race T' "$OUT/$v/log.txt" | sed 's/^.*race /T/' | cut -c1-80 | tr '\n' ';')"
done

python3 - "$OUT" <<'EOF'
import json, os, shutil, sys
out = sys.argv[1]
merged = {}
for v in ("raw", "patched", "only-global", "only-shared"):
    path = os.path.join(out, v, "fp4_probe.json")
    merged[v] = json.load(open(path)) if os.path.exists(path) else {"missing": path}
json.dump(merged, open(os.path.join(out, "race.json"), "w"), indent=1, default=str)
with open(os.path.join(out, "fences-log.txt"), "a") as log:
    for v in ("raw", "patched", "only-global", "only-shared"):
        p = os.path.join(out, v, "log.txt")
        if os.path.exists(p):
            log.write(f"\n===== {v}: log.txt =====\n" + open(p).read())
        shutil.rmtree(os.path.join(out, v), ignore_errors=True)
EOF
say "done"

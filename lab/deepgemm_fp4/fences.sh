#!/usr/bin/env bash
# What megamoe's proxy-fence patch to DeepGEMM PR #323 (megamoe/fused/deepgemm_patches/0001-*.patch) changes,
# measured on one H200 on builds that share one _C.so: the pull request unpatched (raw), patched, and patched
# with fence families compiled out. Each build runs the race probe (identical launches, and two inputs
# alternating) and, with MASKED_REPEATS set, the matrix cases whose ids contain MASKED_CASE (default
# dsv4-flash-T128-auto-masked; "masked" takes the masked and all-masked cases of both presets) relaunched that often.
# Run from the repository root:
#   RESTORE=dg-build.tgz OUT=results [VARIANTS=...] [MASKED_REPEATS=100] bash lab/deepgemm_fp4/fences.sh [COUNTS...]
# VARIANTS: raw, patched, or without-F[-F...] with F in global, shared, decode (default: raw patched
# without-decode without-shared-decode without-global-decode). RESTORE: a dg-build.tgz from
# `bash bench/device/deepgemm_fp4.sh ... pack` (its _C.so serves every build; its kernel cache only the build
# that compiled it). Leaves the patched build in build/deepgemm-pr323 for the matrix, the tests and the sweep;
# writes $OUT/race.json and $OUT/fences-log.txt.
set -u
OUT=${OUT:-/tmp/fp4-fences}
mkdir -p "$OUT"
TOKENS=${*:-64 96 128 512}
VARIANTS=${VARIANTS:-raw patched without-decode without-shared-decode without-global-decode}
FP4="bash bench/device/deepgemm_fp4.sh"
MAIN=build/deepgemm-pr323
T0=$(date +%s)
say() { echo "[fences $(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/fences-log.txt"; }
dest() { [ "$1" = patched ] && echo $MAIN || echo "$MAIN-$1"; }

OUT=$OUT/raw DEST=$MAIN-raw PATCHES=0 $FP4 stage restore
OUT=$OUT/patched DEST=$MAIN $FP4 stage restore
for v in $VARIANTS; do
  case $v in without-*) ;; *) continue ;; esac
  d=$(dest "$v")
  rm -rf "$d" && cp -r "$MAIN" "$d" && rm -rf "$d/jit-cache"
  defines=""
  for f in $(echo "${v#without-}" | tr '-' ' '); do
    defines="$defines\n#define MEGAMOE_NO_$(echo "$f" | tr a-z A-Z)_PROXY_FENCE"
  done
  sed -i "0,/^#pragma once\$/s//#pragma once$defines/" "$d/deep_gemm/include/deep_gemm/impls/sm90_fp8_fp4_mega_moe.cuh"
  echo "$(cat "$MAIN/deep_gemm/VERSION").$v" > "$d/deep_gemm/VERSION"
  python3 -c "import sys; from megamoe.fused.deepgemm_build import build_identity as b, own_jit_cache as o; \
o(sys.argv[1], b(sys.argv[1] + '/deep_gemm') + ' ' + sys.argv[2])" "$d" "$v"
done
say "staged: $(for v in $VARIANTS; do echo -n "$v=$(cat "$(dest "$v")/deep_gemm/VERSION") "; done)"

# Kernels: the patched build compiles everything the matrix, tests and sweep use; the variants what they run.
OUT=$OUT/patched DEST=$MAIN $FP4 prebuild &
for v in $VARIANTS; do
  case $v in without-*) OUT=$OUT/$v DEST=$(dest "$v") PREBUILD_TOKENS="$TOKENS 128" $FP4 prebuild & ;; esac
done
wait
say "kernels compiled"

for v in $VARIANTS; do
  OUT=$OUT/$v DEST=$(dest "$v") PROBE_SECTIONS=race PROBE_ARGS="--race-tokens $TOKENS" PROBE_DEADLINE=200 $FP4 probe
  [ -n "${MASKED_REPEATS:-}" ] && OUT=$OUT/$v DEST=$(dest "$v") MATRIX_ONLY=${MASKED_CASE:-dsv4-flash-T128-auto-masked} \
    MATRIX_REPEATS=$MASKED_REPEATS $FP4 matrix
  say "$v: $(grep -h 'race T' "$OUT/$v/log.txt" | sed 's/^.*race /T/; s/  BLOCK_M.*//' | tr '\n' ';') \
$(grep -h '^MATRIX\|relaunch' "$OUT/$v/log.txt" | tail -1)"
done

python3 - "$OUT" $VARIANTS <<'EOF'
import json, os, shutil, sys
out, variants = sys.argv[1], sys.argv[2:]
merged = {}
for v in variants:
    merged[v] = {}
    for name in sorted(os.listdir(os.path.join(out, v)) if os.path.isdir(os.path.join(out, v)) else []):
        if name == "fp4_probe.json" or name.startswith("matrix-fp4") and name.endswith(".json"):
            merged[v][name] = json.load(open(os.path.join(out, v, name)))
json.dump(merged, open(os.path.join(out, "race.json"), "w"), indent=1, default=str)
with open(os.path.join(out, "fences-log.txt"), "a") as log:
    for v in variants:
        p = os.path.join(out, v, "log.txt")
        if os.path.exists(p):
            log.write(f"\n===== {v}: log.txt =====\n" + open(p).read())
        shutil.rmtree(os.path.join(out, v), ignore_errors=True)
EOF
say "done"

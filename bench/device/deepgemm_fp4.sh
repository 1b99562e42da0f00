#!/usr/bin/env bash
# DeepGEMM's SM90 FP8 x FP4 Mega MoE on one H200, built from a clean unpack of its source archive and
# checked through megamoe. Run from the repository root:
#   ARCHIVE=path/to/deepgemm-src.tgz OUT=results bash bench/device/deepgemm_fp4.sh STEP...
# Steps, any subset, run in this order:
#   build     unpack ARCHIVE into a fresh folder and run scripts/build_deepgemm.sh into $DEST (_C.so: ~100 s);
#             with megamoe's patches (megamoe/fused/deepgemm_patches/) unless PATCHES=0
#   stage     like build, without compiling _C.so (for restore)
#   restore   unpack a saved $OUT-style dg-build.tgz (RESTORE=path) into $DEST: _C.so, and the kernel cache
#             only if the same build filled it (version and patch digests: jit-cache/BUILD-VERSION)
#   prebuild  compile the FP4 kernels the tests, the probe, the matrix and the sweep need, ~16 processes side
#             by side (DeepGEMM compiles one kernel at a time in the launching thread)
#   tests     the gpu-marked FP4 tests (layout byte-equal to transform_weights_for_mega_moe_sm90_fp4, the
#             backend against its reference, broken layouts, the window, the block, the one-rank launcher)
#   probe     lab/deepgemm_fp4/probe.py (decode table, the checkpoint case, recipe variants, lossy
#             scales, plans)
#   matrix    the full differential matrix of deepgemm-sm90-fp4 (megamoe.check.matrix); MATRIX_ONLY=substring
#             of the case ids to run, MATRIX_REPEATS relaunches per case (8), MATRIX_MMA the reference's
#             tensor-core model (sm90-fp8-tc-operands; the file names carry it when it is another)
#   pack      $DEST's _C.so and kernel cache into $OUT/dg-build.tgz
# Everything is logged to $OUT/log.txt; at most 7 files land in $OUT. PATCHES=0 builds the pull request unpatched.
set -u
OUT=${OUT:-/tmp/dg-fp4}
mkdir -p "$OUT"
ARCHIVE=${ARCHIVE:-.whl/deepgemm-src.tgz}  # scripts/wheelhouse.sh DEEPGEMM_SRC packs it; unpacks to DeepGEMM/
NO_PATCHES=$([ "${PATCHES:-1}" = 0 ] && echo --no-patches)
DEST=$(realpath -m "${DEST:-build/deepgemm-pr323}")
# shellcheck disable=SC1091
[ -z "${MEGAMOE_SITE:-}" ] && [ -f .whl/prelude.sh ] && source .whl/prelude.sh
export PYTHONPATH=$DEST:$PWD${PYTHONPATH:+:$PYTHONPATH} DG_JIT_CACHE_DIR=$DEST/jit-cache PYTHONUNBUFFERED=1
LOG=$OUT/log.txt
T0=$(date +%s)
say() { echo "[fp4 $(( $(date +%s) - T0 ))s] $*" | tee -a "$LOG"; }

step_build() {
  local src; src=$(mktemp -d)
  tar xzf "$ARCHIVE" -C "$src" && rm -rf "$DEST" && \
    bash scripts/build_deepgemm.sh "$src/DeepGEMM" "$DEST" $NO_PATCHES >> "$LOG" 2>&1
  say "build exit $? ($(du -sh "$DEST" 2>/dev/null | cut -f1), _C.so $(stat -c %s "$DEST/deep_gemm/_C.so" 2>/dev/null) bytes)"
}

step_stage() {  # the package layout only; `restore` then brings a saved _C.so and kernel cache
  local src; src=$(mktemp -d)
  tar xzf "$ARCHIVE" -C "$src" && rm -rf "$DEST" && \
    python3 -m megamoe.fused.deepgemm_build "$src/DeepGEMM" "$DEST" --no-compile $NO_PATCHES >> "$LOG" 2>&1
  say "stage exit $? ($(cat "$DEST/deep_gemm/VERSION" 2>/dev/null))"
}

step_restore() {
  mkdir -p "$DEST" && tar xzf "${RESTORE:?RESTORE=path to a dg-build.tgz}" -C "$DEST" && python3 -c \
    "import sys; from megamoe.fused.deepgemm_build import build_identity as b, own_jit_cache as o; o(sys.argv[1], b(sys.argv[2]))" \
    "$DEST" "$DEST/deep_gemm"
  say "restore exit $? ($(find "$DEST/jit-cache" -name '*.cubin' 2>/dev/null | wc -l) cubins kept for $(cat "$DEST/jit-cache/BUILD-VERSION"))"
}

step_prebuild() {
  local tmp; tmp=$(mktemp -d); local i=0 list
  # PREBUILD_TOKENS="64 96": only those dsv4-flash counts at capacity 8192, one process each
  list=$(if [ -n "${PREBUILD_TOKENS:-}" ]; then for t in $PREBUILD_TOKENS; do echo "dsv4-flash 8192 $t"; done
         else cat <<'EOF'
dsv4-flash 8192 1
dsv4-flash 8192 2 4
dsv4-flash 8192 7 8
dsv4-flash 8192 16 32
dsv4-flash 8192 64
dsv4-flash 8192 128 256
dsv4-flash 8192 300 512
dsv4-flash 8192 1024 2048
dsv4-flash 8192 4096 8192
dsv4-flash 128 1 127 128
dsv4-flash 256 128
small 512 1 2 7
small 512 64 128
small 512 300 512
small 64 64 7
small 8 8
EOF
         fi)
  while read -r preset cap tokens; do
    i=$((i + 1))
    # shellcheck disable=SC2086
    timeout -k 5 "${PREBUILD_TIMEOUT:-300}" python3 bench/device/dg_prebuild.py --preset "$preset" \
      --capacity "$cap" --tokens $tokens > "$tmp/$i.log" 2>&1 &
  done <<< "$list"
  wait
  cat "$tmp"/*.log | grep -E "PREBUILD|Error|error|Traceback" | cut -c1-600 >> "$LOG"
  say "prebuild: $(cat "$tmp"/*.log | grep -c PREBUILD) of $i processes done, $(find "$DEST/jit-cache" -name '*.cubin' | wc -l) cubins"
}

step_tests() {
  python3 -m pytest -q -m gpu -k "fp4" tests/test_layouts_deepgemm.py tests/test_fused.py tests/test_deepgemm_fp4.py \
    tests/test_block.py tests/test_distributed.py \
    -p no:cacheprovider >> "$LOG" 2>&1
  say "gpu tests exit $?"
}

step_probe() {
  # shellcheck disable=SC2086
  python3 lab/deepgemm_fp4/probe.py --out "$OUT" --deadline "${PROBE_DEADLINE:-240}" \
    ${PROBE_SECTIONS:+--sections $PROBE_SECTIONS} ${PROBE_ARGS:-} >> "$LOG" 2>&1
  say "probe exit $?"
}

step_matrix() {
  python3 - "$OUT" >> "$LOG" 2>&1 <<'EOF'
import json, sys, time
from megamoe.check.matrix import format_table, run_matrix
from megamoe.provenance import imported_kernel_modules
out = sys.argv[1]
t = time.time()
from megamoe.check.matrix import default_cases
only = __import__("os").environ.get("MATRIX_ONLY", "")  # a substring of the case ids to keep ("" = all)
cases = [c for c in default_cases("deepgemm-sm90-fp4", (), True) if only in c.id]
mma = __import__("os").environ.get("MATRIX_MMA", "sm90-fp8-tc-operands")
name = "matrix-fp4" + ("" if mma == "sm90-fp8-tc-operands" else f"-{mma}")
rows = run_matrix("deepgemm-sm90-fp4", cases, f"{out}/{name}.json", mma=mma, ref_max_tokens=512,
                  repeats=int(__import__("os").environ.get("MATRIX_REPEATS", "8")),
                  deadline_s=float(__import__("os").environ.get("MATRIX_DEADLINE", "300")))
meta = {"modules": imported_kernel_modules(), "wall_s": round(time.time() - t, 1)}
json.dump({"meta": meta, "rows": rows}, open(f"{out}/{name}.json", "w"), indent=1, default=str)
open(f"{out}/{name}.md", "w").write(format_table(rows) + "\n")
bad = [r["case"] for r in rows if r.get("status") not in ("pass", "detected")]
print("MATRIX", mma, len(rows), "cases;", "not passing:", bad)
EOF
  say "matrix exit $?; $(grep MATRIX "$LOG" | tail -1)"
}

step_pack() {
  tar czf "$OUT/dg-build.tgz" -C "$DEST" deep_gemm/_C.so jit-cache 2>> "$LOG"
  say "pack exit $? ($(stat -c %s "$OUT/dg-build.tgz") bytes)"
}

say "steps: $*; card: $(nvidia-smi --query-gpu=name,uuid --format=csv,noheader 2>/dev/null)"
for s in "$@"; do "step_$s"; done
say "done"

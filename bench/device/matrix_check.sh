#!/usr/bin/env bash
# H200: `megamoe check --backend NAME` for every fused backend, in one device call. Each prints the
# differential matrix as a table; rows go to $OUT/matrix-<backend>.json, the check report to
# $OUT/check-<backend>.json, the console to $OUT/check-<backend>.txt.
#   run(command="bash bench/device/matrix_check.sh", carry=[".whl"], timeout_s=600)
set -u
OUT=${OUT:-/tmp/megamoe-matrix-out}
mkdir -p "$OUT"
# shellcheck disable=SC1091
source .whl/prelude.sh
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 COLUMNS=200
MMA=${MMA:-sm90-fp8-tc}
REF_MAX=${REF_MAX:-512}
for spec in ${BACKENDS:-flashinfer-mxfp4:250 deepgemm-sm90-fp8:250}; do
  name=${spec%%:*}; dl=${spec##*:}
  timeout -k 10 $((dl + 60)) python3 -m megamoe.cli check --backend "$name" --mma "$MMA" --ref-max-tokens "$REF_MAX" \
    --matrix-deadline "$dl" --matrix-json "$OUT/matrix-$name.json" --json "$OUT/check-$name.json" \
    > "$OUT/check-$name.txt" 2>&1
  echo "[matrix_check] $name exit $?"
  grep -E "pass|FAIL|error|detected|skipped" "$OUT/check-$name.txt" | tail -n 80 | cut -c1-220
done

#!/usr/bin/env bash
# `megamoe check --backends NAME` on an H200, for each fused backend: the reference check and the backend's
# differential matrix. Each run writes a new folder under $OUT (check.json, check.md, matrix-NAME.json); the
# console goes to $OUT/check-NAME.txt.
#
#   pip install -e ".[fused]"
#   OUT=/tmp/matrix bash bench/device/matrix_check.sh
#   BACKENDS="flashinfer-mxfp4:250" OUT=/tmp/matrix bash bench/device/matrix_check.sh     # NAME:deadline-seconds
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:?set OUT to the folder the results go to}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 COLUMNS=200
MMA=${MMA:-sm90-fp8-tc-operands}
REF_MAX=${REF_MAX:-512}
for spec in ${BACKENDS:-flashinfer-mxfp4:250 deepgemm-sm90-fp8:250}; do
  name=${spec%%:*}; dl=${spec##*:}
  timeout -k 10 $((dl + 60)) python3 -m megamoe check --backends "$name" --mma "$MMA" --ref-max-tokens "$REF_MAX" \
    --deadline-s "$dl" --out "$OUT" > "$OUT/check-$name.txt" 2>&1
  echo "[matrix_check] $name exit $?"
  grep -E "pass|FAIL|error|detected|skipped" "$OUT/check-$name.txt" | tail -n 80 | cut -c1-220
done

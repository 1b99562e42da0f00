#!/usr/bin/env bash
# The pytest-benchmark suites (bench/) on an H200: every fused backend at DeepSeek-V4-Flash geometry (1, 128, 2048
# and 8192 tokens), checked then timed as megamoe bench times it; the harness / bare-loop test per backend; the
# reference and its stages; the ceilings. The figures pytest-benchmark records are device times.
#
#   pip install -e ".[fused,test]"
#   OUT=/tmp/pb bash bench/device/run_pytest_bench.sh
#   pytest-benchmark compare /tmp/pb/pytest-bench.json OTHER.json      # against another run
#
# Writes $OUT/pytest-bench.json (with the commit, versions and card in machine_info) and $OUT/pytest-log.txt.
# Dry run on a CPU: MEGAMOE_BENCH_PRESET=tiny OUT=/tmp/pb bash bench/device/run_pytest_bench.sh
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:?set OUT to the folder the results go to}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
timeout -k 10 "${PY_TIMEOUT:-540}" python3 -m pytest bench/ -q -p no:cacheprovider --benchmark-only \
  --benchmark-json="$OUT/pytest-bench.json" --benchmark-columns=min,median,max,rounds 2>&1 | tee "$OUT/pytest-log.txt"
exit "${PIPESTATUS[0]}"

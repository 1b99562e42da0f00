#!/usr/bin/env bash
# The pytest-benchmark suites (bench/) on the H200 in one device call: every fused backend at
# DeepSeek-V4-Flash geometry (1, 128, 2048, 8192 tokens by default), checked then timed, the harness /
# bare-loop overhead test per backend, the reference and its stages, and the ceilings.
#   run(command="MEGAMOE_COMMIT=<sha> bash bench/device/run_pytest_bench.sh", carry=[".whl"], timeout_s=600)
# <sha>: `git rev-parse --short=10 HEAD` on THIS machine (the device's git HEAD can be stale); it names the
# results folder. Writes $OUT/<date>_<card>_<sha>-pytest/{pytest-bench.json,pytest-bench.md,pytest-log.txt}.
# Dry run on a CPU: MEGAMOE_BENCH_PRESET=tiny OUT=/tmp/pb bash bench/device/run_pytest_bench.sh
set -u
OUT=${OUT:-/tmp/megamoe-pytest-bench}
if [ -f .whl/prelude.sh ]; then
  # shellcheck disable=SC1091
  source .whl/prelude.sh || echo "[run_pytest_bench] prelude failed: the fused suites will skip"
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# the folder is named as megamoe bench names its own (results_dir_name), with "-pytest" after it
name=$(python3 -c "import sys, time, torch; from megamoe.bench.sweep import results_dir_name; \
card = torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu'; \
print(results_dir_name({'date': time.strftime('%Y-%m-%d', time.gmtime()), 'card': card, 'commit': sys.argv[1]}))" \
  "${MEGAMOE_COMMIT:-unknown}") || name="$(date -u +%Y-%m-%d)_unknown_${MEGAMOE_COMMIT:-unknown}"
dir="$OUT/${name}-pytest"
mkdir -p "$dir"
timeout -k 10 "${PY_TIMEOUT:-540}" python3 -m pytest bench/ -q -p no:cacheprovider --benchmark-enable \
  --benchmark-json="$dir/pytest-bench.json" 2>&1 | tee "$dir/pytest-log.txt"
rc=${PIPESTATUS[0]}
if [ -f "$dir/pytest-bench.json" ]; then
  python3 -c "import json, sys; from megamoe.bench.report import benchmark_json_markdown as md; print(md(json.load(open(sys.argv[1])), sys.argv[2] or None), end='')" \
    "$dir/pytest-bench.json" "${MEGAMOE_COMMIT:-}" > "$dir/pytest-bench.md" && cat "$dir/pytest-bench.md"
fi
echo "[run_pytest_bench] pytest exit $rc; files:"; find "$OUT" -type f | sort
exit "$rc"

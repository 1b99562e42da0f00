#!/usr/bin/env bash
# On an H200 (or H100) machine, from the repository root, with the kernel packages installed (or the offline
# wheelhouse: source .whl/prelude.sh first): the Humming probe, both Humming matrices, a short timing beside
# FlashInfer. Everything lands in $OUT; each step has its own time limit, so one that hangs leaves the others.
#   OUT=/tmp/h bash lab/humming/device_run.sh
set -u
OUT=${OUT:?set OUT}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 COLUMNS=200
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,power.limit --format=csv > "$OUT/nvidia-smi.txt" 2>&1
git rev-parse --short=10 HEAD > "$OUT/commit.txt" 2>/dev/null
start=$SECONDS
if [ "${PROBE_S:-200}" -gt 0 ]; then  # PROBE_S=0 skips the probe
  timeout -k 5 "${PROBE_S:-200}" python3 lab/humming/probe.py --out "$OUT" > "$OUT/probe.log" 2>&1
  echo "[humming] probe exit $? at $((SECONDS - start)) s"; grep -E "^\[probe\]" "$OUT/probe.log" | cut -c1-700
fi
for spec in ${MATRICES:-humming-w4a8:150 humming-w4a16:90}; do
  name=${spec%%:*}; dl=${spec##*:}
  timeout -k 5 $((dl + 40)) python3 - "$name" "$dl" "$OUT" > "$OUT/matrix-$name.log" 2>&1 <<'PY'
import sys
from megamoe.check.matrix import format_table, run_matrix
name, dl, out = sys.argv[1], float(sys.argv[2]), sys.argv[3]
rows = run_matrix(name, out_json=f"{out}/matrix-{name}.json", quick=True, ref_max_tokens=256, deadline_s=dl, repeats=4)
open(f"{out}/matrix-{name}.md", "w").write(format_table(rows) + "\n")
PY
  echo "[humming] matrix $name exit $? at $((SECONDS - start)) s"
  grep -E "^\[matrix\]" "$OUT/matrix-$name.log" | cut -c1-260 | tail -n 60
done
[ "${BENCH_S:-150}" -gt 0 ] && timeout -k 5 "${BENCH_S:-150}" python3 -m megamoe bench --preset dsv4-flash --tokens ${TOKENS:-1 8 64 512 4096} \
  --backends ${BENCH_BACKENDS:-humming-w4a8 humming-w4a16 flashinfer-mxfp4} --passes 1 --studies --deadline-s 100 --out "$OUT/bench" > "$OUT/bench.log" 2>&1
echo "[humming] bench exit $? at $((SECONDS - start)) s"; tail -n 40 "$OUT/bench.log" | cut -c1-250

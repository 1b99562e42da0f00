#!/usr/bin/env bash
# The 1-token CUDA step's next measurements on one H200 with nvcc (docs/decode-kernel-tc.md, "Next"), within a
# wall-time budget: the main line's probe modes (touch, ahead, empty, plain and their bare twins, with timelines and
# traces), then the first round of the A/B of the candidate versions against the main line, each checked bit for
# bit before it is timed. Later rounds: the same A/B with --from-round 2 (bench/device/step1_ab.py).
#
#   python3 bench/device/step1_ab.py --export build/ab main step1-adopt step1-adopt-ew   # where git is
#   OUT=/tmp/next bash bench/device/step1_next.sh                                        # on the H200
#   python3 bench/device/step1_trace.py $OUT/probe/trace-*.pt --experts 183 59 202 95 89 31   # any machine
#
# The probe runs from the exported main line ($AB/main), so the probe and the A/B's first version are the same
# commit, named by its COMMIT file. Each part has its own time limit (PROBE_S, AB_S; together under ten minutes);
# what a part finished is kept when a later one stops short. The version the A/B was running when its limit came
# says so in the table; one it had not begun is missing from it (run it alone, or with the later rounds). The kernels build with nvcc on first use into $MEGAMOE_CACHE (default
# build/step1-cache), which is copied to $OUT/cache at the end so that a later run can start from it.
# Files: $OUT/probe/ (step1_probe.json, stamps-*.pt, trace-*.pt), $OUT/probe.log, $OUT/ab/ (step1_ab.py's folders
# and summary.md), $OUT/ab.log, $OUT/cache/.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:?set OUT to the folder the results go to}
AB=${AB:-build/ab}
VERSIONS=${VERSIONS:-main step1-adopt-ew step1-adopt}  # the first must be main: the probe runs from it
PROBE_S=${PROBE_S:-200}
AB_S=${AB_S:-370}  # about 2 min per version (its checks, then its probe)
PY=${PYTHON:-python3}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export MEGAMOE_CACHE=${MEGAMOE_CACHE:-$PWD/build/step1-cache}
mkdir -p "$OUT" "$MEGAMOE_CACHE"
for v in $VERSIONS; do
  [ -f "$AB/$v/COMMIT" ] || { echo "no exported version $AB/$v (step1_ab.py --export)" >&2; exit 2; }
done

main_dir=$(cd "$AB/main" && pwd)
echo "[step1_next] probe of $(cat "$main_dir/COMMIT")"
(cd "$main_dir" && PYTHONPATH=$main_dir MEGAMOE_COMMIT=$(cat COMMIT) timeout "$PROBE_S" "$PY" \
  bench/device/step1_probe.py --out "$OUT/probe" --stages --inflight --lags \
  --modes touch touch_bare ahead ahead_bare empty plain empty_plain \
  --timelines cuda touch ahead --traces cuda touch ahead) > "$OUT/probe.log" 2>&1
echo "[step1_next] probe exit $? (log: $OUT/probe.log)"

dirs=()
for v in $VERSIONS; do dirs+=("$AB/$v"); done
timeout "$AB_S" "$PY" bench/device/step1_ab.py "${dirs[@]}" --out "$OUT/ab" --rounds 1 --modes touch \
  > "$OUT/ab.log" 2>&1
echo "[step1_next] A/B exit $? (log: $OUT/ab.log)"

mkdir -p "$OUT/cache" && cp -r "$MEGAMOE_CACHE/." "$OUT/cache/"
"$PY" bench/device/step1_ab.py --summarize "$OUT/ab" 2>/dev/null || true

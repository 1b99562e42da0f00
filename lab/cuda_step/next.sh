#!/usr/bin/env bash
# The 1-token CUDA step's next measurements on one H200 with nvcc (docs/decode-kernel-tc.md, "Next"), within a
# wall-time budget, the cheapest question first:
#   1. pattern_bench.cu: the step's stream alone through its ring, against an LDG.128 read of the same bytes
#      and against the same stages loaded by the consumer warpgroups straight into registers (`regs D`, `frag D`):
#      can the step's stream run at a plain read's pace without the ring? Also its `released` / `relaxed` cases;
#   2. the main line's probe modes, with timelines and traces: `relaxed` (the count additions without the release
#      fence) and `no-wait`: does a gpu-scope release hold the SM's copies (the grid-wide hole at 6-7 us)? `regs`
#      (no ring: the computing warpgroups load their own stages into registers, one ahead; checked bit for bit
#      first), `regs_bare`, `regs_nowait` and `regs_l1` (L1 so, L2 through the ring from the start): does the
#      step itself stream sooner without its ring? `ll`, `ll_regs_l1`: the L2 inputs as LL words, the main line's
#      counts kept for the combine; `llc` the combine's inputs as LL words; `ll_all`, `ll_all_regs_l1` both (each
#      mode meant to keep y's bits is checked first, bit for bit);
#   3. the A/B of the main line against the LL version (commit 4887964: every signal between CTAs as LL words, no
#      counts, no release fences), each checked bit for bit before it is timed, one process each.
#
#   python3 lab/cuda_step/ab.py --export build/ab main 4887964      # where git is
#   OUT=build/next bash lab/cuda_step/next.sh                       # on the H200
#   python3 lab/cuda_step/stage_trace.py $OUT/probe/trace-*.pt            # any machine
#
# The checks and the probe run from the exported main line ($AB/main), so they and the A/B's first version are the
# same commit, named by its COMMIT file. Each part has its own time limit (PATTERN_S, CHECK_S, PROBE_S,
# AB_S; together under ten minutes); what a part finished is kept when a later one stops short. The A/B comes last
# and may not finish its versions in its limit: its table says which it reached, and ab.py --from-round runs
# more turns. The kernels build with nvcc on first use into $MEGAMOE_CACHE (default build/step1-cache), which is
# copied to $OUT/cache at the end so that a later run can start from it.
# Files: $OUT/pattern.txt, $OUT/check-modes.jsonl (+ .log), $OUT/probe/ (step1_probe.json, stamps-*.pt,
# trace-*.pt), $OUT/probe.log, $OUT/ab/ (ab.py's folders and summary.md), $OUT/ab.log, $OUT/cache/.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:?set OUT to the folder the results go to}
AB=${AB:-build/ab}
VERSIONS=${VERSIONS:-main 4887964}  # the first must be main: the probe runs from it
PATTERN_S=${PATTERN_S:-80}
CHECK_S=${CHECK_S:-120}
PROBE_S=${PROBE_S:-220}
AB_S=${AB_S:-140}  # about 2 min per version (its checks, then its probe): the first, maybe both
ROUNDS=${ROUNDS:-1}
PY=${PYTHON:-python3}
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export MEGAMOE_CACHE=${MEGAMOE_CACHE:-$PWD/build/step1-cache}
mkdir -p "$OUT" "$MEGAMOE_CACHE"
for v in $VERSIONS; do
  [ -f "$AB/$v/COMMIT" ] || { echo "no exported version $AB/$v (ab.py --export)" >&2; exit 2; }
done

echo "[step1_next] pattern bench"
timeout "$PATTERN_S" bash -c "'$CUDA_HOME/bin/nvcc' -O3 -gencode arch=compute_90a,code=sm_90a -o '$OUT/pattern' \
  lab/cuda_step/pattern_bench.cu && '$OUT/pattern'" > "$OUT/pattern.txt" 2>&1
echo "[step1_next] pattern exit $? ($OUT/pattern.txt)"
rm -f "$OUT/pattern"

main_dir=$(cd "$AB/main" && pwd)
echo "[step1_next] the probe modes meant to keep y's bits, bit for bit"
(cd "$main_dir" && PYTHONPATH=$main_dir timeout "$CHECK_S" "$PY" lab/cuda_step/selfcheck.py --repeats 2 \
  --mode regs --mode regs-l1 --mode ll --mode ll-combine --mode ll+ll-combine --mode regs-l1+ll+ll-combine) \
  > "$OUT/check-modes.jsonl" 2> "$OUT/check-modes.log"
echo "[step1_next] check exit $? ($OUT/check-modes.jsonl)"

echo "[step1_next] probe of $(cat "$main_dir/COMMIT")"
(cd "$main_dir" && PYTHONPATH=$main_dir MEGAMOE_COMMIT=$(cat COMMIT) timeout "$PROBE_S" "$PY" \
  lab/cuda_step/probe.py --out "$OUT/probe" --stages --inflight --lags \
  --modes relaxed nowait regs regs_bare regs_nowait regs_l1 ll ll_regs_l1 llc ll_all ll_all_regs_l1 \
  --timelines cuda relaxed nowait regs regs_l1 ll ll_all ll_all_regs_l1 \
  --traces cuda relaxed nowait ll_all) > "$OUT/probe.log" 2>&1  # (no traces of regs: no ring stages to trace)
echo "[step1_next] probe exit $? (log: $OUT/probe.log)"

dirs=()
for v in $VERSIONS; do dirs+=("$AB/$v"); done
timeout "$AB_S" "$PY" lab/cuda_step/ab.py "${dirs[@]}" --out "$OUT/ab" --rounds "$ROUNDS" \
  > "$OUT/ab.log" 2>&1
echo "[step1_next] A/B exit $? (log: $OUT/ab.log)"

mkdir -p "$OUT/cache" && cp -r "$MEGAMOE_CACHE/." "$OUT/cache/"
"$PY" lab/cuda_step/ab.py --summarize "$OUT/ab" 2>/dev/null || true

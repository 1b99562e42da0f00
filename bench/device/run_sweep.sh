#!/usr/bin/env bash
# The H200 sweep and its studies in one script, within a wall-time budget (TOTAL_S, default 500 s), JIT builds
# included; studies that do not fit are skipped and listed, and can be run on their own (--studies NAME...).
#
#   pip install -e ".[fused,plot]"                     # flashinfer-python, sgl-deep-gemm (the FP8 backends)
#   bash scripts/build_deepgemm.sh SRC /opt/dg-fp4     # DeepGEMM PR #323 for deepgemm-sm90-fp4 (optional)
#   OUT=/tmp/sweep DEEPGEMM_FP4_PATH=/opt/dg-fp4 bash bench/device/run_sweep.sh
#
# Two deep_gemm builds cannot live in one process (sgl-deep-gemm serves deepgemm-sm90-fp8 and the unfused peer;
# deepgemm-sm90-fp4 needs the source build first on PYTHONPATH), so it runs two processes on the same card:
#   process 1: flashinfer-mxfp4, deepgemm-sm90-fp8, deepgemm-staged-fp8 and the eager reference (BACKENDS1; add
#              megamoe-decode and megamoe-decode-tc), the ceilings, then the studies (overhead, staging, block_m, ragged)
#   process 2: deepgemm-sm90-fp4, and flashinfer-mxfp4 again as the anchor between the two processes; its rows
#              join process 1's folder (megamoe bench --append), studies only for what process 1 did not study
# Measured on H200s (bench/results/*/NOTE.md): process 1 with the five backends, 14 counts, 2 passes: setup 46-83 s,
# sweep ~206 s, so its studies start near the 300 s deadline and rarely all fit (block_m 28 s and ragged 33 s for
# two backends, alone); process 2's sweep ~108 s. Sweep cases and studies not begun by a process's deadline are
# skipped and listed in results.md: process 1 stops starting work at 300 s (P1_DEADLINE_S), process 2 25 s before
# the budget runs out.
# Without DEEPGEMM_FP4_PATH process 2 is skipped. Every section writes results.json / results.md as it ends, so
# a timeout or a crash still leaves what finished.
# Files: $OUT/<date>_<card>_<commit>/{results.json,results.md,sweep.png,block_m.png}, $OUT/log-1.txt, log-2.txt,
# nvidia-smi.txt (clocks and power before and after). Copy the folder into bench/results/ to commit it.
#
# Dry run on a CPU (a few seconds a process):
#   OUT=/tmp/o PRESET=tiny TOKENS="1 4" DEVICE=cpu BACKENDS1=reference BACKENDS2=reference \
#     DEEPGEMM_FP4_PATH=/nonexistent EXTRA="--rep-ms 20" bash bench/device/run_sweep.sh
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:?set OUT to the folder the results go to}
PY=${PYTHON:-python3}
PRESET=${PRESET:-dsv4-flash}
TOKENS=${TOKENS:-1 2 4 8 16 32 64 128 256 512 1024 2048 4096 8192}
DEVICE=${DEVICE:-cuda}
BACKENDS1=${BACKENDS1:-flashinfer-mxfp4 deepgemm-sm90-fp8 deepgemm-staged-fp8 reference}
BACKENDS2=${BACKENDS2:-deepgemm-sm90-fp4 flashinfer-mxfp4}
TOTAL_S=${TOTAL_S:-500}          # the whole script; the two processes share it
P1_DEADLINE_S=${P1_DEADLINE_S:-300}
EXTRA=${EXTRA:-}                 # extra `megamoe bench` flags for both processes
EXTRA1=${EXTRA1:-}               # ... for process 1 only (e.g. --studies overhead staging)
EXTRA2=${EXTRA2:-}               # ... for process 2 only
BEFORE2=${BEFORE2:-}             # a command run before process 2 (e.g. wait for a build, then compile its kernels)
PROCESSES=${PROCESSES:-1 2}      # "1", then "2" later on the same machine and OUT: process 2 appends to the folder
                                 # named in $OUT/log-1.txt
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export MEGAMOE_COMMIT=${MEGAMOE_COMMIT:-$(git rev-parse --short=10 HEAD 2>/dev/null || echo unknown)}
smi() { nvidia-smi --query-gpu=name,uuid,serial,pci.bus_id,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.draw,power.limit,temperature.gpu,memory.used --format=csv 2>&1 || true; }
{ date -u +"%Y-%m-%dT%H:%M:%SZ processes $PROCESSES"; smi; } >> "$OUT/nvidia-smi.txt"
start=$SECONDS

rc1=0
case " $PROCESSES " in *" 1 "*)
  # shellcheck disable=SC2086  # TOKENS, BACKENDS and EXTRA are lists
  timeout -k 10 "$((TOTAL_S - 20))" "$PY" -m megamoe bench --preset "$PRESET" --tokens $TOKENS --device "$DEVICE" \
    --backends $BACKENDS1 --passes 2 --deadline-s "$P1_DEADLINE_S" --out "$OUT" $EXTRA $EXTRA1 2>&1 | tee "$OUT/log-1.txt"
  rc1=${PIPESTATUS[0]}
  echo "[run_sweep] process 1: exit $rc1 after $((SECONDS - start)) s";;
esac
dir=$(sed -n 's/^results written to //p' "$OUT/log-1.txt" 2>/dev/null | tail -n 1)
echo "[run_sweep] process 1's results: ${dir:-(none)}"

rc2=0
left=$((TOTAL_S - (SECONDS - start)))
if [[ " $PROCESSES " != *" 2 "* ]]; then
  echo "[run_sweep] process 2 not asked for (PROCESSES=$PROCESSES)"
elif [ -z "${DEEPGEMM_FP4_PATH:-}" ]; then
  echo "[run_sweep] process 2 skipped: DEEPGEMM_FP4_PATH is not set (the DeepGEMM PR #323 build for deepgemm-sm90-fp4)"
elif [ -z "$dir" ] || [ ! -f "$dir/results.json" ]; then
  echo "[run_sweep] process 2 skipped: process 1 left no results folder to append to"
elif [ -n "$BEFORE2" ] && ! bash -c "$BEFORE2"; then
  echo "[run_sweep] process 2 skipped: BEFORE2 failed ($BEFORE2)"
elif left=$((TOTAL_S - (SECONDS - start))) && [ "$left" -lt 60 ]; then
  echo "[run_sweep] process 2 skipped: only $left s of the $TOTAL_S s budget left"
else
  # shellcheck disable=SC2086
  PYTHONPATH=$DEEPGEMM_FP4_PATH:$PYTHONPATH timeout -k 10 "$((left - 5))" "$PY" -m megamoe bench --preset "$PRESET" \
    --tokens $TOKENS --device "$DEVICE" --backends $BACKENDS2 --passes 2 --deadline-s "$((left - 25))" \
    --append "$dir" $EXTRA $EXTRA2 2>&1 | tee "$OUT/log-2.txt"
  rc2=${PIPESTATUS[0]}
  echo "[run_sweep] process 2: exit $rc2 after $((SECONDS - start)) s"
fi

{ echo "--- after, $((SECONDS - start)) s"; smi; } >> "$OUT/nvidia-smi.txt"
[ -n "$dir" ] && [ -f "$dir/results.md" ] && sed -n '/^## Sweep/,/^## Every row/p' "$dir/results.md" | cut -c1-400
echo "[run_sweep] done in $((SECONDS - start)) s; files:"; find "$OUT" -type f | sort
[ "$rc1" -eq 0 ] && [ "$rc2" -eq 0 ]

#!/usr/bin/env bash
# The H200 benchmark in ONE device call (<= 9 min wall, JIT builds included): ceilings, the
# DeepSeek-V4-Flash token sweep (1..8192) over every available backend run twice (repeatability),
# the forced-BLOCK_M study, the ragged-step study, the staging cost and the bare-loop overhead check.
# The eager reference is warmed up for HOST_MIN_WARMUP (1) s and timed for at least HOST_MIN_TIME (1) s
# per pass (2 s each, run ff478e511e, spread its passes further, not less), with the host's speed probed
# and slow passes retaken; device-bound rows time 1 s of samples per pass (the default of megamoe bench).
# Run 810b815d80 took 502 s: setup 58 s, the sweep 338 s (7 reference passes retaken), overhead 23 s,
# BLOCK_M 28 s, ragged 52 s; the deadline then cut the staging section, which ran in a second call
# (167 s, folder 810b815d80-staging). Run cf038b4ac2 (another card, host probe calibrated at 1656 us
# against 899-988 us before) timed out in its reference rows after 420 s of them and kept none: since
# then the host speed check spends at most --host-extra-budget (90) s, reference cases not begun by the
# deadline are skipped, every row is logged and each host-bound row is written as it finishes.
# With the 90 s budget, runs 806b20e8fa and 0e3c5a09b5 (two cards) took 412 s and 480 s, every section in.
#
# <sha> is `git rev-parse --short=10 HEAD` taken on THIS machine: on the device, git rev-parse returned a
# stale HEAD at 3ec44fd (its results say cf038b4ac2).
#   run(command="MEGAMOE_COMMIT=<sha> bash bench/device/run_sweep.sh",
#       carry=[".whl"], timeout_s=600)
#   run(command="source .whl/prelude.sh && export PYTHONPATH=$PWD:$PYTHONPATH MEGAMOE_COMMIT=<sha> &&
#       python3 -m megamoe.bench.cli --backends flashinfer-mxfp4 deepgemm-sm90-fp8 deepgemm-staged-fp8
#       --passes 1 --no-block-m --no-ragged --no-overhead --deadline 400 --out $OUT --no-progress",
#       carry=[".whl"], timeout_s=500)
#
# (prepare .whl once here with `bash ../shared/device/wheelhouse.sh`). Writes under $OUT, at most 6 files:
#   $OUT/log.txt  $OUT/nvidia-smi.txt  $OUT/<date>_<card>_<commit>/{results.json,results.md,sweep.png,block_m.png}
# Every section writes its results as it finishes, so a timeout or a crash still returns what ran.
# Dry run on a CPU: PRESET=tiny TOKENS="1 4 16" DEVICE=cpu OUT=/tmp/o bash bench/device/run_sweep.sh
set -u
OUT=${OUT:-/tmp/megamoe-bench-out}
mkdir -p "$OUT"
if [ -z "${MEGAMOE_SITE:-}" ] && [ -f .whl/prelude.sh ]; then
  # shellcheck disable=SC1091
  source .whl/prelude.sh || echo "[run_sweep] prelude failed: kernel packages missing, only the reference will run"
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PRESET=${PRESET:-dsv4-flash}
TOKENS=${TOKENS:-1 2 4 8 16 32 64 128 256 512 1024 2048 4096 8192}
DEVICE=${DEVICE:-cuda}
PY_TIMEOUT=${PY_TIMEOUT:-550}   # seconds for the whole python run; the rest of the 9 minutes is setup
DEADLINE=${DEADLINE:-510}       # optional studies are skipped once this much wall time has passed (the
                                # last, staging, takes ~30 s: at 810b815d80 it would have started at ~501 s)
{
  date -u +"%Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=name,uuid,serial,pci.bus_id,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.draw,power.limit,temperature.gpu,memory.used --format=csv 2>&1 || true
} > "$OUT/nvidia-smi.txt"
timeout -k 10 "$PY_TIMEOUT" python3 -m megamoe.bench.cli --preset "$PRESET" --tokens $TOKENS --device "$DEVICE" \
  --passes 2 --repeats 20 --warmup 5 --reference-repeats 3 --host-min-time "${HOST_MIN_TIME:-1}" \
  --host-min-warmup "${HOST_MIN_WARMUP:-1}" --host-max-repeats 256 --deadline "$DEADLINE" --out "$OUT" ${EXTRA_ARGS:-} \
  2>&1 | tee "$OUT/log.txt"
rc=${PIPESTATUS[0]}
{ echo "--- after"; nvidia-smi --query-gpu=clocks.sm,power.draw,temperature.gpu --format=csv 2>&1 || true; } >> "$OUT/nvidia-smi.txt"
echo "[run_sweep] python exit $rc; files:"; find "$OUT" -type f | sort
tail -n 60 "$OUT"/*/results.md 2>/dev/null | cut -c1-400
exit "$rc"

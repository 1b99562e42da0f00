#!/usr/bin/env bash
# The README's test command, with extra arguments for pytest (e.g. `bash scripts/test.sh -m "not slow"`, the quick
# loop). CI runs the README's two commands themselves (.ci/run). pytest's exit 5 ("no tests collected") fails here
# too.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pytest -q "$@"

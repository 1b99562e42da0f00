#!/usr/bin/env bash
# The README's test command. pytest exit 5 ("no tests collected") is a failure here too.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pytest -q "$@"

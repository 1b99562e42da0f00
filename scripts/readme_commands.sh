#!/usr/bin/env bash
# Prints the README's two commands (the lines of its first ```bash block), one a line; .ci/run runs them and
# tests/test_packaging.py checks what they say. Exits 1 unless there are exactly two.
set -euo pipefail
cd "$(dirname "$0")/.."
commands=$(awk '/^```bash$/ { inside = 1; next } inside && /^```$/ { exit } inside && NF' README.md)
count=$(printf '%s\n' "$commands" | grep -c .)
if [ "$count" != 2 ]; then
  echo "README.md: its first bash block holds $count command lines, expected the two that CI runs" >&2
  exit 1
fi
printf '%s\n' "$commands"

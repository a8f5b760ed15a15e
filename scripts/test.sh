#!/usr/bin/env bash
# Sets up .venv from nothing (scripts/setup.sh) and runs the whole test suite. With arguments,
# pytest gets them as they are (e.g. -m "not ray"). Without, the multi-node tests (`-m cluster`:
# each brings up a Ray cluster of its own with cluster/local.sh and spends most of its time
# waiting on Ray — node deaths, reclaim deadlines, the autoscaler, resize checks) run in a
# second pytest beside the rest, and their report follows the main one.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m ruff check .
if [ $# -gt 0 ]; then
  exec .venv/bin/python -m pytest --durations=25 "$@"
fi
log=$(mktemp)
.venv/bin/python -m pytest -m cluster --durations=10 -p no:cacheprovider \
  --basetemp="$(mktemp -d)" >"$log" 2>&1 &
cluster=$!
rc=0
.venv/bin/python -m pytest -m "not cluster" --durations=25 || rc=$?
cluster_rc=0
wait "$cluster" || cluster_rc=$?
echo
echo "=== the multi-node tests (pytest -m cluster), run beside the above ==="
cat "$log"
rm -f "$log"
if [ "$rc" -ne 0 ]; then exit "$rc"; fi
exit "$cluster_rc"

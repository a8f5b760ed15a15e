#!/usr/bin/env bash
# The first GPU run in one command: on a machine with one GPU it sets up what it needs (Ray and
# the project's other dependencies from ./.whl, see bench/results/gpu.md), runs a short real
# `rayacc train` of jobs/gpu_gpt.yaml on one GPU worker (NCCL, bf16, compile, fused AdamW,
# validation, checkpoints, auto micro-batch with real CUDA out-of-memory trials) and
# bench/gpu_step.py against the bare anchor, and prints one table of what passed and the figures.
#   bash bench/gpu_check.sh [--out DIR]      # on the GPU machine, within 8 minutes
#   bash bench/gpu_check.sh --dry-run        # the same steps on CPU with a tiny model (CI runs it)
set -uo pipefail
cd "$(dirname "$0")/.."
dry=0
args=()
for a in "$@"; do
  if [[ $a == --dry-run ]]; then dry=1; fi
  args+=("$a")
done
if ((dry)); then
  py=${PYTHON:-.venv/bin/python}
else
  py=${PYTHON:-python3}
  if [[ -d .whl ]]; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
  fi
fi
# Ray's workers import the project from this checkout
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
exec "$py" bench/gpu_check.py "${args[@]}"

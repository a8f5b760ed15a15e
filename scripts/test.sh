#!/usr/bin/env bash
# Sets up .venv from nothing (scripts/setup.sh) and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m ruff check .
exec .venv/bin/python -m pytest --durations=25 "$@"

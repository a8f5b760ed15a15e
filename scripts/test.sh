#!/usr/bin/env bash
# Sets up .venv from nothing (scripts/setup.sh) and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m ruff check .
# the project's bytecode, written once: where PYTHONDONTWRITEBYTECODE is set
# (a machine setting), every process the suite starts — Ray workers, `rayacc` commands —
# compiles rayacc anew
# (about 0.5 CPU-s each, a few hundred processes)
.venv/bin/python -m compileall -q rayacc tests bench >/dev/null
# two workers, each test file on one of them (tests/conftest.py::SECOND_WORKER): the heavy
# whole-stack files on one; the multi-node tests, which mostly wait on their clusters, the
# gloo ranks, the units and the lighter whole-stack files on the other
exec .venv/bin/python -m pytest -n 2 --dist loadgroup --durations=25 "$@"

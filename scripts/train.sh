#!/usr/bin/env bash
# Sets up .venv from nothing (scripts/setup.sh) and runs the default main job on the embedded
# default: a local Ray, the bundled digits data, a local MLflow store (./mlflow.db).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/rayacc train -c jobs/digits.yaml "$@"

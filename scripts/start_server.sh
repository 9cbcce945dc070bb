#!/usr/bin/env bash
# Start the shared MLflow tracking server on PostgreSQL: `rlhf-mlflow server` from this checkout's
# virtualenv (created first if needed). Arguments go to `rlhf-mlflow server`, e.g.
#   scripts/start_server.sh --root /srv/mlflow --port 5000
# then, in every shell that runs the pipeline: export MLFLOW_TRACKING_URI=http://127.0.0.1:5000
set -euo pipefail
cd "$(dirname "$0")/.."
make --quiet .venv/.installed
exec .venv/bin/rlhf-mlflow server "$@"

#!/usr/bin/env bash
# The README's test command: sets up (or reuses) the environment, then runs the suite.
#   bash tools/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
venv="$(bash tools/setup_env.sh | tail -n 1)"
export PYTHONHASHSEED=0
exec "$venv/bin/python" -m pytest tests "$@"

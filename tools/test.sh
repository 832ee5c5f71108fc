#!/usr/bin/env bash
# The README's test command: sets up (or reuses) the environment, runs the linter, then the suite.
#   bash tools/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
venv="$(bash tools/setup_env.sh | tail -n 1)"
export PYTHONHASHSEED=0
# glibc keeps freed memory for the next forward instead of unmapping it (same figures, less time)
source tools/cpu_env.sh
# the linter first (ruff.toml: unused imports, undefined names, syntax): seconds, and a defect it finds fails CI
"$venv/bin/python" -m ruff check --quiet . || { echo "ruff check failed (ruff.toml): fix the lines above"; exit 1; }
# two workers (pytest-xdist), one per core, an idle one taking tests queued for the other;
# each runs torch on one thread (tests/conftest.py).
# LATTE_TEST_WORKERS=0 runs the suite in this one process.
workers="${LATTE_TEST_WORKERS:-2}"
if [ "$workers" = 0 ]; then exec "$venv/bin/python" -m pytest tests "$@"; fi
exec "$venv/bin/python" -m pytest tests -n "$workers" --dist worksteal "$@"

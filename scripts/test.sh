#!/usr/bin/env bash
# The test command: lint, types, the fast lane, then the real-engine lane.
# Usage: scripts/test.sh [--fast] [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
.venv/bin/ruff check src tests
.venv/bin/mypy --strict src
if [ "${1:-}" = "--fast" ]; then
  shift
  exec .venv/bin/python -m pytest -m "not engine and not gpu and not slow" "$@"
fi
.venv/bin/python -m pytest -m "not engine and not gpu and not slow" "$@"
exec .venv/bin/python -m pytest -m "engine and not gpu" "$@"

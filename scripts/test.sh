#!/usr/bin/env bash
# The test suite, from a fresh machine: set up, lint, run pytest (extra pytest args pass through).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh engine,triton,dev
.venv/bin/ruff check .
.venv/bin/python -m pytest -q "$@"

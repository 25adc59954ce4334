#!/usr/bin/env bash
# The test suite, from a fresh machine: set up, lint, run pytest (extra pytest args pass through).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh engine,triton,gateway,operator,dev
# integration tests run a real redis-server
if ! command -v redis-server >/dev/null; then
  echo "[setup] installing redis-server (apt)"
  sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
  $sudo apt-get install -y -qq redis-server >/dev/null 2>&1 \
    || { $sudo apt-get update -qq >/dev/null && $sudo apt-get install -y -qq redis-server >/dev/null; }
fi
.venv/bin/ruff check .
# Two workers (pytest-xdist), each running whole test modules (module-scoped servers stay in one worker):
# much of the suite waits on one process at a time (an engine booting, a server answering), so a second
# worker uses the otherwise idle core.
.venv/bin/python -m pytest -q -n 2 --dist loadfile "$@"

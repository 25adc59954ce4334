#!/usr/bin/env bash
# Create .venv and install kvfleet with the given extras, at the tested versions (constraints.txt); a no-op
# when nothing changed since last time.
# Usage: scripts/setup.sh EXTRAS   (e.g. "engine,dev")
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-engine,dev}"
py="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $($py --version)"
  "$py" -m venv .venv
fi
stamp=".venv/.kvfleet-installed-$(cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)-${extras//,/_}"
if [ ! -f "$stamp" ]; then
  echo "[setup] installing kvfleet[$extras] (torch is pinned to the CPU build)"
  .venv/bin/python -m pip install --quiet --upgrade pip
  # torch first and alone, pinned: nothing later may resolve it to a CUDA wheel.
  .venv/bin/python -m pip install --quiet "torch==2.13.0"
  .venv/bin/python -m pip install --quiet -c constraints.txt -e ".[$extras]"
  touch "$stamp"
fi

#!/usr/bin/env bash
# The main job, from a fresh machine: set up, write the demo model, then `kvfleet up --once`: a local
# redis-server, two engine replicas of the model (`kvfleet engine serve`) and the gateway; a demo tenant and
# its API key; one chat request through the gateway; then everything is stopped again.
# Extra arguments go to `kvfleet up` (e.g. --replicas 1); KVFLEET_DEMO_PORT sets the gateway's port.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh engine,gateway
if ! command -v redis-server >/dev/null; then
  echo "[setup] installing redis-server (apt)"
  sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo"
  $sudo apt-get install -y -qq redis-server >/dev/null 2>&1 \
    || { $sudo apt-get update -qq >/dev/null && $sudo apt-get install -y -qq redis-server >/dev/null; }
fi
model=.kvfleet/models/demo-llama-small  # also the model of the README's offline example
if [ ! -f "$model/config.json" ]; then
  .venv/bin/kvfleet demo-model --out "$model" --arch llama --preset small
fi
port="${KVFLEET_DEMO_PORT:-$(.venv/bin/python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')}"
mkdir -p .kvfleet
exec .venv/bin/kvfleet up --once --model-dir "$model" --port "$port" --run-dir .kvfleet/demo "$@"

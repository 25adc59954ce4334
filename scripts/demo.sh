#!/usr/bin/env bash
# The main job, from a fresh machine: set up, write the demo model, generate from it.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh engine
model=.kvfleet/models/demo-llama-small
if [ ! -f "$model/config.json" ]; then
  .venv/bin/kvfleet demo-model --out "$model" --arch llama --preset small
fi
.venv/bin/kvfleet generate --model "$model" --chat --max-tokens 48 \
  --prompt "Tell me about the lighthouse on the hill." \
  --prompt "How do I bake bread?" \
  --prompt "Write a short poem about rain."

#!/usr/bin/env bash
# The main job, from a fresh machine: set up, write the demo model, serve it with `kvfleet engine serve`
# (API server + engine core process), send one chat request through the OpenAI API, stop the server.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh engine
model=.kvfleet/models/demo-llama-small
if [ ! -f "$model/config.json" ]; then
  .venv/bin/kvfleet demo-model --out "$model" --arch llama --preset small
fi
port="${KVFLEET_DEMO_PORT:-$(.venv/bin/python -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')}"
log=.kvfleet/demo-server.log
.venv/bin/kvfleet engine serve --model "$model" --served-model-name demo --port "$port" --max-model-len 2048 >"$log" 2>&1 &
server=$!
trap 'kill -TERM $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
echo "[demo] engine server starting on http://127.0.0.1:$port (log: $log)"
.venv/bin/python - "$port" <<'PY'
# A plain-stdlib client: the engine extra alone (what this script installs) has no HTTP client library.
import json, sys, time, urllib.error, urllib.request

url = f"http://127.0.0.1:{sys.argv[1]}"
deadline = time.time() + 300
while True:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            if r.status == 200:
                break
    except (urllib.error.URLError, OSError):
        pass
    if time.time() > deadline:
        sys.exit("[demo] the server did not become healthy; see .kvfleet/demo-server.log")
    time.sleep(0.5)
body = {"model": "demo", "messages": [{"role": "user", "content": "Tell me about the lighthouse on the hill."}],
        "max_tokens": 48, "temperature": 0}
print(f"[demo] POST {url}/v1/chat/completions\n{json.dumps(body, indent=2)}")
req = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(),
                             headers={"Content-Type": "application/json"})
with urllib.request.urlopen(req, timeout=120) as r:
    resp = json.load(r)
print(f"[demo] -> {resp['choices'][0]['message']['content']!r}")
print(f"[demo] usage: {resp['usage']}")
PY

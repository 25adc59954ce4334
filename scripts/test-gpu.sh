#!/usr/bin/env bash
# The engine tests on a CUDA GPU: runs `pytest tests/engine` with KVFLEET_TEST_DEVICE=cuda (tests/conftest.py),
# so exact-parity tests compare float32 engine and HF on the GPU, bfloat16 is checked against tolerances and
# agreement floors (tests/engine/test_bf16_agreement.py; -s prints the rates), the Triton kernels run compiled
# instead of interpreted, CPU-only tests (oneDNN packs, C kernels) stay on the CPU, and a TP x PP test with
# more ranks than the machine has GPUs is skipped, saying so. Extra arguments go to pytest (more paths too).
# KVFLEET_TEST_DEVICE may name another GPU (cuda:1); scripts/test.sh is the CPU suite and is unchanged.
#
# Nothing here installs anything: scripts/setup.sh pins the CPU build of torch, which must never replace a
# machine's CUDA torch (and a GPU machine may have no network). Two ways to bring a Python:
#
#   scripts/test-gpu.sh [pytest args]
#       venv mode: the repository's .venv (KVFLEET_GPU_VENV=DIR for another) with a CUDA build of torch
#       in it. To make one: create the venv, install the CUDA build of the pinned torch first (from
#       PyTorch's CUDA wheel index), then `scripts/setup.sh engine,triton,gateway,dev`: pip keeps a
#       torch 2.13.0+cuXXX, which satisfies the pin.
#
#   KVFLEET_GPU_PYTHON=python3 scripts/test-gpu.sh [pytest args]
#       system mode: that interpreter as it is (e.g. a machine image with CUDA torch preinstalled and the
#       other wheels carried in), with the sources on PYTHONPATH=common:engine:gateway:cli:devkit instead of an
#       editable install. It needs torch (CUDA), transformers, tokenizers, safetensors, numpy, msgspec,
#       xxhash, pydantic, pytest, openai and jsonschema; triton for the kernel tests (skipped without it).
#
# The Redis-backed presence tests run only where `redis-server` is on PATH (no apt-get here).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -n "${KVFLEET_GPU_PYTHON:-}" ]; then
  py="$KVFLEET_GPU_PYTHON"
  command -v "$py" >/dev/null || { echo "[test-gpu] KVFLEET_GPU_PYTHON=$py: no such interpreter" >&2; exit 2; }
  # Absolute: tests start Python subprocesses in other directories.
  export PYTHONPATH="$PWD/common:$PWD/engine:$PWD/gateway:$PWD/cli:$PWD/devkit${PYTHONPATH:+:$PYTHONPATH}"
  echo "[test-gpu] system mode: $py with PYTHONPATH=$PYTHONPATH"
else
  venv="${KVFLEET_GPU_VENV:-.venv}"
  py="$venv/bin/python"
  if [ ! -x "$py" ]; then
    echo "[test-gpu] no $py: make a venv with a CUDA torch (see the top of $0)," \
      "or run with KVFLEET_GPU_PYTHON=python3" >&2
    exit 2
  fi
  echo "[test-gpu] venv mode: $py"
fi

# The interpreter must see a CUDA torch and the packages the engine tests import.
"$py" - <<'EOF' || exit 2
import importlib
import sys

try:
    import torch
except ImportError as e:
    sys.exit(f"[test-gpu] torch does not import: {e}")
if torch.version.cuda is None or not torch.cuda.is_available():
    sys.exit(
        f"[test-gpu] torch {torch.__version__} sees no CUDA device (CUDA build: {torch.version.cuda}); "
        "this script never installs torch: see its header"
    )
missing = []
needed = ("kvfleet_engine", "transformers", "tokenizers", "safetensors", "numpy", "pytest", "openai", "jsonschema")
for name in needed:
    try:
        importlib.import_module(name)
    except ImportError as e:
        missing.append(f"{name} ({e})")
if missing:
    sys.exit("[test-gpu] missing: " + ", ".join(missing))
try:
    import triton

    kernels = f"triton {triton.__version__}"
except ImportError:
    kernels = "no triton: the Triton kernel tests will be skipped"
gpus = ", ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
print(f"[test-gpu] torch {torch.__version__} (CUDA {torch.version.cuda}), {kernels}; GPUs: {gpus}")
EOF

export KVFLEET_TEST_DEVICE="${KVFLEET_TEST_DEVICE:-cuda}"
unset TRITON_INTERPRET  # compiled kernels (tests/conftest.py sets it only where torch sees no CUDA)
args=(tests/engine -q)
if ! command -v redis-server >/dev/null; then
  echo "[test-gpu] no redis-server on PATH: leaving out tests/engine/test_presence.py, test_presence_signing.py"
  args+=(--ignore=tests/engine/test_presence.py --ignore=tests/engine/test_presence_signing.py)
fi
echo "[test-gpu] KVFLEET_TEST_DEVICE=$KVFLEET_TEST_DEVICE $py -m pytest ${args[*]} $*"
exec "$py" -m pytest "${args[@]}" "$@"

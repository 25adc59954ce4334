#!/usr/bin/env bash
# The GPU checks of the engine in one run, for a machine lent for minutes: the throughput benchmark on a
# fresh Triton cache (bench/gpu_throughput.py), the engine test suite on the GPU (scripts/test-gpu.sh, in
# parallel), and the bfloat16 agreement rates (tests/engine/test_bf16_agreement.py -s, which the parallel
# run cannot print). Each part has its own time limit, so one that hangs leaves the others their results.
#
#   scripts/gpu-checks.sh [OUT_DIR]        # logs, junit XML and the benchmark's JSON go to OUT_DIR
#
# It uses the machine's own python3 with the sources on PYTHONPATH (test-gpu.sh's system mode). Where that
# Python lacks packages (fastapi, msgspec, pyzmq, openai, ...), KVFLEET_GPU_WHEELS=DIR installs the wheels
# in DIR into a scratch directory first, offline. PHASES (default "bench async tests agree") picks the parts;
# BENCH_ARGS are extra bench flags (default --skip-hf-cb: HF continuous batching alone takes minutes);
# the "async" part runs kvfleet alone again with --async-scheduling (offline and served, no HF);
# TESTS_S, AGREE_S and BENCH_S bound each part in seconds; NPROC sets the test workers (default 8).
set -u
cd "$(dirname "$0")/.."
out="${1:-gpu-checks}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
t0=$(date +%s)
say() { echo "[gpu-checks +$(($(date +%s) - t0))s] $*"; }
site=""
if [ -n "${KVFLEET_GPU_WHEELS:-}" ]; then
  site="$(mktemp -d)"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
    "$KVFLEET_GPU_WHEELS"/*.whl || { say "installing the wheels failed"; exit 2; }
fi
export PYTHONPATH="${site:+$site:}$PWD/common:$PWD/engine:$PWD/gateway:$PWD/cli:$PWD/devkit:$PWD"
{ nvidia-smi; python3 -c "import sys, torch, triton, transformers
print(sys.version); print(torch.__version__, torch.version.cuda, triton.__version__, transformers.__version__,
      torch.cuda.get_device_name(0))"; } >"$out/env.txt" 2>&1
say "$(tail -1 "$out/env.txt")"
for phase in ${PHASES:-bench async tests agree}; do
  case $phase in
  bench)
    timeout "${BENCH_S:-300}" python3 -m bench.gpu_throughput ${BENCH_ARGS:---skip-hf-cb} \
      --out "$out/gpu_throughput.json" --log-dir "$out/logs" >"$out/bench.log" 2>&1
    say "bench rc $?"
    grep -E "^(│|target|sanity|NVIDIA)" "$out/bench.log" ;;
  async)
    timeout "${BENCH_S:-300}" python3 -m bench.gpu_throughput --async-scheduling --skip-hf \
      --out "$out/gpu_throughput-async.json" --log-dir "$out/logs" >"$out/bench-async.log" 2>&1
    say "async bench rc $?"
    grep -E "^(│|target|NVIDIA)" "$out/bench-async.log" ;;
  tests)
    KVFLEET_GPU_PYTHON=python3 timeout -s INT -k 20 "${TESTS_S:-240}" scripts/test-gpu.sh -n "${NPROC:-8}" \
      --dist loadfile -p no:cacheprovider --junitxml="$out/junit.xml" -rfEs >"$out/tests.log" 2>&1
    say "tests rc $?"
    grep -E "^(FAILED|ERROR) |passed|failed" "$out/tests.log" | tail -20 ;;
  agree)
    KVFLEET_TEST_DEVICE=cuda timeout "${AGREE_S:-90}" python3 -m pytest tests/engine/test_bf16_agreement.py \
      -q -s -p no:cacheprovider >"$out/agree.log" 2>&1
    say "agree rc $?"
    grep "^\[bf16" "$out/agree.log" | cut -c1-200 ;;
  *) say "unknown phase $phase (bench, async, tests, agree)" ;;
  esac
done

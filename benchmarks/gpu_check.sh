#!/usr/bin/env bash
# One prepared command for a lent GPU machine (about 3-5 minutes, within 8):
#
#     bash benchmarks/gpu_check.sh
#
# 1. makes sure torch (a CUDA build) and nbserve's dependencies import, installing only what is
#    missing (plain `pip install torch` gives a CUDA build on Linux x86-64; an installed torch is
#    kept);
# 2. runs the CUDA correctness tests in bfloat16 (tests/test_cuda.py) and the pool tests;
# 3. runs the engine benchmark at batch 1 and 64 on a random-weight Qwen2.5-1.5B-shaped model,
#    printing decode tokens/s beside the GPU's memory-bandwidth bound.
# Without a GPU it still runs end to end: the CUDA tests skip and the benchmark runs --tiny on CPU.
# Logs and the benchmark's JSON go to $OUT when set (the device tool), else /tmp/nbserve-gpu-check.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
PY="${PYTHON:-python3}"
LOG_DIR="${OUT:-/tmp/nbserve-gpu-check}"
mkdir -p "$LOG_DIR"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false

importable() { "$PY" -c "import $1" 2>/dev/null; }
if ! importable torch; then
    "$PY" -m pip install -q torch || { echo "gpu_check: torch is missing and pip could not install it"; exit 1; }
fi
# nbserve's own dependencies (pyproject's, torch kept as found) and what the checks import
if ! "$PY" -c "import nbserve, pytest, pytest_asyncio, transformers, httpx" 2>/dev/null; then
    "$PY" -m pip install -q -e . pytest pytest-asyncio "transformers>=4.45" accelerate httpx \
        || echo "gpu_check: warning: could not install nbserve's dependencies"
fi

nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader || true
"$PY" - <<'PYEOF'
import torch
ok = torch.cuda.is_available()
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}); GPU visible: {ok}"
      + (f" ({torch.cuda.get_device_name()})" if ok else " -- the CUDA tests will be skipped"))
PYEOF

echo "== correctness: tests/test_cuda.py (bf16 on CUDA) and tests/test_pool.py"
timeout 270 "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_cuda.py tests/test_pool.py 2>&1 \
    | tee "$LOG_DIR/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}

echo "== benchmark: engine decode at batch 1 and 64"
bench_args="--batch 1,64"
"$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" || bench_args="$bench_args --device cpu --tiny"
timeout 240 "$PY" benchmarks/gpu_bench.py $bench_args --json "$LOG_DIR/gpu_bench.json" 2>&1 \
    | tee "$LOG_DIR/gpu_bench.log"
bench_rc=${PIPESTATUS[0]}

echo "gpu_check: tests exit $tests_rc, benchmark exit $bench_rc"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]

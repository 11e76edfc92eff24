#!/usr/bin/env bash
# One prepared command for a lent GPU machine (a bare image that reaches no package registry),
# at most 7.5 minutes (its steps' time limits; a few minutes expected on an H200):
#
#     bash benchmarks/gpu_check.sh        # the device tool's run, with carry [".whl"]
#
# 0. nbserve's missing dependencies come as wheels in .whl/ (benchmarks/device_wheels.py makes
#    them here), installed with --no-index into a folder on PYTHONPATH; torch is the image's
#    own, never installed; gradio is not needed (the check serves without the UI);
# 1. correctness on CUDA (tests/test_cuda.py): bfloat16 logits against float32 and against
#    transformers on the same weights, a batch equal to each request alone, the paged cache, a
#    pool on cuda:0 and two replicas on one GPU, CUDA graphs against eager decode steps;
# 2. the notebook lifecycle (benchmarks/gpu_lifecycle.py): memory back after stop() and
#    update(), launch again works;
# 3. decode tokens/s at batch 1, 16, 64, 256 on a random-weight Llama-3.2-1B-shaped model
#    beside the HBM-bandwidth bound, with CUDA graphs and without, the step time split, the
#    time to first token of a 2,000-token prompt, the KV budget and the weights
#    (benchmarks/gpu_bench.py).
# Without a GPU it still runs end to end (the CUDA tests skip, the benchmark runs --tiny on CPU,
# and with no device memory to measure the steps run side by side, their logs printed after):
# benchmarks/device_dry_run.sh runs it so here, in a fresh environment built like the image.
# Logs and JSON go to $OUT when set (the device tool), else /tmp/nbserve-gpu-check.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
PY="${PYTHON:-python3}"
LOG_DIR="${OUT:-/tmp/nbserve-gpu-check}"
WHEELS="${NBSERVE_WHEELS:-.whl}"
SITE="${NBSERVE_SITE:-/tmp/nbserve-site}"
mkdir -p "$LOG_DIR"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
export TOKENIZERS_PARALLELISM=false
start=$(date +%s)

if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" "$WHEELS"/*.whl || { echo "gpu_check: the carried wheels did not install"; exit 1; }
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
"$PY" - <<'PYEOF' || { echo "gpu_check: a module is missing (run benchmarks/device_wheels.py and carry .whl)"; exit 1; }
import importlib, sys
missing = []
for name in ("torch", "nbserve.serving.app", "fastapi", "starlette", "uvicorn", "pydantic",
             "gguf", "tokenizers", "safetensors", "jinja2", "transformers", "httpx", "pytest",
             "pytest_asyncio", "prometheus_client"):
    try:
        importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 -- every missing name listed at once
        missing.append(f"{name} ({type(exc).__name__}: {exc})")
import torch
print(f"python {sys.version.split()[0]}; torch {torch.__version__} (CUDA {torch.version.cuda}); "
      f"GPU visible: {torch.cuda.is_available()}"
      + (f" ({torch.cuda.get_device_name()})" if torch.cuda.is_available() else
         " -- the CUDA tests will be skipped"))
if missing:
    print("missing:", *missing, sep="\n  ")
    sys.exit(1)
PYEOF
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader 2>/dev/null || true

tests_cmd=(timeout 150 "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_cuda.py)
life_cmd=(timeout 60 "$PY" benchmarks/gpu_lifecycle.py --json "$LOG_DIR/gpu_lifecycle.json")
bench_rc=0
if "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    echo "== 1. correctness: tests/test_cuda.py"
    "${tests_cmd[@]}" 2>&1 | tee "$LOG_DIR/gpu_tests.log"
    tests_rc=${PIPESTATUS[0]}

    echo "== 2. the notebook lifecycle"
    "${life_cmd[@]}" 2>&1 | tee "$LOG_DIR/gpu_lifecycle.log"
    life_rc=${PIPESTATUS[0]}

    echo "== 3. decode throughput, with CUDA graphs and without"
    for graphs in on off; do
        timeout 110 "$PY" benchmarks/gpu_bench.py --config llama-3.2-1b --batch 1,16,64,256 \
            --new-tokens 128 --static-decode "$graphs" --json "$LOG_DIR/gpu_bench_$graphs.json" \
            2>&1 | tee "$LOG_DIR/gpu_bench_$graphs.log"
        rc=${PIPESTATUS[0]}; [ "$rc" -eq 0 ] || bench_rc=$rc
    done
else
    # No GPU: no device memory is measured, so the steps run side by side in two lanes (the
    # lifecycle; the skipped CUDA tests, then the --tiny benchmark), each step's output to its
    # log, printed in step order once both lanes are done.
    "${life_cmd[@]}" > "$LOG_DIR/gpu_lifecycle.log" 2>&1 &
    life_pid=$!
    "${tests_cmd[@]}" > "$LOG_DIR/gpu_tests.log" 2>&1
    tests_rc=$?
    timeout 150 "$PY" benchmarks/gpu_bench.py --device cpu --tiny --batch 1,16,64,256 \
        --json "$LOG_DIR/gpu_bench_cpu.json" > "$LOG_DIR/gpu_bench_cpu.log" 2>&1
    bench_rc=$?
    wait "$life_pid"
    life_rc=$?
    echo "== 1. correctness: tests/test_cuda.py"
    cat "$LOG_DIR/gpu_tests.log"
    echo "== 2. the notebook lifecycle"
    cat "$LOG_DIR/gpu_lifecycle.log"
    echo "== 3. decode throughput (no GPU: --tiny on CPU)"
    cat "$LOG_DIR/gpu_bench_cpu.log"
fi

echo "gpu_check: tests exit $tests_rc, lifecycle exit $life_rc, benchmark exit $bench_rc," \
     "$(( $(date +%s) - start )) s"
[ "$tests_rc" -eq 0 ] && [ "$life_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
